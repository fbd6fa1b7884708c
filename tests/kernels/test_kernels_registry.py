"""Registry dispatch, device selection and lazy backend loading."""

from __future__ import annotations

import importlib
import logging
import subprocess
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import pypto_kernels
from pypto_kernels import registry
from pypto_kernels.backends import cpu as cpu_backend
from pypto_kernels.backends import cuda as cuda_backend


@pytest.fixture
def clean_registry(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Isolate fast-path registrations made by a test."""
    monkeypatch.setattr(registry, "_FAST_PATHS", {})
    monkeypatch.setattr(registry, "_LOADED_DEVICE_TYPES", set())
    yield


def test_public_api_exports() -> None:
    for name in pypto_kernels.__all__:
        assert hasattr(pypto_kernels, name), name
    assert set(pypto_kernels.available_kernels()) == set(pypto_kernels.KERNEL_NAMES)


def test_fake_cuda_fast_path_only_for_cuda(clean_registry: None) -> None:
    def fake_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return x

    pypto_kernels.register_kernel("rms_norm", "cuda", fake_rms_norm)
    assert pypto_kernels.get_kernel("rms_norm", "cuda") is fake_rms_norm
    assert pypto_kernels.get_kernel("rms_norm", torch.device("cuda", 1)) is fake_rms_norm
    # The CPU keeps its own: the built-in native pass, or the reference where a kernel has no fast path.
    assert pypto_kernels.get_kernel("rms_norm", "cpu").fast is cpu_backend.native_rms_norm  # type: ignore[attr-defined]
    assert pypto_kernels.get_kernel("apply_rope", "cpu") is pypto_kernels.apply_rope.reference
    assert pypto_kernels.get_kernel("apply_rope", torch.device("cpu")) is pypto_kernels.reference_kernel("apply_rope")
    # The built-in CUDA fast path loaded lazily by get_kernel must not override the user's registration.
    assert pypto_kernels.get_kernel("rms_norm", "cuda") is fake_rms_norm
    assert pypto_kernels.available_kernels()["rms_norm"] == ["cpu", "cuda"]
    # Kernels without a cuda fast path fall back to the reference on cuda too.
    assert pypto_kernels.get_kernel("moe_experts", "cuda") is pypto_kernels.moe_experts.reference


def test_public_function_dispatches_by_tensor_device(clean_registry: None, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []

    def fake(x: torch.Tensor) -> torch.Tensor:
        calls.append("fast")
        return x

    pypto_kernels.register_kernel("silu_and_mul", "cuda", fake)
    monkeypatch.setattr(registry, "BACKENDS", frozenset({"npu", "cuda", "meta"}))
    pypto_kernels.register_kernel("silu_and_mul", "meta", fake)
    meta = torch.empty(2, 8, device="meta")
    assert pypto_kernels.silu_and_mul(meta) is meta and calls == ["fast"]
    cpu_out = pypto_kernels.silu_and_mul(torch.ones(2, 8))
    assert cpu_out.shape == (2, 4) and calls == ["fast"]


def test_supports_routes_declined_calls_to_the_reference(clean_registry: None) -> None:
    calls: list[str] = []

    def fast(x: torch.Tensor) -> torch.Tensor:
        calls.append("fast")
        return x[..., : x.shape[-1] // 2]

    def supports(x: torch.Tensor) -> bool:
        return x.shape[-1] % 4 == 0

    pypto_kernels.register_kernel("silu_and_mul", "cuda", fast, supports)
    guarded = pypto_kernels.get_kernel("silu_and_mul", "cuda")
    assert guarded is not fast and guarded.fast is fast and guarded.supports is supports  # type: ignore[attr-defined]
    assert pypto_kernels.get_kernel("silu_and_mul", "cuda:1") is guarded  # built once, at registration
    x = torch.randn(3, 8)
    assert torch.equal(guarded(x), x[:, :4]) and calls == ["fast"]
    odd = torch.randn(3, 6)  # declined: the reference runs, whatever the fast path would have done
    assert torch.equal(guarded(odd), pypto_kernels.silu_and_mul.reference(odd)) and calls == ["fast"]
    assert pypto_kernels.available_kernels()["silu_and_mul"] == ["cuda"]
    with pytest.raises(TypeError, match="supports for 'silu_and_mul' must be callable"):
        pypto_kernels.register_kernel("silu_and_mul", "cuda", fast, True)  # type: ignore[arg-type]


def test_describe_kernel_reports_labels_and_fallbacks(clean_registry: None) -> None:
    def fast(x: torch.Tensor) -> torch.Tensor:
        return x

    def explain(**features: int) -> str | None:
        return "odd width" if features.get("width", 4) % 2 else None

    assert pypto_kernels.describe_kernel("apply_rope", "cpu") == "reference"
    assert pypto_kernels.describe_kernel("silu_and_mul", "cuda") == "reference"
    pypto_kernels.register_kernel("silu_and_mul", "cuda", fast)
    assert pypto_kernels.describe_kernel("silu_and_mul", "cuda").startswith("cuda: ")
    pypto_kernels.register_kernel("silu_and_mul", "cuda", fast, lambda x: True, label="cuda: fused")
    assert pypto_kernels.describe_kernel("silu_and_mul", "cuda") == "cuda: fused where supported, else reference"
    pypto_kernels.register_kernel("silu_and_mul", "cuda", fast, lambda x: True, label="cuda: fused", explain=explain)
    assert pypto_kernels.describe_kernel("silu_and_mul", "cuda", width=8) == "cuda: fused"
    assert (
        pypto_kernels.describe_kernel("silu_and_mul", "cuda", width=7) == "reference (cuda: fused declines: odd width)"
    )
    with pytest.raises(ValueError, match="unknown kernel"):
        pypto_kernels.describe_kernel("flash", "cuda")


def test_unknown_names_raise() -> None:
    with pytest.raises(ValueError, match="unknown kernel 'rms_nrom'"):
        pypto_kernels.register_kernel("rms_nrom", "cuda", lambda x: x)
    with pytest.raises(ValueError, match="unknown kernel"):
        pypto_kernels.get_kernel("flash_attn", "cpu")
    with pytest.raises(ValueError, match="unknown backend 'tpu'"):
        pypto_kernels.register_kernel("rms_norm", "tpu", lambda x: x)


def test_builtin_cuda_rms_norm_matches_reference_on_cpu() -> None:
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(7, 64, generator=gen).to(dtype)
        w = torch.randn(64, generator=gen).to(dtype)
        torch.testing.assert_close(cuda_backend.rms_norm(x, w, 1e-6), pypto_kernels.rms_norm(x, w, 1e-6))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_fast_paths_match_reference() -> None:
    x = torch.randn(7, 64, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(64, device="cuda", dtype=torch.bfloat16)
    assert pypto_kernels.get_kernel("rms_norm", x.device) is cuda_backend.rms_norm
    torch.testing.assert_close(pypto_kernels.rms_norm(x, w, 1e-6), pypto_kernels.rms_norm.reference(x, w, 1e-6))


@pytest.mark.skipif(not pypto_kernels.npu_available(), reason="needs an Ascend NPU with torch_npu")
def test_npu_fast_paths_match_reference() -> None:
    device = pypto_kernels.select_device("npu")
    x = torch.randn(7, 2, 128, device=device, dtype=torch.bfloat16)
    w = torch.randn(128, device=device, dtype=torch.bfloat16)
    torch.testing.assert_close(
        pypto_kernels.rms_norm(x, w, 1e-6), pypto_kernels.rms_norm.reference(x, w, 1e-6), atol=2e-2, rtol=2e-2
    )
    gu = torch.randn(5, 64, device=device, dtype=torch.bfloat16)
    torch.testing.assert_close(
        pypto_kernels.silu_and_mul(gu), pypto_kernels.silu_and_mul.reference(gu), atol=2e-2, rtol=2e-2
    )
    inv_freq, scaling = pypto_kernels.rope_inv_freq(64, 10000.0, None, 4096)
    cos, sin = pypto_kernels.rope_cos_sin(torch.arange(7, device=device), inv_freq, scaling, torch.bfloat16)
    k = torch.randn(7, 1, 128, device=device, dtype=torch.bfloat16)
    for fast, ref in zip(pypto_kernels.apply_rope(x, k, cos, sin), pypto_kernels.apply_rope.reference(x, k, cos, sin)):
        torch.testing.assert_close(fast, ref, atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="expects a CPU-only host")
def test_select_device_auto_is_cpu_and_logs_reason(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="pypto_kernels"):
        device = pypto_kernels.select_device("auto")
    if pypto_kernels.npu_available():
        pytest.skip("host has an NPU")
    assert device == torch.device("cpu")
    messages = [r.getMessage() for r in caplog.records if r.name == "pypto_kernels"]
    assert any("using cpu" in m and "torch_npu" in m and "CUDA" in m for m in messages), messages


def test_select_device_explicit() -> None:
    assert pypto_kernels.select_device("cpu") == torch.device("cpu")
    assert pypto_kernels.select_device(" CPU ") == torch.device("cpu")
    with pytest.raises(ValueError, match="unsupported device 'tpu'"):
        pypto_kernels.select_device("tpu")
    with pytest.raises(ValueError, match="bad device index"):
        pypto_kernels.select_device("cuda:x")
    if not pypto_kernels.npu_available():
        with pytest.raises(ValueError, match=r"'npu' requested but no NPU is usable.*torch-npu"):
            pypto_kernels.select_device("npu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            pypto_kernels.select_device("cuda:1")
    else:
        with pytest.raises(ValueError, match="device"):
            pypto_kernels.select_device(f"cuda:{torch.cuda.device_count()}")


def test_npu_available_never_raises() -> None:
    assert isinstance(pypto_kernels.npu_available(), bool)


def test_import_does_not_import_torch_npu() -> None:
    code = (
        "import sys, pypto_kernels, torch\n"
        "x = torch.ones(2, 4)\n"
        "pypto_kernels.rms_norm(x, torch.ones(4), 1e-6)\n"
        "pypto_kernels.get_kernel('rms_norm', 'cuda')\n"
        "pypto_kernels.get_kernel('paged_attention', 'cuda')\n"
        "assert 'torch_npu' not in sys.modules, 'torch_npu imported eagerly'\n"
        "assert 'flash_attn' not in sys.modules, 'flash_attn imported by loading the cuda backend'\n"
        "assert 'pypto_kernels.backends.npu' not in sys.modules\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def _fake_torch_npu() -> types.ModuleType:
    """Stand-in implementing the documented semantics of the torch_npu ops the NPU backend uses."""
    fake = types.ModuleType("torch_npu")

    def npu_rms_norm(x: torch.Tensor, gamma: torch.Tensor, epsilon: float) -> tuple[torch.Tensor, torch.Tensor]:
        rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + epsilon)
        return gamma * (x.float() * rstd).to(x.dtype), rstd

    def npu_swiglu(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        assert x.is_contiguous() and x.numel() > 0
        a, b = x.chunk(2, dim=dim)
        return torch.nn.functional.silu(a) * b

    def npu_rotary_mul(x: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor) -> torch.Tensor:
        assert x.dim() == 4 and r1.shape == (1, x.shape[1], 1, x.shape[3]) and r1.shape == r2.shape
        x1, x2 = x.chunk(2, dim=-1)
        return r1 * x + r2 * torch.cat((-x2, x1), dim=-1)

    fake.npu_rms_norm = npu_rms_norm  # type: ignore[attr-defined]
    fake.npu_swiglu = npu_swiglu  # type: ignore[attr-defined]
    fake.npu_rotary_mul = npu_rotary_mul  # type: ignore[attr-defined]
    return fake


def test_npu_backend_glue_with_stub_ops(clean_registry: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """NPU wrapper glue (reshapes, partial rotary, fallbacks) on CPU via stubs doing the documented math."""
    monkeypatch.setitem(sys.modules, "torch_npu", _fake_torch_npu())
    monkeypatch.delitem(sys.modules, "pypto_kernels.backends.npu", raising=False)
    monkeypatch.setattr(pypto_kernels.device, "npu_available", lambda: True)
    npu_backend = importlib.import_module("pypto_kernels.backends.npu")
    monkeypatch.setitem(sys.modules, "pypto_kernels.backends.npu", npu_backend)  # dropped again on teardown
    assert pypto_kernels.get_kernel("rms_norm", "npu:0") is npu_backend.rms_norm
    assert pypto_kernels.available_kernels()["apply_rope"] == ["npu"]

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 64, generator=gen)
    w = torch.randn(64, generator=gen)
    assert torch.equal(npu_backend.rms_norm(x, w, 1e-6), pypto_kernels.rms_norm.reference(x, w, 1e-6))  # type: ignore[attr-defined]
    gu = torch.randn(5, 64, generator=gen)
    assert torch.equal(npu_backend.silu_and_mul(gu[:, ::1]), pypto_kernels.silu_and_mul.reference(gu))  # type: ignore[attr-defined]
    assert npu_backend.silu_and_mul(gu[:0]).shape == (0, 32)
    k = torch.randn(5, 1, 64, generator=gen)
    for rotary_dim in (64, 32):
        inv_freq, scaling = pypto_kernels.rope_inv_freq(rotary_dim, 10000.0, None, 4096)
        cos, sin = pypto_kernels.rope_cos_sin(torch.arange(5) * 7, inv_freq, scaling, torch.float32)
        for fast, ref in zip(npu_backend.apply_rope(x, k, cos, sin), pypto_kernels.apply_rope(x, k, cos, sin)):
            torch.testing.assert_close(fast, ref, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize(
    ("stored", "flags", "runs"),
    [
        (torch.bfloat16, {"avx2", "fma"}, torch.float32),  # AVX2 only: emulated bfloat16, upcast
        (torch.bfloat16, {"avx512f", "avx512_bf16"}, torch.bfloat16),
        (torch.bfloat16, {"amx_bf16"}, torch.bfloat16),
        (torch.bfloat16, {"fp", "asimd", "bf16"}, torch.bfloat16),  # Arm's Features line
        (torch.float16, {"avx512_bf16"}, torch.float32),  # bfloat16 instructions do not do float16
        (torch.float16, {"avx512_fp16"}, torch.float16),
        (torch.float32, set(), torch.float32),
        (torch.float32, {"avx2", "fma"}, torch.float32),
        (torch.float32, {"avx512f", "avx512_bf16"}, torch.bfloat16),  # bfloat16 where it is faster
        (torch.float32, {"amx_bf16"}, torch.bfloat16),
        (torch.float32, {"fp", "asimd", "bf16"}, torch.float32),  # Arm: not measured, kept as stored
    ],
)
def test_auto_dtype_upcasts_only_what_the_cpu_cannot_compute(
    stored: torch.dtype, flags: set[str], runs: torch.dtype, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="pypto_kernels"):
        assert pypto_kernels.auto_dtype(stored, torch.device("cpu"), frozenset(flags)) == runs
    assert bool(caplog.records) == (runs != stored)
    # Accelerators keep what is stored whatever the host CPU has.
    assert pypto_kernels.auto_dtype(stored, torch.device("cuda"), frozenset()) == stored


def test_cpu_flags_come_from_proc_cpuinfo() -> None:
    from pypto_kernels.device import cpu_flags

    flags = cpu_flags()
    if not Path("/proc/cpuinfo").exists():
        assert flags == frozenset()
        return
    text = Path("/proc/cpuinfo").read_text()
    first = next(line for line in text.splitlines() if line.split(":")[0].strip() in ("flags", "Features"))
    assert set(first.partition(":")[2].split()) <= flags and flags


def test_upload_is_torch_tensor_on_the_cpu() -> None:
    cpu = torch.device("cpu")
    for values, dtype in (([3, 1, 2], None), ([3, 1, 2], torch.int32), ([True, False], None), ([0.5, 2.0], None)):
        got, expected = pypto_kernels.upload(values, cpu, dtype), torch.tensor(values, dtype=dtype)
        assert got.dtype == expected.dtype and torch.equal(got, expected)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_upload_to_cuda_does_not_synchronise() -> None:
    """Under the CUDA sync debugger a plain ``torch.tensor(..., device="cuda")`` raises (the check
    has teeth); :func:`pypto_kernels.upload` of the same values does not, and they arrive."""
    cuda = torch.device("cuda")
    busy = torch.randn(4096, 4096, device=cuda)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError, match="synchronizing"):
            torch.tensor([1, 2, 3], device=cuda)
        busy = busy @ busy  # queued work the upload must not wait for
        got = pypto_kernels.upload([1, 2, 3], cuda, torch.long)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert got.device.type == "cuda" and got.cpu().tolist() == [1, 2, 3]
