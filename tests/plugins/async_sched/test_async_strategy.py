"""Unit tests of the async (depth-2) strategy over the fake executor, driving ``EngineCore`` directly
and spying on the strategy's calls into it (schedule / submit / wait_result / apply)."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

pytest.importorskip("pypto_serving_async_sched")

from pypto_serving import SamplingParams
from tests.fakes import reference_tokens

from .helpers import VOCAB, Spy, make_llm, run, tokens

GREEDY = dict(temperature=0.0)


def greedy(max_tokens: int, **kw: Any) -> SamplingParams:
    return SamplingParams(**GREEDY, max_tokens=max_tokens, **kw)


def prompts(n: int, seed: int, lo: int = 2, hi: int = 12) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def find_prompt(pred: Any, seed: int = 0, lo: int = 2, hi: int = 8) -> list[int]:
    rng = random.Random(seed)
    for _ in range(100_000):
        p = [rng.randrange(VOCAB) for _ in range(rng.randrange(lo, hi))]
        if pred(p):
            return p
    raise AssertionError("no prompt found")


@pytest.fixture
def llms():
    made = []

    def make(*args: Any, **kw: Any) -> Any:
        llm = make_llm(*args, **kw)
        made.append(llm)
        return llm

    yield make
    for llm in made:
        llm.shutdown()


def cache_tokens(engine: Any, req: Any, upto: int) -> list[int]:
    """The token ids the fake executor's cache holds at positions [0, upto) of ``req``."""
    fake = engine.worker._runner.executor
    return fake._context(torch.tensor(req.kv.block_ids["kv"]), upto)


# --------------------------------------------------------------------------- reservation & pipelining


@pytest.mark.parametrize("k", [0, 1, 3])
def test_upper_bound_reservation_between_dispatch_and_apply(llms: Any, k: int) -> None:
    """Scheduling advances computed tokens by num_new + k and reserves 1 + k placeholders per sampling
    entry (a decode of several forwards, num_steps: num_steps of each, four a command without drafts);
    between the dispatch of step N+1 and the apply of step N a request carries both."""
    llm = llms("async", k=k, err=0.0, **({} if k else {"num_scheduler_steps": 4}))
    eng = llm.engine
    pairs = 0

    def on_apply(out: Any, result: Any) -> None:
        nonlocal pairs
        later = list(eng.strategy.in_flight)
        assert len(later) <= 1
        if not later:
            return
        assert later[0].command.step_id == out.command.step_id + 1
        mine = {e.request_id: e for e in out.command.entries if e.sample}
        for e in later[0].command.entries:
            if not (e.sample and e.request_id in mine):
                continue
            req = eng.scheduler.requests[e.request_id]
            # the input of the later decode is still being sampled: typed flag, no token ids
            assert e.use_last_sampled and e.token_ids == []
            before = mine[e.request_id]
            assert req.num_output_placeholders == (before.num_steps + before.num_draft) + (e.num_steps + e.num_draft)
            assert req.num_computed_tokens == req.num_tokens + req.num_output_placeholders - 1
            pairs += 1

    spy = Spy(eng, on_apply=on_apply)
    ps = prompts(3, seed=1)
    res = run(eng, [(f"r{i}", p, greedy(20)) for i, p in enumerate(ps)])
    assert pairs > 10
    for d in spy.dispatched:
        for e in d.out.command.entries:
            c0, ph0, _ = d.before[e.request_id]
            c1, ph1, _ = d.after[e.request_id]
            num_new = e.num_steps if e.use_last_sampled else len(e.token_ids)
            assert c1 - c0 == num_new + e.num_draft
            assert ph1 - ph0 == ((e.num_steps + e.num_draft) if e.sample else 0)
            assert e.start_pos == c0
    if k:
        assert any(e.num_draft == k for e in spy.entries())
    else:
        assert any(e.num_steps > 1 for e in spy.entries())
    assert tokens(res) == {f"r{i}": reference_tokens(p, 20) for i, p in enumerate(ps)}


