"""Tensor-parallel worker groups on gloo over loopback: TP=2 samples what TP=1 samples (greedy,
seeded, engine-seeded), on one node and on two "nodes" (a ``pypto-serving worker`` subprocess);
mismatched settings are refused at start-up; a rank that dies mid-step fails the step within the
step timeout and the next generate serves again on a fresh group; ranks that sample differently stop
the group. The model is the toy of :mod:`tests.core.tp_toy`, whose forward shards over the ranks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pypto_serving import EngineDeadError, PluginManager, SamplingParams, ServingSettings
from pypto_serving.config import SettingsError
from pypto_serving.distributed import (
    RankLayout,
    check_parallel_settings,
    combine_profiles,
    free_port,
    info_mismatch,
    rank_device,
)
from pypto_serving.executor import CacheGroupSpec, ExecutorInfo
from pypto_serving.messages import MemoryProfile
from tests.core.test_worker import bounded, pid_alive
from tests.core.tp_toy import VOCAB, ToyTPPlugin

pytest.importorskip("pypto_serving_sync_sched")

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 20, 30, 40, 50, 60, 11, 12, 13, 14]]
PARAMS = [
    SamplingParams(temperature=0, max_tokens=10),
    SamplingParams(temperature=1.0, seed=5, max_tokens=10),
    SamplingParams(temperature=0.8, top_k=20, max_tokens=10),  # seeded by the engine's seed
]
BASE: dict[str, Any] = dict(executor="tp_toy", block_size=4, num_kv_blocks=64, worker_threads=1)


def toy_llm(**settings: Any) -> Any:
    from pypto_serving import LLM

    return LLM(plugins=PluginManager(extra_plugins=[ToyTPPlugin]), **{**BASE, **settings})


def tokens(outs: list[Any]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    """TP=1, in-process: the plain computation."""
    llm = toy_llm(worker_mode="inproc", scheduler="sync")
    try:
        return tokens(llm.generate(PROMPTS, PARAMS, use_tqdm=False))
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def tp2() -> Iterator[Any]:
    """One TP=2 engine on one node (gloo), pipelined (async) scheduling, a short step timeout."""
    pytest.importorskip("pypto_serving_async_sched")
    llm = toy_llm(tensor_parallel_size=2, scheduler="async", step_timeout=4.0)
    yield llm
    llm.shutdown()


def test_tp2_samples_what_tp1_samples(tp2: Any, reference: list[list[int]]) -> None:
    assert len(tp2.engine.worker.pids) == 2
    outs = bounded(lambda: tp2.generate(PROMPTS, PARAMS, use_tqdm=False))
    assert tokens(outs) == reference
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    assert len({tuple(t) for t in reference}) == 3 and len(set(reference[0])) > 1  # not a degenerate model


def test_idle_ranks_outlive_the_step_timeout(tp2: Any, reference: list[list[int]]) -> None:
    """Rank 0 heartbeats while idle, so ranks waiting for the next command never time out (4 s)."""
    time.sleep(6)
    assert tp2.engine.worker.check_alive() is None
    assert tokens(bounded(lambda: tp2.generate(PROMPTS[:1], PARAMS[:1], use_tqdm=False))) == reference[:1]


def test_memory_profile_is_the_tightest_rank_sharing_the_host(tp2: Any) -> None:
    """Run last on the shared engine: profiling leaves the profile's cache allocated."""
    profile = tp2.engine.worker.profile_memory(16)
    mem_total = next(
        int(x.split()[1]) * 1024 for x in Path("/proc/meminfo").read_text().splitlines() if "MemTotal" in x
    )
    assert profile.total_bytes == mem_total // 2  # two ranks share this host's memory
    assert 0 < profile.used_bytes < profile.total_bytes


def wait_gone(pids: list[int], within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not any(pid_alive(p) for p in pids)


def worker_gone(worker: Any, within: float = 10.0) -> str:
    """Why the worker is gone, once it is (a process's threads may outlive its main thread briefly)."""
    deadline = time.monotonic() + within
    while (reason := worker.check_alive()) is None:
        assert time.monotonic() < deadline, "the worker still runs"
        time.sleep(0.1)
    return reason


def test_a_killed_rank_fails_the_step_and_a_fresh_group_serves(reference: list[list[int]]) -> None:
    """Rank 1 killed mid-generate: the step fails within the step timeout, rank 0 goes too, the next
    generate runs on a fresh group with no KV block left behind. Then rank 0 killed: rank 1 exits."""
    llm = toy_llm(tensor_parallel_size=2, scheduler="sync", step_timeout=20.0, executor_options={"step_sleep": 0.1})
    try:
        old = llm.engine.worker.pids
        killer = threading.Timer(1.0, lambda: os.kill(old[1], signal.SIGKILL))
        killer.start()
        started = time.monotonic()
        with pytest.raises(EngineDeadError, match=r"tensor-parallel rank 1 of the worker died \(exit code -9\)"):
            bounded(lambda: llm.generate(PROMPTS, [SamplingParams(temperature=0, max_tokens=40)] * 3, use_tqdm=False))
        assert time.monotonic() - started < 20.0
        assert wait_gone(old)
        outs = bounded(lambda: llm.generate(PROMPTS[:1], PARAMS[:1], use_tqdm=False))
        assert tokens(outs) == reference[:1]
        new = llm.engine.worker.pids
        assert len(new) == 2 and not set(new) & set(old) and all(pid_alive(p) for p in new)
        assert all(p.num_free == p.num_blocks for p in llm.engine.kv.pools.values())
        os.kill(new[0], signal.SIGKILL)
        assert wait_gone(new[1:])  # its wait for rank 0's next broadcast fails
        assert "died (exit code -9)" in worker_gone(llm.engine.worker)
    finally:
        bounded(llm.shutdown, 30)


def test_ranks_sampling_other_tokens_stop_the_group() -> None:
    """The step digest check: rank 1's logits are changed after the gather, so it samples other
    tokens; the step fails with that reason and the group stops (it cannot be trusted)."""
    llm = toy_llm(tensor_parallel_size=2, scheduler="sync", executor_options={"diverge_rank": 1})
    try:
        pids = llm.engine.worker.pids
        (out,) = bounded(lambda: llm.generate(PROMPTS[:1], PARAMS[:1], use_tqdm=False))
        assert out.outputs[0].finish_reason == "error"
        assert "tensor-parallel group lost a rank" in worker_gone(llm.engine.worker)
        assert wait_gone(pids)
    finally:
        bounded(llm.shutdown, 30)
