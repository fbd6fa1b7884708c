"""The worker's overlap of steps: while step N is between its two parts (forward and sampler queued,
sampled tokens not read yet), step N+1's admissions and blocks are staged if N+1 is already in the
pipe. These tests drive the worker's real command loop (``_serve_steps``) over a real pipe, on a
thread of this process (and once in a spawned worker), and check when staging happens, that it falls
back to the plain order where it must, and that every output equals the plain order's."""

from __future__ import annotations

import multiprocessing as mp
import threading
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch.overrides import TorchFunctionMode

from pypto_serving import LLM, BatchInput, CacheGroupSpec, Executor, ExecutorInfo, SamplingParams, ServingSettings
from pypto_serving.messages import (
    NewRequestData,
    ScheduledEntry,
    Shutdown,
    StepCommand,
    StepResult,
    WorkerCommand,
    wire_sampling,
)
from pypto_serving.runner import ModelRunner
from pypto_serving.worker import _serve_steps
from tests.conftest import plugin_installed
from tests.core.test_engine_properties import (
    PROPS,
    Job,
    _seeded,
    blocks_alone,
    check_against_reference,
    run,
    workloads,
)

VOCAB = 13
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(StepResult)


# ----------------------------------------------------------------------------- runner-level steps


class HostReads(TorchFunctionMode):
    """Calls ``on_read()`` at every read of tensor values back to the host (the step's sampled tokens)."""

    def __init__(self, on_read: Callable[[], None]) -> None:
        super().__init__()
        self.on_read = on_read

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in (torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.numpy):
            self.on_read()
        return func(*args, **(kwargs or {}))


class TokenExecutor(Executor):
    """Logits that favour ``(input token + 1) % VOCAB`` at each sampled row, made with tensor ops
    only (nothing read back), and a log of the forwards and releases."""

    def __init__(self, log: list[tuple[str, Any]]) -> None:
        self.log = log

    def load(self) -> ExecutorInfo:
        self.device = torch.device("cpu")
        return ExecutorInfo(
            cache_groups=[CacheGroupSpec("kv", 4, bytes_per_block=64)], vocab_size=VOCAB, max_model_len=64
        )

    def init_kv_cache(self, num_blocks: dict[str, int]) -> None:
        pass

    def execute(self, batch: BatchInput) -> torch.Tensor:
        self.log.append(("forward", tuple(batch.request_ids)))
        last = batch.input_ids.index_select(0, batch.logits_indices)
        return torch.nn.functional.one_hot((last + 1) % VOCAB, VOCAB).float() * 10.0

    def release(self, request_ids: list[str]) -> None:
        self.log.append(("release", tuple(request_ids)))


def _runner(log: list[tuple[str, Any]]) -> ModelRunner:
    runner = ModelRunner(TokenExecutor(log), ServingSettings.load(executor="fake", block_size=4))
    runner.load()
    return runner


def _new(rid: str, prompt: list[int], outputs: list[int] | None = None) -> NewRequestData:
    sp = SamplingParams(temperature=0.0) if outputs is None else SamplingParams(temperature=0.9)
    return NewRequestData(
        request_id=rid, prompt_token_ids=prompt, output_token_ids=outputs or [], sampling=wire_sampling(sp, ()), seed=7
    )


def _entry(rid: str, tokens: list[int], start: int, blocks: list[int]) -> ScheduledEntry:
    """A prefill chunk of ``tokens``, or with no tokens a decode of the last sampled token."""
    return ScheduledEntry(
        request_id=rid,
        token_ids=tokens,
        use_last_sampled=not tokens,
        num_draft=0,
        start_pos=start,
        rejected_seen=0,
        new_block_ids={"kv": blocks},
        sample=True,
    )


def _snapshot(runner: ModelRunner) -> dict[str, int]:
    """The requests the runner holds and how many kv blocks each has."""
    ib = runner.input_batch
    return {rid: int(ib.tables["kv"].num_blocks[row]) for rid, row in ib.row_of.items()} | {
        rid: -1 for rid in runner.states if rid not in ib.row_of
    }