def test_two_steps_dispatched_before_the_first_is_applied(llms: Any) -> None:
    outstanding = {}
    for sched in ("sync", "async"):
        eng = llms(sched).engine
        spy = Spy(eng)
        run(eng, [(f"r{i}", p, greedy(12)) for i, p in enumerate(prompts(4, seed=2))])
        subs = [s for kind, s in spy.events if kind == "submit"]
        apps = [s for kind, s in spy.events if kind == "apply"]
        assert subs == sorted(subs) and apps == subs  # every step applied once, in order
        level, peak = 0, 0
        for kind, _ in spy.events:
            level += {"submit": 1, "apply": -1}.get(kind, 0)
            peak = max(peak, level)
        outstanding[sched] = peak
        if sched == "async":
            assert spy.events[:2] == [("submit", subs[0]), ("submit", subs[1])]
            for n in apps[:-1]:  # step n+1 is dispatched before step n is applied
                assert spy.events.index(("submit", n + 1)) < spy.events.index(("apply", n))
    assert outstanding == {"sync": 1, "async": 2}


@pytest.mark.parametrize("k", [1, 2, 3])
def test_async_equals_sync_when_all_drafts_are_accepted(llms: Any, k: int) -> None:
    ps = prompts(6, seed=k)
    reqs = [(f"r{i}", p, greedy(10 + 3 * i)) for i, p in enumerate(ps)]
    outs, stats = {}, {}
    for sched in ("sync", "async"):
        eng = llms(sched, k=k, err=0.0).engine
        outs[sched] = tokens(run(eng, reqs))
        stats[sched] = eng.stats()
    assert outs["async"] == outs["sync"] == {rid: reference_tokens(p, sp.max_tokens) for rid, p, sp in reqs}
    assert stats["async"]["spec_drafted"] > 0
    assert stats["async"]["spec_accepted"] == stats["async"]["spec_drafted"]


@pytest.mark.parametrize("k,err", [(1, 1.0), (2, 0.5), (3, 0.3), (3, 1.0)])
def test_rejected_drafts_leave_no_desync(llms: Any, k: int, err: float) -> None:
    """After reconciliation (every in-flight result applied) the scheduler state, the worker's
    history and the cache contents are exactly what sync has after each of its steps."""
    reqs = [(f"r{i}", p, greedy(30)) for i, p in enumerate(prompts(3, seed=10 + k))]
    llm = llms("async", k=k, err=err)
    eng = llm.engine
    runner = eng.worker._runner
    corrected = 0
    reconciled = 0

    def on_apply(out: Any, result: Any) -> None:
        nonlocal corrected
        later = {e.request_id for e in eng.strategy.in_flight[0].command.entries} if eng.strategy.in_flight else set()
        for e in out.command.entries:
            got = result.sampled.get(e.request_id)
            if got is not None and len(got) - 1 < e.num_draft and e.request_id in later:
                corrected += 1  # the later step was scheduled before this rejection was known

    def reconcile(i: int) -> None:
        nonlocal reconciled
        if i % 3 != 2:
            return
        eng.strategy.drain()
        for req in eng.scheduler.running:
            if not req.output_token_ids:
                continue
            reconciled += 1
            assert req.num_output_placeholders == 0
            assert req.num_computed_tokens == req.num_tokens - 1  # what sync has after every step
            st = runner.states[req.request_id]
            assert st.history == req.all_token_ids
            assert st.last_sampled == req.output_token_ids[-1]
            assert cache_tokens(eng, req, req.num_computed_tokens) == req.all_token_ids[: req.num_computed_tokens]

    Spy(eng, on_apply=on_apply)
    res = run(eng, reqs, before_step=reconcile)
    sync = tokens(run(llms("sync", k=k, err=err).engine, reqs))
    assert tokens(res) == sync == {rid: reference_tokens(p, 30) for rid, p, _ in reqs}
    s = eng.stats()
    assert s["spec_accepted"] < s["spec_drafted"]
    assert corrected > 0 and reconciled > 0


