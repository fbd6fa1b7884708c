"""``use_last_sampled`` is a typed field, never a sentinel token id, and the worker refuses to guess."""

from __future__ import annotations

import random
import typing

import msgspec
import pytest

pytest.importorskip("pypto_serving_async_sched")

from pypto_serving import SamplingParams
from pypto_serving.config import ServingSettings
from pypto_serving.messages import NewRequestData, ScheduledEntry, StepCommand, wire_sampling
from pypto_serving.runner import MissingSampledTokenError, ModelRunner
from tests.fakes import FakeExecutor, next_token

from .helpers import VOCAB, Spy, make_llm, run


def test_entry_field_is_a_bool() -> None:
    hints = typing.get_type_hints(ScheduledEntry)
    assert hints["use_last_sampled"] is bool
    assert hints["token_ids"] == list[int]
    e = ScheduledEntry(
        request_id="r",
        token_ids=[],
        use_last_sampled=True,
        num_draft=2,
        start_pos=7,
        rejected_seen=1,
        new_block_ids={"kv": [3, 4]},
        sample=True,
    )
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(e), type=ScheduledEntry)
    assert back == e and back.use_last_sampled is True and back.token_ids == []


@pytest.mark.parametrize("k", [0, 2])
def test_no_entry_carries_a_negative_token(k: int) -> None:
    """Across pipelined decodes, drafts, chunked prefill and preemption, every entry's token ids are
    real vocabulary ids, and an entry whose input is in flight carries the flag and no ids."""
    rng = random.Random(k)
    llm = make_llm("async", k=k, err=0.4, num_kv_blocks=14, max_num_batched_tokens=8)
    try:
        eng = llm.engine
        spy = Spy(eng)
        reqs = [
            (
                f"r{i}",
                [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 15))],
                SamplingParams(temperature=0.0, max_tokens=20),
            )
            for i in range(6)
        ]
        run(eng, reqs)
        entries = list(spy.entries())
        assert eng.stats()["num_preemptions"] > 0
        assert sum(e.use_last_sampled for e in entries) > 20
        for e in entries:
            assert all(0 <= t < VOCAB for t in e.token_ids), e
            if e.use_last_sampled:
                assert e.token_ids == [] and e.sample
            else:
                assert e.token_ids
    finally:
        llm.shutdown()


@pytest.fixture
def runner() -> ModelRunner:
    settings = ServingSettings.load(executor="fake", block_size=4, executor_options={})
    r = ModelRunner(FakeExecutor(settings), settings)
    r.load()
    r.init_kv_cache({"kv": 8})
    return r


def _new(rid: str, prompt: list[int], outputs: list[int] | None = None) -> NewRequestData:
    return NewRequestData(
        request_id=rid,
        prompt_token_ids=prompt,
        output_token_ids=list(outputs or []),
        sampling=wire_sampling(SamplingParams(temperature=0.0), ()),
        seed=0,
    )


def _entry(
    rid: str, tokens: list[int], use_last: bool, start: int, blocks: dict[str, list[int]], sample: bool = True
) -> ScheduledEntry:
    """An entry without drafts."""
    return ScheduledEntry(
        request_id=rid,
        token_ids=tokens,
        use_last_sampled=use_last,
        num_draft=0,
        start_pos=start,
        rejected_seen=0,
        new_block_ids=blocks,
        sample=sample,
    )


def test_use_last_sampled_without_a_sampled_token_is_a_clear_error(runner: ModelRunner) -> None:
    prompt = [5, 6, 7]
    blocks = {"kv": [0, 1]}
    # The prefill has not sampled anything yet, so a decode cannot use "the last sampled token".
    bad = _entry("x", [], True, 3, blocks)
    assert runner.step(StepCommand(0, [_new("x", prompt)], [], [])).error is None
    with pytest.raises(MissingSampledTokenError, match=r"'x'.*last sampled token"):
        runner._build_batch([bad])
    # Through step() the error comes back as the step's error, naming the type.
    res = runner.step(StepCommand(1, [], [bad], []))
    assert res.error is not None and res.error.startswith("MissingSampledTokenError") and "'x'" in res.error
    # A non-sampling prefill chunk still leaves nothing to use.
    chunk = _entry("x", prompt[:2], False, 0, blocks, sample=False)
    assert runner.step(StepCommand(2, [], [chunk], [])).error is None
    assert runner.step(StepCommand(3, [], [bad], [])).error.startswith("MissingSampledTokenError")


def test_use_last_sampled_resolves_the_workers_token(runner: ModelRunner) -> None:
    """The pipelined pair (prefill, then a decode using the in-flight token) equals the explicit one."""
    prompt = [5, 6, 7]
    blocks = {"kv": [0, 1]}
    r0 = runner.step(StepCommand(0, [_new("x", prompt)], [_entry("x", prompt, False, 0, blocks)], []))
    first = r0.sampled["x"]
    assert first == [next_token(prompt, VOCAB)]
    r1 = runner.step(StepCommand(1, [], [_entry("x", [], True, 3, blocks)], []))
    assert r1.error is None and r1.sampled["x"] == [next_token([*prompt, *first], VOCAB)]
    # A resumed request (preempted, outputs known) may also use its last output right away.
    runner.step(StepCommand(2, [_new("y", prompt, first)], [], ["x"]))
    r3 = runner.step(StepCommand(3, [], [_entry("y", [*prompt, *first], False, 0, blocks)], []))
    assert r3.sampled["y"] == r1.sampled["x"]


def test_finished_request_state_is_forgotten(runner: ModelRunner) -> None:
    prompt = [1, 2]
    blocks = {"kv": [0]}
    runner.step(StepCommand(0, [_new("x", prompt)], [_entry("x", prompt, False, 0, blocks)], []))
    runner.step(StepCommand(1, [], [], ["x"]))
    res = runner.step(StepCommand(2, [], [_entry("x", [], True, 2, blocks)], []))
    assert res.error is not None and "no state for request 'x'" in res.error
