"""The native CPU passes between a decoder layer's products (``csrc/norm_rope.c``): RMSNorm with and
without the residual add, the q/k norms, rotation and K/V cache write of a fused projection, and
SwiGLU, against the torch references, float64 definitions, and each other."""

from __future__ import annotations

import ctypes
import platform
import subprocess
from typing import Any

import pytest
import torch

import pypto_kernels as K
from pypto_kernels import native
from pypto_kernels.backends import cpu as cpu_backend
from pypto_kernels.device import cpu_flags

needs_native = pytest.mark.skipif(
    native.library() is None, reason="no native CPU kernels on this machine (no C compiler; see the log)"
)

# Row widths around the 16-lane sum (1, 15, 16, 17), the models' (64, 256, 1024) and odd ones.
WIDTHS = [1, 15, 16, 17, 64, 100, 256, 1024]

# One bfloat16 ulp at 1.0: a sum of squares in another order may move a rounding by one.
_TOLERANCE = {torch.float32: {"rtol": 2e-6, "atol": 1e-6}, torch.bfloat16: {"rtol": 8e-3, "atol": 8e-3}}


def _float64_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm from its definition, in float64: x / sqrt(mean(x**2) + eps) * w."""
    h = x.double()
    return h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + eps) * w.double()


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("rows", [1, 7, 200])
def test_native_rms_norm_is_the_reference(dtype: torch.dtype, width: int, rows: int) -> None:
    gen = torch.Generator().manual_seed(width * 1000 + rows)
    x = (torch.randn(rows, width, generator=gen) * 3).to(dtype)
    residual = torch.randn(rows, width, generator=gen).to(dtype)
    w = torch.randn(width, generator=gen).to(dtype)
    out, summed = native.rms_norm(x, w, 1e-6)
    assert summed is None and out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out, K.rms_norm.reference(x, w, 1e-6), **_TOLERANCE[dtype])  # type: ignore[attr-defined]
    exact = _float64_rms_norm(x, w, 1e-6)
    torch.testing.assert_close(out.double(), exact, rtol=1e-5 if dtype == torch.float32 else 2e-2, atol=1e-5)
    out, summed = native.rms_norm(x, w, 1e-6, residual)
    ref_out, ref_sum = K.add_rms_norm.reference(x, residual, w, 1e-6)  # type: ignore[attr-defined]
    assert summed is not None and torch.equal(summed, ref_sum)  # one rounded add, as torch's
    torch.testing.assert_close(out, ref_out, **_TOLERANCE[dtype])


@needs_native
def test_native_rms_norm_takes_strided_rows_and_leaves_its_inputs() -> None:
    gen = torch.Generator().manual_seed(3)
    wide = torch.randn(9, 300, generator=gen)
    x, residual = wide[:, 10:266], torch.randn(9, 2, 256, generator=gen)[:, 1]  # rows of stride 300 and 512
    w = torch.randn(256, generator=gen)
    before = wide.clone(), residual.clone()
    out, summed = native.rms_norm(x, w, 1e-5, residual)
    assert torch.equal(wide, before[0]) and torch.equal(residual, before[1])
    assert summed is not None and torch.equal(summed, x + residual)
    torch.testing.assert_close(out, K.rms_norm.reference(x + residual, w, 1e-5), **_TOLERANCE[torch.float32])  # type: ignore[attr-defined]
    heads = torch.randn(5, 4, 64, generator=gen)  # [T, H, D] contiguous: rows of one head
    torch.testing.assert_close(
        native.rms_norm(heads, w[:64], 1e-6)[0],
        K.rms_norm.reference(heads, w[:64], 1e-6),  # type: ignore[attr-defined]
        **_TOLERANCE[torch.float32],
    )


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_rms_norm_row_depends_only_on_itself(dtype: torch.dtype) -> None:
    """A row alone, in a batch large enough to split over threads, on one or two threads: bitwise the
    same (the dense Qwen executor promises its logits do not depend on the thread count)."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(256, 1024, generator=gen).to(dtype)  # 256 x 1024 elements: split over threads
    w = torch.randn(1024, generator=gen).to(dtype)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        batch = native.rms_norm(x, w, 1e-6)[0]
        torch.set_num_threads(1)
        alone = torch.cat([native.rms_norm(x[i : i + 1], w, 1e-6)[0] for i in range(0, 256, 51)])
        one_thread = native.rms_norm(x, w, 1e-6)[0]
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(batch, one_thread)
    assert torch.equal(batch[::51], alone)


