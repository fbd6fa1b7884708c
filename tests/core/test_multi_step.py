"""Several decode forwards a command (``num_scheduler_steps``) on the fake executor: the tokens are
those of one forward a command, the worker really runs the forwards back to back, stops a request's
forwards at the token that ends it, leaves an error to the next command, runs one forward a command
while a request waits to be admitted, and ``auto`` bursts only while forwards are short. The
property tests (``test_engine_properties.py``) draw the setting beside chunking, preemption, prefix
caching and aborts. With the fake's ``greedy_steps`` option the greedy forwards after a command's
first run as one executor loop (``Executor.greedy_steps``), with the same tokens, stops and errors."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from pypto_serving import LLM, SamplingParams
from tests.conftest import plugin_installed
from tests.core.test_stop_strings import PROMPT, TableTokenizer, table
from tests.fakes import reference_tokens

pytest.importorskip("pypto_serving_sync_sched")

VOCAB = 97
SCHEDULERS = ["sync"] + (["async"] if plugin_installed("async_sched") else [])
PROMPTS = [[(7 * i + k) % VOCAB for k in range(5 + i)] for i in range(4)]


@pytest.fixture
def make(make_llm: Callable[..., LLM]) -> Callable[..., LLM]:
    """The shared ``make_llm`` (fake executor, in-process, sync) with blocks of 4 tokens."""
    return lambda **kw: make_llm(**{"block_size": 4, **kw})


def _forwards(llm: LLM) -> list[list[str]]:
    """Record the request ids of every forward the in-process worker's executor runs."""
    assert llm.engine is not None
    executor = llm.engine.worker._runner.executor  # type: ignore[union-attr]
    seen: list[list[str]] = []
    execute = executor.execute

    def counted(batch: Any) -> Any:
        seen.append(list(batch.request_ids))
        return execute(batch)

    executor.execute = counted
    return seen


def _executor(llm: LLM) -> Any:
    assert llm.engine is not None
    return llm.engine.worker._runner.executor  # type: ignore[union-attr]


def _commands(llm: LLM) -> list[Any]:
    """Record every command the engine submits to the worker."""
    engine = llm.engine
    assert engine is not None
    sent: list[Any] = []
    submit = engine.submit

    def recorded(out: Any) -> None:
        sent.append(out.command)
        submit(out)

    engine.submit = recorded  # type: ignore[method-assign]
    return sent


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_several_forwards_a_command_give_the_tokens_of_one(
    make: Callable[..., LLM], scheduler: str, fused: bool
) -> None:
    params = SamplingParams(temperature=0, max_tokens=13, stop_token_ids=[11])
    llm = make(scheduler=scheduler, num_scheduler_steps=4, executor_options={"eos": 5, "greedy_steps": fused})
    forwards, commands = _forwards(llm), _commands(llm)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        ref, reason = reference_tokens(prompt, 13, VOCAB, 5, (11,))
        assert (out.outputs[0].token_ids, out.outputs[0].finish_reason) == (ref, reason)
    # The decodes ran as several forwards each command: more forwards than commands, at most four a command.
    assert any(e.num_steps == 4 for c in commands for e in c.entries)
    assert len(forwards) + _executor(llm).greedy_forwards > len(commands)
    assert max(e.num_steps for c in commands for e in c.entries) == 4
    # Fused: a command of several forwards each ran whole in the executor's loop, its first forward too.
    assert (_executor(llm).greedy_forwards > len(PROMPTS)) == fused
    assert fused or len(forwards) > len(commands)
    one_by_one = sum(not all(e.num_steps > 1 for e in c.entries) for c in commands if c.entries)
    assert not fused or len(forwards) == one_by_one