@pytest.mark.parametrize("k", [0, 2])
def test_eos_mid_pair_drops_the_trailing_token(llms: Any, k: int) -> None:
    eos = 5
    p = find_prompt(
        lambda p: reference_tokens(p, 40, eos=eos)[1] == "stop" and 5 <= len(reference_tokens(p, 40, eos=eos)[0]) <= 12
    )
    ref = reference_tokens(p, 40, eos=eos)
    eng = llms("async", k=k, err=0.0, options={"eos": eos}).engine
    mid_pair = []

    def on_apply(out: Any, result: Any) -> None:
        got = result.sampled.get("a", [])
        if eos in got:
            later = [e for s in eng.strategy.in_flight for e in s.command.entries if e.request_id == "a"]
            mid_pair.append((got, later))

    spy = Spy(eng, on_apply=on_apply)
    # More tokens than one command's forwards (auto: up to AUTO_STEPS = 64 without drafts), so the
    # command after the one that samples EOS is already in flight.
    res = run(eng, [("a", p, greedy(100))])
    assert tokens(res) == {"a": ref}
    assert len(mid_pair) == 1
    got, later = mid_pair[0]
    assert later and later[0].use_last_sampled  # a step for the token after EOS was already in flight
    assert spy.applied[-1][1].sampled.get("a")  # ... and its result came back and was dropped
    if k:
        assert got[-1] == eos or got.index(eos) < len(got) - 1
    # The reclaimed positions / blocks are free (run() checked); the worker forgets the request once
    # the next step goes out.
    run(eng, [("b", [1, 2, 3], greedy(3))])
    assert "a" not in eng.worker._runner.states


@pytest.mark.parametrize("k", [0, 2])
def test_completing_prefill_is_not_scheduled_twice(llms: Any, k: int) -> None:
    ps = {"a": list(range(10, 23)), "b": list(range(40, 47))}
    eng = llms("async", k=k, err=0.0, max_num_batched_tokens=4).engine
    spy = Spy(eng)
    res = run(eng, [(rid, p, greedy(6)) for rid, p in ps.items()])
    assert tokens(res) == {rid: reference_tokens(p, 6) for rid, p in ps.items()}
    for rid, p in ps.items():
        mine = [(d, e) for d in spy.dispatched for e in d.out.command.entries if e.request_id == rid]
        sent_prompt = [t for _, e in mine if not e.use_last_sampled for t in e.token_ids]
        assert sent_prompt[: len(p)] == p and all(e.use_last_sampled for _, e in mine if e.start_pos >= len(p))
        pos = 0
        for d, e in mine:
            assert e.start_pos == pos
            assert d.after[rid][0] == pos + (e.num_steps if e.use_last_sampled else len(e.token_ids)) + e.num_draft
            pos = d.after[rid][0]
            if not e.use_last_sampled and e.start_pos + len(e.token_ids) == len(p):  # terminal prefill chunk
                assert e.sample
                assert d.after[rid][0] == len(p)
        first_decode = next(e for _, e in mine if e.start_pos >= len(p))
        assert first_decode.start_pos == len(p) and first_decode.use_last_sampled


@pytest.mark.parametrize("barrier", [True, False])
def test_terminal_prefill_barrier(llms: Any, barrier: bool) -> None:
    """With the barrier the first decode after a terminal prefill waits for its result, while the
    other ready requests are still scheduled in that step (one forward a command, so that "a" still
    runs when "b" arrives)."""
    eng = llms("async", options={"barrier": barrier}, num_scheduler_steps=1).engine
    spy = Spy(eng)
    a, b = [3, 1, 4], [1, 5, 9, 2, 6, 5]
    eng.add_request("a", a, greedy(30))
    for _ in range(4):
        eng.step()
    n0 = len(spy.dispatched)
    res = run(eng, [("b", b, greedy(8))])
    steps = [d.out.command for d in spy.dispatched[n0:]]
    i = next(i for i, c in enumerate(steps) if any(e.request_id == "b" and e.sample for e in c.entries))
    pre, nxt, after = steps[i], steps[i + 1], steps[i + 2]
    assert [len(e.token_ids) for e in pre.entries if e.request_id == "b"] == [len(b)]
    assert spy.events.index(("submit", nxt.step_id)) < spy.events.index(("apply", pre.step_id))
    assert "a" in {e.request_id for e in nxt.entries}  # others still scheduled
    b_next = [e for e in nxt.entries if e.request_id == "b"]
    if barrier:
        assert b_next == []
        (e,) = [e for e in after.entries if e.request_id == "b"]
        assert not e.use_last_sampled and e.token_ids == [reference_tokens(b, 1)[0][0]]
    else:
        assert len(b_next) == 1 and b_next[0].use_last_sampled
    assert tokens(res)["b"] == reference_tokens(b, 8)
    eng.abort("a")
    run(eng)


# --------------------------------------------------------------------------- stale results