@needs_native
def test_rms_norm_takes_the_native_pass_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    inner = native.rms_norm

    def counted(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: Any = None) -> Any:
        calls.append("add" if residual is not None else "norm")
        return inner(x, weight, eps, residual)

    monkeypatch.setattr(native, "rms_norm", counted)
    x, w = torch.randn(3, 64), torch.randn(64)
    K.rms_norm(x, w, 1e-6)
    K.add_rms_norm(x, x, w, 1e-6)
    assert calls == ["norm", "add"]
    # Declined (the reference runs): a weight of another dtype, float16, a strided 3-D view.
    K.rms_norm(x, w.double(), 1e-6)
    K.rms_norm(x.half(), w.half(), 1e-6)
    K.rms_norm(torch.randn(3, 4, 128)[:, :, ::2], w, 1e-6)
    assert calls == ["norm", "add"]


def _float64_swiglu(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up from its definition, in float64: gate / (1 + e**-gate) * up."""
    gate, up = x.double().chunk(2, dim=-1)
    return gate / (1 + torch.exp(-gate)) * up


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [1, 15, 16, 17, 64, 100, 3072])
@pytest.mark.parametrize("rows", [1, 7, 40])
def test_native_silu_mul_is_the_reference(dtype: torch.dtype, width: int, rows: int) -> None:
    """Against torch's ``F.silu(gate) * up`` (float32 within 4 ulps: another exponential; bfloat16
    rounded as torch rounds each op, so at most one bfloat16 ulp apart where silu's float32 value
    sits on a rounding edge) and float64's definition; arguments past the exponential's range
    (+-100) and zero included."""
    gen = torch.Generator().manual_seed(width * 100 + rows)
    x = (torch.randn(rows, 2 * width, generator=gen) * 4).to(dtype)
    x[0, 0] = 100.0
    x[-1, width - 1] = -100.0
    x[0, width // 2] = 0.0
    out = native.silu_mul(x)
    assert out.dtype == dtype and out.shape == (rows, width)
    ref = K.silu_and_mul.reference(x)  # type: ignore[attr-defined]
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=5e-7, atol=1e-30)
        torch.testing.assert_close(out.double(), _float64_swiglu(x), rtol=1e-6, atol=1e-30)
    else:
        torch.testing.assert_close(out, ref, rtol=8e-3, atol=1e-30)
        assert float((out.float() != ref.float()).float().mean()) < 0.02  # edge cases only


@needs_native
def test_the_native_silu_mul_is_declined_on_x86_without_avx512(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without AVX-512 GCC leaves the SwiGLU loop scalar (7x torch's time): torch's ops run there."""
    x = torch.randn(4, 64)
    monkeypatch.setattr(native, "cpu_flags", lambda: frozenset({"avx2", "fma", "avx512f"}))
    assert native.silu_takes(x)
    monkeypatch.setattr(native, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    assert not native.silu_takes(x)
    torch.testing.assert_close(K.silu_and_mul(x), K.silu_and_mul.reference(x), rtol=0, atol=0)  # type: ignore[attr-defined]


def test_prefill_runs_are_not_routed_to_the_native_kernel_on_x86_without_avx512(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its AVX2 build took 3.3-6x the torch path's time: the torch path runs there (the kernel itself
    still takes the caches when called)."""
    cache = torch.zeros(4, 16, 2, 64)
    monkeypatch.setattr(native, "cpu_flags", lambda: frozenset({"avx2", "fma", "avx512f"}))
    assert native.prefill_routed(cache)
    monkeypatch.setattr(native, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    assert not native.prefill_routed(cache) and native.prefill_takes(cache)


@needs_native
def test_silu_and_mul_takes_the_native_pass_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows of dense elements (strided rows too, a row's result its own) take the C pass; a strided
    last dimension, an odd width and float16 the reference."""
    calls: list[tuple[int, ...]] = []
    inner = native.silu_mul
    monkeypatch.setattr(native, "silu_mul", lambda x: calls.append(tuple(x.shape)) or inner(x))
    monkeypatch.setattr(native, "cpu_flags", lambda: frozenset({"avx2", "avx512f"}))  # routed so on any host
    wide = torch.randn(6, 300)
    rows = wide[:, 20:276]  # rows of stride 300
    assert torch.equal(K.silu_and_mul(rows), torch.cat([inner(rows[i : i + 1]) for i in range(6)]))
    K.silu_and_mul(torch.randn(2, 3, 64))
    assert calls == [(6, 256), (2, 3, 64)]
    for declined in (torch.randn(3, 128)[:, ::2], torch.randn(3, 64).half()):
        torch.testing.assert_close(K.silu_and_mul(declined), K.silu_and_mul.reference(declined))  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="even last dim"):
        K.silu_and_mul(torch.randn(3, 7))
    assert calls == [(6, 256), (2, 3, 64)]