@pytest.mark.parametrize(
    ("fused", "worker_mode", "scheduler"),
    [(False, "inproc", "sync"), (True, "inproc", "sync"), (True, "process", "sync")]
    + [(fused, "inproc", "async") for fused in (False, True) if "async" in SCHEDULERS],
)
def test_an_arrival_not_taken_ends_each_command_after_its_first_forward(
    make: Callable[..., LLM], fused: bool, worker_mode: str, scheduler: str
) -> None:
    """An arrival counted (``EngineCore.step_interrupt.arrive()``, here before the run, as a request
    arriving during one would count) and not taken: every command runs its first forward and no
    more, the forwards it leaves are given back, the tokens are the same; taken (``clear()``),
    commands run their forwards again. With a spawned worker the count lives in memory it shares
    with the engine."""
    llm = make(
        num_scheduler_steps=8, worker_mode=worker_mode, scheduler=scheduler, executor_options={"greedy_steps": fused}
    )
    assert llm.engine is not None and llm.engine.step_interrupt is not None
    commands, get_result = _commands(llm), llm.engine.worker.get_result
    results: list[Any] = []

    def recorded() -> Any:
        results.append(get_result())
        return results[-1]

    llm.engine.worker.get_result = recorded  # type: ignore[method-assign]
    params = SamplingParams(temperature=0, max_tokens=12)
    for arrived in (True, False):
        commands.clear()
        results.clear()
        if arrived:
            llm.engine.step_interrupt.arrive()
        else:
            llm.engine.step_interrupt.take()
        out = llm.generate([PROMPTS[1]], params, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == reference_tokens(PROMPTS[1], 12, VOCAB)[0]
        assert max(e.num_steps for c in commands for e in c.entries) == 8
        forwards = [r.num_forwards for r in results]
        assert forwards == [1] * 12 if arrived else max(forwards) == 8
    assert llm.engine.stats()["kv_usage"] == 0.0


@pytest.mark.parametrize("fused", [False, True])
def test_a_request_stops_its_forwards_at_the_token_that_ends_it(make: Callable[..., LLM], fused: bool) -> None:
    prompt = PROMPTS[0]
    ref, _ = reference_tokens(prompt, 12, VOCAB)
    eos = ref[2]  # the third output ends the request
    llm = make(num_scheduler_steps=8, executor_options={"eos": eos, "greedy_steps": fused})
    forwards = _forwards(llm)
    assert llm.engine is not None
    results: list[Any] = []
    wait = llm.engine.wait_result

    def recorded() -> Any:
        results.append(wait())
        return results[-1]

    llm.engine.wait_result = recorded  # type: ignore[method-assign]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0].outputs[0]
    assert (out.token_ids, out.finish_reason) == (ref[:3], "stop")
    # The prefill samples the first token; one command of 8 forwards then ran two and stopped at EOS
    # (fused: both in the executor's loop, which stopped there).
    assert (len(forwards), _executor(llm).greedy_forwards) == ((1, 2) if fused else (3, 0))
    assert [r.num_forwards for r in results] == [1, 2]  # what the scheduler times a forward by
    assert llm.engine is not None and not llm.engine.has_unfinished()
    pool = llm.engine.kv.pools["kv"]
    assert pool.num_free == pool.num_blocks


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_an_error_in_a_later_forward_is_met_by_the_next_command(
    make: Callable[..., LLM], scheduler: str, fused: bool
) -> None:
    """NaN logits at the fourth output: the forward that meets them inside a command reports
    nothing; the next command computes that position again and fails the request as one forward a
    command does, with the same tokens before."""
    prompt = PROMPTS[1]
    ref, _ = reference_tokens(prompt, 12, VOCAB)
    opts = {"nan_on_token": ref[3], "greedy_steps": fused}
    params = SamplingParams(temperature=0, max_tokens=12)
    got = []
    for steps in (1, 8):
        llm = make(scheduler=scheduler, num_scheduler_steps=steps, executor_options=opts)
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        got.append((out.outputs[0].token_ids, out.outputs[0].finish_reason, out.outputs[0].error))
    assert got[0] == got[1]
    assert got[0][1] == "error" and got[0][0] == ref[:4]
    assert (_executor(llm).greedy_forwards > 0) == fused


@pytest.mark.parametrize("fused", [False, True])
def test_a_request_ended_by_a_stop_string_is_not_failed_by_a_later_forward(
    make: Callable[..., LLM], fused: bool
) -> None:
    """A stop string ends the request at its third token (the engine's check, after the command);
    the worker's later forwards for it meet NaN logits at the sixth. Those forwards' error is not
    reported, so the request ends by its stop string as with one forward a command."""
    ref, _ = reference_tokens(PROMPT, 8, VOCAB)
    llm = make(num_scheduler_steps=8, executor_options={"nan_on_token": ref[4], "greedy_steps": fused})
    assert llm.engine is not None
    llm.engine.tokenizer = TableTokenizer(table())  # type: ignore[assignment]
    forwards = _forwards(llm)
    params = SamplingParams(temperature=0, max_tokens=8, stop=["STOP"], ignore_eos=True)
    out = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0]
    assert (out.text, out.token_ids, out.finish_reason) == ("abc", ref[:3], "stop")
    # The prefill, then five forwards of one command: the fifth met NaN (fused: four in the executor's
    # loop, which stopped before the NaN; that one then on its own).
    assert (len(forwards), _executor(llm).greedy_forwards) == ((2, 4) if fused else (6, 0))
    assert not llm.engine.has_unfinished()


