"""Scheduler unit tests, driven with synthetic step results on the fake executor's info."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest

from pypto_serving import ServingSettings
from pypto_serving.kv_cache import KVCacheManager
from pypto_serving.messages import StepResult
from pypto_serving.request import Request, RequestStatus, SamplingParams
from pypto_serving.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from pypto_serving.speculative import no_speculation
from tests.fakes import FakeExecutor

BLOCK = 4


def _policy_max(request: Request, max_k: int) -> int:
    return max_k


@pytest.fixture
def make_sched() -> Callable[..., Scheduler]:
    """``make_sched(num_blocks=.., executor_options=.., policy=.., **SchedulerConfig fields)``."""

    def make(
        num_blocks: int = 32,
        executor_options: dict[str, Any] | None = None,
        policy: Any = None,
        **cfg: Any,
    ) -> Scheduler:
        settings = ServingSettings(block_size=BLOCK, executor_options=executor_options or {})
        info = FakeExecutor(settings).load()
        kv = KVCacheManager(info.cache_groups, {"kv": num_blocks})
        cfg.setdefault("max_model_len", info.max_model_len)
        return Scheduler(SchedulerConfig(**cfg), kv, info, policy or no_speculation(settings))

    return make


def req(rid: str, n_prompt: int, max_tokens: int = 8, base: int = 1, **sp: Any) -> Request:
    return Request(rid, [(base + i) % 90 for i in range(n_prompt)], SamplingParams(max_tokens=max_tokens, **sp))


def step(s: Scheduler, token: int = 5, extra: dict[str, list[int]] | None = None) -> SchedulerOutput:
    """schedule -> a result sampling ``token`` (or ``extra[rid]``) for every sampling entry -> update."""
    out = s.schedule()
    assert out is not None, "nothing was scheduled"
    return answer(s, out, token, extra)


def answer(
    s: Scheduler, out: SchedulerOutput, token: int = 5, extra: dict[str, list[int]] | None = None
) -> SchedulerOutput:
    extra = extra or {}
    sampled = {e.request_id: extra.get(e.request_id, [token]) for e in out.command.entries if e.sample}
    s.update(out, StepResult(out.command.step_id, sampled=sampled))
    s.kv.check_invariants(s.live_requests())
    return out


def entry_ids(out: SchedulerOutput) -> list[str]:
    return [e.request_id for e in out.command.entries]


def n_tokens(out: SchedulerOutput) -> dict[str, int]:
    return {e.request_id: len(e.token_ids) + e.num_draft for e in out.command.entries}


def run_to_end(s: Scheduler, limit: int = 500) -> list[SchedulerOutput]:
    """Steps until nothing is left (a step where nothing runs, e.g. after a request failed while
    scheduling, sends nothing)."""
    outs = []
    for _ in range(limit):
        if not s.has_unfinished():
            break
        out = s.schedule()
        if out is not None:
            outs.append(answer(s, out))
    assert not s.has_unfinished(), "the scheduler does not make progress"
    assert all(p.num_free == p.num_blocks for p in s.kv.pools.values())
    return outs


# ----------------------------------------------------------------------------- budget & order


def test_token_budget_is_respected_and_filled(make_sched: Callable[..., Scheduler]) -> None:
    s = make_sched(max_num_batched_tokens=16)
    for i in range(3):
        s.add_request(req(f"r{i}", 10))
    out = step(s)
    assert n_tokens(out) == {"r0": 10, "r1": 6}  # FCFS, the second one chunked to the rest
    assert out.num_batched_tokens == 16
    for out in run_to_end(s):
        assert out.num_batched_tokens <= 16
        assert sum(n_tokens(out).values()) == out.num_batched_tokens


def test_max_num_seqs(make_sched: Callable[..., Scheduler]) -> None:
    s = make_sched(max_num_seqs=2)
    for i in range(4):
        s.add_request(req(f"r{i}", 3, max_tokens=2))
    out = step(s)
    assert entry_ids(out) == ["r0", "r1"]
    assert s.num_waiting == 2
    for out in run_to_end(s):
        assert len(out.command.entries) <= 2


def test_fcfs_order(make_sched: Callable[..., Scheduler]) -> None:
    s = make_sched(max_num_batched_tokens=4)
    for i in range(3):
        s.add_request(req(f"r{i}", 4, max_tokens=1))
    firsts: dict[str, int] = {}
    for n, out in enumerate(run_to_end(s)):
        for rid in entry_ids(out):
            firsts.setdefault(rid, n)
    assert firsts["r0"] < firsts["r1"] < firsts["r2"]


# ----------------------------------------------------------------------------- chunked prefill


def test_long_prefill_threshold_chunks(make_sched: Callable[..., Scheduler]) -> None:
    s = make_sched(long_prefill_token_threshold=4)
    s.add_request(req("a", 10, max_tokens=2))
    outs = [step(s) for _ in range(3)]
    assert [n_tokens(o)["a"] for o in outs] == [4, 4, 2]
    assert [o.command.entries[0].start_pos for o in outs] == [0, 4, 8]
    assert [o.command.entries[0].sample for o in outs] == [False, False, True]
    r = s.requests["a"]
    assert r.output_token_ids == [5] and r.num_computed_tokens == 10
    out = step(s)  # decode is not subject to the threshold cap; produces the last token
    assert n_tokens(out) == {"a": 1}
    assert not s.has_unfinished()


def test_threshold_lets_others_share_the_step(make_sched: Callable[..., Scheduler]) -> None:
    s = make_sched(long_prefill_token_threshold=4, max_num_batched_tokens=100)
    s.add_request(req("long", 20))
    s.add_request(req("short", 3))
    out = step(s)
    assert n_tokens(out) == {"long": 4, "short": 3}


def test_chunked_prefill_disabled_waits_for_room(make_sched: Callable[..., Scheduler]) -> None:
    s = make_sched(enable_chunked_prefill=False, max_num_batched_tokens=16)
    s.add_request(req("a", 10, max_tokens=3))
    s.add_request(req("b", 10, max_tokens=3))
    out = step(s)
    assert n_tokens(out) == {"a": 10}  # b is not split; it waits for a full-size slot
    for out in run_to_end(s):
        for e in out.command.entries:
            if e.start_pos == 0:
                assert len(e.token_ids) == 10


def test_chunked_prefill_disabled_rejects_prompt_over_budget(make_sched: Callable[..., Scheduler]) -> None:
    s = make_sched(enable_chunked_prefill=False, max_num_batched_tokens=8)
    with pytest.raises(ValueError, match="max_num_batched_tokens=8"):
        s.add_request(req("a", 9))
    s.add_request(req("b", 8))  # exactly the budget is fine


# ----------------------------------------------------------------------------- preemption


def test_preemption_picks_latest_arrival_and_resumes_it_first(make_sched: Callable[..., Scheduler]) -> None:
    s = make_sched(num_blocks=6)
    s.add_request(req("a", 8, max_tokens=10, base=1))
    s.add_request(req("b", 8, max_tokens=10, base=40))
    step(s)  # both prefilled: 2 blocks each
    while s.stats.num_preemptions == 0:
        step(s)
        assert s.requests["a"].status is RequestStatus.RUNNING
    b = s.requests["b"]
    assert b.status is RequestStatus.PREEMPTED
    assert s.waiting[0] is b and b.kv.block_ids == {} and b.num_computed_tokens == 0
    assert b.metrics.num_preemptions == 1
    produced_before = list(b.output_token_ids)
    assert produced_before
    s.add_request(req("c", 4, max_tokens=2, base=70))  # arrives after the preemption
    firsts: dict[str, int] = {}
    resumed_entry = None
    for n, out in enumerate(run_to_end(s)):
        ids = entry_ids(out)
        if "b" in ids and "c" in ids and n == firsts.get("b", n) == firsts.get("c", n):
            assert ids.index("b") < ids.index("c")
        for e in out.command.entries:
            firsts.setdefault(e.request_id, n)
            if e.request_id == "b" and resumed_entry is None:
                resumed_entry = e
                news = {nr.request_id: nr for nr in out.command.new_requests}
                assert news["b"].output_token_ids == produced_before  # the worker gets the history
    assert firsts["b"] <= firsts["c"]
    # Recompute covers prompt + the outputs it had (minus a prefix-cache hit on its prompt).
    assert resumed_entry is not None
    assert resumed_entry.start_pos == b.num_cached_tokens < b.num_prompt_tokens
    assert resumed_entry.token_ids == (b.prompt_token_ids + produced_before)[resumed_entry.start_pos :]


def test_preemption_victim_is_the_newest_even_if_it_is_scheduled_first(
    make_sched: Callable[..., Scheduler],
) -> None:
    s = make_sched(num_blocks=5)
    reqs = [req(f"r{i}", 4, max_tokens=12, base=10 * i) for i in range(3)]
    for r in reqs:
        s.add_request(r)
    step(s)
    while s.stats.num_preemptions == 0:
        step(s)
    assert reqs[2].status is RequestStatus.PREEMPTED
    assert reqs[0].status is RequestStatus.RUNNING
    run_to_end(s)
    assert all(len(r.output_token_ids) == 12 for r in reqs)


def test_a_victim_scheduled_earlier_in_the_step_leaves_the_step(make_sched: Callable[..., Scheduler]) -> None:
    """The newest request can be scheduled before an older one that then needs its blocks: it is
    preempted, and its entry must leave the step, or two entries would write KV into one block."""
    s = make_sched(num_blocks=5)
    reqs = [req(f"r{i}", 4, max_tokens=12, base=10 * i) for i in range(3)]
    for r in reqs:
        s.add_request(r)
    step(s)
    s.running.insert(0, s.running.pop())  # the newest first: it is scheduled before the others
    saw_victim_step = False
    while s.has_unfinished():
        before = s.stats.num_preemptions
        out = step(s)
        owners: dict[int, str] = {}
        for r in s.running:
            for b in r.kv.block_ids.get("kv", []):
                assert owners.setdefault(b, r.request_id) == r.request_id, f"block {b} in two requests"
        preempted = [r.request_id for r in reqs if r.status is RequestStatus.PREEMPTED]
        assert not set(preempted) & set(entry_ids(out))
        assert out.num_batched_tokens == sum((len(e.token_ids) or 1) + e.num_draft for e in out.command.entries)
        saw_victim_step |= s.stats.num_preemptions > before and "r2" in preempted
    assert saw_victim_step
    assert all(len(r.output_token_ids) == 12 for r in reqs)


def test_request_too_big_for_the_whole_cache_fails_alone(make_sched: Callable[..., Scheduler]) -> None:
    s = make_sched(num_blocks=2)
    r = req("a", 6, max_tokens=8)
    s.add_request(r)
    run_to_end(s)
    assert r.status is RequestStatus.FINISHED_ERROR
    assert "too small" in (r.error or "")


# ----------------------------------------------------------------------------- abort


def _all_free(s: Scheduler) -> bool:
    return all(p.num_free == p.num_blocks for p in s.kv.pools.values())


def test_abort_waiting(make_sched: Callable[..., Scheduler]) -> None:
    s = make_sched()
    s.add_request(req("a", 5))
    assert [r.request_id for r in s.abort(["a"])] == ["a"]
    assert not s.has_unfinished() and "a" not in s.requests
    assert s.schedule() is None
    assert s.abort(["a", "unknown"]) == []  # idempotent


def test_abort_running_frees_and_tells_the_worker(make_sched: Callable[..., Scheduler]) -> None:
    s = make_sched()
    a, b = req("a", 5, max_tokens=20), req("b", 5, max_tokens=3, base=30)
    s.add_request(a)
    s.add_request(b)
    step(s)
    step(s)
    s.abort(["a"])
    assert a.status is RequestStatus.FINISHED_ABORTED and a.finish_reason == "abort"
    assert a.kv.block_ids == {}
    s.kv.check_invariants(s.live_requests())
    out = step(s)
    assert "a" in out.command.finished_ids and entry_ids(out) == ["b"]
    run_to_end(s)


def test_abort_mid_prefill_discards_the_in_flight_result(make_sched: Callable[..., Scheduler]) -> None:
    s = make_sched(long_prefill_token_threshold=4)
    a = req("a", 12)
    s.add_request(a)
    step(s)
    out = s.schedule()  # second chunk in flight
    s.abort(["a"])
    touched = s.update(out, StepResult(out.command.step_id))
    assert touched == [] and a.output_token_ids == []
    assert _all_free(s)
    s.kv.check_invariants(s.live_requests())


def test_abort_with_sample_in_flight(make_sched: Callable[..., Scheduler]) -> None:
    s = make_sched()
    a = req("a", 4)
    s.add_request(a)
    out = s.schedule()
    s.abort(["a"])
    assert s.update(out, StepResult(out.command.step_id, sampled={"a": [9]})) == []
    assert a.output_token_ids == [] and _all_free(s)


# ----------------------------------------------------------------------------- uniform batches


def _kinds(out: SchedulerOutput) -> set[str]:
    kinds = set()
    for r, e in zip(out.requests, out.command.entries):
        n = len(e.token_ids) or 1
        decode = n == 1 and e.start_pos >= r.num_prompt_tokens
        kinds.add("decode" if decode else "prefill")
    return kinds


@pytest.mark.parametrize("uniform", [True, False])
def test_uniform_batches(make_sched: Callable[..., Scheduler], uniform: bool) -> None:
    s = make_sched(executor_options={"uniform": uniform}, max_num_batched_tokens=8)
    s.add_request(req("a", 6, max_tokens=6))
    step(s)
    s.add_request(req("b", 12, max_tokens=3, base=20))
    s.add_request(req("c", 3, max_tokens=3, base=50))
    mixed = False
    for out in run_to_end(s):
        mixed |= len(_kinds(out)) > 1
    assert mixed is not uniform


# ----------------------------------------------------------------------------- speculative capacity


def test_spec_policy_reserves_draft_capacity(make_sched: Callable[..., Scheduler]) -> None:
    s = make_sched(executor_options={"max_draft": 3}, policy=_policy_max)
    a = req("a", 6, max_tokens=20)
    s.add_request(a)
    first = step(s)
    assert first.command.entries[0].num_draft == 0  # no drafts for a prefill
    before = a.num_computed_tokens
    out = s.schedule()
    (e,) = out.command.entries
    assert e.num_draft == 3
    assert a.num_output_placeholders == 4
    assert len(a.kv.block_ids["kv"]) == math.ceil((before + 1 + 3) / BLOCK)
    assert out.num_batched_tokens == 4
    # one draft accepted (two tokens back): two rejected positions are given back
    s.update(out, StepResult(out.command.step_id, sampled={"a": [11, 12]}))
    assert a.output_token_ids[-2:] == [11, 12]
    assert a.num_computed_tokens == before + 2
    assert a.num_output_placeholders == 0
    s.kv.check_invariants(s.live_requests())
    out = s.schedule()
    assert out.command.entries[0].rejected_seen == 2


def test_spec_capacity_capped_by_max_tokens(make_sched: Callable[..., Scheduler]) -> None:
    s = make_sched(executor_options={"max_draft": 3}, policy=_policy_max)
    a = req("a", 6, max_tokens=3)
    s.add_request(a)
    step(s)  # one output
    out = s.schedule()
    assert out.command.entries[0].num_draft == 1  # 2 tokens left: the bonus token + 1 draft
    s.update(out, StepResult(out.command.step_id, sampled={"a": [1, 2]}))
    assert a.status is RequestStatus.FINISHED_LENGTH and len(a.output_token_ids) == 3


def test_spec_capacity_capped_by_budget(make_sched: Callable[..., Scheduler]) -> None:
    s = make_sched(executor_options={"max_draft": 3}, policy=_policy_max, max_num_batched_tokens=6)
    a = req("a", 6, max_tokens=10)
    s.add_request(a)
    step(s)
    s.add_request(req("b", 4, max_tokens=2, base=30))
    out = s.schedule()
    # a's decode takes 1 + 3; b gets the remaining 2 (chunked)
    assert n_tokens(out) == {"a": 4, "b": 2}
    s2 = make_sched(executor_options={"max_draft": 3}, policy=_policy_max, max_num_batched_tokens=2)
    a2 = req("a", 2, max_tokens=10)
    s2.add_request(a2)
    step(s2)
    out = s2.schedule()
    assert out.command.entries[0].num_draft == 1


def test_no_drafts_without_executor_support(make_sched: Callable[..., Scheduler]) -> None:
    s = make_sched(policy=_policy_max)
    s.add_request(req("a", 4, max_tokens=5))
    for out in run_to_end(s):
        assert all(e.num_draft == 0 for e in out.command.entries)


# ----------------------------------------------------------------------------- admission errors


def test_prompt_too_long(make_sched: Callable[..., Scheduler]) -> None:
    s = make_sched(max_model_len=16)
    with pytest.raises(ValueError, match="max_model_len is 16"):
        s.add_request(req("a", 16))
    s.add_request(req("ok", 15))


def test_prompt_larger_than_cache(make_sched: Callable[..., Scheduler]) -> None:
    s = make_sched(num_blocks=2)
    with pytest.raises(ValueError, match="does not fit in the whole KV cache"):
        s.add_request(req("a", 8))  # 8 prompt + 1 output > 2 blocks of 4


def test_duplicate_request_id(make_sched: Callable[..., Scheduler]) -> None:
    s = make_sched()
    s.add_request(req("a", 3))
    with pytest.raises(ValueError, match="already in use"):
        s.add_request(req("a", 3))


def test_stop_conditions(make_sched: Callable[..., Scheduler]) -> None:
    s = make_sched()
    eos = Request("eos", [1, 2], SamplingParams(max_tokens=5), eos_token_ids=(7,))
    stop = req("stop", 2, max_tokens=5, stop_token_ids=[8])
    ignore = Request("ign", [1, 2], SamplingParams(max_tokens=2, ignore_eos=True), eos_token_ids=(7,))
    mint = Request("min", [1, 2], SamplingParams(max_tokens=5, min_tokens=2), eos_token_ids=(7,))
    for r in (eos, stop, ignore, mint):
        s.add_request(r)
    step(s, extra={"eos": [7], "stop": [8], "ign": [7], "min": [7]})
    assert eos.status is RequestStatus.FINISHED_EOS and eos.finish_reason == "stop"
    assert stop.status is RequestStatus.FINISHED_STOP and stop.stop_reason == 8
    assert not ignore.is_finished and not mint.is_finished
    step(s, extra={"ign": [7], "min": [7]})
    assert ignore.status is RequestStatus.FINISHED_LENGTH
    assert mint.status is RequestStatus.FINISHED_EOS and len(mint.output_token_ids) == 2


def test_a_decode_step_message_grows_with_changes_not_with_blocks(make_sched: Callable[..., Scheduler]) -> None:
    """Entries carry only the blocks appended since the request's previous entry: with 8 running
    decodes, the encoded step message is (but for wider position integers) as large at 8 blocks per
    request as at 256, and a request
    that crosses a block boundary adds exactly its one new block."""
    import msgspec

    def decode_message(prompt_len: int) -> tuple[int, list[dict[str, list[int]]]]:
        s = make_sched(
            num_blocks=8 * (prompt_len // BLOCK + 8),
            max_num_batched_tokens=8 * prompt_len,
            max_num_seqs=8,
            max_model_len=2 * prompt_len,
        )
        for i in range(8):
            s.add_request(req(f"r{i}", prompt_len - 1, max_tokens=16))
        step(s)  # the prompts: every block so far goes out once
        out = step(s)  # the first decode of each: fills the last prompt slot, needs no new block
        return len(msgspec.msgpack.encode(out.command)), [e.new_block_ids for e in out.command.entries]

    small, small_blocks = decode_message(8 * BLOCK)
    big, big_blocks = decode_message(256 * BLOCK)
    assert small_blocks == big_blocks == [{}] * 8
    # Only the position integers grow (msgpack widens 32 -> 1024 by two bytes each); resending the
    # tables would add 8 x 256 block ids, kilobytes.
    assert big - small <= 8 * 4, (small, big)

    s = make_sched(num_blocks=16, max_num_seqs=1)
    s.add_request(req("a", BLOCK, max_tokens=8))
    first = step(s).command.entries[0].new_block_ids["kv"]
    crossing = step(s).command.entries[0].new_block_ids  # token BLOCK + 1 opens the second block
    assert len(first) == 1 and len(crossing["kv"]) == 1 and crossing["kv"] != first


# ----------------------------------------------------------------------------- random workloads

TEXT_STOP = 11  # the fake detokenizer "finds a stop string" in this token's text


def _sched_for(options: dict[str, Any], num_blocks: int, prefix_caching: bool) -> Scheduler:
    settings = ServingSettings(block_size=BLOCK, executor_options=options)
    info = FakeExecutor(settings).load()
    budget = 24
    kv = KVCacheManager(
        info.cache_groups, {"kv": num_blocks}, enable_prefix_caching=prefix_caching, max_step_tokens=budget
    )
    policy = _policy_max if options.get("max_draft") else no_speculation(settings)
    cfg = SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=budget, max_model_len=40)

    def text_stop(r: Request) -> str | None:
        """A detokenizer stand-in: it must be asked once per committed token, in order."""
        seen = r.out.detokenizer or 0
        assert seen == len(r.output_token_ids) - 1, "a token was committed without the stop-string check"
        r.out.detokenizer = seen + 1
        n = len(r.output_token_ids)
        return "<stop>" if r.output_token_ids[-1] == TEXT_STOP and n >= r.sampling_params.min_tokens else None

    return Scheduler(cfg, kv, info, policy, text_stop=text_stop)


def _random_result(rng: Any, out: SchedulerOutput) -> StepResult:
    """The worker's answer: 1 + accepted tokens per sampling entry from a small vocabulary (so EOS,
    stop ids and the stop string come up), sometimes logprobs, sometimes one request's error."""
    sampled = {
        e.request_id: [rng.randrange(12) for _ in range(1 + rng.randint(0, e.num_draft))]
        for e in out.command.entries
        if e.sample
    }
    logprobs = {rid: [{t: -1.0} for t in toks] for rid, toks in sampled.items()} if rng.random() < 0.1 else {}
    errors = {rng.choice(list(sampled)): "boom"} if sampled and rng.random() < 0.05 else {}
    return StepResult(out.command.step_id, sampled=sampled, logprobs=logprobs, request_errors=errors)