def _serve(cmds: list[StepCommand], *, ahead: bool) -> tuple[list[StepResult], list[tuple[str, Any]], ModelRunner]:
    """Run ``cmds`` through the worker's command loop in this thread (where ``HostReads`` sees the
    reads). ``ahead``: every command is in the pipe before the loop starts (as the async strategy
    sends them); else each is sent only once the previous result is back (nothing can be staged).
    Returns the results, the log of forwards, host reads (with the runner's requests and blocks at
    that moment) and releases, and the runner."""
    log: list[tuple[str, Any]] = []
    runner = _runner(log)
    engine, worker = mp.Pipe()
    results: list[StepResult] = []

    def engine_side() -> None:
        for cmd in cmds[1:]:
            results.append(_decoder.decode(engine.recv_bytes()))
            engine.send_bytes(_encoder.encode(cmd))
        results.append(_decoder.decode(engine.recv_bytes()))
        engine.send_bytes(_encoder.encode(Shutdown()))

    for msg in cmds if ahead else cmds[:1]:
        engine.send_bytes(_encoder.encode(msg))
    if ahead:
        engine.send_bytes(_encoder.encode(Shutdown()))
        with HostReads(lambda: log.append(("read", _snapshot(runner)))):
            _serve_steps(worker, runner)
        results = [_decoder.decode(engine.recv_bytes()) for _ in cmds]
    else:
        t = threading.Thread(target=engine_side, daemon=True)
        t.start()
        with HostReads(lambda: log.append(("read", _snapshot(runner)))):
            _serve_steps(worker, runner)
        t.join(10)
        assert not t.is_alive()
    return results, log, runner


def _three_steps() -> list[StepCommand]:
    """Step 0 prefills ``a``; step 1 admits ``b`` and gives ``a`` a block for its decode; step 2
    finishes ``a`` (it may still be in step 1's rows) and decodes ``b``."""
    return [
        StepCommand(0, [_new("a", [1, 2, 3])], [_entry("a", [1, 2, 3], 0, [5])], []),
        StepCommand(1, [_new("b", [7, 8])], [_entry("a", [], 3, [6]), _entry("b", [7, 8], 0, [9])], []),
        StepCommand(2, [], [_entry("b", [], 2, [])], ["a"]),
    ]


def _plain(cmds: list[StepCommand]) -> list[StepResult]:
    runner = _runner([])
    return [runner.step(c) for c in cmds]


def _tokens(results: list[StepResult]) -> list[Any]:
    for r in results:
        assert r.error is None, r.error
    return [(r.step_id, r.sampled, r.request_errors) for r in results]


def test_the_next_steps_admissions_and_blocks_are_staged_before_the_host_read() -> None:
    """With step N+1 in the pipe, its new request and blocks are in the runner when step N reads
    its sampled tokens, its finished request is still there (released only after that read), and
    every forward follows the read before it."""
    results, log, _ = _serve(_three_steps(), ahead=True)
    assert log == [
        ("forward", ("a",)),
        ("read", {"a": 2, "b": 1}),  # step 1's b admitted, a's block for step 1 appended
        ("forward", ("a", "b")),
        ("read", {"a": 2, "b": 1}),  # step 2 finishes a: a stays until step 1 is read
        ("release", ("a",)),
        ("forward", ("b",)),
        ("read", {"b": 1}),
    ]
    assert (
        _tokens(results)
        == _tokens(_plain(_three_steps()))
        == [(0, {"a": [4]}, {}), (1, {"a": [5], "b": [9]}, {}), (2, {"b": [10]}, {})]
    )
    # Staging time is the staged step's: the first step has none.
    assert all(r.execute_seconds > 0 for r in results)


def test_a_step_not_yet_in_the_pipe_runs_after_the_host_read() -> None:
    results, log, _ = _serve(_three_steps(), ahead=False)
    assert log == [
        ("forward", ("a",)),
        ("read", {"a": 1}),  # nothing of step 1 yet
        ("forward", ("a", "b")),
        ("read", {"a": 2, "b": 1}),
        ("release", ("a",)),
        ("forward", ("b",)),
        ("read", {"b": 1}),
    ]
    assert _tokens(results) == _tokens(_plain(_three_steps()))


