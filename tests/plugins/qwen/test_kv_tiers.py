"""KV offload tiers end to end on the embedded tiny Qwen3: a device cache too small to keep the
conversations' prefixes, a small host tier spilling to disk, and the outputs of later turns equal to
an engine without prefix caching, token for token, greedy and seeded, while the prefixes really come
back from host memory and disk; with aborts and preemptions mixed in and no block leaked. A restart
over the same directory finds the blocks, a corrupt file is a shorter hit."""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import pytest

from pypto_serving import LLM, SamplingParams
from pypto_serving.engine import EngineCore
from pypto_serving.kv_cache import FREED
from pypto_serving.metrics import ServerMetrics
from pypto_serving.request import Request

COMMON: dict[str, Any] = {
    "model": "tiny-qwen3",
    "device": "cpu",
    "num_kv_blocks": 12,
    "max_model_len": 256,
    "block_size": 16,
    "worker_mode": "inproc",
}
_rng = random.Random(30)
# 4 full blocks each (16 in all, the device has 12): 3 run at once, each needs a 5th block: preemptions.
TURN1 = [[_rng.randrange(1, 2000) for _ in range(64)] for _ in range(4)]
TURN2 = [p + [_rng.randrange(1, 2000) for _ in range(12)] for p in TURN1]
N_OUT = 6

pytestmark = pytest.mark.requires_plugin("sync_sched")


def _params(seeded: bool, i: int) -> SamplingParams:
    if seeded:
        return SamplingParams(temperature=0.9, top_p=0.95, seed=100 + i, max_tokens=N_OUT, ignore_eos=True)
    return SamplingParams(temperature=0, max_tokens=N_OUT, ignore_eos=True)


def _check(engine: EngineCore) -> None:
    tiers = engine.tiers
    owners = engine.scheduler.live_requests() + (tiers.owners() if tiers is not None else [])
    engine.kv.check_invariants(owners, tiers.held() if tiers is not None else ())
    for tier in tiers.tiers.values() if tiers is not None else ():
        assert tier.used == sum(n for _, n in tier.entries.values()) <= tier.capacity


def _run(llm: LLM, prompts: list[list[int]], seeded: bool, abort: int | None = None) -> dict[int, Any]:
    """All prompts at once (the cache holds fewer: preemptions), request ``abort`` aborted at once
    (a load in flight); checks the block accounting after every step."""
    engine = llm._engine()
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, _params(seeded, i))
    if abort is not None:
        engine.abort(str(abort))
    done: dict[int, Any] = {}
    deadline = time.monotonic() + 60
    while len(done) < len(prompts) and time.monotonic() < deadline:
        for out in engine.step():
            if out.finished:
                done[int(out.request_id)] = out
        _check(engine)
    assert not engine.has_unfinished()
    # None failed (blocks held by the tiers' copies never make a request "too big for the cache").
    assert all(o.outputs[0].error is None for o in done.values())
    _settle(engine)
    return done


def _settle(engine: EngineCore) -> None:
    """Wait for the stores in flight; then every device block is free again."""
    deadline = time.monotonic() + 10
    while engine.tiers is not None and (engine.tiers.storing or engine.tiers.held()[-1]):
        engine.check_worker()
        assert time.monotonic() < deadline
        time.sleep(0.005)
    _check(engine)
    assert all(p.num_free == p.num_blocks for p in engine.kv.pools.values()), "blocks leaked"


@pytest.fixture(scope="module")
def reference() -> dict[bool, list[list[int]]]:
    with LLM(enable_prefix_caching=False, scheduler="sync", **COMMON) as llm:
        return {
            seeded: [o.outputs[0].token_ids for o in llm.generate(TURN2, [_params(seeded, i) for i in range(4)])]
            for seeded in (False, True)
        }


