"""The worker process: parity with in-process execution, crashes, step errors, NaN logits, shutdown.
Every generate runs in a thread with a deadline so a hang fails the test instead of the suite."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

from pypto_serving import EngineDeadError, SamplingParams
from pypto_serving.worker import HEAP_REUSE_TUNABLES
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


def test_worker_crash_raises_and_the_next_generate_starts_a_new_worker(make_llm: Callable[..., Any]) -> None:
    crash = 96
    bad = prompt_hitting(crash, at=3)
    others = prompts_avoiding(crash, 2)
    llm = make_llm(worker_mode="process", block_size=4, num_kv_blocks=32, executor_options={"crash_on_token": crash})
    pid = llm.engine.worker.pid
    with pytest.raises(EngineDeadError, match=r"worker process died .*the next generate\(\) starts a new worker"):
        bounded(lambda: llm.generate([bad, *others], GREEDY, use_tqdm=False))
    assert not pid_alive(pid)
    later = bounded(lambda: llm.generate(others, GREEDY, use_tqdm=False))
    assert tokens(later) == [reference_tokens(p, 8)[0] for p in others]
    new_pid = llm.engine.worker.pid
    assert new_pid is not None and new_pid != pid and pid_alive(new_pid)
    assert all(p.num_free == p.num_blocks for p in llm.engine.kv.pools.values())
    bounded(llm.shutdown, 20)
    assert not pid_alive(new_pid)


def test_a_rejected_prompt_takes_back_the_prompts_added_before_it(make_llm: Callable[..., Any]) -> None:
    llm = make_llm(block_size=4, num_kv_blocks=32)
    good = prompts_avoiding(-1, 2)
    with pytest.raises(ValueError, match="prompt token ids"):
        llm.generate([good[0], [VOCAB + 5]], GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished()
    outs = bounded(lambda: llm.generate(good, GREEDY, use_tqdm=False))
    assert [o.request_id for o in outs] == [f"gen-{i}" for i in (2, 3)]
    assert tokens(outs) == [reference_tokens(p, 8)[0] for p in good]


def test_a_value_the_wire_cannot_carry_fails_only_its_request(make_llm: Callable[..., Any]) -> None:
    llm = make_llm(block_size=4, num_kv_blocks=32)
    poisoned = SamplingParams(temperature=0, max_tokens=8)
    poisoned.top_k = 2**64  # mutated past validation: the engine still refuses it at add time
    with pytest.raises(ValueError, match="cannot be sent to the worker"):
        llm.generate([[1, 2, 3]], poisoned, use_tqdm=False)
    good = prompts_avoiding(-1, 1)
    assert tokens(bounded(lambda: llm.generate(good, GREEDY, use_tqdm=False))) == [reference_tokens(good[0], 8)[0]]


UNGUARDED_SCRIPT = """
from pypto_serving import LLM, PluginManager
from tests.fakes import FakePlugin

llm = LLM(executor="fake", scheduler="sync", block_size=4, num_kv_blocks=8, executor_options={{"vocab": 97}},
          plugins=PluginManager(extra_plugins=[FakePlugin]))
print("loaded", llm.generate([[1, 2, 3]], use_tqdm=False)[0].finished)
llm.shutdown()
"""


@pytest.mark.parametrize("guarded", [False, True])
def test_a_script_without_a_main_guard_gets_an_error_that_says_so(tmp_path: Any, guarded: bool) -> None:
    import subprocess
    import sys
    import textwrap
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    body = UNGUARDED_SCRIPT.format()
    if guarded:
        head, _, rest = body.partition("\nllm = ")
        body = head + '\nif __name__ == "__main__":\n' + textwrap.indent("llm = " + rest, "    ")
    script = tmp_path / "offline.py"
    script.write_text(body)
    env = dict(os.environ, PYTHONPATH=str(root), OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    if guarded:
        assert r.returncode == 0 and "loaded True" in r.stdout, r.stderr[-2000:]
        return
    assert r.returncode != 0
    assert "WorkerError" in r.stderr and 'if __name__ == "__main__":' in r.stderr, r.stderr[-2000:]
    assert "bootstrapping phase" not in r.stderr  # multiprocessing's own opaque error is not what the user sees


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


def test_an_in_process_worker_runs_on_worker_threads(make_llm: Callable[..., Any]) -> None:
    before = torch.get_num_threads()
    want = 1 if before != 1 else 2
    try:
        llm = make_llm(worker_threads=want, block_size=4, num_kv_blocks=32)
        assert torch.get_num_threads() == want  # the setting is not ignored in process
        prompt = prompts_avoiding(95, 1)[0]
        assert tokens(bounded(lambda: llm.generate([prompt], GREEDY, use_tqdm=False))) == [
            reference_tokens(prompt, 8)[0]
        ]
    finally:
        torch.set_num_threads(before)


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


@pytest.mark.parametrize(
    ("setting", "value", "variable", "exported", "seen"),
    [
        ("worker_omp_wait_policy", "passive", "OMP_WAIT_POLICY", None, "PASSIVE"),
        ("worker_omp_wait_policy", "active", "OMP_WAIT_POLICY", None, "ACTIVE"),
        ("worker_omp_wait_policy", "inherit", "OMP_WAIT_POLICY", None, ""),
        ("worker_omp_wait_policy", "passive", "OMP_WAIT_POLICY", "ACTIVE", "ACTIVE"),
        ("worker_huge_pages", True, "THP_MEM_ALLOC_ENABLE", None, "1"),
        ("worker_huge_pages", False, "THP_MEM_ALLOC_ENABLE", None, ""),
        ("worker_huge_pages", True, "THP_MEM_ALLOC_ENABLE", "0", "0"),
        ("worker_heap_reuse", True, "GLIBC_TUNABLES", None, HEAP_REUSE_TUNABLES),
        ("worker_heap_reuse", False, "GLIBC_TUNABLES", None, ""),
        ("worker_heap_reuse", True, "GLIBC_TUNABLES", "glibc.malloc.arena_max=2", "glibc.malloc.arena_max=2"),
    ],
)
def test_the_worker_starts_with_its_environment(
    make_llm: Callable[..., Any],
    monkeypatch: Any,
    setting: str,
    value: Any,
    variable: str,
    exported: str | None,
    seen: str,
) -> None:
    """A spawned worker gets the variable its setting asks for (OMP_WAIT_POLICY from
    ``worker_omp_wait_policy``, THP_MEM_ALLOC_ENABLE=1 from ``worker_huge_pages``, GLIBC_TUNABLES from
    ``worker_heap_reuse``) unless the user exported it; this process's environment is left as it was."""
    if exported is None:
        monkeypatch.delenv(variable, raising=False)
    else:
        monkeypatch.setenv(variable, exported)
    llm = make_llm(worker_mode="process", executor_options={"architecture_from_env": variable}, **{setting: value})
    assert llm.engine.worker.info.architecture == seen
    assert os.environ.get(variable) == exported


