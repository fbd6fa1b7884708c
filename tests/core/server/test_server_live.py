"""A real uvicorn on 127.0.0.1 (in a thread) with real sockets: client disconnects free their KV
blocks at once, 50 concurrent streaming clients with random disconnects leak nothing, and an engine
failure ends in-flight streams with an error chunk instead of hanging them."""

from __future__ import annotations

import asyncio
import random
import re
import time
from typing import Any

import httpx
import pytest

pytest.importorskip("pypto_serving_sync_sched")

from tests.core.server.server_helpers import parse_sse

TIMEOUT = httpx.Timeout(30.0)


def metric(text: str, name: str, labels: str = "") -> float:
    m = re.search(rf"^{re.escape(name)}\{{[^}}]*{re.escape(labels)}[^}}]*\}} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


async def wait_idle(client: httpx.AsyncClient, within: float) -> str:
    """Poll /metrics until no block is used and nothing runs or waits; returns the last scrape."""
    deadline = time.monotonic() + within
    while True:
        text = (await client.get("/metrics")).text
        busy = [
            metric(text, f"pypto_serving_{n}")
            for n in ("kv_cache_usage_perc", "num_requests_running", "num_requests_waiting")
        ]
        if busy == [0.0, 0.0, 0.0]:
            return text
        assert time.monotonic() < deadline, f"still busy after {within}s: {busy}"
        await asyncio.sleep(0.02)


async def stream(client: httpx.AsyncClient, body: dict[str, Any], leave_after: int | None = None) -> str | None:
    """Stream a completion; with ``leave_after`` drop the connection after that many events."""
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200, await r.aread()
        seen, raw = 0, ""
        async for chunk in r.aiter_text():
            raw += chunk
            seen = raw.count("\n\n")
            if leave_after is not None and seen >= leave_after:
                return None  # leaving the block closes the socket mid-stream
        return raw


def test_disconnect_mid_stream_frees_blocks_at_once(live_server: Any) -> None:
    server, _ = live_server(executor_options={"step_sleep": 0.02})

    async def main() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT) as client:
            body = {"prompt": [5, 6, 7], "max_tokens": 110, "ignore_eos": True}
            t0 = time.monotonic()
            assert await stream(client, body, leave_after=3) is None
            text = await wait_idle(client, within=1.5)
            assert time.monotonic() - t0 < 2.0  # well before the 110 steps x 20 ms it would take
            assert metric(text, "pypto_serving_request_success_total", 'finish_reason="abort"') == 1

    asyncio.run(main())


def test_fifty_concurrent_streams_with_random_disconnects(live_server: Any) -> None:
    server, llm = live_server(num_kv_blocks=96, executor_options={"step_sleep": 0.002})
    rng = random.Random(7)

    async def main() -> None:
        limits = httpx.Limits(max_connections=60)
        async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT, limits=limits) as client:
            plans = []
            for i in range(50):
                body = {
                    "prompt": [rng.randrange(3, 300) for _ in range(rng.randrange(1, 12))],
                    "max_tokens": rng.randrange(4, 30),
                    "temperature": 0,
                    "ignore_eos": True,
                    "stream_options": {"include_usage": True},
                    "n": 1 + (i % 5 == 0),
                }
                plans.append((body, rng.choice([None, None, 1, 2, 5])))
            results = await asyncio.wait_for(
                asyncio.gather(*(stream(client, b, leave) for b, leave in plans)), timeout=60
            )
            completed = 0
            for (body, leave), raw in zip(plans, results):
                if leave is not None:
                    continue
                assert raw is not None
                events, done = parse_sse(raw)
                assert done, raw[-200:]
                finishes = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
                assert finishes == ["length"] * body["n"]
                usage = events[-1]["usage"]
                assert usage["completion_tokens"] == body["max_tokens"] * body["n"]
                completed += 1
            assert completed >= 10
            await wait_idle(client, within=5)
        assert llm.engine is not None and not llm.engine.has_unfinished()
        llm.engine.kv.check_invariants([])

    asyncio.run(main())


async def wait_health(client: httpx.AsyncClient, status: int, within: float) -> dict[str, Any]:
    deadline = time.monotonic() + within
    while True:
        r = await client.get("/health")
        if r.status_code == status:
            return dict(r.json())
        assert time.monotonic() < deadline, f"/health still {r.status_code} {r.text} after {within}s"
        await asyncio.sleep(0.05)


