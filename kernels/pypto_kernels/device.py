"""Device discovery and selection, guarded so that a missing or broken ``torch_npu`` never raises."""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Sequence
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

logger = logging.getLogger("pypto_kernels")

_SUPPORTED_TYPES = ("cpu", "cuda", "npu")


@functools.cache
def _probe_npu() -> tuple[bool, str]:
    """Import ``torch_npu`` once and report (available, reason); cached because the import is slow."""
    # Turn off torch's entry-point autoload of device extensions so torch_npu is only ever
    # imported here, explicitly and under our exception guard.
    os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
    try:
        import torch_npu  # noqa: F401
    except (ImportError, OSError, RuntimeError) as exc:
        return False, f"torch_npu not importable ({type(exc).__name__}: {exc})"
    except Exception as exc:  # vendor stacks fail in creative ways; never raise from a probe
        return False, f"torch_npu import failed ({type(exc).__name__}: {exc})"
    try:
        npu = getattr(torch, "npu", None)
        if npu is None or not npu.is_available():
            return False, "torch_npu imported but torch.npu.is_available() is False"
        return True, f"torch_npu found {npu.device_count()} NPU device(s)"
    except Exception as exc:
        return False, f"torch.npu query failed ({type(exc).__name__}: {exc})"


def npu_available() -> bool:
    """True when ``torch_npu`` imports and reports at least one NPU; never raises."""
    return _probe_npu()[0]


def _parse(preference: str) -> tuple[str, int | None]:
    kind, sep, index = preference.strip().lower().partition(":")
    if kind not in _SUPPORTED_TYPES:
        raise ValueError(f"unsupported device {preference!r}; expected 'auto' or one of {_SUPPORTED_TYPES}")
    if not sep:
        return kind, None
    if not index.isdigit():
        raise ValueError(f"bad device index in {preference!r}; expected e.g. '{kind}:0'")
    return kind, int(index)


def select_device(preference: str = "auto") -> torch.device:
    """Resolve a device preference ("auto", "cpu", "cuda", "npu", "cuda:1", ...) to a usable device.

    Explicit requests fail loudly (ValueError) instead of silently falling back, so a
    misconfigured server does not end up serving on CPU.
    """
    if preference.strip().lower() == "auto":
        has_npu, npu_reason = _probe_npu()
        if has_npu:
            logger.info("select_device(auto): using npu (%s)", npu_reason)
            return torch.device("npu")
        if torch.cuda.is_available():
            count = torch.cuda.device_count()
            logger.info("select_device(auto): using cuda (%d device(s); no NPU: %s)", count, npu_reason)
            return torch.device("cuda")
        logger.info("select_device(auto): using cpu (no NPU: %s; CUDA is not available)", npu_reason)
        return torch.device("cpu")

    kind, index = _parse(preference)
    if kind == "cpu":
        return torch.device("cpu")
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {preference!r} requested but CUDA is not available on this host/build")
        count = torch.cuda.device_count()
    else:
        has_npu, npu_reason = _probe_npu()
        if not has_npu:
            raise ValueError(
                f"device {preference!r} requested but no NPU is usable: {npu_reason}; "
                "install the 'npu' extra (torch-npu) on an Ascend host"
            )
        count = torch.npu.device_count()  # type: ignore[attr-defined]
    if index is not None and index >= count:
        raise ValueError(f"device {preference!r} requested but only {count} {kind} device(s) are visible")
    return torch.device(kind) if index is None else torch.device(kind, index)


#: /proc/cpuinfo flags that mean native arithmetic in a 16-bit float dtype: x86 AVX-512 and AMX
#: instructions, and Arm's ``bf16`` / half-precision SIMD features.
NATIVE_CPU_FLAGS: dict[torch.dtype, tuple[str, ...]] = {
    torch.bfloat16: ("avx512_bf16", "amx_bf16", "bf16"),
    torch.float16: ("avx512_fp16", "amx_fp16", "asimdhp"),
}


@functools.cache
def _cpuinfo() -> tuple[tuple[str, str], ...]:
    """``/proc/cpuinfo``'s ``(key, value)`` lines, read once; empty where the file is absent (not Linux)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as handle:
            text = handle.read()
    except OSError:
        return ()
    pairs = (line.partition(":") for line in text.splitlines())
    return tuple((key.strip(), value.strip()) for key, _, value in pairs)


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from ``/proc/cpuinfo`` (``flags`` on x86, ``Features`` on Arm); empty
    where the file is absent (not Linux), so such CPUs count as lacking every 16-bit feature."""
    return frozenset(flag for key, value in _cpuinfo() if key in ("flags", "Features") for flag in value.split())


def avx2_without_avx512(flags: frozenset[str]) -> bool:
    """Whether CPU ``flags`` are the AVX2 class: x86 with AVX2 and without AVX-512 (where packing
    rules and native-kernel routing differ; docs/benchmarks.md)."""
    return "avx2" in flags and "avx512f" not in flags