def _caches(blocks: int, heads: int, dim: int, dtype: torch.dtype, head_major: bool) -> tuple[torch.Tensor, ...]:
    """Key and value caches ``[blocks, 16, heads, dim]`` full of NaN, head-major views or contiguous."""
    out = []
    for _ in range(2):
        if head_major:
            out.append(torch.full((blocks, heads, 16, dim), float("nan"), dtype=dtype).transpose(1, 2))
        else:
            out.append(torch.full((blocks, 16, heads, dim), float("nan"), dtype=dtype))
    return tuple(out)


def _qk_case(
    t: int, heads: tuple[int, int], dim: int, rotary: int, dtype: torch.dtype, norms: bool, seed: int
) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    hq, hkv = heads
    wide = torch.randn(t, (hq + 2 * hkv) * dim + 8, generator=gen).to(dtype)
    inv_freq, scaling = K.rope_inv_freq(rotary, 10000.0, None, 4096)
    cos, sin = K.rope_cos_sin(torch.randint(0, 4000, (t,), generator=gen), inv_freq, scaling, dtype)
    weights = (torch.randn(dim, generator=gen).to(dtype), torch.randn(dim, generator=gen).to(dtype))
    return {
        "qkv": wide[:, 8:],  # rows of a wider tensor: strided
        "num_q_heads": hq,
        "num_kv_heads": hkv,
        "head_dim": dim,
        "norms": weights if norms else (None, None),
        "eps": 1e-6,
        "rotary": (cos, sin),
        "slot_mapping": torch.randperm(16 * 16, generator=gen)[:t],
    }


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_major", [False, True])
@pytest.mark.parametrize(
    ("t", "heads", "dim", "rotary"),
    [(1, (4, 2), 64, 64), (5, (2, 1), 128, 64), (37, (8, 8), 32, 32), (64, (16, 8), 64, 64), (3, (3, 1), 100, 96)],
)
@pytest.mark.parametrize("norms", [True, False])
def test_native_qk_norm_rope_write_kv_is_the_reference(
    dtype: torch.dtype,
    cache_dtype: torch.dtype,
    head_major: bool,
    t: int,
    heads: tuple[int, int],
    dim: int,
    rotary: int,
    norms: bool,
) -> None:
    case = _qk_case(t, heads, dim, rotary, dtype, norms, seed=t * 7 + dim)
    ours_caches = _caches(16, heads[1], dim, cache_dtype, head_major)
    ref_caches = _caches(16, heads[1], dim, cache_dtype, head_major)
    assert cpu_backend.supports_qk_norm_rope_write_kv(caches=ours_caches, **case)
    q = native.qk_norm_rope_write_kv(caches=ours_caches, **case)
    ref_q = K.qk_norm_rope_write_kv.reference(caches=ref_caches, **case)  # type: ignore[attr-defined]
    assert q.dtype == dtype and q.shape == (t, heads[0], dim)
    if norms:  # the head norms' sums of squares in another order: within rounding
        torch.testing.assert_close(q, ref_q, **_TOLERANCE[dtype])
        coarser = torch.bfloat16 if torch.bfloat16 in (dtype, cache_dtype) else torch.float32
        for ours, ref in zip(ours_caches, ref_caches, strict=True):
            torch.testing.assert_close(ours, ref, equal_nan=True, **_TOLERANCE[coarser])
    else:  # the rotation and the cache write: the reference's rounded steps exactly
        assert torch.equal(q, ref_q)
        for ours, ref in zip(ours_caches, ref_caches, strict=True):
            assert torch.equal(ours.nan_to_num(7.0), ref.nan_to_num(7.0))
    # Slots not in the mapping are left as they were (NaN), those in it written.
    written = torch.zeros(16 * 16, dtype=torch.bool)
    written[case["slot_mapping"]] = True
    for cache in ours_caches:
        rows = cache.contiguous().reshape(16 * 16, heads[1], dim)  # [slot, head, dim] in either layout
        assert not rows[written].isnan().any() and rows[~written].isnan().all()