@pytest.mark.parametrize("scheduler", ["sync", pytest.param("async", marks=pytest.mark.requires_plugin("async_sched"))])
def test_later_turns_come_back_from_host_and_disk_with_the_same_outputs(
    reference: dict[bool, list[list[int]]], scheduler: str, tmp_path: Path
) -> None:
    block_bytes = 32768  # tiny-qwen3's K and V of 16 tokens over its layers (fp32)
    kw = {"kv_offload_host_bytes": 5 * block_bytes, "kv_offload_disk_path": str(tmp_path)}
    with LLM(scheduler=scheduler, kv_offload_disk_bytes=64 * block_bytes, **COMMON, **kw) as llm:
        engine = llm._engine()
        assert engine.tiers is not None and engine.tiers.block_bytes == {"kv": block_bytes}
        for seeded in (False, True):
            _run(llm, TURN1, seeded, abort=3)
            done = _run(llm, TURN2, seeded, abort=1)
            for i in (0, 2, 3):
                assert done[i].outputs[0].token_ids == reference[seeded][i], (seeded, i)
            assert any(done[i].num_cached_tokens for i in (0, 2, 3))
            assert done[1].outputs[0].finish_reason == "abort"
        stats = engine.stats()
        hits = stats["kv_offload_hits_per_tier"]
        assert hits["host"] > 0 and hits["disk"] > 0, stats
        assert stats["num_preemptions"] > 0 and stats["kv_offload_load_failed"] == 0
        # Every block loaded was counted as a hit of its tier (the aborted requests' loads too).
        assert stats["kv_offload_bytes_up"] == (hits["host"] + hits["disk"]) // 16 * block_bytes
        assert stats["kv_offload_bytes_down"] >= 16 * block_bytes  # each distinct block went down once
        # The same numbers on /metrics.
        metrics = ServerMetrics("m")
        metrics.update_engine(stats, dead=False)
        sample = metrics.registry.get_sample_value
        for tier in ("host", "disk"):
            assert sample("pypto_serving_prefix_cache_tier_hits_total", {"model_name": "m", "tier": tier}) == hits[tier]
        assert sample("pypto_serving_kv_offload_bytes_up_total", {"model_name": "m"}) == stats["kv_offload_bytes_up"]
        assert sample("pypto_serving_kv_offload_loads_total", {"model_name": "m"}) == stats["kv_offload_loads"] > 0


def test_a_restart_finds_the_disk_blocks_and_a_corrupt_file_is_a_shorter_hit(
    reference: dict[bool, list[list[int]]], tmp_path: Path
) -> None:
    kw = {"kv_offload_disk_path": str(tmp_path), "kv_offload_disk_bytes": 1 << 24, "scheduler": "sync"}
    with LLM(**COMMON, **kw) as llm:
        llm.generate(TURN1[:2], _params(False, 0))
        _settle(llm._engine())
        group = llm._engine().kv.groups[0]
        keys = llm._engine().kv.prefix_keys(Request("k", TURN2[0], SamplingParams()), group, 64)
    files = sorted(tmp_path.iterdir())
    assert len(files) == 8  # 2 prompts x 4 full blocks
    bad = tmp_path / f"{keys[2].hex()}.kvb"
    data = bad.read_bytes()
    bad.write_bytes(data[:-100] + bytes([data[-100] ^ 1]) + data[-99:])
    (tmp_path / "copied-from-elsewhere.kvb").write_bytes(data[:50])
    with LLM(**COMMON, **kw) as llm:
        engine = llm._engine()
        assert engine.stats()["kv_offload_disk_ignored"] == 1
        outs = llm.generate(TURN2[:2], [_params(False, 0), _params(False, 1)])
        assert [o.outputs[0].token_ids for o in outs] == reference[False][:2]
        # The first prompt's third block failed its check: it reused 2 blocks and computed the rest.
        assert [o.num_cached_tokens for o in outs] == [32, 64]
        stats = engine.stats()
        assert stats["kv_offload_hits_per_tier"] == {"disk": 96} and stats["kv_offload_load_failed"] == 1
        _settle(engine)
        assert all(b != FREED for b in engine.kv.pools[group.name].cached.values())


def test_a_loaded_request_whose_id_a_choice_took_meanwhile_fails_alone() -> None:
    """User request "a-0" loads its prefix; meanwhile request "a" with n=2 names a choice "a-0": the
    loaded one fails with the reason when its load ends, the other runs, no block leaks. One forward
    a command keeps the steps those of the case found: the choice still runs when the load ends."""
    with LLM(scheduler="sync", kv_offload_host_bytes=1 << 24, num_scheduler_steps=1, **COMMON) as llm:
        engine = llm._engine()
        llm.generate(TURN1, _params(False, 0))  # 16 blocks through a 12-block cache: the first prefix left it
        _settle(engine)
        engine.add_request("a-0", TURN1[0], _params(False, 0))
        assert engine.tiers is not None and "a-0" in engine.tiers.loads
        engine.add_request("a", TURN1[1], SamplingParams(n=2, temperature=0, max_tokens=2, ignore_eos=True))
        done: dict[str, Any] = {}
        for _ in range(1000):
            done |= {o.request_id: o for o in engine.step() if o.finished}
            if len(done) == 2:
                break
        assert "already in use" in (done["a-0"].outputs[0].error or "")
        assert [c.error for c in done["a"].outputs] == [None, None]
        _settle(engine)