def cpu_vendor() -> str:
    """The CPU's ``vendor_id`` from ``/proc/cpuinfo`` (``GenuineIntel``, ``AuthenticAMD``, ...); empty
    where the file or the field is absent (Arm, not Linux)."""
    return next((value for key, value in _cpuinfo() if key == "vendor_id"), "")


def cpu_computes_natively(dtype: torch.dtype, flags: frozenset[str] | None = None) -> bool:
    """Whether this CPU (or one with ``flags``) has instructions for ``dtype`` products; float32 always."""
    if dtype not in NATIVE_CPU_FLAGS:
        return True
    have = cpu_flags() if flags is None else flags
    return any(flag in have for flag in NATIVE_CPU_FLAGS[dtype])


#: /proc/cpuinfo flags of x86 CPUs with int8 dot-product instructions (AVX512-VNNI, AVX-VNNI, AMX),
#: where int8 x int8 products are W8A8's fast path on the CPU.
INT8_DOT_CPU_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")


def cpu_int8_products_pay(flags: frozenset[str] | None = None) -> bool:
    """Whether int8 x int8 products (``torch._int_mm``, oneDNN) beat dequantised float products on this
    CPU (or one with ``flags``). On an x86 CPU without int8 dot products (:data:`INT8_DOT_CPU_FLAGS`)
    they do not: on the AVX2 AMD EPYC ``torch._int_mm`` took 326 ms for a product float32 did in
    7.6 ms (docs/benchmarks.md). Other architectures keep them (not measured)."""
    have = cpu_flags() if flags is None else flags
    x86 = "sse2" in have
    return not x86 or any(flag in have for flag in INT8_DOT_CPU_FLAGS)


#: /proc/cpuinfo flags of x86 CPUs whose bfloat16 products run at twice float32's rate or more
#: (AVX512-BF16's dot products, AMX's tiles), where ``dtype = "auto"`` runs a float32 checkpoint in
#: bfloat16.
BF16_FASTER_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


def auto_dtype(stored: torch.dtype, device: torch.device, flags: frozenset[str] | None = None) -> torch.dtype:
    """The dtype a checkpoint stored in ``stored`` runs in under ``dtype = "auto"``.

    As stored, except on a CPU (``flags`` stands in for this CPU's, tests), both logged:

    - a 16-bit checkpoint on a CPU without instructions for it runs in float32: torch emulates
      bfloat16/float16 products there through float32 conversions, 22x slower than float32 on the
      project's AVX2 machine (docs/benchmarks.md), at twice the weight memory;
    - a float32 checkpoint on an x86 CPU with AVX512-BF16 or AMX (:data:`BF16_FASTER_CPU_FLAGS`)
      runs in bfloat16 (products accumulate in float32), as vLLM's CPU backend runs it: on the
      AVX-512 AMD EPYC 1.1x the throughput and 1.6x faster at concurrency 1 on the small shape, at
      half the weight memory (docs/benchmarks.md, "The AVX-512 AMD machine").
    """
    if device.type != "cpu":
        return stored
    have = cpu_flags() if flags is None else flags
    if stored == torch.float32 and any(flag in have for flag in BF16_FASTER_CPU_FLAGS):
        logger.warning(
            "dtype=auto: this CPU has bfloat16 instructions (%s), so the float32 checkpoint runs in bfloat16 "
            "(float32 accumulation, half the weight memory); set dtype=float32 to keep it as stored",
            ", ".join(flag for flag in BF16_FASTER_CPU_FLAGS if flag in have),
        )
        return torch.bfloat16
    if cpu_computes_natively(stored, have):
        return stored
    logger.warning(
        "dtype=auto: this CPU has no %s instructions (none of %s), so the %s checkpoint runs in float32 "
        "(twice its weight memory, about 20x faster than emulated %s); set dtype=%s to keep it as stored",
        stored,
        ", ".join(NATIVE_CPU_FLAGS[stored]),
        stored,
        stored,
        str(stored).removeprefix("torch."),
    )
    return torch.float32


def upload(values: Sequence[Any], device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype)`` (numbers, booleans, nested lists) on ``device`` without
    stalling the host.

    ``torch.tensor(values, device="cuda")`` copies from pageable memory, which waits for every
    kernel already queued on the stream: a host that uploads step metadata mid-forward can then never
    run ahead of the device. On CUDA the values go through pinned memory (torch's caching host
    allocator, which keeps the block until the copy has read it) and the copy does not block.
    Elsewhere (and on fake tensors) a plain copy.
    """
    if device.type != "cuda" or not torch.cuda.is_available():
        return torch.tensor(values, dtype=dtype, device=device)
    host = torch.tensor(values, dtype=dtype)
    if isinstance(host, FakeTensor):  # the device-discipline tests: no pinned memory to take
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