@pytest.mark.parametrize("at", [0, 2])
def test_a_loop_that_raises_leaves_the_command_to_the_forwards_one_by_one(make: Callable[..., LLM], at: int) -> None:
    """The executor raises on the forward whose input is output ``at``: at a command's first forward
    (0) or inside its loop (2). The loop's tokens are dropped and the forwards run one by one, so the
    request ends as with one forward a command: the same tokens, then the error; no block is lost."""
    ref, _ = reference_tokens(PROMPTS[0], 10, VOCAB)
    params = SamplingParams(temperature=0, max_tokens=10)
    got = []
    for steps, fused in ((1, False), (4, True)):
        llm = make(num_scheduler_steps=steps, executor_options={"fail_on_token": ref[at], "greedy_steps": fused})
        out = llm.generate([PROMPTS[0]], params, use_tqdm=False)[0].outputs[0]
        got.append((out.token_ids, out.finish_reason))
        assert llm.engine is not None and not llm.engine.has_unfinished()
        pool = llm.engine.kv.pools["kv"]
        assert pool.num_free == pool.num_blocks
    assert got[0] == got[1] == (ref[: at + 1], "error")
    assert (_executor(llm).greedy_forwards > 0) == (at > 0)  # the loop ran forwards before the failing one


GREEDY_ONLY = {
    "greedy": SamplingParams(temperature=0, max_tokens=12),
    "sampled": SamplingParams(temperature=0.8, seed=3, max_tokens=12),
    "logprobs": SamplingParams(temperature=0, max_tokens=12, logprobs=2),
    "penalty": SamplingParams(temperature=0, max_tokens=12, repetition_penalty=1.3),
    "logit_bias": SamplingParams(temperature=0, max_tokens=12, logit_bias={3: 0.5}),
    "bad_words": SamplingParams(temperature=0, max_tokens=12, bad_words_token_ids=[[96, 95]]),
}


@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_only_requests_greedy_throughout_run_their_forwards_as_one_loop(
    make: Callable[..., LLM], scheduler: str
) -> None:
    """A request whose logits are read or edited (sampled, logprobs, a penalty, logit bias, bad words),
    or one beside it, runs its forwards one by one: same tokens and logprobs, no loop."""
    batches = [[name] for name in GREEDY_ONLY] + [["greedy", "sampled"]]
    for names in batches:
        prompts, params = PROMPTS[: len(names)], [GREEDY_ONLY[n] for n in names]
        got, loops = [], []
        for fused in (False, True):
            llm = make(scheduler=scheduler, num_scheduler_steps=4, executor_options={"greedy_steps": fused})
            outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
            got.append([(o.token_ids, o.logprobs) for o in outs])
            loops.append(_executor(llm).greedy_forwards)
        assert got[0] == got[1], names
        assert loops == [0, 11 if names == ["greedy"] else 0], names  # 11 outputs after the prefill's, looped


def test_min_tokens_bans_keep_forwards_one_by_one_while_they_last(make: Callable[..., LLM]) -> None:
    """EOS is banned until min_tokens outputs: those forwards run one by one (the loop would take the
    banned argmax), the forwards after them in the executor's loop; the tokens are those without it."""
    ref, _ = reference_tokens(PROMPTS[0], 12, VOCAB)
    params = SamplingParams(temperature=0, max_tokens=12, min_tokens=6)
    got = []
    for fused in (False, True):
        llm = make(num_scheduler_steps=4, executor_options={"eos": ref[2], "greedy_steps": fused})
        got.append(llm.generate([PROMPTS[0]], params, use_tqdm=False)[0].outputs[0].token_ids)
        loops = _executor(llm).greedy_forwards
    assert got[0] == got[1] and len(got[0]) >= 6 and ref[2] not in got[0][:6]
    assert got[0][:2] == ref[:2] and got[0][2] != ref[2]  # the ban took effect
    assert loops > 0