def test_abort_discards_results_in_flight(llms: Any) -> None:
    pa, pb = [7, 8, 9], [10, 11, 12, 13]
    eng = llms("async", num_scheduler_steps=1).engine  # one token a result: the count below is of tokens
    aborted_at = []

    def on_apply(out: Any, result: Any) -> None:
        req = eng.scheduler.requests.get("a")
        later = eng.strategy.in_flight
        if req is not None and len(req.output_token_ids) >= 5 and later and not aborted_at:
            assert any(e.request_id == "a" for e in later[0].command.entries)
            assert "a" in result.sampled
            eng.abort("a")  # with two steps for "a" in flight
            aborted_at.append(list(req.output_token_ids))

    spy = Spy(eng, on_apply=on_apply)
    res = run(eng, [("a", pa, greedy(30)), ("b", pb, greedy(30))])
    assert tokens(res) == {"a": (aborted_at[0], "abort"), "b": reference_tokens(pb, 30)}
    assert aborted_at[0] == reference_tokens(pa, 30)[0][: len(aborted_at[0])]
    stale = [r for o, r in spy.applied if "a" in r.sampled]
    assert len(stale) >= len(aborted_at[0]) + 2  # both in-flight results for "a" came back unused


def test_abort_between_steps(llms: Any) -> None:
    ps = prompts(4, seed=5)
    ref = {f"r{i}": reference_tokens(p, 25) for i, p in enumerate(ps)}
    eng = llms("async", k=2, err=0.4).engine
    res = run(eng, [(f"r{i}", p, greedy(25)) for i, p in enumerate(ps)], aborts={3: ["r1"], 7: ["r2"]})
    for rid, (toks, reason) in tokens(res).items():
        if rid in ("r1", "r2"):
            assert reason == "abort" and toks == ref[rid][0][: len(toks)]
        else:
            assert (toks, reason) == ref[rid]


@pytest.mark.parametrize("k", [0, 2])
def test_preemption_discards_stale_results(llms: Any, k: int) -> None:
    ps = prompts(6, seed=7, lo=3, hi=9)
    reqs = [(f"r{i}", p, greedy(28)) for i, p in enumerate(ps)]
    eng = llms("async", k=k, err=0.3, num_kv_blocks=12).engine
    stale = 0

    def on_apply(out: Any, result: Any) -> None:
        nonlocal stale
        for r in out.requests:  # preempted after this step was scheduled: its result is stale
            if r.request_id in result.sampled and not r.is_finished and r.sched.valid_from > out.command.step_id:
                stale += 1

    Spy(eng, on_apply=on_apply)
    res = run(eng, reqs)
    assert eng.stats()["num_preemptions"] > 0 and stale > 0
    sync = tokens(run(llms("sync", k=k, err=0.3, num_kv_blocks=12).engine, reqs))
    assert tokens(res) == sync == {rid: reference_tokens(p, 28) for rid, p, _ in reqs}


def test_step_error_discards_the_later_result_of_its_requests(llms: Any) -> None:
    pa = [3, 3, 3]
    ref_a = reference_tokens(pa, 30)[0]
    bad = ref_a[4]
    pb = find_prompt(lambda p: bad not in p and bad not in reference_tokens(p, 40)[0], seed=3)
    # One forward a command, so the step after the failing one is in flight when it fails (auto runs
    # several for decodes; test_multi_step.py covers an error inside a command of several).
    eng = llms("async", options={"fail_on_token": bad}, num_scheduler_steps=1).engine
    spy = Spy(eng)
    res = run(eng, [("a", pa, greedy(30)), ("b", pb, greedy(40))])
    (toks_a, why_a), (toks_b, why_b) = tokens(res)["a"], tokens(res)["b"]
    assert why_a == why_b == "error"
    assert toks_a == ref_a[: ref_a.index(bad) + 1]  # nothing from the failed or the later step
    assert toks_b == reference_tokens(pb, 40)[0][: len(toks_b)]
    errors = [i for i, (_, r) in enumerate(spy.applied) if r.error is not None]
    assert errors and errors[0] < len(spy.applied) - 1  # a later step was in flight and drained
    assert eng.dead_reason is None
    pc = find_prompt(lambda p: bad not in p and bad not in reference_tokens(p, 10)[0], seed=4)
    assert tokens(run(eng, [("c", pc, greedy(10))])) == {"c": reference_tokens(pc, 10)}


