"""Bounded sliding-window KV: a cache group declaring ``window_tokens`` holds O(window) blocks per
request. The fake executor's next token depends on the last ``window`` tokens read back through the
block table, so a block given back too early (and reused by another request) changes the output."""

from __future__ import annotations

import math
import random
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
    return sum(1 for b in req.kv.block_ids.get("kv", []) if b != FREED)


def _poison_free_blocks(engine: Any) -> None:
    """Overwrite every free block's cache entries in the (in-process) fake executor: no step may read
    a block once it is given back, so this must not change any output. It also makes a block given
    back too early fail the test at once, instead of only when the pool happens to reuse it."""
    executor = engine.worker._runner.executor
    for b in engine.kv.pools["kv"].free:
        executor.cache[b * BLOCK : (b + 1) * BLOCK] = 96


@pytest.mark.requires_plugin("sync_sched")
@pytest.mark.parametrize("steps", [1, 4])
@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_blocks_stay_bounded_over_a_long_generation(fake_pm: Any, scheduler: str, steps: int) -> None:
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
        num_scheduler_steps=steps,
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
                    # Positions c-W+1 .. c+2*steps (one command in flight under async) span W+2*steps tokens.
                    assert _held(r) <= math.ceil((WINDOW + 2 * steps) / BLOCK) + 1, r.kv.block_ids
                    steady += 1
        assert engine.scheduler.stats.num_preemptions == 0
    finally:
        llm.shutdown()
    assert steady > 100 // steps
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
    swa = list(r.kv.block_ids["swa"])
    kv.release_outside_window(r, 13)  # the window of position 13 starts at 8: blocks 0, 1 go
    assert r.kv.block_ids["swa"] == [FREED, FREED, *swa[2:]]
    assert kv.pools["swa"].num_free == 16 - 6 and kv.pools["full"].num_free == 16 - 8
    kv.release_outside_window(r, 14)  # window from 9: block 2 (8..11) is still partly inside
    assert r.kv.block_ids["swa"][2] == swa[2]
    kv.release_outside_window(r, 17)  # window from 12: block 2 goes
    assert r.kv.block_ids["swa"][:3] == [FREED] * 3
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


# ----------------------------------------------------------------------------- prefix caching


def _window_and_full() -> KVCacheManager:
    """A sliding-window group and a full group, 4 tokens per block, the window 6 tokens."""
    groups = [CacheGroupSpec("swa", 4, 1, window_tokens=6), CacheGroupSpec("full", 4, 1)]
    return KVCacheManager(groups, {"swa": 16, "full": 32})


def test_a_prefix_hit_needs_only_the_window_blocks_before_it() -> None:
    kv = _window_and_full()
    prompt = list(range(1, 30))  # 29 tokens: 7 full blocks, a hit covers at most 28
    a = Request("a", prompt, SamplingParams())
    assert kv.allocate(a, 29)
    swa, full = list(a.kv.block_ids["swa"]), list(a.kv.block_ids["full"])
    kv.publish(a, 29)
    kv.release_outside_window(a, 17)  # window from 12: swa entries 0..2 go back, still cached
    assert a.kv.block_ids["swa"][:3] == [FREED] * 3
    # Free queue: the 8 never-used swa blocks, then a's entries released head-first (0, 1, 2): a
    # window's earliest blocks serve only the shortest hits, so they are evicted first.
    assert list(kv.pools["swa"].free) == [*range(8, 16), swa[0], swa[1], swa[2]]

    # A hit at 28 reads swa positions 23..27 (window 6) and every full position: swa entries 5, 6
    # and full entries 0..6. The swa entries before are neither taken nor revived.
    b = Request("b", prompt, SamplingParams())
    assert kv.find_cached_prefix(b) == 28
    assert b.kv.block_ids == {"swa": [FREED] * 5 + swa[5:7], "full": full[:7]}
    assert b.kv.window_freed == {"swa": 5}
    assert list(kv.pools["swa"].free) == [*range(8, 16), swa[0], swa[1], swa[2]]
    assert kv.group_hits == {"swa": 28, "full": 28}
    kv.check_invariants([a, b])
    kv.free(b)

    # Another request's 9 swa blocks take the 8 unused ones and evict a's entry 0 (tokens 0..3).
    c = Request("c", list(range(100, 136)), SamplingParams())
    assert kv.allocate(c, 36)
    kv.publish(c, 36)
    assert c.kv.block_ids["swa"][8] == swa[0]  # a's content of entry 0 is gone
    # The chain of keys still runs from block 0 (it comes from the tokens), and a hit at 28 needs
    # only swa entries 5, 6: the evicted early entry does not cut it.
    d = Request("d", prompt, SamplingParams())
    assert kv.find_cached_prefix(d) == 28
    assert d.kv.block_ids == {"swa": [FREED] * 5 + swa[5:7], "full": full[:7]}
    kv.check_invariants([a, c, d])
    kv.free(d)

    # Evicting entries 1 and 2 as well changes nothing either.
    e = Request("e", [200] * 8, SamplingParams())
    assert kv.allocate(e, 8)
    assert e.kv.block_ids["swa"] == [swa[1], swa[2]]
    f = Request("f", prompt, SamplingParams())
    assert kv.find_cached_prefix(f) == 28
    kv.free(f)
    # Once a's window entries go too (a finishes, releasing its entries 7..3 tail-first, then two
    # requests take 2 + 2 swa blocks: 7, 6, 5, 4), a hit at p needs entries (p - 5) // 4 .. p // 4 - 1:
    # only entry 3 is left, and 16 needs 2, 3 (2 evicted), 20 needs 3, 4: nothing hits. The full
    # group alone could serve 28.
    kv.free(a)
    others = [Request("x", [300] * 8, SamplingParams()), Request("y", [400] * 8, SamplingParams())]
    for r in others:
        assert kv.allocate(r, 8)
    hits = dict(kv.group_hits)
    g = Request("g", prompt, SamplingParams())
    assert kv.find_cached_prefix(g) == 0
    assert g.kv.block_ids == {}
    assert kv.group_hits["full"] - hits["full"] == 28 and kv.group_hits["swa"] - hits["swa"] < 28
    # A prefix all of whose needed blocks are still cached (c's) hits.
    h = Request("h", [*range(100, 120), 7], SamplingParams())
    assert kv.find_cached_prefix(h) == 20
    assert h.kv.block_ids == {"swa": [FREED] * 3 + c.kv.block_ids["swa"][3:5], "full": c.kv.block_ids["full"][:5]}
    kv.check_invariants([c, e, h, *others])
    for r in (c, e, h, *others):
        kv.free(r)
    kv.check_invariants([])
    assert kv.pools["swa"].num_free == 16 and kv.pools["full"].num_free == 32