@pytest.mark.parametrize(("bind", "threads"), [("auto", 1), ("auto", None), ("off", 1), ("last", None)])
def test_the_worker_pins_its_threads_to_cores(
    make_llm: Callable[..., Any], monkeypatch: Any, bind: str, threads: int | None
) -> None:
    """``worker_cpu_bind``: the spawned worker's OpenMP places and its CPU affinity are the chosen cores
    (auto: the last ``worker_threads`` of this process's cores), one thread per core; 'off' leaves both
    alone; this process's environment is left as it was."""
    for name in ("OMP_PLACES", "OMP_PROC_BIND"):
        monkeypatch.delenv(name, raising=False)
    allowed = sorted(os.sched_getaffinity(0))
    spec = str(allowed[-1]) if bind == "last" else bind
    llm = make_llm(
        worker_mode="process",
        worker_cpu_bind=spec,
        worker_threads=threads,
        executor_options={"architecture_from_env": "OMP_PLACES"},
    )
    pid = llm.engine.worker._proc.pid
    # Each thread's own mask: OpenMP binds its initial thread to the first place at start-up, and the
    # threads of its pool to the others when a parallel region first runs (the fake executor runs none).
    masks = [os.sched_getaffinity(int(tid)) for tid in os.listdir(f"/proc/{pid}/task")]
    if bind == "off":
        assert llm.engine.worker.info.architecture == ""
        assert sorted(set().union(*masks)) == allowed
    else:
        # Unset worker_threads: torch's thread count here, which the spawned worker inherits (OMP_NUM_THREADS).
        want = allowed[-(threads or torch.get_num_threads()) :] if bind == "auto" else allowed[-1:]
        assert llm.engine.worker.info.architecture == ",".join(f"{{{c}}}" for c in want)
        assert set().union(*masks) <= set(want) and os.sched_getaffinity(pid) == {want[0]}
    assert "OMP_PLACES" not in os.environ and "OMP_PROC_BIND" not in os.environ


def test_worker_cpu_bind_refuses_cores_it_may_not_use(monkeypatch: Any) -> None:
    """A listed core the kernel does not let this process use fails the worker's spawn, before any
    process starts, and leaves the spawning thread's cores as they were."""
    from pypto_serving.config import ServingSettings
    from pypto_serving.worker import _worker_environment, worker_cores

    for name in ("OMP_PLACES", "OMP_PROC_BIND"):
        monkeypatch.delenv(name, raising=False)
    before = os.sched_getaffinity(0)
    outside = max(before) + 1
    with (
        pytest.raises(ValueError, match=rf"worker_cpu_bind names cores this process may not run on: \[{outside}\]"),
        _worker_environment(ServingSettings(worker_cpu_bind=f"{min(before)},{outside}")),
    ):
        pass
    assert os.sched_getaffinity(0) == before and "OMP_PLACES" not in os.environ
    with pytest.raises(ValueError, match="worker_cpu_bind"):
        ServingSettings(worker_cpu_bind="all")
    too_many = len(os.sched_getaffinity(0)) + 1
    assert worker_cores(ServingSettings(worker_threads=too_many)) is None  # oversubscribed: nothing pinned
    assert worker_cores(ServingSettings(worker_cpu_bind="0", tensor_parallel_size=2)) is None
