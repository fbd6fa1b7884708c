"""What ``device = "auto"`` means on this host, and the KV cache block size and (on the CPU) memory
each kind of device takes by default.

The default block size is the one the device's fused paged attention accepts, so that a launch
with default settings runs it: flash-attn's paged varlen kernel (CUDA) needs a block size divisible by
256, torch_npu's ``npu_fused_infer_attention_score`` (Ascend) a multiple of 128 from 128 to 512. The
CPU runs the torch reference, which takes any size; small blocks there waste less of the cache and
let the prefix cache share prompts at a finer grain. ``tests/kernels`` checks these rules against
the kernels' own.

A leaf module: torch and torch_npu are imported only when a probe runs, so the settings that use it
stay light to import.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
import os
from pathlib import Path

__all__ = [
    "CPU_KV_CACHE_MEMORY",
    "DEFAULT_BLOCK_SIZES",
    "auto_device_kind",
    "cpu_kv_cache_memory",
    "default_block_size",
    "device_kind",
    "fused_attention_refusal",
    "log_block_size",
]

logger = logging.getLogger(__name__)

DEFAULT_BLOCK_SIZES = {"cuda": 256, "npu": 128, "cpu": 16}
"""Tokens per KV cache block when ``block_size`` is unset, by device kind."""

CPU_KV_CACHE_MEMORY = 4 * 1024**3
"""The most bytes an unset ``kv_cache_memory`` gives a CPU rank's KV cache (vLLM CPU's default
``VLLM_CPU_KVCACHE_SPACE`` too)."""


def _probe_npu() -> tuple[bool, str | None]:
    """(an NPU is usable, the error of a ``torch_npu`` that is installed but broken)."""
    if importlib.util.find_spec("torch_npu") is None:
        return False, None
    try:
        importlib.import_module("torch_npu")
        import torch

        return bool(torch.npu.is_available()), None  # type: ignore[attr-defined]
    except ModuleNotFoundError as e:
        if e.name == "torch_npu":  # gone between the lookup and the import: not installed
            return False, None
        return False, f"{type(e).__name__}: {e}"
    except Exception as e:  # a broken vendor stack fails in many ways; the device is then taken as no NPU
        return False, f"{type(e).__name__}: {e}"


@functools.cache
def _npu_usable() -> bool:
    """Whether an NPU is usable, probed once per process (importing torch_npu is slow); a broken
    ``torch_npu`` is reported once, as a warning with its error."""
    usable, error = _probe_npu()
    if error is not None:
        logger.warning(
            "torch_npu is installed but unusable (%s); device 'auto' takes this host as having no NPU", error
        )
    return usable


def auto_device_kind() -> str:
    """The device kind ``device = "auto"`` resolves to here: npu > cuda > cpu."""
    if _npu_usable():
        return "npu"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def device_kind(device: str) -> str:
    """The kind of a ``device`` setting ('cuda:1' -> 'cuda'; 'auto' probes the host)."""
    kind = device.strip().lower().partition(":")[0]
    return auto_device_kind() if kind == "auto" else kind


def default_block_size(kind: str) -> int:
    """Tokens per KV cache block for a device kind when ``block_size`` is unset."""
    return DEFAULT_BLOCK_SIZES.get(kind, DEFAULT_BLOCK_SIZES["cpu"])


def fused_attention_refusal(kind: str, block_size: int) -> str | None:
    """Why the fused paged attention of a device kind cannot take ``block_size`` (None: it can, or the
    kind has none)."""
    if kind == "cuda" and block_size % 256:
        return "flash-attn's paged attention needs a multiple of 256"
    if kind == "npu" and (block_size % 128 or not 128 <= block_size <= 512):
        return "torch_npu's fused attention needs a multiple of 128 from 128 to 512"
    return None


def log_block_size(device: str, block_size: int) -> None:
    """Say which block size runs on which device; warn when it turns off the device's fused attention
    (the torch reference then runs on the device), which only a block size that was set can do."""
    kind = device_kind(device)
    refusal = fused_attention_refusal(kind, block_size)
    if refusal is not None:
        logger.warning(
            "block_size=%d turns off the fused paged attention on %s (%s): the torch reference runs instead; "
            "unset block_size for %s's default %d",
            block_size,
            kind,
            refusal,
            kind,
            default_block_size(kind),
        )
    elif block_size == default_block_size(kind):
        # The CPU's default is what every release used: saying so on each start is noise (DEBUG).
        level = logging.DEBUG if kind == "cpu" else logging.INFO
        logger.log(level, "block_size %d: the default on %s (an unset block_size follows the device)", block_size, kind)
    else:
        logger.info("block_size %d on %s (set; the default there is %d)", block_size, kind, default_block_size(kind))


def cpu_kv_cache_memory(
    bytes_per_token: float, *, max_num_seqs: int, max_model_len: int, floor: int, ranks: int = 1
) -> tuple[int, str]:
    """Bytes for a CPU rank's KV cache when ``kv_cache_memory`` is unset, and why.

    A fixed default starves the CPU: 512 MiB holds about 2,300 tokens of a Qwen3-0.6B in float32, so
    a batch of 64 ~270-token requests ran eight at a time (67.6 against 105.1 output tok/s with
    room for all 64, docs/benchmarks.md). Pages of an untouched cache are not committed, so the size
    costs memory only as requests fill it. It is what ``max_num_seqs`` requests of ``max_model_len``
    tokens take, at most :data:`CPU_KV_CACHE_MEMORY` and a quarter of the memory available now
    shared by the host's ``ranks``, and never less than ``floor`` (the device-independent default).

    :param bytes_per_token: KV bytes one token of a sequence takes in all cache groups together.
    :return: (bytes, the reason in words, for the log).
    """
    need = int(bytes_per_token * max_num_seqs * max_model_len)
    available = _available_bytes()
    share = available // (4 * max(1, ranks)) if available else CPU_KV_CACHE_MEMORY
    size = max(floor, min(need, CPU_KV_CACHE_MEMORY, share))
    why = (
        f"{max_num_seqs} sequences x {max_model_len} tokens need {need / 2**30:.2f} GiB; the CPU default takes "
        f"at most {CPU_KV_CACHE_MEMORY / 2**30:.0f} GiB and a quarter of the {available / 2**30:.1f} GiB "
        f"available shared by {ranks} rank(s), at least {floor / 2**30:.2f} GiB"
    )
    return size, why


def _available_bytes() -> int:
    """``MemAvailable`` of this host in bytes (free pages where there is no procfs; 0 if unknown)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError):
        return 0