@needs_native
def test_native_qk_norm_rope_write_kv_token_depends_only_on_itself() -> None:
    case = _qk_case(64, (16, 8), 64, 64, torch.float32, True, seed=11)  # 64 tokens: split over threads
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        batch = native.qk_norm_rope_write_kv(caches=_caches(16, 8, 64, torch.float32, True), **case)
        torch.set_num_threads(1)
        one_thread = native.qk_norm_rope_write_kv(caches=_caches(16, 8, 64, torch.float32, True), **case)
        token = {**case, "qkv": case["qkv"][9:10], "slot_mapping": case["slot_mapping"][9:10]}
        token["rotary"] = tuple(r[9:10] for r in case["rotary"])
        alone = native.qk_norm_rope_write_kv(caches=_caches(16, 8, 64, torch.float32, True), **token)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(batch, one_thread) and torch.equal(batch[9:10], alone)


@needs_native
def test_native_qk_norm_rope_write_kv_refuses_a_bad_slot_and_writes_nothing() -> None:
    case = _qk_case(4, (4, 2), 64, 64, torch.float32, True, seed=2)
    for bad in (256, -1):
        caches = _caches(16, 2, 64, torch.float32, True)
        case["slot_mapping"] = torch.tensor([3, 9, bad, 12])
        with pytest.raises(IndexError, match="outside the caches"):
            native.qk_norm_rope_write_kv(caches=caches, **case)
        assert all(c.isnan().all() for c in caches)


