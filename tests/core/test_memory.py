"""Sizing the KV cache from device memory (``gpu_memory_utilization``) and fitting ``max_model_len``
to a memory-sized cache. The device's figures are pinned by a stand-in for the memory probe so the
expected block counts can be computed by hand; the profile step itself runs for real."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from pypto_serving import LLM
from pypto_serving.config import SettingsError
from pypto_serving.messages import MemoryProfile

pytestmark = pytest.mark.requires_plugin("sync_sched")

GiB = 2**30
BLOCK = 4
BYTES_PER_BLOCK = BLOCK * 1024  # the fake executor's declared KV: 1 KiB per token


@pytest.fixture
def device(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """A device of 2 GiB with 1 GiB in use; the test may change the figures before starting."""
    figures = {"total": 2 * GiB, "used": 1 * GiB}
    monkeypatch.setattr("pypto_serving.memory._device_memory", lambda dev: (figures["total"], figures["used"]))
    return figures


@pytest.fixture
def profiles(monkeypatch: pytest.MonkeyPatch) -> list[MemoryProfile]:
    """Every profile the worker returned (the peak is measured, so the test reads it from here)."""
    from pypto_serving.worker import WorkerClient

    seen: list[MemoryProfile] = []
    real = WorkerClient.profile_memory

    def spy(self: WorkerClient, num_tokens: int) -> MemoryProfile:
        seen.append(real(self, num_tokens))
        return seen[-1]

    monkeypatch.setattr(WorkerClient, "profile_memory", spy)
    return seen


def _llm(fake_pm: Any, **kw: Any) -> LLM:
    kw.setdefault("executor_options", {"max_model_len": 4096})
    kw.setdefault("worker_mode", "inproc")
    return LLM(plugins=fake_pm, executor="fake", scheduler="sync", block_size=BLOCK, **kw)


def test_utilization_gives_the_cache_what_is_left(
    fake_pm: Any, device: dict[str, int], profiles: list[MemoryProfile]
) -> None:
    llm = _llm(fake_pm, gpu_memory_utilization=0.75, max_num_batched_tokens=64)
    try:
        assert llm.engine is not None
        (profile,) = profiles
        assert (profile.total_bytes, profile.used_bytes) == (2 * GiB, GiB) and profile.peak_bytes >= 0
        free = int(0.75 * 2 * GiB) - GiB - profile.peak_bytes  # 0.5 GiB less the profile step's peak
        assert llm.engine.kv.pools["kv"].num_blocks == free // BYTES_PER_BLOCK
        out = llm.generate([[1, 2, 3]], use_tqdm=False)  # the engine still works after the profile step
        assert len(out[0].outputs[0].token_ids) > 0
    finally:
        llm.shutdown()


def test_explicit_sizes_win_over_utilization(
    fake_pm: Any, device: dict[str, int], profiles: list[MemoryProfile]
) -> None:
    for kw, blocks in [({"num_kv_blocks": 77}, 77), ({"kv_cache_memory": 100 * BYTES_PER_BLOCK}, 100)]:
        llm = _llm(fake_pm, gpu_memory_utilization=0.75, **kw)
        try:
            assert llm.engine is not None and llm.engine.kv.pools["kv"].num_blocks == blocks
        finally:
            llm.shutdown()
    assert profiles == []  # no profile step ran


def test_no_memory_left_is_refused_with_the_numbers(fake_pm: Any, device: dict[str, int]) -> None:
    device["used"] = 2 * GiB
    with pytest.raises(SettingsError, match=r"no memory left for the KV cache: gpu_memory_utilization=0.5 of 2.00 GiB"):
        _llm(fake_pm, gpu_memory_utilization=0.5)


def test_a_memory_sized_cache_lowers_the_models_context(fake_pm: Any, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="pypto_serving.engine")
    llm = _llm(fake_pm, kv_cache_memory=100 * BYTES_PER_BLOCK)  # 100 blocks = 400 tokens < the model's 4096
    try:
        assert llm.engine is not None and llm.engine.max_model_len == 400
        assert "max_model_len lowered from the model's 4096 to 400 tokens" in caplog.text
    finally:
        llm.shutdown()


def test_an_explicit_context_the_cache_cannot_hold_is_refused(fake_pm: Any) -> None:
    with pytest.raises(
        SettingsError, match=r"max_model_len=1000 does not fit the KV cache \(kv: 100 blocks of 4 tokens\)"
    ):
        _llm(fake_pm, kv_cache_memory=100 * BYTES_PER_BLOCK, max_model_len=1000)


def test_the_profile_crosses_the_process_boundary(fake_pm: Any) -> None:
    """A real spawned worker measures this machine: the cache gets about the 5 % of memory above what
    is in use now (the fake's 1 KiB per token would overflow the block limit at a fixed 0.9)."""
    info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    total, available = (int(info[k].split()[0]) for k in ("MemTotal", "MemAvailable"))
    utilization = min(1.0, (total - available) / total + 0.05)
    llm = _llm(fake_pm, worker_mode="process", gpu_memory_utilization=utilization, max_num_batched_tokens=32)
    try:
        assert llm.engine is not None and llm.engine.kv.pools["kv"].num_blocks > 0
        assert len(llm.generate([[1, 2, 3]], use_tqdm=False)[0].outputs[0].token_ids) > 0
    finally:
        llm.shutdown()


# -- an unset kv_cache_memory on the CPU


@pytest.mark.parametrize(
    ("seqs", "length", "available", "expected"),
    [
        (64, 4096, 64 * GiB, 512 * 2**20),  # 64 x 4096 x 1 KiB = 256 MiB: the 512 MiB floor
        (64, 16384, 64 * GiB, GiB),  # what 64 sequences of 16,384 tokens take
        (64, 131072, 64 * GiB, 4 * GiB),  # 8 GiB asked: the 4 GiB cap
        (64, 131072, 8 * GiB, 2 * GiB),  # a quarter of the 8 GiB available
        (64, 131072, GiB, 512 * 2**20),  # a quarter of 1 GiB is under the floor: the floor
    ],
)
def test_an_unset_cpu_cache_holds_the_running_requests(
    fake_pm: Any,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    seqs: int,
    length: int,
    available: int,
    expected: int,
) -> None:
    """512 MiB held eight 270-token Qwen3-0.6B requests at a time on the CPU; an unset size there now
    follows max_num_seqs x max_model_len within the 512 MiB .. 4 GiB and a-quarter-of-free bounds."""
    monkeypatch.setattr("pypto_serving.devices._available_bytes", lambda: available)
    caplog.set_level(logging.INFO, logger="pypto_serving.engine")
    llm = _llm(fake_pm, device="cpu", max_num_seqs=seqs, executor_options={"max_model_len": length})
    try:
        assert llm.engine is not None and llm.engine.kv.pools["kv"].num_blocks == expected // BYTES_PER_BLOCK
        assert f"KV cache memory {expected / GiB:.2f} GiB (kv_cache_memory unset on the CPU" in caplog.text
    finally:
        llm.shutdown()


def test_a_set_cpu_cache_size_is_taken_as_given(fake_pm: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("pypto_serving.devices._available_bytes", lambda: 64 * GiB)
    llm = _llm(fake_pm, device="cpu", kv_cache_memory=512 * 2**20, executor_options={"max_model_len": 131072})
    try:
        assert llm.engine is not None and llm.engine.kv.pools["kv"].num_blocks == 512 * 2**20 // BYTES_PER_BLOCK
    finally:
        llm.shutdown()


def test_cpu_default_divides_the_free_memory_among_the_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    from pypto_serving import devices

    # Pinned: the host's available memory moves between two reads (a flake on a busy CI machine).
    monkeypatch.setattr(devices, "_available_bytes", lambda: 22 * GiB)
    size, why = devices.cpu_kv_cache_memory(1024, max_num_seqs=64, max_model_len=131072, floor=0, ranks=4)
    assert size == min(devices.CPU_KV_CACHE_MEMORY, 22 * GiB // 16)
    assert "shared by 4 rank(s)" in why