def _drive(s: Scheduler, seed: int, in_flight: int) -> list[Request]:
    """A seeded workload of arrivals (shared prefixes), aborts, stop strings and preemptions (a
    small cache), with ``in_flight`` steps scheduled ahead of their results, run to the end."""
    import random

    rng = random.Random(seed)
    prefixes = [[rng.randrange(1, 90) for _ in range(rng.randint(0, 9))] for _ in range(2)]
    reqs: list[Request] = []
    pending: list[SchedulerOutput] = []
    n = 0
    while n < 40 or s.has_unfinished() or pending:
        if n < 40 and rng.random() < 0.35:
            prompt = rng.choice(prefixes) + [rng.randrange(1, 90) for _ in range(rng.randint(1, 10))]
            max_tokens = rng.randint(1, 14)
            sp = SamplingParams(
                max_tokens=max_tokens,
                min_tokens=rng.randint(0, min(2, max_tokens)),
                stop_token_ids=rng.sample(range(12), rng.randint(0, 1)),
                ignore_eos=rng.random() < 0.5,
                stop=["<stop>"] if rng.random() < 0.5 else [],
            )
            reqs.append(Request(f"r{n}", prompt, sp, eos_token_ids=(rng.randrange(12),)))
            s.add_request(reqs[-1])
        live = s.live_requests()
        if live and rng.random() < 0.06:
            s.abort([rng.choice(live).request_id])
        out = s.schedule()
        if out is not None:
            pending.append(out)
        if pending and (len(pending) > in_flight or out is None):
            done = pending.pop(0)
            s.update(done, _random_result(rng, done))
        s.kv.check_invariants(s.live_requests())
        n += 1
        assert n < 2000, "no progress"
    assert all(p.num_free == p.num_blocks for p in s.kv.pools.values())
    return reqs


