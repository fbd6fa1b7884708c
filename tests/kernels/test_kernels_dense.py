"""Packed dense linears (pypto_kernels.linear / pack_linear): every packed path against F.linear."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import pypto_kernels as K
from pypto_kernels.backends import cpu
from pypto_kernels.dense import NEVER, ONEDNN_FLOAT32_AVX512_MIN_ELEMENTS, ONEDNN_FLOAT32_MIN_ELEMENTS

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
BF16_ONEDNN = K.onednn_supports(torch.bfloat16)
needs_mkl = pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="torch built without MKL")

# Odd sizes on purpose: no multiple of a SIMD width or a packing block.
SHAPES = [(37, 53), (129, 67), (256, 131)]
ROWS = [1, 3, 64, 67]


def _weight(out_f: int, in_f: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(out_f, in_f, generator=gen) / in_f**0.5).to(dtype)


def _close(ours: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    # Different accumulation orders: float32 agrees to a few ulps of the row's scale, bfloat16 to its rounding.
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert ours.shape == ref.shape and ours.dtype == ref.dtype
    assert float((ours.float() - ref.float()).abs().max()) <= tol * max(1.0, float(ref.float().abs().max()))


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_onednn_matches_reference_on_ragged_shapes(shape: tuple[int, int], dtype: torch.dtype) -> None:
    if dtype == torch.bfloat16 and not BF16_ONEDNN:
        pytest.skip("this CPU lacks oneDNN's bf16 instructions (AVX-512 BW/VL/DQ, AVX-NE-CONVERT or AMX)")
    out_f, in_f = shape
    w = _weight(out_f, in_f, dtype)
    bias = torch.randn(out_f).to(dtype)
    packed = K.pack_linear(w, 64, library="onednn")
    assert packed is not None and packed.library == "onednn" and (packed.min_rows, packed.max_rows) == (1, NEVER)
    assert packed.weight is None and torch.equal(packed.plain(), w)  # only the packed copy is held
    for rows in ROWS:
        x = torch.randn(rows, in_f).to(dtype)
        for b in (None, bias):
            _close(K.linear(x, packed, b), F.linear(x, w, b), dtype)
    x3 = torch.randn(2, 3, in_f).to(dtype)  # leading dimensions are rows too
    _close(K.linear(x3, packed), F.linear(x3, w), dtype)


@needs_mkl
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("batch", [3, 67])
def test_mkl_runs_packed_at_its_batch_and_plain_elsewhere(shape: tuple[int, int], batch: int) -> None:
    out_f, in_f = shape
    w = _weight(out_f, in_f, torch.float32)
    bias = torch.randn(out_f)
    packed = K.pack_linear(w, batch, library="mkl")
    assert packed is not None and packed.library == "mkl" and packed.min_rows == packed.max_rows == batch
    assert packed.weight is w  # MKL's op needs the plain matrix beside its copy
    for rows in ROWS:
        x = torch.randn(rows, in_f)
        for b in (None, bias):
            out = K.linear(x, packed, b)
            if rows == batch:
                _close(out, F.linear(x, w, b), torch.float32)
            else:  # outside the packed row count: exactly the reference
                assert torch.equal(out, F.linear(x, w, b))


@needs_onednn
def test_transposed_view_weight() -> None:
    """The output projection is stored [in, out]; its packed copy is of the [out, in] view."""
    w_t = _weight(67, 129, torch.float32).t().contiguous()
    for library, batch in (("onednn", 64), ("mkl", 5)):
        packed = K.pack_linear(w_t.t(), batch, library=library)
        assert packed is not None
        x = torch.randn(5, 129)
        _close(K.linear(x, packed), torch.matmul(x, w_t), torch.float32)


def test_packing_rule() -> None:
    assert K.packing_rule(torch.bfloat16, 64) == (("onednn", 1, NEVER) if BF16_ONEDNN else None)
    assert K.packing_rule(torch.float32, 64) is None  # MKL's packing is opt-in: it doubles the memory
    big, small = ONEDNN_FLOAT32_MIN_ELEMENTS, ONEDNN_FLOAT32_MIN_ELEMENTS - 1
    avx2, avx512 = frozenset({"avx", "avx2", "fma"}), frozenset({"avx2", "avx512f", "avx512bw"})
    onednn = ("onednn", 1, NEVER) if torch.backends.mkldnn.is_available() else None
    # float32 through oneDNN on an x86 CPU without AVX-512 for large weights, on a non-Intel one with
    # AVX-512 (MKL's slow path) from 64 Ki elements, never on an Intel one with AVX-512 (MKL's GEMV wins).
    for vendor in ("GenuineIntel", "AuthenticAMD"):
        assert K.packing_rule(torch.float32, 64, elements=big, flags=avx2, vendor=vendor) == onednn
        assert K.packing_rule(torch.float32, 64, elements=small, flags=avx2, vendor=vendor) is None
    assert K.packing_rule(torch.float32, 64, elements=big, flags=avx512, vendor="GenuineIntel") is None
    # A non-Intel CPU with AVX-512: the native panels at every size where they are built, else oneDNN.
    amd512, amd = ONEDNN_FLOAT32_AVX512_MIN_ELEMENTS, {"flags": avx512, "vendor": "AuthenticAMD"}
    assert K.packing_rule(torch.float32, 64, elements=amd512, native_kernels=False, **amd) == onednn
    assert K.packing_rule(torch.float32, 64, elements=amd512 - 1, native_kernels=False, **amd) is None
    for elements in (amd512, big):
        assert K.packing_rule(torch.float32, 64, elements=elements, native_kernels=True, **amd) == ("panels", 1, NEVER)
    assert K.packing_rule(torch.float32, 64, elements=amd512 - 1, native_kernels=True, **amd) is None
    # bfloat16: the panels on a non-Intel CPU with AVX-512 and AVX512-BF16, from 64 Ki elements and for
    # an even input count (they pair the inputs), where the native kernels are built; else oneDNN's.
    bf16_onednn = K.packing_rule(torch.bfloat16, 64)
    amd_bf16 = {"flags": avx512 | {"avx512_bf16"}, "vendor": "AuthenticAMD"}
    panels = ("panels", 1, NEVER)
    assert K.packing_rule(torch.bfloat16, 64, elements=amd512, inputs=256, native_kernels=True, **amd_bf16) == panels
    for changed in (
        {"inputs": 255},  # odd
        {"inputs": None},  # not known
        {"elements": amd512 - 1},
        {"native_kernels": False},
        {"flags": avx512},  # no AVX512-BF16
        {"vendor": "GenuineIntel"},  # AMX / oneDNN's own bf16 kernels there
    ):
        args: dict[str, Any] = {"elements": amd512, "inputs": 256, "native_kernels": True, **amd_bf16, **changed}
        assert K.packing_rule(torch.bfloat16, 64, **args) == bf16_onednn, changed
    intel = {"flags": avx512, "vendor": "GenuineIntel", "native_kernels": True}
    assert K.packing_rule(torch.float32, 64, elements=big, **intel) is None
    assert K.packing_rule(torch.float32, 64, elements=big, flags=frozenset({"asimd"}), vendor="") is None  # Arm
    assert K.packing_rule(torch.float16, 64) is None
    assert K.pack_linear(_weight(8, 8, torch.float32), 64) is None
    assert K.pack_linear(_weight(8, 8, torch.float16), 64) is None
    assert K.pack_linear(torch.empty(8, 8, device="meta"), 64) is None
    with pytest.raises(ValueError, match="unknown packing library"):
        K.pack_linear(_weight(8, 8, torch.float32), 4, library="blas")


@needs_onednn
def test_reference_and_fallbacks_ignore_the_packed_copy() -> None:
    w = _weight(53, 37, torch.float32)
    packed = K.pack_linear(w, 64, library="onednn")
    assert packed is not None
    x = torch.randn(3, 37)
    assert torch.equal(K.reference_kernel("linear")(x, packed), F.linear(x, w))
    assert torch.equal(K.linear(x, w), F.linear(x, w))  # a plain tensor weight is F.linear
    # A call in another dtype than the packed copy's is declined and runs the reference (which refuses it).
    assert not cpu.supports_linear(x.double(), packed)
    with pytest.raises(RuntimeError, match="same dtype"):
        K.linear(x.double(), packed)
    assert K.describe_kernel("linear", "cpu", dtype=torch.float32) == cpu.LINEAR_LABEL
    assert K.describe_kernel("linear", "cpu", packed=False).startswith("reference")


@needs_onednn
@pytest.mark.parametrize("bf16", [True, False])
def test_bf16_packing_follows_the_cpu(monkeypatch: pytest.MonkeyPatch, bf16: bool) -> None:
    """A CPU without oneDNN's bf16 instructions (torch's reorder fails there at load) keeps bf16
    weights plain under the default rule and refuses an explicit oneDNN request with the reason."""
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: bf16)
    assert K.onednn_supports(torch.bfloat16) is bf16 and K.onednn_supports(torch.float32)
    assert K.packing_rule(torch.bfloat16, 64) == (("onednn", 1, NEVER) if bf16 else None)
    w = _weight(8, 8, torch.bfloat16)
    if bf16:
        return
    assert K.pack_linear(w, 64) is None
    with pytest.raises(ValueError, match=r"cannot pack torch\.bfloat16 weights on this CPU"):
        K.pack_linear(w, 64, library="onednn")


@pytest.mark.parametrize("rows", [1, 3, 16, 17, 64, 67])
@pytest.mark.parametrize("shape", [(131, 4099), (64, 20001)])
def test_transposed_product_matches_reference_on_ragged_shapes(
    rows: int, shape: tuple[int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A float32 weight stored [in, out] (the output projection) runs the chunked transposed product
    from 16 rows, F.linear below; either way the reference's result."""
    # Chunks of max(256, 16384 // rows) output features: several per call, the last one partial.
    monkeypatch.setattr(cpu, "TRANSPOSED_CHUNK_ELEMENTS", 1 << 14)
    in_f, out_f = shape
    w_t = _weight(out_f, in_f, torch.float32, seed=rows).t().contiguous()
    weight, bias = w_t.t(), torch.randn(out_f)
    x = torch.randn(rows, in_f)
    assert cpu.supports_linear(x, weight) == (rows >= cpu.TRANSPOSED_MIN_ROWS)
    for b in (None, bias):
        ref = F.linear(x, weight, b)
        _close(K.linear(x, weight, b), ref, torch.float32)
        _close(cpu.transposed_linear(x, weight, b), ref, torch.float32)  # the fast path itself, any row count
        if rows < cpu.TRANSPOSED_MIN_ROWS:
            assert torch.equal(K.linear(x, weight, b), ref)
    x3 = torch.randn(2, rows, in_f)  # leading dimensions are rows too
    _close(K.linear(x3, weight), torch.matmul(x3, w_t), torch.float32)


