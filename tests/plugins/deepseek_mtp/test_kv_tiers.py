"""KV offload tiers on DeepSeek-V4's hybrid caches, with MTP: a shared system prompt's blocks of
every group (sliding window, compressed KV, indexer keys, compressor snapshots) leave a small device
cache, come back from host memory and disk, and the requests sharing the prompt hit them; outputs
(greedy and seeded) equal prefix caching off (whose run preempts), with a request aborted while its
load is in flight, and no block leaks, under the sync and async strategies."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch

from pypto_serving import LLM, SamplingParams

from .conftest import VARIANTS
from .helpers import build_checkpoint, plugin_manager

pytestmark = pytest.mark.requires_plugin("sync_sched")

BLOCKS = 16  # per group; block size 4: swa 4 tokens a block, CSA groups 8, HCA 16; hit unit 16
NEW = 6


def _tokens(seed: int, n: int) -> list[int]:
    return torch.randint(3, 96, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


SYSTEM = _tokens(0, 40)
FILLERS = [_tokens(50 + i, 44) for i in range(3)]


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(Path(tmp_path_factory.mktemp("kv_tiers")), **VARIANTS["mixed_yarn"]).path


def _params(i: int) -> SamplingParams:
    if i % 2:
        return SamplingParams(temperature=0.8, top_p=0.9, seed=100 + i, max_tokens=NEW, ignore_eos=True)
    return SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)


def _run(path: Path, scheduler: str, **settings: Any) -> dict[str, Any]:
    llm = LLM(
        model=str(path),
        plugins=plugin_manager(),
        dtype="float32",
        device="cpu",
        worker_mode="inproc",
        scheduler=scheduler,
        block_size=4,
        max_num_batched_tokens=16,
        num_kv_blocks=BLOCKS,
        speculative_config={"method": "mtp", "num_speculative_tokens": 2, "policy": "fixed"},
        **settings,
    )
    engine = llm._engine()
    tokens: dict[str, list[int]] = {}

    def drain() -> None:
        while engine.has_unfinished():
            for o in engine.step():
                if o.finished and o.request_id != "gone":
                    assert o.outputs[0].error is None
                    tokens[o.request_id] = list(o.outputs[0].token_ids)
            tiers = engine.tiers
            engine.kv.check_invariants(engine.scheduler.live_requests(), tiers.held() if tiers else ())
        deadline = time.monotonic() + 10
        while engine.tiers is not None and any(engine.tiers.held()):
            engine.check_worker()
            assert time.monotonic() < deadline
            time.sleep(0.005)

    try:
        engine.add_request("a", [*SYSTEM, *_tokens(1, 6)], _params(0))
        drain()
        for i, filler in enumerate(FILLERS):  # push the system prompt's blocks out of the device
            engine.add_request(f"filler{i}", filler, SamplingParams(temperature=0.0, max_tokens=2))
            drain()
        for i in range(1, 4):  # together: without their hits they do not all fit (preemptions)
            engine.add_request(f"q{i}", [*SYSTEM, *_tokens(1 + i, 6)], _params(i))
        engine.add_request("gone", [*SYSTEM, *_tokens(9, 6)], _params(0))
        engine.abort("gone")  # while its load is in flight (with the tiers)
        drain()
        tokens.pop("gone", None)
        stats_preempted = engine.stats()["num_preemptions"]
        stats = engine.stats()
        leaked = {n: p.num_blocks - p.num_free for n, p in engine.kv.pools.items() if p.num_free != p.num_blocks}
    finally:
        llm.shutdown()
    return {"tokens": tokens, "stats": stats, "leaked": leaked, "preempted": stats_preempted}


@pytest.fixture(scope="module")
def cold(path: Path) -> dict[str, Any]:
    return _run(path, "sync", enable_prefix_caching=False)


@pytest.mark.parametrize(
    ("scheduler", "tier"),
    [("sync", "host"), pytest.param("async", "disk", marks=pytest.mark.requires_plugin("async_sched"))],
)
def test_hybrid_blocks_come_back_from_a_tier_with_the_same_outputs(
    path: Path, cold: dict[str, Any], scheduler: str, tier: str, tmp_path: Path
) -> None:
    if tier == "host":
        tiers: dict[str, Any] = {"kv_offload_host_bytes": 1 << 20}
    else:
        tiers = {"kv_offload_disk_path": str(tmp_path), "kv_offload_disk_bytes": 1 << 20}
    tiered = _run(path, scheduler, **tiers)
    assert tiered["tokens"] == cold["tokens"] and cold["preempted"] > 0
    assert tiered["leaked"] == {} and set(tiered["tokens"]) == {"a", "filler0", "filler1", "filler2", "q1", "q2", "q3"}
    stats = tiered["stats"]
    # The fillers pushed the system prompt's window blocks off the device: each of the three requests
    # loads what its hit at 32 needs (only the window blocks before 32 in swa, every compressed and
    # indexer block, the compressor snapshot at 32; no MTP block) and hits 32 tokens.
    assert stats["kv_offload_loads"] >= 1 and stats["kv_offload_hits_per_tier"][tier] > 0, stats
    assert stats["prefix_cache_hits"] >= 3 * 32 and stats["kv_offload_load_failed"] == 0
