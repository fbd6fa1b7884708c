"""``quant_linear`` over stored-precision weights: the reference against an element-wise definition,
and every fast path (CPU, CUDA with a documented ``torch._scaled_mm`` stand-in and under the fake
CUDA device, NPU with documented stand-ins for ``npu_dynamic_quant`` / ``npu_quant_matmul``) against
the reference on ragged shapes."""

from __future__ import annotations

import importlib
import itertools
import sys
import types
from collections.abc import Callable
from typing import Any

import pytest
import torch

import pypto_kernels
from pypto_kernels import registry
from pypto_kernels.backends import cpu as cpu_backend
from pypto_kernels.quant import quant_linear
from pypto_serving.quantization import QuantizedWeight
from tests.core.test_quantization import quantize

SHAPES = [(48, 64), (37, 50), (5, 3)]  # whole blocks, ragged edges in both dims, one partial block
BLOCK = (16, 16)


def _fp8(shape: tuple[int, int], block: tuple[int, int] = BLOCK, seed: int = 0) -> tuple[QuantizedWeight, torch.Tensor]:
    torch.manual_seed(seed)
    w = torch.randn(shape) * 0.5
    q, s = quantize(w, block)
    return QuantizedWeight("fp8_block", q, s, block), w


def _int8(shape: tuple[int, int], *, offset: bool = False, seed: int = 0) -> QuantizedWeight:
    """Per-channel int8 as msModelSlim writes it: ``scale = absmax / 127`` per output row."""
    torch.manual_seed(seed)
    w = torch.randn(shape)
    scale = w.abs().amax(dim=1, keepdim=True) / 127
    data = torch.round(w / scale).clamp(-127, 127).to(torch.int8)
    off = torch.randint(-3, 4, (shape[0], 1)).float() if offset else None
    return QuantizedWeight("w8a8_dynamic", data, scale, offset=off)


def _x(rows: int, cols: int, dtype: torch.dtype = torch.float32, seed: int = 1) -> torch.Tensor:
    torch.manual_seed(seed)
    return torch.randn(rows, cols).to(dtype)


