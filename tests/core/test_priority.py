"""Priority scheduling (``scheduling_policy = "priority"``): admission by (priority, arrival),
preemption of the lowest priority (latest arrival first), an arrival preempting running requests
it outranks, aging past ``priority_max_wait_s``, no KV block leaked under random arrivals,
priorities and aborts, and outputs that do not depend on the order requests ran in."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pypto_serving import LLM, ServingSettings
from pypto_serving.kv_cache import KVCacheManager
from pypto_serving.request import Request, RequestStatus, SamplingParams
from pypto_serving.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from pypto_serving.speculative import no_speculation
from tests.core.test_engine_properties import SCHEDULERS, Job, blocks_alone, check_against_reference, run, workloads
from tests.core.test_scheduler import answer, entry_ids, req
from tests.fakes import FakeExecutor

BLOCK = 4


@dataclass
class Clock:
    """The scheduler's clock (and the requests' arrival times), moved by the test."""

    now: float = 1000.0

    def __call__(self) -> float:
        return self.now


def make(policy: str = "priority", num_blocks: int = 32, clock: Clock | None = None, **cfg: Any) -> Scheduler:
    settings = ServingSettings(block_size=BLOCK)
    info = FakeExecutor(settings).load()
    kv = KVCacheManager(info.cache_groups, {"kv": num_blocks})
    cfg.setdefault("max_model_len", info.max_model_len)
    config = SchedulerConfig(policy=policy, **cfg)  # type: ignore[arg-type]
    return Scheduler(config, kv, info, no_speculation(settings), clock=clock or Clock())


def add(s: Scheduler, rid: str, n_prompt: int, priority: int, clock: Clock | None = None, **kw: Any) -> Request:
    r = req(rid, n_prompt, base=len(s.requests) * 11 + 1, priority=priority, **kw)
    if clock is not None:
        r.metrics.arrival_time = clock.now
    s.add_request(r)
    return r


def step(s: Scheduler) -> SchedulerOutput:
    out = s.schedule()
    assert out is not None, "nothing was scheduled"
    return answer(s, out)


def preempted(s: Scheduler) -> list[str]:
    return [r.request_id for r in s.requests.values() if r.status is RequestStatus.PREEMPTED]


# ----------------------------------------------------------------------------- order


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_admission_by_priority_then_arrival(policy: str) -> None:
    s = make(policy, max_num_seqs=1)
    for rid, priority in [("p5", 5), ("p1a", 1), ("p1b", 1), ("p0", 0), ("neg", -3)]:
        add(s, rid, 3, priority, max_tokens=1)
    firsts: list[str] = []
    while s.has_unfinished():
        firsts += [rid for rid in entry_ids(step(s)) if rid not in firsts]
    expected = ["neg", "p0", "p1a", "p1b", "p5"] if policy == "priority" else ["p5", "p1a", "p1b", "p0", "neg"]
    assert firsts == expected


# ----------------------------------------------------------------------------- preemption


def _full_cache(policy: str) -> Scheduler:
    """Four running requests of 7-token prompts (2 blocks each) in an 8-block cache, with
    priorities 5, 9, 9, 1 in arrival order (admitted in the policy's order); their next decodes
    need no new block."""
    s = make(policy, num_blocks=8)
    for rid, priority in [("mid", 5), ("low_old", 9), ("low_new", 9), ("top", 1)]:
        add(s, rid, 7, priority, max_tokens=1000)
    step(s)
    assert len(s.running) == 4 and s.kv.pools["kv"].num_free == 0
    return s


def test_a_high_priority_arrival_preempts_the_lowest_priority_first() -> None:
    s = _full_cache("priority")
    add(s, "high", 15, 0)  # 4 blocks: two requests of priority 9 must go
    out = step(s)
    assert entry_ids(out) == ["top", "mid", "high"]
    assert preempted(s) == ["low_old", "low_new"]
    assert [r.request_id for r in s.waiting] == ["low_old", "low_new"]  # back in (priority, arrival) order
    assert s.stats.num_preemptions == 2


def test_the_latest_arrival_of_the_lowest_priority_goes_first() -> None:
    s = _full_cache("priority")
    add(s, "high", 7, 0)  # 2 blocks: one request goes
    out = step(s)
    assert entry_ids(out) == ["top", "mid", "low_old", "high"]
    assert preempted(s) == ["low_new"]


def test_an_arrival_preempts_nobody_it_does_not_outrank() -> None:
    s = _full_cache("priority")
    add(s, "low", 7, 9)  # ties with the lowest running priority: it waits
    out = step(s)
    assert entry_ids(out) == ["top", "mid", "low_old", "low_new"] and not preempted(s)


def test_under_fcfs_an_arrival_waits_for_free_blocks() -> None:
    s = _full_cache("fcfs")
    add(s, "high", 15, 0)
    out = step(s)
    assert entry_ids(out) == ["mid", "low_old", "low_new", "top"] and not preempted(s)


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_a_growing_request_preempts_the_lowest_priority(policy: str) -> None:
    """Out of blocks while decoding: FCFS preempts the latest arrival, priority the lowest priority
    (here the earlier arrival)."""
    s = make(policy, num_blocks=5)
    add(s, "low", 8, 9, max_tokens=20)  # 2 blocks each, full after the prefill's sampled token
    add(s, "high", 8, 0, max_tokens=20)
    step(s)
    while not s.stats.num_preemptions:
        step(s)
    assert preempted(s) == (["low"] if policy == "priority" else ["high"])


def test_a_high_priority_arrival_takes_a_seat_of_a_full_batch() -> None:
    s = make("priority", max_num_seqs=2)
    add(s, "a", 4, 3, max_tokens=50)
    add(s, "b", 4, 7, max_tokens=50)
    step(s)
    add(s, "c", 4, 5, max_tokens=50)  # outranks b: takes its seat
    out = step(s)
    assert entry_ids(out) == ["a", "c"] and preempted(s) == ["b"]
    add(s, "d", 4, 5, max_tokens=50)  # outranks nobody running
    assert entry_ids(step(s)) == ["a", "c"]
    assert [r.request_id for r in s.waiting] == ["d", "b"]


# ----------------------------------------------------------------------------- starvation


def _first_wait(max_wait: float, steps: int = 60) -> float | None:
    """A request of priority 10 arrives, then two of priority 0 each step (more than the one seat
    serves); the clock moves one second per step. Returns how long the low request waited before
    its first step, or None if it never ran; checks that it finished once admitted."""
    clock = Clock()
    s = make("priority", max_num_seqs=1, clock=clock, priority_max_wait_s=max_wait)
    low = add(s, "low", 4, 10, clock, max_tokens=3)
    waited = None
    for n in range(steps):
        for k in range(2):
            add(s, f"h{n}.{k}", 4, 0, clock, max_tokens=2)
        if "low" in entry_ids(step(s)) and waited is None:
            waited = clock.now - low.metrics.arrival_time
        clock.now += 1.0
    assert waited is None or low.status is RequestStatus.FINISHED_LENGTH  # aged: never preempted again
    return waited


def test_no_request_waits_beyond_the_bound() -> None:
    assert _first_wait(max_wait=1e9) is None  # without aging the low request starves
    for bound in (3.0, 7.5, 20.0):
        waited = _first_wait(max_wait=bound)
        assert waited is not None and bound <= waited < bound + 1.0  # the first step past the bound


def test_aged_requests_go_oldest_first_and_no_fresh_priority_preempts_them() -> None:
    clock = Clock()
    s = make("priority", max_num_seqs=1, clock=clock, priority_max_wait_s=5.0)
    add(s, "old_low", 4, 9, clock)
    clock.now += 1
    add(s, "newer_low", 4, 8, clock)
    clock.now += 1
    add(s, "running", 4, 0, clock, max_tokens=100)
    assert entry_ids(step(s)) == ["running"]
    clock.now += 4.5  # the two low requests are past the bound, "running" is not yet
    add(s, "urgent", 4, -5, clock)
    assert entry_ids(step(s)) == ["old_low"] and preempted(s) == ["running"]  # the oldest aged one
    clock.now += 1  # "running" is past the bound too: aged ones go by arrival
    assert entry_ids(step(s)) == ["old_low"]  # neither an aged nor a fresh urgent request preempts it
    assert [r.request_id for r in s.waiting] == ["newer_low", "running", "urgent"]


# ----------------------------------------------------------------------------- properties


@dataclass(frozen=True)
class Arrival:
    n_prompt: int
    max_tokens: int
    priority: int
    at: int
    abort_at: int | None


arrivals = st.lists(
    st.builds(
        Arrival,
        st.integers(1, 20),
        st.integers(1, 8),
        st.integers(-2, 2),
        st.integers(0, 12),
        st.none() | st.integers(0, 20),
    ),
    min_size=1,
    max_size=10,
)


@settings(max_examples=60, deadline=None)
@given(
    jobs=arrivals,
    spare=st.integers(0, 6),
    max_num_seqs=st.integers(1, 4),
    budget=st.integers(4, 32),
    max_wait=st.sampled_from([2.0, 5.0, 1e9]),
)
def test_no_block_leaks_under_random_arrivals_priorities_and_aborts(
    jobs: list[Arrival], spare: int, max_num_seqs: int, budget: int, max_wait: float
) -> None:
    clock = Clock()
    alone = max(-(-(j.n_prompt + j.max_tokens) // BLOCK) for j in jobs)
    s = make(
        num_blocks=alone + spare,
        clock=clock,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        priority_max_wait_s=max_wait,
    )
    added: dict[int, Request] = {}
    for n in range(400):
        for i, j in enumerate(jobs):
            if j.at == n:
                added[i] = add(s, str(i), j.n_prompt, j.priority, clock, max_tokens=j.max_tokens)
            if j.abort_at == n and i in added:
                s.abort([str(i)])
        out = s.schedule()
        if out is not None:
            answer(s, out)  # checks the KV invariants after every step
        clock.now += 1.0
        if len(added) == len(jobs) and not s.has_unfinished():
            break
    assert not s.has_unfinished(), "the scheduler does not make progress"
    pool = s.kv.pools["kv"]
    assert pool.num_free == pool.num_blocks and not any(pool.ref_cnt), "blocks leaked"
    for i, r in added.items():
        assert r.status is RequestStatus.FINISHED_ABORTED or len(r.output_token_ids) == jobs[i].max_tokens


# ----------------------------------------------------------------------------- outputs


def _seeded(jobs: list[Job], priorities: list[int]) -> Callable[[Job], SamplingParams]:
    index = {id(j): i for i, j in enumerate(jobs)}

    def params(job: Job) -> SamplingParams:
        i = index[id(job)]
        return SamplingParams(temperature=1.5, seed=1000 + i, max_tokens=job.max_tokens, priority=priorities[i])

    return params


@pytest.mark.parametrize("seed", range(4))
def test_seeded_outputs_under_priority_equal_fcfs(make_llm: Callable[..., LLM], seed: int) -> None:
    """The tokens of each seeded request do not depend on the order requests ran in: a small cache
    preempts under both policies, differently."""
    rng = random.Random(seed)
    jobs = [
        Job(tuple(rng.randrange(97) for _ in range(rng.randint(4, 30))), rng.randint(4, 14), (), rng.randint(0, 3))
        for _ in range(6)
    ]
    priorities = [rng.randint(-2, 2) for _ in jobs]
    common = dict(block_size=2, num_kv_blocks=blocks_alone(jobs, 2) + 4, max_num_batched_tokens=24)
    fcfs_llm = make_llm(**common)
    fcfs = run(fcfs_llm, jobs, _seeded(jobs, [0] * len(jobs)))
    prio_llm = make_llm(scheduling_policy="priority", **common)
    prio = run(prio_llm, jobs, _seeded(jobs, priorities))
    assert fcfs_llm.engine is not None and prio_llm.engine is not None
    assert fcfs_llm.engine.stats()["num_preemptions"] and prio_llm.engine.stats()["num_preemptions"]
    for i in range(len(jobs)):
        assert prio[i].outputs[0].token_ids == fcfs[i].outputs[0].token_ids, f"job {i}"


@pytest.mark.parametrize("scheduler", SCHEDULERS)
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(jobs=workloads(), priorities=st.lists(st.integers(-3, 3), min_size=6, max_size=6), spare=st.integers(0, 6))
def test_greedy_outputs_under_priority_match_the_reference(
    make_llm: Callable[..., LLM], scheduler: str, jobs: list[Job], priorities: list[int], spare: int
) -> None:
    """Under sync and async (two steps in flight when an admission preempts) scheduling."""
    llm = make_llm(
        scheduler=scheduler,
        scheduling_policy="priority",
        block_size=2,
        num_kv_blocks=blocks_alone(jobs, 2) + spare,
        max_num_seqs=3,
    )
    by_job = {id(j): p for j, p in zip(jobs, priorities)}

    def params(job: Job) -> SamplingParams:
        return SamplingParams(
            temperature=0, max_tokens=job.max_tokens, stop_token_ids=list(job.stop_token_ids), priority=by_job[id(job)]
        )

    check_against_reference(jobs, run(llm, jobs, params), None)


def test_a_priority_under_fcfs_is_refused(make_llm: Callable[..., LLM]) -> None:
    llm = make_llm()
    with pytest.raises(ValueError, match="scheduling_policy = 'priority'"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), priority=[1], use_tqdm=False)
    assert llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), priority=[0], use_tqdm=False)[0].finished
    prio = make_llm(scheduling_policy="priority")
    outs = prio.generate([[1, 2, 3], [4, 5]], SamplingParams(temperature=0, max_tokens=3), priority=[2, -1])
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 3]
    with pytest.raises(ValueError, match="got 1 priorities for 2 prompts"):
        prio.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=2), priority=[1])


def test_priority_is_an_int64() -> None:
    assert SamplingParams(priority=-(2**63)).priority == -(2**63)
    for bad in (2**63, -(2**63) - 1):
        with pytest.raises(ValueError, match="priority="):
            SamplingParams(priority=bad)