def test_transposed_product_rule() -> None:
    """Only float32 [in, out]-stored weights (or large [out, in] ones, below), eager, without
    autograd; small [out, in] weights keep F.linear."""
    w_t = _weight(300, 40, torch.float32).t().contiguous()
    x = torch.randn(16, 40)
    assert cpu.supports_linear(x, w_t.t())
    assert not cpu.supports_linear(x, w_t.t().contiguous())  # stored [out, in]: F.linear's own layout
    assert not cpu.supports_linear(x.double(), w_t.t().double())
    assert not cpu.supports_linear(x.bfloat16(), w_t.t().bfloat16())
    assert not cpu.supports_linear(x[:15], w_t.t())
    assert not cpu.supports_linear(x.requires_grad_(), w_t.t())
    with torch.no_grad():
        assert cpu.supports_linear(x, w_t.t())
    assert K.describe_kernel("linear", "cpu", packed=False, stored_in_out=True, rows=64) == cpu.LINEAR_LABEL
    assert "below 16" in K.describe_kernel("linear", "cpu", packed=False, stored_in_out=True, rows=4)


@pytest.mark.parametrize("rows", [1, 2, 5, 64, 128, 129])
def test_large_out_in_weight_transposed_at_its_rows(rows: int) -> None:
    """A contiguous [out, in] float32 weight of 512 Ki elements or more (a Qwen3-0.6B-sized decoder
    projection) runs the transposed product at 2-128 rows, F.linear at others; always the reference's
    result. A smaller one (the small shape's projections) keeps F.linear."""
    weight, bias = _weight(1031, 520, torch.float32, seed=rows), torch.randn(1031)
    assert weight.numel() >= cpu.TRANSPOSED_OUT_IN_MIN_ELEMENTS
    x = torch.randn(rows, 520)
    transposed = cpu.TRANSPOSED_OUT_IN_ROWS[0] <= rows <= cpu.TRANSPOSED_OUT_IN_ROWS[1]
    assert cpu.supports_linear(x, weight) == transposed
    for b in (None, bias):
        ref = F.linear(x, weight, b)
        _close(K.linear(x, weight, b), ref, torch.float32)
        if not transposed:
            assert torch.equal(K.linear(x, weight, b), ref)
    small = _weight(768, 256, torch.float32)
    assert not cpu.supports_linear(torch.randn(rows, 256), small)
    assert not cpu.supports_linear(x, weight[:, :519])  # a strided slice is not the contiguous layout measured
    reason = K.describe_kernel("linear", "cpu", packed=False, elements=small.numel(), rows=16)
    assert "elements: the weight has no packed copy and the transposed product is slower below" in reason
    reason = K.describe_kernel("linear", "cpu", packed=False, elements=weight.numel(), rows=rows)
    assert (reason == cpu.LINEAR_LABEL) == transposed