async def greedy_text(client: httpx.AsyncClient, llm: Any, prompt: list[int], max_tokens: int = 6) -> str:
    """A greedy completion, checked against the fake model's reference decoding."""
    from tests.core.server.conftest import VOCAB
    from tests.fakes import reference_tokens

    r = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["text"]
    # The detokenizer holds back a trailing partial UTF-8 character, which decode() shows as U+FFFD.
    assert text == llm.tokenizer.decode(reference_tokens(prompt, max_tokens, VOCAB)[0]).rstrip("\ufffd")
    return str(text)


def test_worker_death_fails_in_flight_then_the_worker_is_replaced(live_server: Any) -> None:
    server, llm = live_server(worker_mode="process", executor_options={"crash_on_token": 299, "step_sleep": 0.01})

    async def main() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT) as client:
            assert (await client.get("/health")).status_code == 200
            before = await greedy_text(client, llm, [5, 6], 8)
            body = {"prompt": [5, 6], "max_tokens": 100, "ignore_eos": True, "temperature": 0}  # never samples 299
            long = asyncio.ensure_future(stream(client, body))
            await asyncio.sleep(0.3)
            crash = await asyncio.wait_for(stream(client, {"prompt": [299], "max_tokens": 5}), 20)
            raw = await asyncio.wait_for(long, 20)
            for body in (crash, raw):
                assert body is not None
                events, done = parse_sse(body)
                assert done and "error" in events[-1] and "worker" in events[-1]["error"]["message"], body[-300:]
            health = await wait_health(client, 200, within=60)  # a fresh worker, without a person
            assert health == {"status": "ok"}
            assert await greedy_text(client, llm, [5, 6], 8) == before
            text = (await client.get("/metrics")).text
            assert metric(text, "pypto_serving_worker_restarts_total") == 1
            assert metric(text, "pypto_serving_engine_dead") == 0
            await wait_idle(client, within=5)
        assert llm.num_restarts == 1 and llm.engine is not None and llm.engine.worker.pid is not None

    asyncio.run(main())


def test_worker_killed_while_idle_is_noticed_within_a_second(live_server: Any) -> None:
    import os
    import signal

    server, llm = live_server(worker_mode="process")

    async def main() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT) as client:
            ref = await greedy_text(client, llm, [7, 8, 9])
            old_pid = llm.engine.worker.pid
            os.kill(old_pid, signal.SIGKILL)
            t0 = time.monotonic()
            while llm.restarting is None and llm.engine.worker.pid == old_pid:
                assert time.monotonic() - t0 < 1.0, "a worker killed while idle went unnoticed for 1 s"
                await asyncio.sleep(0.01)
            r = await client.get("/health")
            if r.status_code == 503:  # unless the restart is already done
                assert r.json()["status"] == "restarting" and "exit code -9" in r.json()["reason"]
            await wait_health(client, 200, within=60)
            assert await greedy_text(client, llm, [7, 8, 9]) == ref
            assert llm.engine.worker.pid != old_pid

    asyncio.run(main())


def test_restart_budget_exhausted_is_final(live_server: Any) -> None:
    fatal: list[str] = []
    server, llm = live_server(worker_mode="process", max_worker_restarts=0, executor_options={"crash_on_token": 299})
    llm.on_fatal = fatal.append

    async def main() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT) as client:
            crash = await asyncio.wait_for(stream(client, {"prompt": [299], "max_tokens": 5}), 20)
            assert crash is not None and "error" in parse_sse(crash)[0][-1]
            deadline = time.monotonic() + 5
            health = await wait_health(client, 503, within=5)
            while health["status"] != "unavailable":  # the engine thread may still be deciding
                assert health["status"] == "restarting" and time.monotonic() < deadline, health
                await asyncio.sleep(0.02)
                health = await wait_health(client, 503, within=5)
            assert "max_worker_restarts=0" in health["reason"]
            r = await client.post("/v1/completions", json={"prompt": [5], "max_tokens": 2})
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
            assert metric((await client.get("/metrics")).text, "pypto_serving_engine_dead") == 1
        assert len(fatal) == 1 and "exit code 17" in fatal[0]

    asyncio.run(main())


