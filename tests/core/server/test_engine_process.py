"""``engine_mode = "process"``: the engine core runs in a child process of the server. Its outputs equal
the thread mode's; a killed core fails the requests in flight with a clear error and is replaced
within the restart budget, or ``on_fatal`` ends the server past it; a killed server leaves neither
its core nor the core's worker behind."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pypto_serving_sync_sched")

from pypto_serving import SamplingParams
from pypto_serving.engine import EngineDeadError
from pypto_serving.server import EngineFailure
from tests.core.server.conftest import VOCAB, fake_settings, start_llm
from tests.core.server.server_helpers import child_pids, is_running, thread_masks, wait_for
from tests.fakes import reference_tokens

ROOT = Path(__file__).resolve().parents[3]

# A mix that exercises what the core sends back: greedy and seeded sampling, a stop string (the
# core's detokenizer ends the request), n > 1, logprobs and min_tokens.
CASES: list[tuple[list[int], SamplingParams]] = [
    ([5, 6, 7], SamplingParams(temperature=0, max_tokens=12)),
    ([9, 8], SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=10)),
    ([1, 2, 3, 4], SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=8, logprobs=2)),
    ([11], SamplingParams(temperature=0, max_tokens=20, stop=["e"], min_tokens=2)),
    ([3, 3, 3], SamplingParams(temperature=0.5, seed=11, max_tokens=9, stop_token_ids=[17])),
]


async def _final(llm: Any, rid: str, prompt: list[int], params: SamplingParams) -> Any:
    last = None
    async for out in llm.generate(rid, prompt, params):
        last = out
    return last


async def _all(llm: Any) -> list[Any]:
    return list(await asyncio.gather(*(_final(llm, f"r{i}", p, sp) for i, (p, sp) in enumerate(CASES))))


def _summary(out: Any) -> list[tuple[Any, ...]]:
    return [(c.token_ids, c.text, c.finish_reason, c.stop_reason, c.logprobs) for c in out.outputs]


def test_the_core_runs_in_a_child_process_with_the_thread_modes_outputs(fake_model_dir: Path) -> None:
    process = start_llm(fake_model_dir, engine_mode="process")
    thread = start_llm(fake_model_dir, engine_mode="thread")
    try:
        core = process.engine.pid
        assert core != os.getpid() and core in child_pids(os.getpid()) and is_running(core)
        assert b"engine_proc" in Path(f"/proc/{core}/cmdline").read_bytes()
        assert process.max_model_len == thread.max_model_len and process.vocab_size == VOCAB
        got, want = asyncio.run(_all(process)), asyncio.run(_all(thread))
        assert [_summary(o) for o in got] == [_summary(o) for o in want]
        assert all(o.finished for o in got)
        # Independent reference for the greedy case: the fake model's next-token function.
        assert got[0].outputs[0].token_ids == reference_tokens([5, 6, 7], 12, VOCAB)[0]
        assert got[3].outputs[0].stop_reason == "e"  # the stop string ended it, in the core
        assert process.stats["num_running"] == 0 and process.num_waiting() == 0
    finally:
        process.shutdown(10)
        thread.shutdown(10)
    wait_for(lambda: not is_running(core), 10, "the core process to exit after shutdown")


async def _kill_core_mid_stream(llm: Any) -> list[str | None]:
    """Each request's failure: its last output's error (a core death fails them as the engine fails
    a request: finish_reason "error"), or an exception raised instead, or None if it succeeded."""
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    decoding: set[str] = set()
    errors: list[str | None] = []

    async def one(rid: str) -> None:
        last = None
        try:
            async for out in llm.generate(rid, [4, 5, 6], params):
                decoding.add(rid)
                last = out
        except (EngineFailure, EngineDeadError) as e:
            errors.append(f"raised {type(e).__name__}: {e}")
            return
        failed = [c.error for c in last.outputs if c.finish_reason == "error"] if last else []
        errors.append(failed[0] if failed else None)

    async def all_decoding() -> None:
        while len(decoding) < 3:
            await asyncio.sleep(0.01)

    tasks = [asyncio.create_task(one(f"k{i}")) for i in range(3)]
    await asyncio.wait_for(all_decoding(), 30)
    os.kill(llm.engine.pid, signal.SIGKILL)
    await asyncio.wait_for(asyncio.gather(*tasks), 30)
    return errors


def test_a_killed_core_is_replaced_within_the_budget_then_calls_on_fatal(fake_model_dir: Path) -> None:
    """One restart allowed: the first kill (mid-stream) fails the requests in flight and a new core
    serves; the second (idle, noticed through the closed pipe) exhausts the budget."""
    from pypto_serving import PluginManager
    from pypto_serving.server import AsyncLLM
    from tests.fakes import FakePlugin

    fatal: list[str] = []
    options = {"executor_options": {"step_sleep": 0.02}}
    settings = fake_settings(fake_model_dir, engine_mode="process", max_worker_restarts=1, **options)
    llm = AsyncLLM(settings, PluginManager(extra_plugins=[FakePlugin]), on_fatal=fatal.append)
    llm.wait_ready(60)
    try:
        old = llm.engine.pid
        errors = asyncio.run(_kill_core_mid_stream(llm))
        assert len(errors) == 3, errors
        assert all(e and e.startswith("the engine core process died (exit code -9)") for e in errors), errors
        wait_for(lambda: llm.ready and llm.engine.pid != old, 60, "a new core process")
        assert llm.num_restarts == 1 and llm.failure is None and not is_running(old) and not fatal
        out = asyncio.run(_final(llm, "after", [5, 6, 7], SamplingParams(temperature=0, max_tokens=6)))
        assert out.outputs[0].token_ids == reference_tokens([5, 6, 7], 6, VOCAB)[0]

        os.kill(llm.engine.pid, signal.SIGKILL)
        wait_for(lambda: fatal, 10, "on_fatal")
        assert len(fatal) == 1 and "engine core process died" in fatal[0] and "no restart left" in fatal[0]
        assert llm.dead_reason == fatal[0] and not llm.healthy
        with pytest.raises(EngineDeadError, match="no restart left"):
            asyncio.run(_final(llm, "late", [1, 2], SamplingParams(max_tokens=2)))
    finally:
        llm.shutdown(10)


_SERVER_SCRIPT = """
import sys, time
sys.path.insert(0, {root!r})
from pypto_serving import PluginManager
from pypto_serving.server import AsyncLLM
from tests.core.server.conftest import fake_settings
from tests.fakes import FakePlugin

