"""AsyncLLM's engine thread keeps serving: an unexpected error inside a step fails the requests in
flight and a fresh engine replaces the broken one; one bad add fails that request only; a client
that leaves while its add is queued frees its request."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pypto_serving_sync_sched")

from pypto_serving import SamplingParams
from tests.conftest import plugin_installed
from tests.core.server.conftest import VOCAB, start_llm
from tests.fakes import reference_tokens

GREEDY = SamplingParams(temperature=0, max_tokens=6)


async def run(llm: Any, rid: str, prompt: list[int], params: SamplingParams = GREEDY) -> Any:
    last = None
    async for out in llm.generate(rid, prompt, params):
        last = out
    return last


def wait_for(predicate: Any, within: float) -> None:
    deadline = time.monotonic() + within
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


@pytest.fixture
def llm(fake_model_dir: Path) -> Any:
    llm = start_llm(fake_model_dir, executor_options={"step_sleep": 0.01})
    yield llm
    llm.shutdown(10)


def test_an_error_inside_a_step_replaces_the_engine(llm: Any) -> None:
    broken = llm.engine

    def explode() -> None:
        raise RuntimeError("a bug in a strategy")

    broken.strategy.step = explode
    out = asyncio.run(run(llm, "r1", [4, 5, 6]))
    assert out.finished and out.outputs[0].finish_reason == "error"
    wait_for(lambda: llm.ready, within=30)
    assert llm.engine is not broken and llm.num_restarts == 1 and llm.failure is None
    out = asyncio.run(run(llm, "r2", [4, 5, 6]))
    assert out.outputs[0].token_ids == reference_tokens([4, 5, 6], 6, VOCAB)[0]


def test_a_failing_add_fails_that_request_only(llm: Any) -> None:
    def refuse(*args: Any) -> None:
        raise KeyError("a bug triggered by one request")

    good_add = llm.engine.add_request
    llm.engine.add_request = refuse
    with pytest.raises(KeyError):
        asyncio.run(run(llm, "bad", [1, 2]))
    llm.engine.add_request = good_add
    out = asyncio.run(run(llm, "good", [1, 2]))
    assert out.outputs[0].token_ids == reference_tokens([1, 2], 6, VOCAB)[0]
    assert llm.healthy and llm.num_restarts == 0


def test_a_client_leaving_while_its_add_is_queued_frees_the_request(fake_model_dir: Path) -> None:
    llm = start_llm(fake_model_dir, executor_options={"step_sleep": 0.3})

    async def main() -> None:
        busy = asyncio.ensure_future(run(llm, "busy", [7, 8], SamplingParams(temperature=0, max_tokens=3)))
        await asyncio.sleep(0.05)  # the engine thread is now inside a 0.3 s step
        leaving = asyncio.ensure_future(llm.add_request("leaving", [9, 9], GREEDY))
        await asyncio.sleep(0.01)
        leaving.cancel()  # the add is still queued behind the step
        with pytest.raises(asyncio.CancelledError):
            await leaving
        await busy

    try:
        asyncio.run(main())
        wait_for(lambda: not llm.engine.has_unfinished(), within=10)
        assert llm.failure is None and llm.healthy
        llm.engine.kv.check_invariants([])
        assert all(p.num_free == p.num_blocks for p in llm.engine.kv.pools.values())
    finally:
        llm.shutdown(10)


@pytest.mark.parametrize(
    ("engine_mode", "worker_mode", "scheduler"),
    [("thread", "inproc", "sync"), ("process", "inproc", "sync")]
    + ([("process", "process", "async")] if plugin_installed("async_sched") else []),
)
def test_an_arrival_ends_a_command_of_several_forwards_after_its_current_one(
    fake_model_dir: Path, engine_mode: str, worker_mode: str, scheduler: str
) -> None:
    """A request added while another runs a command of 16 forwards of 50 ms each waits for the
    forward running (the add raises ``EngineCore.step_interrupt``: from the event loop's thread, or
    the core process's reader), not the 0.8 s command; the running request's tokens are unchanged.
    With async scheduling and a spawned worker (the server's defaults) the next command is already
    in the worker's pipe when the request arrives: it ends after its first forward too."""
    llm = start_llm(
        fake_model_dir,
        engine_mode=engine_mode,
        worker_mode=worker_mode,
        scheduler=scheduler,
        device="cpu",
        num_scheduler_steps=16,
        executor_options={"step_sleep": 0.05},
    )
    long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)

    async def main() -> tuple[Any, float]:
        started = asyncio.Event()

        async def run_long() -> Any:
            last = None
            async for out in llm.generate("long", [5, 6, 7], long):
                last = out
                started.set()  # its prefill's token: the next command is 16 forwards
            return last

        task = asyncio.ensure_future(run_long())
        await started.wait()
        await asyncio.sleep(0.15)  # inside that command
        t0 = time.monotonic()
        async for _ in llm.generate("short", [9, 8], SamplingParams(temperature=0, max_tokens=1)):
            break
        waited = time.monotonic() - t0
        return await task, waited

    try:
        out, waited = asyncio.run(main())
        assert out.outputs[0].token_ids == reference_tokens([5, 6, 7], 40, VOCAB)[0]
        # The forward running, then the one that takes the arrival's prompt: about 0.1 s; the rest
        # of the command would have been 0.6 s more.
        assert waited < 0.4, waited
    finally:
        llm.shutdown(10)