def _check_stop_rule(r: Request) -> None:
    """The request ended where the stop rule says, and nothing after that token was committed."""
    sp, out = r.sampling_params, r.output_token_ids
    assert r.is_finished and len(out) <= (sp.max_tokens or 40)
    assert len(r.output_logprobs) <= len(out)

    def ends(i: int) -> bool:  # output i (0-based) ends the request by a token or the stop string
        eligible = i + 1 >= sp.min_tokens
        by_token = out[i] in sp.stop_token_ids or (out[i] in r.eos_token_ids and not sp.ignore_eos)
        return eligible and (by_token or (out[i] == TEXT_STOP and bool(sp.stop)))

    assert not any(ends(i) for i in range(len(out) - 1)), (r.request_id, out)
    if r.status is RequestStatus.FINISHED_STOP:
        assert ends(len(out) - 1)
        expected = "<stop>" if out[-1] == TEXT_STOP and sp.stop else out[-1]
        assert r.stop_reason == expected
    elif r.status is RequestStatus.FINISHED_EOS:
        assert ends(len(out) - 1) and out[-1] in r.eos_token_ids and r.stop_reason is None
    elif r.status is RequestStatus.FINISHED_LENGTH:
        assert len(out) == min(sp.max_tokens or 40, 40 - r.num_prompt_tokens)
        assert not ends(len(out) - 1)