def test_a_waiting_request_gets_commands_of_one_forward(make: Callable[..., LLM]) -> None:
    llm = make(num_scheduler_steps=4, max_num_seqs=1)
    commands = _commands(llm)
    params = SamplingParams(temperature=0, max_tokens=10)
    outs = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    for prompt, out in zip(PROMPTS[:2], outs):
        assert out.outputs[0].token_ids == reference_tokens(prompt, 10, VOCAB)[0]
    first = [c for c in commands if any(e.request_id == outs[0].request_id for e in c.entries)]
    second = [c for c in commands if any(e.request_id == outs[1].request_id for e in c.entries)]
    # The first request runs while the second waits: one forward a command; the second runs alone: four.
    assert all(e.num_steps == 1 for c in first for e in c.entries)
    assert max(e.num_steps for c in second for e in c.entries) == 4


def test_auto_runs_several_forwards_on_the_cpu_while_they_are_short(make: Callable[..., LLM]) -> None:
    params = SamplingParams(temperature=0, max_tokens=12)
    steps = []
    # Forwards as many as fit in AUTO_STEPS_WITHIN_S = 50 ms at the last command's time per forward,
    # up to AUTO_STEPS = 64 and the tokens left: 4 of 10-12.5 ms each (3 where a loaded machine adds
    # more than 2.5 ms of host work a forward), where a command's time per forward counts every
    # forward it ran one by one (the fake offers no loop; before that counted only its first, 7 ran).
    for sleep in (0.0, 0.010):
        llm = make(device="cpu", executor_options={"step_sleep": sleep})  # auto runs several on the CPU
        commands = _commands(llm)
        out = llm.generate([PROMPTS[2]], params, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == reference_tokens(PROMPTS[2], 12, VOCAB)[0]
        steps.append(max(e.num_steps for c in commands for e in c.entries))
    assert steps[0] > steps[1] and steps[1] in (3, 4)
    # Decodes beside each other run several a command too; beside a prompt still computed in chunks
    # (8 tokens a step), one: its next chunk goes in the next command.
    llm = make(device="cpu", max_num_batched_tokens=8)
    commands = _commands(llm)
    long = [(3 * k + 1) % VOCAB for k in range(40)]
    outs = llm.generate([PROMPTS[0], long], [params, SamplingParams(temperature=0, max_tokens=20)], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [
        reference_tokens(PROMPTS[0], 12, VOCAB)[0],
        reference_tokens(long, 20, VOCAB)[0],
    ]
    prompt_len = {o.request_id: len(o.prompt_token_ids) for o in outs}
    chunked = [c for c in commands if any(e.start_pos < prompt_len[e.request_id] for e in c.entries)]
    assert len(chunked) >= 5 and any(len(c.entries) == 2 for c in chunked)
    assert all(e.num_steps == 1 for c in chunked for e in c.entries)
    assert max(e.num_steps for c in commands if len(c.entries) == 2 for e in c.entries) > 1


def test_several_forwards_a_command_refuse_speculation(make: Callable[..., LLM]) -> None:
    with pytest.raises(ValueError, match="num_scheduler_steps=4 cannot run: speculative decoding drafts"):
        make(
            num_scheduler_steps=4,
            speculative_config={"method": "fake", "num_speculative_tokens": 2},
            executor_options={"max_draft": 2},
        )
    with pytest.raises(ValueError, match="num_scheduler_steps=2 cannot run: its executor needs uniform batches"):
        make(num_scheduler_steps=2, executor_options={"uniform": True})


@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_a_lone_request_runs_its_one_forward_commands_as_the_executors_loop(
    make: Callable[..., LLM], scheduler: str
) -> None:
    """With one forward a command (``num_scheduler_steps=1``, or ``auto`` where forwards are long), a
    request running alone still takes the executor's greedy loop, one forward a call (on the CPU one C
    call instead of the interpreter between the kernels), with the same tokens; requests decoding
    together run their forwards through ``execute`` as ever."""
    llm = make(scheduler=scheduler, num_scheduler_steps=1, executor_options={"greedy_steps": True})
    executor, commands = _executor(llm), _commands(llm)
    out = llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=9), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == reference_tokens(PROMPTS[1], 9, VOCAB)[0]
    assert {e.num_steps for c in commands for e in c.entries} == {1}
    assert executor.greedy_forwards == 8  # every forward after the prefill's
    seen = _forwards(llm)
    outs = llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    for o, prompt in zip(outs, PROMPTS[:2], strict=True):
        assert o.outputs[0].token_ids == reference_tokens(prompt, 6, VOCAB)[0]
    assert any(len(ids) == 2 for ids in seen)
    assert llm.engine is not None and llm.engine.stats()["kv_usage"] == 0.0