@needs_native
def test_qk_norm_rope_write_kv_takes_the_native_pass_where_it_can(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    inner = native.qk_norm_rope_write_kv

    def counted(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(1)
        return inner(*args, **kwargs)

    monkeypatch.setattr(native, "qk_norm_rope_write_kv", counted)
    case = _qk_case(2, (4, 2), 64, 64, torch.float32, True, seed=4)
    K.qk_norm_rope_write_kv(caches=_caches(16, 2, 64, torch.float32, True), **case)
    assert calls == [1]
    # Declined, the reference runs: an FP8 cache with its scales, one norm without the other, a head
    # longer than the C pass's stack rows.
    fp8 = tuple(torch.zeros(16, 16, 2, 64, dtype=torch.float8_e4m3fn) for _ in range(2))
    K.qk_norm_rope_write_kv(caches=fp8, k_scale=0.5, v_scale=0.25, **case)
    one_norm = {**case, "norms": (case["norms"][0], None)}
    K.qk_norm_rope_write_kv(caches=_caches(16, 2, 64, torch.float32, True), **one_norm)
    long = _qk_case(1, (1, 1), native.MAX_HEAD_DIM + 64, 64, torch.float32, False, seed=5)
    K.qk_norm_rope_write_kv(caches=_caches(16, 1, native.MAX_HEAD_DIM + 64, torch.float32, False), **long)
    assert calls == [1]


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("out", "width"), [(1, 16), (7, 100), (151, 256), (1000, 17), (4099, 64), (33, 1024), (130, 211)]
)
def test_native_gemv_is_the_product(out: int, width: int, dtype: torch.dtype) -> None:
    """One row times a plain [out, in] matrix against float64 (the matrix as it is, rows of a wider
    one, any leading dimensions of size 1); an output does not depend on the threads."""
    gen = torch.Generator().manual_seed(out + width)
    wide = torch.randn(out, width + 5, generator=gen).to(dtype)
    for weight in (wide[:, :width].contiguous(), wide[:, 5:]):
        x = torch.randn(1, 1, width, generator=gen).to(dtype)
        exact = (x.double() @ weight.double().t()).to(dtype)  # the exact product, rounded once
        got = native.gemv(x, weight)
        assert got.shape == (1, 1, out) and got.dtype == dtype
        if dtype == torch.float32:
            torch.testing.assert_close(got, exact, rtol=1e-5, atol=1e-5 * width**0.5)
        else:  # float32 sums of the exact products: off by at most the final rounding's ulp
            torch.testing.assert_close(got, exact, rtol=8e-3, atol=1e-5 * width**0.5)
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(1)
            assert torch.equal(native.gemv(x, weight), got)
        finally:
            torch.set_num_threads(threads)


def _gemv_built_for(march: str, tmp_path: Any) -> Any:
    """``csrc/gemv.c`` alone, built for ``march`` with the native build's other flags, loaded (its
    ``pypto_gemv`` declared as :func:`pypto_kernels.native.library` declares it); skipped where that
    build cannot run here."""
    compiler = native._compiler()
    if compiler is None or platform.machine() not in ("x86_64", "AMD64") or "avx2" not in cpu_flags():
        pytest.skip("needs x86 with AVX2 and a C compiler")
    target = tmp_path / f"gemv_{march}.so"
    flags = [f for f in native._FLAGS if not f.startswith("-march")]
    source = native._CSRC / "gemv.c"
    subprocess.run([compiler, *flags, f"-march={march}", "-o", str(target), str(source)], check=True)
    lib = ctypes.CDLL(str(target))
    declared = native.library()
    assert declared is not None
    lib.pypto_gemv.restype = declared.pypto_gemv.restype
    lib.pypto_gemv.argtypes = declared.pypto_gemv.argtypes
    return lib


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [64, 256, 1024])
@pytest.mark.parametrize("march", ["x86-64-v3", "skylake-avx512"])
def test_another_build_of_the_gemv_holds_the_same_sums(
    dtype: torch.dtype, width: int, march: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without AVX-512 a row's 16-lane sums are held as 8-lane halves (GCC keeps a 16-lane vector in
    memory there), and without AVX512-BF16 a bfloat16 row's pair dot products are widened and added
    as the instruction adds them: an AVX2 build and an AVX-512 build without AVX512-BF16 give this
    build's outputs bit for bit, maxima included (on a CPU with the instruction, that checks the
    widened sums against it)."""
    if march == "skylake-avx512" and "avx512f" not in cpu_flags():
        pytest.skip("needs AVX-512 to run that build")
    gen = torch.Generator().manual_seed(width)
    weight = torch.randn(777, width + 3, generator=gen).to(dtype)[:, 3:]
    x = torch.randn(1, width, generator=gen).to(dtype)
    peak, index = torch.empty(1), torch.empty(1, dtype=torch.long)
    expected = native.gemv(x, weight, logits=True, maxima=(peak, index))
    other = _gemv_built_for(march, tmp_path)
    monkeypatch.setattr(native, "library", lambda: other)
    got_peak, got_index = torch.empty(1), torch.empty(1, dtype=torch.long)
    got = native.gemv(x, weight, logits=True, maxima=(got_peak, got_index))
    assert torch.equal(got, expected)
    assert torch.equal(got_index, index) and torch.equal(got_peak, peak)


def _bf16_row_sums(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Each row's product as ``csrc/gemv.c`` documents its order, in float32 tensor arithmetic (each
    operation rounded once, as the C's): 32-value chunks, chunk c into accumulator c % 4 (a last run of
    fewer than four into the first), each lane adding its odd input's product then its even one's;
    (a0 + a1) + (a2 + a3); the lanes halved onto each other (i + 8 onto i, then 4, 2, 1); the last
    values in order; rounded to bfloat16."""
    rows, width = weight.shape
    w, v = weight.float(), x.float().reshape(-1)
    acc = torch.zeros(4, rows, 16)
    chunks, whole = width // 32, width // 32 // 4 * 4
    for c in range(chunks):
        pairs_w, pairs_x = w[:, 32 * c : 32 * c + 32].reshape(rows, 16, 2), v[32 * c : 32 * c + 32].reshape(16, 2)
        k = c % 4 if c < whole else 0
        acc[k] = acc[k] + pairs_w[:, :, 1] * pairs_x[:, 1]
        acc[k] = acc[k] + pairs_w[:, :, 0] * pairs_x[:, 0]
    lanes = (acc[0] + acc[1]) + (acc[2] + acc[3])
    for half in (8, 4, 2):
        lanes = lanes[:, :half] + lanes[:, half : 2 * half]
    total = lanes[:, 0] + lanes[:, 1]
    for i in range(32 * chunks, width):
        total = total + w[:, i] * v[i]
    return total.to(torch.bfloat16)