@pytest.mark.parametrize("shape", SHAPES)
def test_reference_follows_the_elementwise_definitions(shape: tuple[int, int]) -> None:
    weight, _ = _fp8(shape)
    x = _x(3, shape[1])
    want = torch.empty(3, shape[0])
    for i, j in itertools.product(range(3), range(shape[0])):
        want[i, j] = sum(
            x[i, k].item() * weight.data[j, k].float().item() * weight.scale[j // 16, k // 16].item()
            for k in range(shape[1])
        )
    assert torch.allclose(quant_linear.reference(x, weight), want, rtol=1e-5, atol=1e-5)
    # Dynamic W8A8: per-token int8 activations (absmax / 127), (data - offset) * scale weights.
    w8 = _int8(shape, offset=True)
    assert w8.offset is not None
    xs = x.abs().amax(dim=1, keepdim=True) / 127
    xq = torch.round(x / xs)
    want8 = (xq @ ((w8.data.float() - w8.offset) * w8.scale).t()) * xs
    assert torch.allclose(quant_linear.reference(x, w8), want8, rtol=1e-5, atol=1e-4)


def test_static_w8a8_reference_follows_modelslim_formula() -> None:
    torch.manual_seed(0)
    data = torch.randint(-127, 128, (6, 9), dtype=torch.int8)
    deq = torch.rand(6) / 100
    weight = QuantizedWeight(
        "w8a8_static",
        data,
        torch.ones(6, 1),
        input_scale=torch.tensor([0.05]),
        input_offset=torch.tensor([3.0]),
        deq_scale=deq.view(torch.int32).to(torch.int64),  # the float16-model layout: float32 bits in int64
        quant_bias=torch.randint(-50, 50, (6,), dtype=torch.int32),
    )
    x = _x(4, 9)
    xq = torch.clamp(torch.round(x / 0.05 + 3.0), -128, 127)
    assert weight.quant_bias is not None
    want = (xq @ data.float().t() + weight.quant_bias.float()) * deq
    assert torch.allclose(quant_linear(x, weight), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("shape", "dtype"), itertools.product(SHAPES, [torch.float32, torch.bfloat16]))
def test_cpu_fp8_bands_match_the_reference(
    shape: tuple[int, int], dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    weight, _ = _fp8(shape)
    monkeypatch.setattr(cpu_backend, "BAND_ELEMENTS", 16 * 16)  # several bands even on tiny weights
    seen: list[tuple[int, ...]] = []
    band = cpu_backend._dequantized_band

    def recording(*args: Any) -> torch.Tensor:
        out = band(*args)
        seen.append(tuple(out.shape))
        return out

    monkeypatch.setattr(cpu_backend, "_dequantized_band", recording)
    x = _x(7, shape[1], dtype)
    got = pypto_kernels.quant_linear(x, weight)  # dispatched to the CPU fast path
    want = quant_linear.reference(x, weight)
    # float32: the same products; bfloat16: bands multiplied in bfloat16 (a few ulps of 2**-8).
    rel = ((got.float() - want.float()).norm() / want.float().norm()).item()
    assert got.dtype == dtype and rel < (1e-6 if dtype == torch.float32 else 1e-2), rel
    assert seen, "the CPU fast path did not run"
    if shape[0] > 16:  # never a full-size float copy of the weight
        assert all(rows < shape[0] for rows, _ in seen), seen


# x86 CPU classes: int8 dot products (VNNI) run torch._int_mm; without them the weight is converted
# to float band by band (40 values a band here, so the shapes split into several).
INT8_CPUS = {"vnni": (("sse2", "avx2", "avx512f", "avx512_vnni"), 1), "avx2": (("sse2", "avx2", "fma"), 0)}


@pytest.mark.parametrize(("shape", "offset", "cpu"), itertools.product(SHAPES, [False, True], INT8_CPUS))
def test_cpu_int8_matches_the_reference(
    shape: tuple[int, int],
    offset: bool,
    cpu: str,
    cpu_flags: Callable[..., None],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    flags, int_mm_calls = INT8_CPUS[cpu]
    cpu_flags(*flags)
    monkeypatch.setattr(cpu_backend, "BAND_ELEMENTS", 40)
    calls: list[int] = []
    int_mm = torch._int_mm
    monkeypatch.setattr(torch, "_int_mm", lambda a, b: calls.append(1) or int_mm(a, b))
    weight = _int8(shape, offset=offset)
    x = _x(9, shape[1])
    got = pypto_kernels.quant_linear(x, weight, torch.ones(shape[0]))
    want = quant_linear.reference(x, weight, torch.ones(shape[0]))
    assert len(calls) == int_mm_calls
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-4)  # same integer sums, float rounding only
    assert pypto_kernels.describe_kernel("quant_linear", "cpu", scheme="w8a8_dynamic") == cpu_backend.QUANT_LINEAR_LABEL
    assert "reference" in pypto_kernels.describe_kernel("quant_linear", "cpu", scheme="w8a8_static")


# --------------------------------------------------------------------------- CUDA


def _scaled_mm_standin(
    a: torch.Tensor, b: torch.Tensor, *, scale_a: torch.Tensor, scale_b: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """torch._scaled_mm's documented row-wise semantics: ``(a * scale_a) @ (b * scale_b)`` in
    ``out_dtype``, with ``a`` row-major fp8, ``b`` column-major fp8 (any leading dimension), ``scale_a`` ``[M, 1]`` and
    ``scale_b`` ``[1, N]`` float32."""
    assert a.dtype == b.dtype == torch.float8_e4m3fn and a.stride(1) == 1 and b.stride(0) == 1  # row / column major
    assert scale_a.shape == (a.shape[0], 1) and scale_b.shape == (1, b.shape[1])
    assert scale_a.dtype == scale_b.dtype == torch.float32
    return ((a.float() * scale_a) @ (b.float() * scale_b)).to(out_dtype)


def test_cuda_fp8_glue_matches_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    from pypto_kernels.backends import cuda

    monkeypatch.setattr(torch, "_scaled_mm", _scaled_mm_standin)
    weight, _ = _fp8((48, 64), (16, 16))
    for rows in (1, 5, 33):
        x = _x(rows, 64, torch.bfloat16)
        got = cuda.quant_linear_fp8(x, weight)
        want = quant_linear.reference(x, weight)
        # e4m3 activations (per token per 16 columns) and bfloat16 partial sums: a few % at most.
        rel = ((got.float() - want.float()).norm() / want.float().norm()).item()
        assert rel < 0.05, rel


def test_cuda_fp8_runs_on_a_fake_device_without_host_reads() -> None:
    from pypto_kernels.backends import cuda
    from tests.plugins.qwen.fake_cuda import CUDA, fake_cuda

    with fake_cuda():
        weight = QuantizedWeight(
            "fp8_block",
            torch.empty(256, 256, dtype=torch.float8_e4m3fn, device=CUDA),
            torch.empty(2, 2, device=CUDA),
            (128, 128),
        )
        out = cuda.quant_linear_fp8(torch.empty(5, 256, dtype=torch.bfloat16, device=CUDA), weight)
        assert out.shape == (5, 256) and out.device.type == "cuda" and out.dtype == torch.bfloat16
    assert "compute capability" in (cuda.explain_quant_linear(device="cpu") or "")
    assert "scheme" in (cuda.explain_quant_linear(scheme="w8a8_dynamic") or "")


# --------------------------------------------------------------------------- NPU


def _fake_torch_npu(calls: list[str]) -> types.ModuleType:
    def npu_dynamic_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Documented: per-row symmetric int8, scale = absmax / 127 (float32 ``[rows]``)."""
        calls.append("npu_dynamic_quant")
        scale = x.float().abs().amax(dim=-1) / 127
        return torch.round(x.float() / scale[:, None]).clamp(-127, 127).to(torch.int8), scale

    def npu_quant_matmul(
        x1: torch.Tensor,
        x2: torch.Tensor,
        scale: torch.Tensor,
        *,
        offset: torch.Tensor | None = None,
        pertoken_scale: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
        output_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """Documented: ``(x1 @ x2 [+ bias]) * scale * pertoken_scale`` from int8 ``[m, k]`` x ``[k, n]``."""
        calls.append("npu_quant_matmul")
        assert x1.dtype == x2.dtype == torch.int8 and x2.shape[0] == x1.shape[1]
        assert scale.shape == (x2.shape[1],) and pertoken_scale is not None and pertoken_scale.shape == (x1.shape[0],)
        acc = (x1.long() @ x2.long()).float()
        return (acc * scale * pertoken_scale[:, None]).to(output_dtype or torch.float16)

    fake = types.ModuleType("torch_npu")
    fake.npu_dynamic_quant = npu_dynamic_quant  # type: ignore[attr-defined]
    fake.npu_quant_matmul = npu_quant_matmul  # type: ignore[attr-defined]
    return fake


def test_npu_w8a8_glue_matches_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(registry, "_FAST_PATHS", {})
    monkeypatch.setattr(registry, "_LOADED_DEVICE_TYPES", set())
    monkeypatch.setitem(sys.modules, "torch_npu", _fake_torch_npu(calls))
    monkeypatch.delitem(sys.modules, "pypto_kernels.backends.npu", raising=False)
    npu = importlib.import_module("pypto_kernels.backends.npu")
    monkeypatch.setitem(sys.modules, "pypto_kernels.backends.npu", npu)
    for shape in SHAPES:
        weight = _int8(shape)
        x = _x(6, shape[1], torch.bfloat16)
        assert npu.supports_quant_linear(x, weight)
        got = npu.quant_linear_w8a8(x, weight)
        want = quant_linear.reference(x, weight)
        assert torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    assert calls[:2] == ["npu_dynamic_quant", "npu_quant_matmul"]
    # A row-parallel rank's slice: quantised with the scale reduce_absmax returns (npu_dynamic_quant
    # takes none), the same arithmetic as the reference.
    calls.clear()
    weight, x = _int8((24, 64)), _x(6, 64, torch.bfloat16)
    got = npu.quant_linear_w8a8(x, weight, None, lambda a: a * 2)
    want = quant_linear.reference(x, weight, None, lambda a: a * 2)
    assert calls == ["npu_quant_matmul"] and torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    assert not torch.allclose(want.float(), quant_linear.reference(x, weight).float(), rtol=1e-3, atol=1e-3)
    assert not npu.supports_quant_linear(x, _int8((5, 3), offset=True))  # asymmetric: reference
    assert "scheme" in (npu.explain_quant_linear(scheme="fp8_block") or "")


def test_quantized_weight_dequantize_follows_each_scheme() -> None:
    """The core type's reference dequantisation against each scheme's element-wise definition."""
    fp8, _ = _fp8((37, 50))
    i, j = 20, 33
    assert fp8.dequantize()[i, j].item() == (fp8.data[i, j].float() * fp8.scale[i // 16, j // 16]).item()
    dyn = _int8((6, 9), offset=True)
    assert dyn.offset is not None
    want = (dyn.data.float() - dyn.offset) * dyn.scale
    assert torch.equal(dyn.dequantize(), want) and torch.equal(pypto_kernels.dequantize_weight(dyn), want)
    assert dyn.nbytes() == 6 * 9 + 2 * 6 * 4
    deq = torch.full((6,), 0.5)
    static = QuantizedWeight(
        "w8a8_static",
        dyn.data,
        deq,
        input_scale=torch.tensor([0.25]),
        input_offset=torch.tensor([0.0]),
        deq_scale=deq,
        quant_bias=torch.zeros(6, dtype=torch.int32),
    )
    assert torch.equal(static.dequantize(), dyn.data.float() * 2)  # deq_scale / input_scale = weight scale
    assert static.nbytes() == 6 * 9 + 6 * 4 + 4 + 4 + 6 * 4  # deq_scale counted once


@pytest.mark.parametrize("fmt", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_table_decoding_equals_the_conversion(fmt: torch.dtype) -> None:
    """The CPU's byte-table decoding gives every FP8 code's value (NaNs included) as ``.to`` does,
    for contiguous and strided tensors."""
    from pypto_kernels.quant import fp8_values

    every = torch.arange(256, dtype=torch.uint8).view(fmt).reshape(16, 16)
    for data in (every, every[:, 3:11], every.t()):
        for dtype in (torch.float32, torch.bfloat16):
            got, want = fp8_values(data, dtype), data.to(dtype)
            assert got.dtype == dtype and torch.equal(got.isnan(), want.isnan())
            assert torch.equal(got.nan_to_num(), want.nan_to_num())


# --------------------------------------------------------------------------- row-parallel W8A8


def _two_ranks(run: Callable[[int, Callable[[torch.Tensor], torch.Tensor] | None], torch.Tensor]) -> torch.Tensor:
    """The sum of two simulated tensor-parallel ranks' partial outputs, ``run(rank, reduce_absmax)``,
    where each rank's ``reduce_absmax`` is the all-reduce MAX: a first pass records every absmax
    each rank hands over (in call order), the second gives each call the maximum of both ranks'."""
    seen: dict[int, list[torch.Tensor]] = {0: [], 1: []}

    def record(rank: int) -> Callable[[torch.Tensor], torch.Tensor]:
        return lambda a: seen[rank].append(a.clone()) or a

    def reduce(rank: int) -> Callable[[torch.Tensor], torch.Tensor]:
        other = iter(seen[1 - rank])
        return lambda a: torch.maximum(a, next(other))

    for rank in (0, 1):
        run(rank, record(rank))
    assert len(seen[0]) == len(seen[1]) > 0
    return run(0, reduce(0)) + run(1, reduce(1))


def _columns(weight: QuantizedWeight, rank: int) -> QuantizedWeight:
    """Rank ``rank``'s half of the input columns (a row-parallel part; scales are per output row)."""
    half = weight.data.shape[-1] // 2
    return QuantizedWeight(
        weight.scheme, weight.data[..., rank * half : (rank + 1) * half], weight.scale, offset=weight.offset
    )


@pytest.mark.parametrize("path", ["reference", "cpu"])
def test_row_parallel_w8a8_linear_halves_sum_to_the_whole(path: str) -> None:
    """Each rank quantises its half of a row with the whole row's scale (``reduce_absmax``): the
    partial products add up to one rank's result; with per-half scales they do not."""
    weight, x = _int8((24, 64), offset=True), _x(9, 64) * torch.linspace(0.1, 3, 64)  # halves' ranges differ
    fn = quant_linear.reference if path == "reference" else cpu_backend.quant_linear
    whole = fn(x, weight)

    def rank_out(rank: int, reduce: Callable[[torch.Tensor], torch.Tensor] | None) -> torch.Tensor:
        return fn(x[:, rank * 32 : (rank + 1) * 32], _columns(weight, rank), None, reduce)

    torch.testing.assert_close(_two_ranks(rank_out), whole, rtol=1e-5, atol=1e-4)
    per_half = rank_out(0, None) + rank_out(1, None)
    assert (per_half - whole).abs().max() > 1e-2  # what the ranks gave before: the test can fail


def _split_experts(stack: QuantizedWeight, rank: int, gate_up: bool) -> QuantizedWeight:
    """Rank ``rank``'s half of every expert's intermediate rows: gate and up rows of ``gate_up``
    (``[E, 2I, H]``), the input columns of ``down`` (``[E, H, I]``)."""
    if not gate_up:
        return _columns(stack, rank)
    i = stack.data.shape[1] // 2
    rows = torch.cat([torch.arange(rank * i // 2, (rank + 1) * i // 2) + base for base in (0, i)])
    offset = None if stack.offset is None else stack.offset[:, rows]
    return QuantizedWeight(stack.scheme, stack.data[:, rows], stack.scale[:, rows], offset=offset)


def _expert_stack(rows: int, cols: int, seed: int) -> QuantizedWeight:
    """Five asymmetric int8 experts ``[5, rows, cols]`` with per-row scales and offsets."""
    w = _int8((5 * rows, cols), offset=True, seed=seed)
    assert w.offset is not None
    return QuantizedWeight(
        "w8a8_dynamic", w.data.view(5, rows, cols), w.scale.view(5, rows), offset=w.offset.view(5, rows)
    )


@pytest.mark.parametrize("path", ["reference", "gathered", "cpu"])
def test_split_w8a8_experts_halves_sum_to_the_whole(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tensor-parallel MoE: each rank holds half of every expert's intermediate rows, and the down
    matmuls' inputs (halves of the hidden rows) are quantised with the whole rows' scales."""
    import pypto_kernels.quant_moe as qm

    monkeypatch.setattr(qm, "GATHER_EXPERTS", 2)  # the gathered path's reduction runs per chunk
    stacks = [_expert_stack(48, 40, seed=4), _expert_stack(40, 24, seed=5)]
    x = _x(7, 40, seed=6)
    ids = torch.tensor([[0, 3], [3, 4], [0, 4], [3, 0], [4, 1], [0, 3], [3, 3]])
    weights = torch.rand(7, 2, generator=torch.Generator().manual_seed(7))
    fn = {
        "reference": qm.quant_moe_experts.reference,
        "gathered": qm.gathered_quant_moe_experts,
        "cpu": cpu_backend.int8_moe_experts,
    }[path]
    whole = fn(x, *stacks, weights, ids)

    def rank_out(rank: int, reduce: Callable[[torch.Tensor], torch.Tensor] | None) -> torch.Tensor:
        gu, dn = _split_experts(stacks[0], rank, True), _split_experts(stacks[1], rank, False)
        return fn(x, gu, dn, weights, ids, reduce_absmax=reduce)

    torch.testing.assert_close(_two_ranks(rank_out), whole, rtol=1e-5, atol=1e-4)
    assert (rank_out(0, None) + rank_out(1, None) - whole).abs().max() > 1e-3


def test_row_parallel_w8a8_reads_nothing_on_the_host_of_a_fake_device() -> None:
    """The whole-row scales stay on the device: the W8A8 linear (reference, which CUDA runs) and
    the gathered experts hand ``reduce_absmax`` a device tensor and read nothing back."""
    import pypto_kernels.quant_moe as qm
    from tests.plugins.qwen.fake_cuda import CUDA, fake_cuda

    handed: list[torch.Tensor] = []

    def reduce(a: torch.Tensor) -> torch.Tensor:  # an all-reduce MAX is in place on the device
        handed.append(a)
        return a

    with fake_cuda():
        int8 = torch.empty(24, 32, dtype=torch.int8, device=CUDA)
        weight = QuantizedWeight("w8a8_dynamic", int8, torch.empty(24, 1, device=CUDA))
        out = pypto_kernels.quant_linear(torch.empty(5, 32, dtype=torch.bfloat16, device=CUDA), weight, None, reduce)
        assert out.shape == (5, 24) and out.device == CUDA
        gate_up, down = (
            QuantizedWeight(
                "w8a8_dynamic", torch.empty(4, n, k, dtype=torch.int8, device=CUDA), torch.empty(4, n, device=CUDA)
            )
            for n, k in ((16, 32), (32, 8))
        )
        x, weights = torch.empty(5, 32, dtype=torch.bfloat16, device=CUDA), torch.empty(5, 2, device=CUDA)
        ids = torch.zeros(5, 2, dtype=torch.long, device=CUDA)
        moe = qm.gathered_quant_moe_experts(x, gate_up, down, weights, ids, reduce_absmax=reduce)
        assert moe.shape == (5, 32) and moe.device == CUDA
    assert len(handed) >= 2 and all(a.device == CUDA and a.shape[-1] == 1 for a in handed)


@pytest.mark.parametrize("rows", [1, 9, 64])
def test_a_prepacked_int8_weight_matches_the_reference(rows: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """oneDNN's prepacked int8 product (``pack_quant_linear``) gives the reference's result (the same
    integer sums and scales); the plain data is freed, ``torch._int_mm`` no longer runs, and the
    reference refuses the packed weight instead of reading the emptied data."""
    shape = (37, 150)
    weight, plain = _int8(shape), _int8(shape)
    x, bias = _x(rows, shape[1]), torch.randn(shape[0])
    want = quant_linear.reference(x, plain, bias)
    if not pypto_kernels.device.cpu_int8_products_pay():
        assert not pypto_kernels.pack_quant_linear(weight)
        pytest.skip("this CPU has no int8 dot products: the weight stays plain")
    assert pypto_kernels.pack_quant_linear(weight)
    assert weight.data.numel() == 0 and weight.shape == shape and weight.nbytes() == plain.nbytes()
    monkeypatch.setattr(torch, "_int_mm", None)  # the packed product runs, not _int_mm
    got = pypto_kernels.quant_linear(x, weight, bias)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="packed for oneDNN"):
        quant_linear.reference(x, weight, bias)


def test_only_symmetric_int8_weights_on_int8_cpus_are_packed() -> None:
    vnni, avx2 = frozenset({"sse2", "avx512_vnni"}), frozenset({"sse2", "avx2"})
    assert not pypto_kernels.pack_quant_linear(_int8((8, 16)), flags=avx2)
    assert not pypto_kernels.pack_quant_linear(_int8((8, 16), offset=True), flags=vnni)
    assert not pypto_kernels.pack_quant_linear(_fp8((16, 16))[0], flags=vnni)


def test_int8_products_pay_on_x86_only_with_int8_dot_products() -> None:
    pay = pypto_kernels.device.cpu_int8_products_pay
    assert all(pay(frozenset({"sse2", flag})) for flag in ("avx512_vnni", "avx_vnni", "amx_int8"))
    assert not pay(frozenset({"sse2", "avx2", "avx512f", "avx512bw"}))  # AVX-512 without VNNI
    assert pay(frozenset({"asimd", "asimddp"})) and pay(frozenset())  # Arm, no /proc/cpuinfo: unmeasured, kept