@pytest.mark.parametrize(
    "options",
    [{}, {"uniform": True}, {"barrier": True}, {"max_draft": 2}, {"window": 8}],
    ids=["plain", "uniform", "barrier", "drafts", "window"],
)
@pytest.mark.parametrize("in_flight", [1, 2], ids=["sync", "async"])
def test_random_workloads_end_where_the_stop_rule_says(options: dict[str, Any], in_flight: int) -> None:
    """Over seeded workloads (arrivals, aborts, preemptions, drafts, errors), every request ends by
    the one stop rule at the first token that ends it, the stop-string check sees each committed
    token once and in order (so nothing after a stop string is committed, nothing is taken back),
    and the block pool is consistent after every step and empty at the end."""
    statuses = set()
    for seed in range(12):
        num_blocks = 10 + seed % 3 * 6  # small caches preempt
        for r in _drive(_sched_for(options, num_blocks, seed % 2 == 0), seed, in_flight):
            _check_stop_rule(r)
            statuses.add(r.status)
    assert {RequestStatus.FINISHED_STOP, RequestStatus.FINISHED_EOS, RequestStatus.FINISHED_LENGTH} <= statuses


def test_a_step_with_nothing_to_run_is_none_and_keeps_the_news_for_the_next(
    make_sched: Callable[..., Scheduler],
) -> None:
    """Nothing runnable: ``schedule()`` returns None and keeps what the worker is to be told (the
    finished ids) for the next command, so no caller has to put anything back."""
    s = make_sched()
    a = req("a", 5, max_tokens=20)
    s.add_request(a)
    step(s)
    s.abort(["a"])
    assert s.schedule() is None
    assert s.schedule() is None
    s.add_request(req("b", 3))
    out = s.schedule()
    assert out is not None and out.command.finished_ids == ["a"] and entry_ids(out) == ["b"]
    assert out.command.step_id == 1  # ids count the commands sent, not the calls