settings = fake_settings({model!r}, engine_mode="process", worker_mode="process")
llm = AsyncLLM(settings, PluginManager(extra_plugins=[FakePlugin]))
llm.wait_ready(120)
print(llm.engine.pid, llm.engine.worker_pid, flush=True)
time.sleep(300)
"""


def test_a_killed_server_leaves_no_core_or_worker_behind(fake_model_dir: Path) -> None:
    script = textwrap.dedent(_SERVER_SCRIPT).format(root=str(ROOT), model=str(fake_model_dir))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    server = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, env=env, text=True)
    try:
        assert server.stdout is not None
        core, worker = (int(x) for x in server.stdout.readline().split())
        assert is_running(core) and is_running(worker) and worker in child_pids(core)
        server.kill()  # no shutdown, no atexit: the core sees its pipe close
        server.wait(10)
        wait_for(lambda: not is_running(core) and not is_running(worker), 15, "the core and worker to exit")
    finally:
        if server.poll() is None:
            server.kill()
            server.wait(10)


@pytest.mark.parametrize("bind", ["rest", "auto", "off"])
def test_the_core_process_keeps_off_its_workers_cores(
    fake_model_dir: Path, monkeypatch: pytest.MonkeyPatch, bind: str
) -> None:
    """``engine_cpu_bind``: with one worker thread pinned to the last core, every thread of the engine
    core runs on the others where it is pinned (a list of them; 'auto' where they are two or more),
    else anywhere; the worker is on its core either way, this process is left where it was, and the
    outputs are the fake model's."""
    from pypto_serving.cpu_binding import MIN_ENGINE_CORES

    allowed = frozenset(os.sched_getaffinity(0))
    if len(allowed) < 2:
        pytest.skip("needs two cores")
    for name in ("OMP_PLACES", "OMP_PROC_BIND"):
        monkeypatch.delenv(name, raising=False)
    last = max(allowed)
    rest = allowed - {last}
    spec = ",".join(map(str, sorted(rest))) if bind == "rest" else bind
    llm = start_llm(
        fake_model_dir, engine_mode="process", worker_mode="process", worker_threads=1, engine_cpu_bind=spec
    )
    try:
        core, worker = llm.engine.pid, llm.engine.worker_pid
        assert worker is not None and worker in child_pids(core)
        assert thread_masks(worker) == {frozenset({last})}
        pinned = bind == "rest" or (bind == "auto" and len(rest) >= MIN_ENGINE_CORES)
        assert thread_masks(core) == ({rest} if pinned else {allowed})
        assert thread_masks(os.getpid()) == {allowed}
        out = asyncio.run(_final(llm, "r", [5, 6, 7], SamplingParams(temperature=0, max_tokens=12)))
        assert out.outputs[0].token_ids == reference_tokens([5, 6, 7], 12, VOCAB)[0]
    finally:
        llm.shutdown(10)
