"""Property tests of the whole engine on the fake executor: any workload gives every request the
tokens it would get run alone, under chunking, preemption, prefix caching, aborts, speculation and
commands of several forwards ended early, with the KV accounting consistent after every step."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pypto_serving import LLM, PluginError, SamplingParams
from tests.conftest import plugin_installed
from tests.fakes import reference_tokens

pytest.importorskip("pypto_serving_sync_sched")

VOCAB = 97
SCHEDULERS = ["sync"] + (["async"] if plugin_installed("async_sched") else [])
PROPS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@dataclass(frozen=True)
class Job:
    prompt: tuple[int, ...]
    max_tokens: int
    stop_token_ids: tuple[int, ...] = ()
    arrive_at: int = 0
    abort_at: int | None = None


@st.composite
def workloads(draw: Any, aborts: bool = True, max_jobs: int = 6) -> list[Job]:
    # A few shared prefixes so that prefix caching gets hits.
    prefixes = draw(st.lists(st.lists(st.integers(0, VOCAB - 1), max_size=24), min_size=1, max_size=3))
    jobs = []
    for _ in range(draw(st.integers(1, max_jobs))):
        prefix = draw(st.sampled_from(prefixes))
        suffix = draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=40 - len(prefix)))
        jobs.append(
            Job(
                tuple(prefix + suffix),
                draw(st.integers(1, 12)),
                tuple(draw(st.lists(st.integers(0, VOCAB - 1), max_size=2))),
                draw(st.integers(0, 4)),
                draw(st.none() | st.integers(0, 10)) if aborts else None,
            )
        )
    return jobs


def blocks_alone(jobs: list[Job], block_size: int) -> int:
    """Blocks the biggest request needs when it runs alone."""
    return max(math.ceil((len(j.prompt) + j.max_tokens) / block_size) for j in jobs)


@pytest.fixture
def engine_factory(fake_pm: Any) -> Iterator[Callable[..., LLM]]:
    built: list[LLM] = []

    def make(**kw: Any) -> LLM:
        kw.setdefault("executor", "fake")
        kw.setdefault("worker_mode", "inproc")
        kw.setdefault("scheduler", "sync")
        llm = LLM(plugins=fake_pm, **kw)
        built.append(llm)
        return llm

    yield make
    for llm in built:
        llm.shutdown()


def run(
    llm: LLM,
    jobs: list[Job],
    params: Callable[[Job], SamplingParams] | None = None,
    after_step: Callable[[Any], None] | None = None,
) -> dict[int, Any]:
    """Drive the engine step by step (arrivals and aborts at their steps), checking the KV
    accounting (and ``after_step(engine)``) after every step; returns the final output of each job by index."""
    engine = llm.engine
    assert engine is not None
    params = params or (
        lambda j: SamplingParams(temperature=0, max_tokens=j.max_tokens, stop_token_ids=list(j.stop_token_ids))
    )
    done: dict[int, Any] = {}
    added: set[int] = set()
    step = 0
    while len(done) < len(jobs):
        for i, j in enumerate(jobs):
            if i not in added and j.arrive_at <= step:
                engine.add_request(str(i), list(j.prompt), params(j))
                added.add(i)
            if j.abort_at == step and i in added:
                engine.abort(str(i))
        for out in engine.step():
            if out.finished:
                done[int(out.request_id)] = out
        engine.kv.check_invariants(engine.scheduler.live_requests())
        if after_step is not None:
            after_step(engine)
        step += 1
        assert step < 3000, "the engine does not make progress"
    assert not engine.has_unfinished()
    for pool in engine.kv.pools.values():
        assert pool.num_free == pool.num_blocks, "blocks leaked"
    assert all(c == 0 for pool in engine.kv.pools.values() for c in pool.ref_cnt)
    return done


def check_against_reference(jobs: list[Job], done: dict[int, Any], eos: int | None) -> None:
    for i, j in enumerate(jobs):
        ref, reason = reference_tokens(list(j.prompt), j.max_tokens, VOCAB, eos, j.stop_token_ids)
        out = done[i].outputs[0]
        if out.finish_reason == "abort":
            assert j.abort_at is not None
            assert out.token_ids == ref[: len(out.token_ids)]
        else:
            assert (out.token_ids, out.finish_reason) == (ref, reason), f"job {i}: {j}"


# ----------------------------------------------------------------------------- greedy workloads


@pytest.mark.parametrize("scheduler", SCHEDULERS)
@PROPS
@given(
    jobs=workloads(),
    block_size=st.sampled_from([1, 2, 4, 8]),
    spare_blocks=st.integers(0, 12),
    budget=st.integers(4, 48),
    threshold=st.sampled_from([0, 3, 8]),
    max_num_seqs=st.integers(1, 6),
    eos=st.none() | st.integers(0, VOCAB - 1),
    prefix_caching=st.booleans(),
    steps=st.sampled_from([1, 3, 8, None]),  # None: auto (50 ms a command, one beside a prompt in chunks)
    fused=st.booleans(),
    interrupts=st.lists(st.booleans(), max_size=6),
)
def test_random_workloads_match_reference(
    engine_factory: Callable[..., LLM],
    scheduler: str,
    jobs: list[Job],
    block_size: int,
    spare_blocks: int,
    budget: int,
    threshold: int,
    max_num_seqs: int,
    eos: int | None,
    prefix_caching: bool,
    steps: int | None,
    fused: bool,
    interrupts: list[bool],
) -> None:
    # fused: the executor runs a multi-step decode's greedy forwards as one loop (Executor.greedy_steps);
    # interrupts: after step k an arrival is counted (its commands end after one forward) or the count
    # taken, in turn.
    llm = engine_factory(
        scheduler=scheduler,
        num_scheduler_steps=steps,
        block_size=block_size,
        num_kv_blocks=blocks_alone(jobs, block_size) + spare_blocks,
        max_num_batched_tokens=budget,
        long_prefill_token_threshold=threshold,
        max_num_seqs=max_num_seqs,
        enable_prefix_caching=prefix_caching,
        executor_options={"greedy_steps": fused} | ({} if eos is None else {"eos": eos}),
    )
    taken = itertools.count()

    def interrupt(engine: Any) -> None:
        if interrupts[next(taken) % len(interrupts)]:
            engine.step_interrupt.arrive()
        else:
            engine.step_interrupt.take()

    check_against_reference(jobs, run(llm, jobs, after_step=interrupt if interrupts else None), eos)


def test_tiny_cache_preempts_and_still_matches(engine_factory: Callable[..., LLM]) -> None:
    jobs = [Job(tuple((7 * i + k) % VOCAB for k in range(10)), 12) for i in range(4)]
    llm = engine_factory(block_size=2, num_kv_blocks=blocks_alone(jobs, 2) + 1, max_num_batched_tokens=64)
    done = run(llm, jobs)
    assert llm.engine is not None and llm.engine.stats()["num_preemptions"] > 0
    check_against_reference(jobs, done, None)


@PROPS
@given(jobs=workloads(aborts=False), block_size=st.sampled_from([2, 4]), budget=st.integers(2, 12))
def test_chunked_equals_unchunked(
    engine_factory: Callable[..., LLM], jobs: list[Job], block_size: int, budget: int
) -> None:
    common = dict(block_size=block_size, num_kv_blocks=blocks_alone(jobs, block_size) * 3)
    chunked = run(engine_factory(max_num_batched_tokens=budget, **common), jobs)
    whole = run(engine_factory(max_num_batched_tokens=64, enable_chunked_prefill=False, **common), jobs)
    for i in range(len(jobs)):
        assert chunked[i].outputs[0].token_ids == whole[i].outputs[0].token_ids
        assert chunked[i].outputs[0].finish_reason == whole[i].outputs[0].finish_reason


def check_worker_rows(engine: Any) -> None:
    """The worker's persistent rows after a sync step: dense and consistent, and every running
    request the worker holds has the block table the engine allocated for it, whatever order
    requests entered, left (finish, abort, preemption) and filled the holes left behind."""
    ib = engine.worker._runner.input_batch
    assert ib.row_of == {rid: row for row, rid in enumerate(ib.request_ids)}
    assert set(ib.request_ids) == set(engine.worker._runner.states)
    for req in engine.scheduler.running:
        if req.request_id in ib.row_of:
            for group, blocks in req.kv.block_ids.items():
                assert ib.block_ids(req.request_id, group) == blocks, (req.request_id, group)
    for name, t in ib.tables.items():  # rows past the last one are clear for the next request
        assert not t.table.narrow(0, ib.num_rows, t.table.shape[0] - ib.num_rows).any(), name


@PROPS
@given(
    jobs=workloads(max_jobs=10),
    block_size=st.sampled_from([1, 2, 4]),
    spare_blocks=st.integers(0, 6),
    max_num_seqs=st.integers(2, 8),
    seeded=st.booleans(),
)
def test_worker_rows_follow_admissions_and_removals(
    engine_factory: Callable[..., LLM],
    jobs: list[Job],
    block_size: int,
    spare_blocks: int,
    max_num_seqs: int,
    seeded: bool,
) -> None:
    """Many requests arriving, finishing, aborting and being preempted in random orders: the
    worker's rows stay in step with the engine after every step, greedy outputs equal the
    reference and seeded outputs equal the request run alone."""
    common = dict(block_size=block_size, max_num_batched_tokens=32)
    llm = engine_factory(
        num_kv_blocks=blocks_alone(jobs, block_size) + spare_blocks, max_num_seqs=max_num_seqs, **common
    )
    done = run(llm, jobs, _seeded if seeded else None, after_step=check_worker_rows)
    if not seeded:
        check_against_reference(jobs, done, None)
        return
    for i, j in enumerate(jobs):
        if done[i].outputs[0].finish_reason == "abort":
            continue
        alone_job = Job(j.prompt, j.max_tokens, j.stop_token_ids)
        alone = run(engine_factory(num_kv_blocks=4 * blocks_alone(jobs, block_size), **common), [alone_job], _seeded)
        assert done[i].outputs[0].token_ids == alone[0].outputs[0].token_ids, f"job {i}"


# ----------------------------------------------------------------------------- prefix caching


def _count_computed(llm: LLM) -> list[int]:
    engine = llm.engine
    assert engine is not None
    counted = [0]
    submit = engine.submit

    def counting(out: Any) -> None:
        counted[0] += out.num_batched_tokens
        submit(out)

    engine.submit = counting  # type: ignore[method-assign]
    return counted


@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_prefix_cache_hits_give_same_output_with_less_compute(
    engine_factory: Callable[..., LLM], scheduler: str
) -> None:
    shared = [(3 * k + 1) % VOCAB for k in range(24)]
    first = Job(tuple([*shared, 5]), 6)
    rest = [Job(tuple([*shared, 10 + i, 20 + i]), 6, arrive_at=0) for i in range(3)]
    results = {}
    for caching in (True, False):
        llm = engine_factory(scheduler=scheduler, block_size=4, num_kv_blocks=64, enable_prefix_caching=caching)
        computed = _count_computed(llm)
        a = run(llm, [first])
        b = run(llm, rest)
        assert llm.engine is not None
        results[caching] = (a, b, computed[0], llm.engine.stats())
    (a1, b1, cost1, stats1), (a0, b0, cost0, stats0) = results[True], results[False]
    assert stats1["prefix_cache_hits"] > 0 and stats0["prefix_cache_hits"] == 0
    assert all(out.num_cached_tokens == 24 for out in b1.values())
    assert a1[0].outputs[0].token_ids == a0[0].outputs[0].token_ids
    for i in range(len(rest)):
        assert b1[i].outputs[0].token_ids == b0[i].outputs[0].token_ids
    check_against_reference(rest, b1, None)
    assert cost1 <= cost0 - 3 * 24


# ----------------------------------------------------------------------------- seeded sampling


def _seeded(j: Job) -> SamplingParams:
    return SamplingParams(
        temperature=1.5, top_p=0.95, seed=1000 + len(j.prompt) * 7 + j.max_tokens, max_tokens=j.max_tokens
    )


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(jobs=workloads(aborts=False, max_jobs=3), block_size=st.sampled_from([2, 4]))
def test_seeded_sampling_independent_of_batch_and_preemption(
    engine_factory: Callable[..., LLM], jobs: list[Job], block_size: int
) -> None:
    jobs = [Job(j.prompt, j.max_tokens, (), j.arrive_at) for j in jobs]
    tight = blocks_alone(jobs, block_size)
    # Several forwards a command (num_scheduler_steps) draw the same tokens as one.
    batched_llm = engine_factory(block_size=block_size, num_kv_blocks=4 * tight, num_scheduler_steps=4)
    batched = run(batched_llm, jobs, _seeded)
    preempting_llm = engine_factory(block_size=block_size, num_kv_blocks=tight, max_num_batched_tokens=8)
    preempting = run(preempting_llm, jobs, _seeded)
    for i, j in enumerate(jobs):
        alone = run(engine_factory(block_size=block_size, num_kv_blocks=tight), [j], _seeded)[0]
        assert len(alone.outputs[0].token_ids) == j.max_tokens
        assert batched[i].outputs[0].token_ids == alone.outputs[0].token_ids
        assert preempting[i].outputs[0].token_ids == alone.outputs[0].token_ids


def test_seeded_sampling_survives_preemption(engine_factory: Callable[..., LLM]) -> None:
    jobs = [Job(tuple((5 * i + k) % VOCAB for k in range(9)), 10) for i in range(4)]
    tight = blocks_alone(jobs, 2)
    llm = engine_factory(block_size=2, num_kv_blocks=tight + 1)
    together = run(llm, jobs, _seeded)
    assert llm.engine is not None and llm.engine.stats()["num_preemptions"] > 0
    for i, j in enumerate(jobs):
        alone = run(engine_factory(block_size=2, num_kv_blocks=tight), [j], _seeded)[0]
        assert together[i].outputs[0].token_ids == alone.outputs[0].token_ids


def test_seeded_sampling_is_actually_random(engine_factory: Callable[..., LLM]) -> None:
    job = Job(tuple(range(1, 9)), 24)
    greedy = run(engine_factory(block_size=4, num_kv_blocks=16), [job])[0].outputs[0].token_ids
    seeded = run(engine_factory(block_size=4, num_kv_blocks=16), [job], _seeded)[0].outputs[0].token_ids
    other = (
        run(
            engine_factory(block_size=4, num_kv_blocks=16),
            [job],
            lambda j: SamplingParams(temperature=1.5, top_p=0.95, seed=1, max_tokens=j.max_tokens),
        )[0]
        .outputs[0]
        .token_ids
    )
    assert seeded != greedy and seeded != other


# ----------------------------------------------------------------------------- speculative decoding


@PROPS
@given(
    jobs=workloads(max_jobs=4),
    k=st.integers(1, 3),
    block_size=st.sampled_from([2, 4]),
    spare_blocks=st.integers(0, 6),
    budget=st.integers(4, 32),
)
def test_speculative_decoding_equals_plain(
    engine_factory: Callable[..., LLM],
    jobs: list[Job],
    k: int,
    block_size: int,
    spare_blocks: int,
    budget: int,
) -> None:
    llm = engine_factory(
        block_size=block_size,
        num_kv_blocks=blocks_alone(jobs, block_size) + spare_blocks,
        max_num_batched_tokens=budget,
        speculative_config={"method": "fake", "num_speculative_tokens": k},
        executor_options={"max_draft": k, "draft_error_rate": 0.3},
    )
    check_against_reference(jobs, run(llm, jobs), None)


def test_speculation_drafts_and_accepts(engine_factory: Callable[..., LLM]) -> None:
    jobs = [Job(tuple(range(i, i + 6)), 16) for i in range(3)]
    llm = engine_factory(
        block_size=4,
        num_kv_blocks=32,
        speculative_config={"method": "fake", "num_speculative_tokens": 2},
        executor_options={"max_draft": 2, "draft_error_rate": 0.3},
    )
    done = run(llm, jobs)
    check_against_reference(jobs, done, None)
    assert llm.engine is not None
    stats = llm.engine.stats()
    assert 0 < stats["spec_accepted"] < stats["spec_drafted"]
    assert len(stats["spec_accepted_per_pos"]) == 2
    assert 0 < stats["spec_verify_steps"] <= stats["spec_drafted"]
    assert stats["spec_mean_accepted_length"] == stats["spec_accepted"] / stats["spec_verify_steps"]
    assert 0 < stats["spec_mean_accepted_length"] < 2
    # fewer steps than tokens: accepted drafts saved steps
    assert stats["num_steps"] < sum(j.max_tokens for j in jobs) + len(jobs)


def test_speculation_with_an_executor_that_cannot_draft(engine_factory: Callable[..., LLM]) -> None:
    with pytest.raises(PluginError, match="executor 'fake' cannot draft tokens; unset speculative_config"):
        engine_factory(speculative_config={"method": "mtp", "num_speculative_tokens": 2})