def _poison_uncached_free_blocks(engine: Any) -> None:
    """With prefix caching a free block that keeps its hash may be taken back by a hit, so its
    entries must survive; every other free block is poisoned (see :func:`_poison_free_blocks`)."""
    executor = engine.worker._runner.executor
    pool = engine.kv.pools["kv"]
    for b in pool.free:
        if pool.block_hash[b] is None:
            executor.cache[b * BLOCK : (b + 1) * BLOCK] = 96


Workload = list[tuple[int, str, list[int], int, int | None]]


def _shared_prefix_workload(seed: int) -> Workload:
    """Seeded requests sharing a 40-token prefix (5 windows), cut at random lengths past 3 windows
    and with random tails: (arrival step, id, prompt, max_tokens, abort step or None)."""
    rng = random.Random(seed)
    prefix = [rng.randrange(1, 90) for _ in range(5 * WINDOW)]
    out: Workload = []
    step = 0
    for i in range(10):
        step += rng.randint(0, 6)
        prompt = prefix[: rng.randint(3 * WINDOW, 5 * WINDOW)] + [
            rng.randrange(1, 90) for _ in range(rng.randint(0, 5))
        ]
        abort_at = step + rng.randint(1, 12) if rng.random() < 0.3 else None
        out.append((step, f"r{i}", prompt, rng.randint(1, 2 * WINDOW), abort_at))
    return out


def _run(fake_pm: Any, scheduler: str, workload: Workload, num_blocks: int, prefix_caching: bool) -> dict[str, Any]:
    """Runs ``workload`` (at most 3 requests at a time, 8 tokens a step), checking the block
    invariants and poisoning the free blocks after every step; returns each request's tokens and
    finish reason, and statistics."""
    llm = LLM(
        plugins=fake_pm,
        executor="fake",
        worker_mode="inproc",
        scheduler=scheduler,
        block_size=BLOCK,
        num_kv_blocks=num_blocks,
        max_num_seqs=3,
        max_num_batched_tokens=8,
        enable_prefix_caching=prefix_caching,
        executor_options={"window": WINDOW, "max_model_len": 256},
        num_scheduler_steps=1,  # the statistics below are tuned to one token a step
    )
    engine = llm.engine
    assert engine is not None
    done: dict[str, tuple[list[int], str | None]] = {}
    deep_hits = 0  # admissions with a hit longer than the window: some of its blocks go back at once
    try:
        for step in range(1000):
            for arrival, rid, prompt, max_tokens, abort_at in workload:
                if arrival == step:
                    engine.add_request(
                        rid, prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
                    )
                if abort_at == step:
                    engine.abort(rid)
            before = {r.request_id for r in engine.scheduler.running}
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = (list(out.outputs[0].token_ids), out.outputs[0].finish_reason)
            deep_hits += sum(
                1 for r in engine.scheduler.running if r.request_id not in before and r.num_cached_tokens > WINDOW
            )
            engine.kv.check_invariants(engine.scheduler.live_requests())
            _poison_uncached_free_blocks(engine)
            if step > workload[-1][0] and not engine.has_unfinished():
                break
        assert not engine.has_unfinished(), "the workload did not finish"
        pool = engine.kv.pools["kv"]
        return {
            "done": done,
            "hits": engine.kv.prefix_hits,
            "deep_hits": deep_hits,
            "preemptions": engine.scheduler.stats.num_preemptions,
            "leaked": pool.num_blocks - pool.num_free,
        }
    finally:
        llm.shutdown()


