"""Bounded sliding-window KV: a cache group declaring ``window_tokens`` holds O(window) blocks per
request. The fake executor's next token depends on the last ``window`` tokens read back through the
block table, so a block given back too early (and reused by another request) changes the output."""

from __future__ import annotations

import math
from typing import Any

import pytest

from pypto_serving import LLM
from pypto_serving.executor import CacheGroupSpec
from pypto_serving.kv_cache import FREED, KVCacheManager
from pypto_serving.request import Request, SamplingParams
from tests.conftest import plugin_installed
from tests.fakes import reference_tokens

WINDOW, BLOCK, NEW_TOKENS = 8, 4, 10 * 8
SCHEDULERS = ["sync"] + (["async"] if plugin_installed("async_sched") else [])


def _held(req: Request) -> int:
    return sum(1 for b in req.block_ids.get("kv", []) if b != FREED)


def _poison_free_blocks(engine: Any) -> None:
    """Overwrite every free block's cache entries in the (in-process) fake executor: no step may read
    a block once it is given back, so this must not change any output. It also makes a block given
    back too early fail the test at once, instead of only when the pool happens to reuse it."""
    executor = engine.worker._runner.executor
    for b in engine.kv.pools["kv"].free:
        executor.cache[b * BLOCK : (b + 1) * BLOCK] = 96


@pytest.mark.requires_plugin("sync_sched")
@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_blocks_stay_bounded_over_a_long_generation(fake_pm: Any, scheduler: str) -> None:
    prompts = [[(5 * i + j) % 90 + 1 for j in range(6 + 3 * i)] for i in range(4)]
    # 18 blocks hold 72 tokens: not even one request's 86..101 tokens without giving blocks back.
    llm = LLM(
        plugins=fake_pm,
        executor="fake",
        worker_mode="inproc",
        scheduler=scheduler,
        block_size=BLOCK,
        num_kv_blocks=18,
        enable_prefix_caching=False,  # free blocks are poisoned below, cached ones included
        executor_options={"window": WINDOW, "max_model_len": 256},
    )
    engine = llm.engine
    assert engine is not None
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    done: dict[str, list[int]] = {}
    steady = 0
    try:
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = list(out.outputs[0].token_ids)
            engine.kv.check_invariants(engine.scheduler.live_requests())
            _poison_free_blocks(engine)
            for r in engine.scheduler.running:
                if len(r.output_token_ids) > 2 * WINDOW:  # long past the prompt
                    # Positions c-W+1 .. c+2 (one step in flight under async) span W+2 tokens.
                    assert _held(r) <= math.ceil((WINDOW + 2) / BLOCK) + 1, r.block_ids
                    steady += 1
        assert engine.scheduler.stats.num_preemptions == 0
    finally:
        llm.shutdown()
    assert steady > 100
    for i, p in enumerate(prompts):
        assert done[f"r{i}"] == reference_tokens(p, NEW_TOKENS, window=WINDOW)[0]


def test_release_gives_back_only_blocks_wholly_before_the_window() -> None:
    groups = [
        CacheGroupSpec("swa", 4, 1, window_tokens=6),
        CacheGroupSpec("full", 4, 1),
    ]
    kv = KVCacheManager(groups, {"swa": 16, "full": 16}, enable_prefix_caching=False)
    r = Request("r", list(range(1, 30)), SamplingParams())
    assert kv.allocate(r, 30)
    swa = list(r.block_ids["swa"])
    kv.release_outside_window(r, 13)  # the window of position 13 starts at 8: blocks 0, 1 go
    assert r.block_ids["swa"] == [FREED, FREED, *swa[2:]]
    assert kv.pools["swa"].num_free == 16 - 6 and kv.pools["full"].num_free == 16 - 8
    kv.release_outside_window(r, 14)  # window from 9: block 2 (8..11) is still partly inside
    assert r.block_ids["swa"][2] == swa[2]
    kv.release_outside_window(r, 17)  # window from 12: block 2 goes
    assert r.block_ids["swa"][:3] == [FREED] * 3
    kv.check_invariants([r])
    kv.free(r)
    assert kv.pools["swa"].num_free == 16 and kv.pools["full"].num_free == 16


def test_plan_gives_a_window_group_its_cap_and_the_rest_to_the_others() -> None:
    from pypto_serving.engine import plan_kv_blocks, window_group_tokens

    groups = [
        CacheGroupSpec("swa", block_size=4, bytes_per_block=400, window_tokens=16),  # 100 bytes per token
        CacheGroupSpec("compressed", block_size=4, bytes_per_block=200, tokens_per_entry=4),  # 12.5 per token
    ]
    cap = window_group_tokens(groups[0], max_num_seqs=2, max_num_batched_tokens=8)
    assert cap == 2 * (16 + 2 * 4) + 2 * 8 == 64
    plan = plan_kv_blocks(groups, None, memory=112_500, max_num_seqs=2, max_num_batched_tokens=8)
    # swa: 64 tokens = 16 blocks (6,400 bytes); compressed: the other 106,100 bytes = 8,488 tokens.
    assert plan == {"swa": 16, "compressed": 530}
    assert sum(plan[g.name] * g.bytes_per_block for g in groups) <= 112_500
    # A cap above the even share (1,000 tokens each) leaves the even split.
    even = plan_kv_blocks(groups, None, memory=112_500, max_num_seqs=100, max_num_batched_tokens=8)
    assert even == {"swa": 250, "compressed": 62}


def test_a_long_prompt_fits_a_window_group_smaller_than_the_prompt() -> None:
    groups = [CacheGroupSpec("swa", 4, 1, window_tokens=8), CacheGroupSpec("full", 4, 1)]
    kv = KVCacheManager(groups, {"swa": 12, "full": 64}, max_step_tokens=8)
    assert kv.can_ever_fit(200)  # swa holds 8 + 2 * 8 + 2 * 4 = 32 tokens at most: 8 blocks
    assert not kv.can_ever_fit(257)  # the full group cannot
    tight = KVCacheManager(groups, {"swa": 7, "full": 64}, max_step_tokens=8)
    assert not tight.can_ever_fit(200)