@needs_native
@pytest.mark.parametrize("width", [32, 96, 128, 256, 300, 384, 512])
def test_a_bfloat16_gemv_sums_pairs_in_the_documented_order(width: int) -> None:
    """A bfloat16 row's outputs are the documented chain of pair dot products, bit for bit (an
    independent float32 emulation of the order), on one thread and on several. Each row holds large
    products that cancel in its total, so the small ones a partial sum absorbs, and the result, depend
    on the order of the additions."""
    gen = torch.Generator().manual_seed(width)
    rows = 203
    x = torch.tensor([0.5, -0.5, 1.0, -1.0, 2.0, -2.0])[torch.randint(0, 6, (1, width), generator=gen)]
    weight = torch.randn(rows, width, generator=gen)
    for r in range(rows):
        for p, q in torch.randperm(width, generator=gen)[: 2 * (width // 16)].view(-1, 2).tolist():
            weight[r, p] = 2.0 ** torch.randint(12, 24, (), generator=gen).item() * (1 if (r + p) % 2 else -1)
            weight[r, q] = -weight[r, p] * x[0, p] / x[0, q]  # a power of two times it: exact
    weight, x = weight.to(torch.bfloat16), x.to(torch.bfloat16)
    expected = _bf16_row_sums(weight, x)
    assert torch.equal(native.gemv(x, weight).reshape(-1), expected)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(native.gemv(x, weight).reshape(-1), expected)
    finally:
        torch.set_num_threads(threads)


@needs_native
def test_the_gemv_holds_a_bfloat16_activation_of_128_to_512_inputs_in_registers() -> None:
    """Where the library has AVX512-BF16 the rows of a bfloat16 matrix of 128, 256, 384 or 512
    inputs are summed against an activation held in registers (the documented-order test above
    covers each of those widths bit for bit); other widths, float32 matrices and builds without the
    instruction load it for every row."""
    held = [w for w in range(32, 1025, 32) if native.gemv_holds_activation(torch.bfloat16, w)]
    assert held == ([128, 256, 384, 512] if native.bf16_dot_available() else [])
    assert not any(native.gemv_holds_activation(torch.float32, w) for w in (64, 128, 256, 512))
    assert not native.gemv_holds_activation(torch.bfloat16, 300)


@needs_native
def test_one_row_over_a_held_plain_matrix_takes_the_native_gemv(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    inner = native.gemv

    def counted(x: torch.Tensor, weight: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        calls.append(x.shape[0])
        return inner(x, weight, **kwargs)

    monkeypatch.setattr(native, "gemv", counted)
    weight = torch.randn(512, 256)
    head = K.pack_linear(weight, 64, library="onednn", keep_plain=True)  # a tied head: its plain matrix held
    if head is None:
        pytest.skip("no oneDNN in this torch")
    x = torch.randn(1, 256)
    torch.testing.assert_close(K.linear(x, head), x @ weight.t(), rtol=1e-5, atol=1e-4)
    assert calls == [1]
    K.linear(torch.randn(2, 256), head)  # two rows: the packed copy
    dropped = K.pack_linear(weight, 64, library="onednn")  # no plain matrix held
    assert dropped is not None and dropped.weight is None
    K.linear(x, dropped)
    K.linear(x.half(), weight.half())  # float16: no native product
    assert calls == [1]