@needs_mkl
def test_mkl_copy_outside_its_batch_takes_the_transposed_product() -> None:
    w_t = _weight(4099, 129, torch.float32).t().contiguous()
    packed = K.pack_linear(w_t.t(), 5, library="mkl")
    assert packed is not None
    for rows in (5, 3, 17):
        x = torch.randn(rows, 129)
        _close(K.linear(x, packed), torch.matmul(x, w_t), torch.float32)


@pytest.fixture
def onednn_rows(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The row counts of the oneDNN packed products run from here on."""
    calls: list[int] = []
    real = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda x, *a: calls.append(x.shape[0]) or real(x, *a))
    return calls


@needs_onednn
def test_default_rule_packs_large_float32_weights_on_avx2(
    cpu_flags: Callable[..., None], onednn_rows: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """On an AVX2 CPU without AVX-512 a float32 weight of the threshold's size is packed for oneDNN in
    place of its plain matrix (which the reference rebuilds) and multiplies through it at every row
    count; one element fewer stays plain, and so does the same weight on an AVX-512 CPU."""
    cpu_flags("avx2", "fma")
    w = _weight(ONEDNN_FLOAT32_MIN_ELEMENTS // 512, 512, torch.float32)
    packed = K.pack_linear(w, 64)
    assert packed is not None and (packed.library, packed.weight, packed.min_rows) == ("onednn", None, 1)
    for rows in ROWS:
        x = torch.randn(rows, 512)
        _close(K.linear(x, packed), F.linear(x, w), torch.float32)
    assert onednn_rows == ROWS
    assert K.pack_linear(w[:, :-1].contiguous(), 64) is None  # one column fewer: below the threshold
    cpu_flags("avx2", "avx512f")
    assert K.pack_linear(w, 64) is None
    cpu_flags("avx2", "avx512f", vendor="AuthenticAMD")  # MKL's off-Intel path: smaller weights packed too
    monkeypatch.setattr(K.native, "library", lambda: None)  # without the native kernels' panels
    small = _weight(ONEDNN_FLOAT32_AVX512_MIN_ELEMENTS // 256, 256, torch.float32)
    packed = K.pack_linear(small, 64)
    assert packed is not None and (packed.library, packed.weight) == ("onednn", None)
    onednn_rows.clear()
    x = torch.randn(3, 256)
    _close(K.linear(x, packed), F.linear(x, small), torch.float32)
    assert onednn_rows == [3]
    assert K.pack_linear(small[:, :-1].contiguous(), 64) is None  # below 64 Ki elements: unmeasured, plain


def test_tied_head_min_rows_follow_the_cpu() -> None:
    """A tied output projection's one-row product stays on the plain matrix only where that was
    measured faster: float32 on an AVX2 CPU without AVX-512."""
    avx2, avx512 = frozenset({"avx2", "fma"}), frozenset({"avx2", "avx512f"})
    assert K.tied_head_min_rows(torch.float32, flags=avx2) == 2
    assert K.tied_head_min_rows(torch.float32, flags=avx512) == 1
    assert K.tied_head_min_rows(torch.bfloat16, flags=avx2) == 1


@needs_onednn
def test_onednn_copy_beside_the_plain_matrix_serves_from_min_rows(onednn_rows: list[int]) -> None:
    """``min_rows`` keeps the plain matrix (a tied output projection is the embedding too): calls of
    fewer rows use the plain matrix (one row through oneDNN's GEMV on it, as stored), the others run
    the packed copy."""
    w_t = _weight(300, 67, torch.float32).t().contiguous()  # stored [in, out], as the output projection
    packed = K.pack_linear(w_t.t(), 64, library="onednn", min_rows=2)
    assert packed is not None and packed.weight is not None and packed.weight.data_ptr() == w_t.data_ptr()
    assert (packed.min_rows, packed.max_rows) == (2, NEVER)
    for rows in ROWS:
        x = torch.randn(rows, 67)
        out = K.linear(x, packed)
        _close(out, x @ w_t, torch.float32)
    assert onednn_rows == ROWS  # one row included: the GEMV on the plain matrix
    weights: list[torch.Tensor] = []
    real = torch.ops.mkldnn._linear_pointwise
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda x, w, *a: weights.append(w) or real(x, w, *a))
        K.linear(torch.randn(1, 67), packed)
        K.linear(torch.randn(2, 67), packed)
    assert not weights[0].is_mkldnn and weights[0].data_ptr() == w_t.data_ptr() and weights[1] is packed.packed
    with pytest.raises(ValueError, match="min_rows applies to library='onednn' or 'panels' only"):
        K.pack_linear(w_t.t(), 64, library="mkl", min_rows=2)


def test_on_huge_pages_copies_side_by_side_in_one_buffer() -> None:
    """Copies in one buffer, in order, each contiguous and 64-byte aligned, of the tensors' values,
    shapes and dtypes, the first on a huge-page boundary (the advised span's start: the test below
    checks the pages)."""
    tensors = [torch.randn(5, 7), torch.randn(3).bfloat16(), torch.arange(12).view(3, 4).t(), torch.randn(0, 2)]
    moved = K.on_huge_pages(tensors)
    for t, m in zip(tensors, moved, strict=True):
        assert m.dtype == t.dtype and m.shape == t.shape and m.is_contiguous() and torch.equal(m, t)
    held = moved[:3]  # the empty tensor holds no bytes (its data_ptr is 0)
    assert held[0].data_ptr() % K.HUGE_PAGE == 0 or not sys.platform.startswith("linux")
    for m in held:
        assert m.untyped_storage().data_ptr() == held[0].untyped_storage().data_ptr() and m.data_ptr() % 64 == 0
    assert [m.data_ptr() for m in held] == sorted(m.data_ptr() for m in held)
    assert held[2].data_ptr() - held[0].data_ptr() < 4096  # side by side
    assert K.on_huge_pages([]) == []
    with pytest.raises(ValueError, match="CPU tensors"):
        K.on_huge_pages([torch.empty(2, device="meta")])


def _thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "never"


@pytest.mark.skipif(_thp_mode() == "never", reason="transparent huge pages are off here")
def test_on_huge_pages_lands_on_huge_pages_where_the_kernel_has_them() -> None:
    """Where THP is on (``always`` or ``madvise``), the buffer's pages are huge ones: AnonHugePages of
    its mapping in /proc/self/smaps (small tensors, each alone on 4 KiB pages otherwise), also in a
    process whose heap holds freed memory already faulted in (the buffer is its own fresh mapping)."""
    freed = [torch.ones(2**20) for _ in range(8)]  # 4 MiB each, faulted in, then given back
    del freed
    moved = K.on_huge_pages([torch.randn(64, 1024) for _ in range(24)])  # 6 MiB in 256 KiB tensors
    start, end = moved[0].data_ptr(), moved[-1].data_ptr() + moved[-1].nbytes
    huge_kib, mapping = 0, None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                mapping = lo <= start < hi and end <= hi
            elif mapping and head == "AnonHugePages:":
                huge_kib = int(line.split()[1])
    assert huge_kib >= 4096  # at least two of the span's three 2 MiB pages
