"""Sizing the KV cache from device memory (``gpu_memory_utilization``, vLLM's name).

After the executor loads, the worker measures what the device holds, what is already in use (the
weights and everything else the process keeps) and the peak a forward of the largest step adds (a
profile step of ``max_num_batched_tokens`` prompt tokens through the real runner, on a cache just big
enough for it). The engine then gives the KV cache ``utilization * total - used - peak``.

Memory is counted per device kind: on CUDA and Ascend the allocator's own figures (``mem_get_info``,
peak allocated bytes); on the CPU the machine's physical memory and the worker process's resident
set, whose high-water mark is reset through ``/proc/self/clear_refs`` before the profile step.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .executor import CacheGroupSpec
from .messages import MemoryProfile, NewRequestData, ScheduledEntry, StepCommand, wire_sampling
from .request import SamplingParams

if TYPE_CHECKING:
    from .runner import ModelRunner

__all__ = ["profile_memory", "profile_plan"]

_PROFILE_ID = "__memory_profile__"


def profile_plan(groups: Sequence[CacheGroupSpec], num_tokens: int) -> dict[str, int]:
    """Blocks per group for one request of ``num_tokens`` tokens (the profile step's cache)."""
    return {g.name: math.ceil(num_tokens / g.tokens_per_block) + 1 for g in groups}


def profile_memory(runner: ModelRunner, num_tokens: int) -> MemoryProfile:
    """Measure the device and one forward of ``num_tokens`` prompt tokens (see the module docstring).

    The runner is left with the profile cache allocated; the caller initialises the real one next.
    """
    assert runner.info is not None
    device = runner.device
    groups = runner.info.cache_groups
    plan = profile_plan(groups, num_tokens)
    cache_bytes = sum(plan[g.name] * g.bytes_per_block for g in groups)
    total, used = _device_memory(device)
    with _peak(device) as peak:
        runner.init_kv_cache(plan)
        result = runner.step(_profile_command(plan, num_tokens))
        runner.step(StepCommand(step_id=-2, new_requests=[], entries=[], finished_ids=[_PROFILE_ID]))
    if result.error is not None:
        return MemoryProfile(ok=False, error=f"the profile step failed: {result.error}")
    return MemoryProfile(ok=True, total_bytes=total, used_bytes=used, peak_bytes=max(0, peak.bytes - cache_bytes))


def _profile_command(plan: dict[str, int], num_tokens: int) -> StepCommand:
    sampling = wire_sampling(SamplingParams(temperature=0.0), ())
    tokens = [0] * num_tokens
    new = NewRequestData(
        request_id=_PROFILE_ID, prompt_token_ids=tokens, output_token_ids=[], sampling=sampling, seed=0
    )
    entry = ScheduledEntry(
        request_id=_PROFILE_ID,
        token_ids=tokens,
        use_last_sampled=False,
        num_draft=0,
        start_pos=0,
        rejected_seen=0,
        new_block_ids={name: list(range(n)) for name, n in plan.items()},
        sample=True,
    )
    return StepCommand(step_id=-1, new_requests=[new], entries=[entry], finished_ids=[])


def _device_memory(device: torch.device) -> tuple[int, int]:
    """(total, in use) bytes of ``device``, device-wide (other processes' use included): the
    allocator's view on accelerators, ``MemTotal`` and ``MemTotal - MemAvailable`` on the CPU."""
    if device.type in ("cuda", "npu"):
        backend = getattr(torch, device.type)
        free, total = backend.mem_get_info(device)
        return int(total), int(total - free)
    total = _status_bytes("MemTotal", "/proc/meminfo") or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    available = _status_bytes("MemAvailable", "/proc/meminfo")
    return int(total), int(total - available) if available else _status_bytes("VmRSS")


class _Peak:
    bytes: int = 0


@contextlib.contextmanager
def _peak(device: torch.device) -> Iterator[_Peak]:
    """The most memory the body added at once, above what was in use when it started."""
    out = _Peak()
    if device.type in ("cuda", "npu"):
        backend = getattr(torch, device.type)
        backend.synchronize(device)
        backend.reset_peak_memory_stats(device)
        start = backend.memory_allocated(device)
        yield out
        backend.synchronize(device)
        out.bytes = int(backend.max_memory_allocated(device) - start)
        return
    start = _status_bytes("VmRSS")
    with contextlib.suppress(OSError):  # resets VmHWM to the current RSS (Linux >= 4.0)
        Path("/proc/self/clear_refs").write_text("5")
    yield out
    out.bytes = max(0, _status_bytes("VmHWM") - start)


def _status_bytes(field: str, path: str = "/proc/self/status") -> int:
    """A ``kB`` field of a procfs status file in bytes (0 where there is no procfs)."""
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