def test_step_error_spares_requests_only_in_the_later_step(llms: Any) -> None:
    """A request first scheduled in the step after a failed one was not built on the failed step's
    state: its result is applied normally instead of being failed as collateral."""
    pa = [3, 3, 3]
    ref_a = reference_tokens(pa, 30)[0]
    j = 4
    bad = ref_a[j]
    assert bad not in ref_a[:j] and bad not in pa
    # "a" ends with the step whose input is the bad token, so it is absent from the next step.
    pc = find_prompt(lambda p: bad not in p and bad not in reference_tokens(p, 8)[0], seed=6)
    # One forward a command, so the step after the failing one is in flight when it fails (auto runs
    # several for decodes; test_multi_step.py covers an error inside a command of several).
    eng = llms("async", options={"fail_on_token": bad}, num_scheduler_steps=1).engine
    spy = Spy(eng)
    added = []

    def arrive(i: int) -> None:
        last = spy.dispatched[-1].out.command.entries if spy.dispatched else []
        if not added and any(e.request_id == "a" and e.start_pos == len(pa) + j for e in last):
            eng.add_request("c", pc, greedy(8))  # admitted in the step after the failing one
            added.append(i)

    res = run(eng, [("a", pa, greedy(j + 2))], before_step=arrive)
    assert added
    failed = next(o.command.step_id for o, r in spy.applied if r.error is not None)
    c_first = next(
        d.out.command.step_id for d in spy.dispatched if any(e.request_id == "c" for e in d.out.command.entries)
    )
    assert c_first == failed + 1
    assert tokens(res) == {"a": (ref_a[: j + 1], "error"), "c": reference_tokens(pc, 8)}


def test_request_error_discards_its_later_result(llms: Any) -> None:
    """NaN logits fail one request; its entry in the step already in flight is ignored."""
    pa = [3, 3, 3]
    ref_a = reference_tokens(pa, 30)[0]
    bad = ref_a[3]
    pb = find_prompt(lambda p: bad not in p and bad not in reference_tokens(p, 30)[0], seed=8)
    eng = llms("async", options={"nan_on_token": bad}, num_scheduler_steps=1).engine  # as the test above
    spy = Spy(eng)
    res = run(eng, [("a", pa, greedy(30)), ("b", pb, greedy(30))])
    assert tokens(res)["b"] == reference_tokens(pb, 30)
    toks_a, why_a = tokens(res)["a"]
    assert why_a == "error" and toks_a == ref_a[: ref_a.index(bad) + 1]
    failed = next(i for i, (_, r) in enumerate(spy.applied) if "a" in r.request_errors)
    assert any(e.request_id == "a" for e in spy.applied[failed + 1][0].command.entries)


# --------------------------------------------------------------------------- worker process


@pytest.mark.parametrize("k", [0, 2])
def test_process_worker_async_equals_sync(llms: Any, k: int) -> None:
    ps = prompts(5, seed=20)
    reqs = [(f"r{i}", p, greedy(24)) for i, p in enumerate(ps)]
    outs = {}
    for sched in ("sync", "async"):
        eng = llms(sched, k=k, err=0.3, worker_mode="process", num_kv_blocks=20, options={"eos": 5}).engine
        outs[sched] = tokens(run(eng, reqs))
    assert outs["async"] == outs["sync"] == {rid: reference_tokens(p, 24, eos=5) for rid, p, _ in reqs}


def test_worker_crash_with_two_steps_in_flight(llms: Any) -> None:
    pa = [3, 3, 3]
    bad = reference_tokens(pa, 30)[0][5]
    # One forward a command: a command of several that dies takes its earlier tokens with it.
    eng = llms("async", worker_mode="process", options={"crash_on_token": bad}, num_scheduler_steps=1).engine
    eng.add_request("a", pa, greedy(30))
    done = {}
    for _ in range(100):
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
        if "a" in done:
            break
    assert done["a"].outputs[0].finish_reason == "error"
    assert done["a"].outputs[0].token_ids == reference_tokens(pa, 30)[0][:6]  # up to the input that crashed
    assert eng.dead_reason is not None
    assert not eng.strategy.in_flight and not eng.scheduler.live_requests()