def _readmitted() -> list[StepCommand]:
    """``a`` is preempted while step 0 runs, and step 1 admits it again (it resumes from its first
    output, sampled) while the worker still holds its old row, with ``b`` behind it."""
    return [
        StepCommand(
            0,
            [_new("a", [1, 2, 3]), _new("b", [4, 5])],
            [_entry("a", [1, 2, 3], 0, [5]), _entry("b", [4, 5], 0, [6])],
            [],
        ),
        StepCommand(
            1,
            [_new("a", [1, 2, 3], outputs=[4])],
            [_entry("a", [1, 2, 3, 4], 0, [7, 8]), _entry("b", [], 2, [9])],
            ["a"],
        ),
        StepCommand(2, [], [_entry("a", [], 4, []), _entry("b", [], 3, [])], []),
    ]


def test_a_readmitted_request_still_live_falls_back_to_the_plain_order() -> None:
    """Staging step 1 would add ``a`` again before its old row leaves, moving ``b``'s row while
    step 0 still commits to it: the worker runs step 1 in the plain order instead, with the same
    tokens as a plain run."""
    results, log, _ = _serve(_readmitted(), ahead=True)
    assert log[:2] == [("forward", ("a", "b")), ("read", {"a": 1, "b": 1})]  # nothing of step 1 staged
    assert log[2:4] == [("release", ("a",)), ("forward", ("a", "b"))]
    assert _tokens(results) == _tokens(_plain(_readmitted()))
    assert results[1].sampled["b"] == [7] and results[2].sampled["b"] == [8]


def test_a_staged_step_that_fails_fails_after_its_removals_as_in_the_plain_order() -> None:
    """A staged step whose entry names a request the worker does not hold fails with the plain
    order's error, after the step before it finished normally and after its own removals."""
    cmds = [*_three_steps()[:2], StepCommand(2, [], [_entry("ghost", [], 2, [1])], ["a"])]
    results, log, runner = _serve(cmds, ahead=True)
    plain = _plain(cmds)
    assert [r.error for r in results[:2]] == [None, None]
    assert results[2].error is not None and results[2].error.split("\n")[0] == plain[2].error.split("\n")[0]
    assert "no state for request 'ghost'" in results[2].error
    assert ("release", ("a",)) in log and set(runner.states) == {"b"}


# ----------------------------------------------------------------------------- engine-level outputs