def test_client_timeouts_under_load_do_not_kill_the_engine(live_server: Any, caplog: Any, capfd: Any) -> None:
    """Non-streamed clients that give up while their request waits to be added (the engine busy in a
    step) used to crash the engine thread (set_result on a cancelled future), and every such
    disconnect logged an ASGI traceback."""
    # Steps longer than the handler's disconnect poll (0.25 s), so clients leave while their add is queued.
    server, llm = live_server(num_kv_blocks=128, executor_options={"step_sleep": 0.6})
    rng = random.Random(3)

    async def impatient(client: httpx.AsyncClient, i: int) -> int | None:
        body = {"prompt": [3 + i % 200, 4], "max_tokens": 20, "ignore_eos": True}
        try:
            r = await client.post("/v1/completions", json=body, timeout=rng.uniform(0.05, 0.4))
            return r.status_code
        except httpx.TimeoutException:
            return None

    async def main() -> None:
        limits = httpx.Limits(max_connections=200)
        async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT, limits=limits) as client:
            load = [
                asyncio.ensure_future(stream(client, {"prompt": [9, i], "max_tokens": 4, "ignore_eos": True}))
                for i in range(24)
            ]
            await asyncio.sleep(0.2)
            codes = await asyncio.gather(*(impatient(client, i) for i in range(40)))
            assert codes.count(None) > 10, codes  # most gave up
            assert all(c in (None, 200) for c in codes), codes
            for raw in await asyncio.wait_for(asyncio.gather(*load), 60):
                assert raw is not None and parse_sse(raw)[1]
            assert (await client.get("/health")).status_code == 200
            await greedy_text(client, llm, [5, 6, 7])
            await wait_idle(client, within=5)
        assert llm.engine is not None
        llm.engine.kv.check_invariants([])

    with caplog.at_level("ERROR"):
        asyncio.run(main())
    assert llm.failure is None and llm.num_restarts == 0
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")], caplog.text[-2000:]
    stderr = capfd.readouterr().err
    assert "Exception in ASGI application" not in stderr and "CancelledError" not in stderr, stderr[-2000:]


def test_shutdown_timeout_expiry_ends_streams_with_an_error_event(fake_model_dir: Any, caplog: Any) -> None:
    """Graceful shutdown waits ``shutdown_timeout`` (1 s here) for in-flight requests, then ends the
    rest itself: the stream gets an error event and [DONE] (not a cut connection), a request needing
    ~10 s more does not keep the server up, the engine ends empty, and no traceback is logged."""
    import threading

    from pypto_serving.server import build_app
    from tests.core.server.conftest import LiveServer, start_llm

    llm = start_llm(fake_model_dir, executor_options={"step_sleep": 0.1}, shutdown_timeout=1.0)
    server = LiveServer(build_app(llm, manage_engine=True), llm=llm)
    seen: dict[str, Any] = {}

    def client() -> None:
        body = {"prompt": [5, 6, 7], "max_tokens": 100, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=TIMEOUT) as r:
            for chunk in r.iter_text():
                seen["first"] = True
                seen["raw"] = seen.get("raw", "") + chunk

    t = threading.Thread(target=client)
    t.start()
    deadline = time.monotonic() + 20
    while "first" not in seen:
        assert time.monotonic() < deadline, "no first chunk"
        time.sleep(0.01)
    t0 = time.monotonic()
    with caplog.at_level("INFO"):
        server.stop()
        t.join(15)
    took = time.monotonic() - t0
    assert not server.thread.is_alive() and not t.is_alive()
    assert took < 6.0, f"shutdown took {took:.1f}s; the request alone needed ~10 s more"
    events, done = parse_sse(seen["raw"])
    assert done, seen["raw"][-300:]
    assert "shutdown_timeout" in events[-1]["error"]["message"]
    assert llm.engine is not None and not llm.engine.has_unfinished()
    assert "Traceback" not in caplog.text and "CancelledError" not in caplog.text
    assert len([r for r in caplog.records if "shutdown_timeout expired" in r.getMessage()]) == 1


def test_a_slow_tokenization_does_not_stall_the_event_loop(live_server: Any, monkeypatch: Any) -> None:
    """Prompts are tokenized (and chat templates rendered) off the event loop: while one request's
    tokenization takes a second, /health still answers at once."""
    server, llm = live_server()
    tok = llm.tokenizer
    encode = tok.encode

    def slow_encode(text: str, add_special_tokens: bool = False) -> list[int]:
        if "slow" in text:
            time.sleep(1.0)
        return encode(text, add_special_tokens)

    monkeypatch.setattr(tok, "encode", slow_encode)

    async def main() -> tuple[float, int]:
        async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT) as client:
            body = {"model": "tiny-fake", "prompt": "a slow prompt", "max_tokens": 2}
            slow = asyncio.create_task(client.post("/v1/completions", json=body))
            await asyncio.sleep(0.3)  # the slow request is inside encode now
            t0 = time.monotonic()
            health = await client.get("/health")
            took = time.monotonic() - t0
            assert (await slow).status_code == 200
            return took, health.status_code

    took, status = asyncio.run(main())
    assert status == 200
    assert took < 0.5, f"/health took {took:.2f}s while a prompt was being tokenized"
