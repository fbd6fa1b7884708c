"""The worker process: parity with in-process execution, crashes, step errors, NaN logits, shutdown.
Every generate runs in a thread with a deadline so a hang fails the test instead of the suite."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

import pytest

from pypto_serving import EngineDeadError, SamplingParams
from tests.fakes import next_token, reference_tokens

pytest.importorskip("pypto_serving_sync_sched")

VOCAB = 97
DEADLINE = 60.0
GREEDY = SamplingParams(temperature=0, max_tokens=8)


def bounded(fn: Callable[[], Any], timeout: float = DEADLINE) -> Any:
    """Run ``fn`` in a thread; fail if it does not return within ``timeout``; re-raise its error."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:
            box["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"hung for more than {timeout}s"
    if "error" in box:
        raise box["error"]
    return box["value"]


def pid_alive(pid: int) -> bool:
    """True while the process runs (an exited, not yet reaped zombie counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def prompts_avoiding(token: int, count: int, max_tokens: int = 8) -> list[list[int]]:
    """Prompts whose prompt and whole greedy output avoid ``token``."""
    out, seed = [], 0
    while len(out) < count:
        seed += 1
        p = [(seed * 13 + k * 7) % VOCAB for k in range(6)]
        if token not in p and token not in reference_tokens(p, max_tokens)[0]:
            out.append(p)
    return out


def prompt_hitting(token: int, at: int, max_tokens: int = 8) -> list[int]:
    """A prompt without ``token`` whose greedy output first produces it at output index ``at``."""
    for seed in range(1, 100_000):
        p = [(seed * 31 + k * 11) % VOCAB for k in range(5)]
        ref = reference_tokens(p, max_tokens)[0]
        if token not in p and token in ref and ref.index(token) == at:
            return p
    raise AssertionError("no such prompt")


def tokens(outs: list[Any]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("scheduler", ["sync", pytest.param("async", marks=pytest.mark.requires_plugin("async_sched"))])
def test_process_equals_inproc(make_llm: Callable[..., Any], scheduler: str) -> None:
    prompts = [[(i * 5 + k) % VOCAB for k in range(3 + 4 * i)] for i in range(5)]
    kw = dict(block_size=4, num_kv_blocks=12, max_num_batched_tokens=16, scheduler=scheduler)
    proc = make_llm(worker_mode="process", **kw)
    assert proc.engine.worker.pid is not None and proc.engine.worker.pid != os.getpid()
    got = bounded(lambda: proc.generate(prompts, GREEDY, use_tqdm=False))
    want = make_llm(**kw).generate(prompts, GREEDY, use_tqdm=False)
    assert tokens(got) == tokens(want) == [reference_tokens(p, 8)[0] for p in prompts]


def test_worker_crash_fails_requests_and_kills_the_engine(make_llm: Callable[..., Any]) -> None:
    crash = 96
    bad = prompt_hitting(crash, at=3)
    others = prompts_avoiding(crash, 2)
    llm = make_llm(worker_mode="process", block_size=4, num_kv_blocks=32, executor_options={"crash_on_token": crash})
    pid = llm.engine.worker.pid
    try:
        outs = bounded(lambda: llm.generate([bad, *others], GREEDY, use_tqdm=False))
    except EngineDeadError as e:
        assert "died" in str(e)
    else:
        for o in outs:
            c = o.outputs[0]
            assert c.finish_reason == "error" and o.finished
        # the 4th output is the crash token: the step that feeds it back kills the worker
        assert outs[0].outputs[0].token_ids == reference_tokens(bad, 8)[0][:4]
        dead = llm.engine.dead_reason
        # (the exit code itself is racy: executor.py reads it before the process is reaped)
        assert dead is not None and "worker process died" in dead
    assert not pid_alive(pid)
    with pytest.raises(EngineDeadError):
        llm.generate(others, GREEDY, use_tqdm=False)
    bounded(llm.shutdown, 20)


@pytest.mark.parametrize("mode", ["inproc", "process"])
def test_executor_exception_fails_the_batch_and_serving_continues(make_llm: Callable[..., Any], mode: str) -> None:
    fail = 95
    bad = [1, 2, fail, 3]
    good = prompts_avoiding(fail, 2)
    llm = make_llm(worker_mode=mode, block_size=4, num_kv_blocks=32, executor_options={"fail_on_token": fail})
    outs = bounded(lambda: llm.generate([bad, good[0]], GREEDY, use_tqdm=False))
    for o in outs:  # same first step: both are in the failed batch
        assert o.outputs[0].finish_reason == "error"
    engine = llm.engine
    assert engine.dead_reason is None
    later = bounded(lambda: llm.generate(good, GREEDY, use_tqdm=False))
    assert tokens(later) == [reference_tokens(p, 8)[0] for p in good]
    assert all(o.outputs[0].finish_reason == "length" for o in later)
    assert all(p.num_free == p.num_blocks for p in engine.kv.pools.values())


def test_executor_exception_message_reaches_the_request(make_llm: Callable[..., Any]) -> None:
    fail = 95
    llm = make_llm(block_size=4, num_kv_blocks=32, executor_options={"fail_on_token": fail})
    engine = llm.engine
    engine.add_request("x", [1, fail], GREEDY)
    req = engine.scheduler.requests["x"]
    outs = bounded(lambda: engine.step())
    assert outs and outs[0].finished and outs[0].outputs[0].finish_reason == "error"
    assert req.error is not None and "fake executor asked to fail" in req.error


@pytest.mark.parametrize("mode", ["inproc", "process"])
def test_nan_logits_fail_only_that_request(make_llm: Callable[..., Any], mode: str) -> None:
    nan = 94
    good = prompts_avoiding(nan, 2)
    bad = [3, 1, 4, nan]  # its last input is the NaN trigger: its first sample is non-finite
    llm = make_llm(worker_mode=mode, block_size=4, num_kv_blocks=32, executor_options={"nan_on_token": nan})
    engine = llm.engine
    outs = bounded(lambda: llm.generate([good[0], bad, good[1]], GREEDY, use_tqdm=False))
    assert outs[1].outputs[0].finish_reason == "error" and outs[1].outputs[0].token_ids == []
    assert tokens([outs[0], outs[2]]) == [reference_tokens(p, 8)[0] for p in good]
    assert engine.dead_reason is None


def test_nan_error_message(make_llm: Callable[..., Any]) -> None:
    llm = make_llm(block_size=4, num_kv_blocks=32, executor_options={"nan_on_token": 94})
    engine = llm.engine
    engine.add_request("x", [1, 94], GREEDY)
    req = engine.scheduler.requests["x"]
    bounded(engine.step)
    assert req.finish_reason == "error" and "non-finite" in (req.error or "")


def test_shutdown_stops_the_worker(make_llm: Callable[..., Any]) -> None:
    llm = make_llm(worker_mode="process", block_size=4, num_kv_blocks=8)
    pid = llm.engine.worker.pid
    assert pid_alive(pid)
    bounded(lambda: llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False))
    bounded(llm.shutdown, 20)
    assert not pid_alive(pid)
    with pytest.raises(EngineDeadError, match="shut down"):
        llm.generate([[1, 2]], GREEDY, use_tqdm=False)
    llm.shutdown()  # idempotent


def test_context_manager_exit_stops_the_worker(fake_pm: Any) -> None:
    pytest.importorskip("pypto_serving_sync_sched")
    from pypto_serving import LLM

    with LLM(executor="fake", plugins=fake_pm, worker_mode="process", scheduler="sync", num_kv_blocks=8) as llm:
        pid = llm.engine.worker.pid
        first = next_token([5, 6], VOCAB)
        out = bounded(lambda: llm.generate([[5, 6]], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False))
        assert out[0].outputs[0].token_ids == [first]
    assert llm.engine is None
    assert not pid_alive(pid)