class ThreadWorker:
    """The engine's worker handle, with the worker's real command loop on a thread of this process
    behind a real pipe, around the runner of the in-process worker the engine was built with."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.staged = 0
        stage = runner.stage

        def counting(cmd: StepCommand) -> bool:
            done = stage(cmd)
            self.staged += done
            return done

        runner.stage = counting  # type: ignore[method-assign]
        self._conn, child = mp.Pipe()
        self._thread = threading.Thread(target=_serve_steps, args=(child, runner), daemon=True)
        self._thread.start()
        self._in_flight = 0
        self.dead_reason: str | None = None

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def submit(self, cmd: WorkerCommand) -> None:
        self._in_flight += 1
        self._conn.send_bytes(_encoder.encode(cmd))

    def get_result(self) -> StepResult:
        self._in_flight -= 1
        assert self._conn.poll(60), "the worker thread did not answer"
        return _decoder.decode(self._conn.recv_bytes())

    def check_alive(self) -> str | None:
        return None

    def close(self) -> None:
        self._conn.send_bytes(_encoder.encode(Shutdown()))
        self._thread.join(10)
        self.runner.shutdown()


def _overlapping(llm: LLM) -> ThreadWorker:
    engine = llm.engine
    assert engine is not None
    worker = ThreadWorker(engine.worker._runner)
    engine.worker = worker  # type: ignore[assignment]
    return worker


SLEEP = {"step_sleep": 0.002}  # the forward sleeps (releasing the GIL), so the next step arrives during it


@pytest.mark.skipif(not plugin_installed("async_sched"), reason="the async strategy is what sends steps ahead")
@PROPS
@given(
    jobs=workloads(),
    block_size=st.sampled_from([1, 2, 4]),
    spare_blocks=st.integers(0, 6),
    budget=st.integers(4, 32),
    max_num_seqs=st.integers(1, 5),
    seeded=st.booleans(),
    steps=st.sampled_from([1, 4]),
)
def test_outputs_with_the_overlap_equal_the_plain_order(
    make_llm: Callable[..., LLM],
    jobs: list[Job],
    block_size: int,
    spare_blocks: int,
    budget: int,
    max_num_seqs: int,
    seeded: bool,
    steps: int,
) -> None:
    """Random workloads (arrivals, aborts, stop tokens, tight caches that preempt, prefix hits),
    greedy or seeded sampling, under the async strategy: the overlapping worker gives every request
    the tokens and finish reason of the in-process worker, which runs each step whole."""
    common = dict(
        scheduler="async",
        block_size=block_size,
        num_kv_blocks=blocks_alone(jobs, block_size) + spare_blocks,
        max_num_batched_tokens=budget,
        max_num_seqs=max_num_seqs,
        executor_options=SLEEP,
        # Set: under auto the forwards a command follow their timing, and so would what the aborts cut.
        num_scheduler_steps=steps,
    )
    params = _seeded if seeded else None
    llm = make_llm(**common)
    _overlapping(llm)
    got = run(llm, jobs, params)
    want = run(make_llm(**common), jobs, params)
    for i in range(len(jobs)):
        assert (got[i].outputs[0].token_ids, got[i].outputs[0].finish_reason) == (
            want[i].outputs[0].token_ids,
            want[i].outputs[0].finish_reason,
        ), f"job {i}"
    if not seeded:
        check_against_reference(jobs, got, None)


@pytest.mark.skipif(not plugin_installed("async_sched"), reason="the async strategy is what sends steps ahead")
@pytest.mark.parametrize("seeded", [False, True])
def test_preempting_workload_overlaps_and_matches(make_llm: Callable[..., LLM], seeded: bool) -> None:
    """A cache that preempts, with the overlap on: steps are staged (the path is exercised), preempted
    requests come back, and the outputs equal the plain order's."""
    jobs = [Job(tuple((7 * i + k) % 97 for k in range(10)), 12, arrive_at=i % 2) for i in range(5)]
    common = dict(
        scheduler="async",
        block_size=2,
        num_kv_blocks=blocks_alone(jobs, 2) + 1,
        max_num_batched_tokens=64,
        executor_options=SLEEP,
    )
    params = _seeded if seeded else None
    llm = make_llm(**common)
    worker = _overlapping(llm)
    got = run(llm, jobs, params)
    assert llm.engine is not None and llm.engine.stats()["num_preemptions"] > 0
    want = run(make_llm(**common), jobs, params)
    assert [got[i].outputs[0].token_ids for i in range(5)] == [want[i].outputs[0].token_ids for i in range(5)]
    assert worker.staged > 0


@pytest.mark.skipif(not plugin_installed("async_sched"), reason="the async strategy is what sends steps ahead")
def test_a_spawned_worker_overlapping_under_preemption_and_aborts_matches(make_llm: Callable[..., LLM]) -> None:
    """The same through a spawned worker process (``_worker_main``): seeded sampling, a cache that
    preempts, an abort mid-stream, late arrivals."""
    jobs = [
        Job(tuple((5 * i + k) % 97 for k in range(9)), 10, arrive_at=i % 3, abort_at=6 if i == 2 else None)
        for i in range(5)
    ]
    common = dict(scheduler="async", block_size=2, num_kv_blocks=blocks_alone(jobs, 2) + 2, max_num_batched_tokens=32)
    got = run(make_llm(worker_mode="process", **common), jobs, _seeded)
    llm = make_llm(**common)
    want = run(llm, jobs, _seeded)
    assert llm.engine is not None and llm.engine.stats()["num_preemptions"] > 0
    assert [(got[i].outputs[0].token_ids, got[i].outputs[0].finish_reason) for i in range(5)] == [
        (want[i].outputs[0].token_ids, want[i].outputs[0].finish_reason) for i in range(5)
    ]
    assert want[2].outputs[0].finish_reason == "abort"