@pytest.mark.requires_plugin("sync_sched")
@pytest.mark.parametrize("scheduler", SCHEDULERS)
# 8 blocks are all a request may ever need (its window, two steps' tokens and two partly filled
# blocks: 32 tokens), so requests preempt one another; 16 keep given-back blocks cached longer.
@pytest.mark.parametrize("num_blocks", [8, 16], ids=["tight", "roomy"])
def test_prefix_caching_with_a_window_gives_the_outputs_of_no_caching(
    fake_pm: Any, scheduler: str, num_blocks: int
) -> None:
    totals = {"hits": 0, "deep_hits": 0, "preemptions": 0, "aborts": 0, "compared": 0}
    # Seeds 9 and 11 fail requests as too big for the tight cache under async scheduling if a hit
    # keeps the blocks before its window (see the next test).
    for seed in range(8, 12):
        workload = _shared_prefix_workload(seed)
        on = _run(fake_pm, scheduler, workload, num_blocks, prefix_caching=True)
        off = _run(fake_pm, scheduler, workload, num_blocks, prefix_caching=False)
        assert off["hits"] == 0
        for run in (on, off):
            assert run["leaked"] == 0
            for _, rid, prompt, max_tokens, _ in workload:
                tokens, reason = run["done"][rid]
                ref = reference_tokens(prompt, max_tokens, window=WINDOW)[0]
                # Nothing fails; an aborted request stops early, but what it produced is the reference's start.
                assert reason in ("length", "abort"), (seed, rid, reason)
                assert tokens == (ref if reason == "length" else ref[: len(tokens)]), (seed, rid, reason)
        # Aborts land at the same step in both runs, which need not be the same point of a request.
        both = [rid for rid in on["done"] if on["done"][rid][1] == off["done"][rid][1] == "length"]
        assert [on["done"][rid] for rid in both] == [off["done"][rid] for rid in both], seed
        totals["compared"] += len(both)
        totals["hits"] += on["hits"]
        totals["deep_hits"] += on["deep_hits"]
        totals["preemptions"] += on["preemptions"]
        totals["aborts"] += sum(1 for _, reason in on["done"].values() if reason == "abort")
    assert totals["compared"] >= 20 and totals["aborts"] >= 4, totals
    if num_blocks == 8:
        assert totals["preemptions"] >= 5 and totals["deep_hits"] >= 2 and totals["hits"] >= 10 * WINDOW, totals
    else:  # most of the 40 requests hit past the window
        assert totals["deep_hits"] >= 20 and totals["hits"] >= 60 * WINDOW, totals


@pytest.mark.requires_plugin("sync_sched")
def test_a_hit_longer_than_the_window_group_pool_is_admitted(fake_pm: Any) -> None:
    """The first request (one output, so its 32 tokens fill the 8-block pool exactly) leaves its
    whole prompt cached; the second one's hit covers all 8 blocks and it needs a ninth: it is
    admitted because the hit gives back the blocks before its window at once."""
    llm = LLM(
        plugins=fake_pm,
        executor="fake",
        worker_mode="inproc",
        scheduler="sync",
        block_size=BLOCK,
        num_kv_blocks=8,
        max_num_seqs=1,
        max_num_batched_tokens=8,
        executor_options={"window": WINDOW, "max_model_len": 256},
    )
    engine = llm.engine
    assert engine is not None
    prompt = [(7 * j) % 90 + 1 for j in range(32)]
    outputs: dict[str, list[int]] = {}
    try:
        for rid, p, n in (("a", prompt, 1), ("b", [*prompt, 5], 4)):
            engine.add_request(rid, p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
            for _ in range(20):
                for out in engine.step():
                    outputs[out.request_id] = list(out.outputs[0].token_ids)
                engine.kv.check_invariants(engine.scheduler.live_requests())
                _poison_uncached_free_blocks(engine)
                if not engine.has_unfinished():
                    break
            assert not engine.has_unfinished(), f"{rid} was never admitted"
        assert engine.kv.prefix_hits == 32
        assert engine.kv.pools["kv"].num_free == 8
    finally:
        llm.shutdown()
    assert outputs["a"] == reference_tokens(prompt, 1, window=WINDOW)[0]
    assert outputs["b"] == reference_tokens([*prompt, 5], 4, window=WINDOW)[0]
