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
        assert r.status_code == 200
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


def test_engine_death_ends_streams_with_error_and_health_503(live_server: Any) -> None:
    server, _ = live_server(worker_mode="process", executor_options={"crash_on_token": 299, "step_sleep": 0.01})

    async def main() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT) as client:
            assert (await client.get("/health")).status_code == 200
            long = asyncio.ensure_future(stream(client, {"prompt": [5, 6], "max_tokens": 100, "ignore_eos": True}))
            await asyncio.sleep(0.3)
            crash = await asyncio.wait_for(stream(client, {"prompt": [299], "max_tokens": 5}), 20)
            raw = await asyncio.wait_for(long, 20)
            for body in (crash, raw):
                assert body is not None
                events, done = parse_sse(body)
                assert done and "error" in events[-1], body[-300:]
            r = await client.get("/health")
            assert r.status_code == 503 and "worker" in r.json()["reason"]
            r = await client.post("/v1/completions", json={"prompt": [5], "max_tokens": 2})
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
            assert "pypto_serving_engine_dead{" in (await client.get("/metrics")).text

    asyncio.run(main())


def test_shutdown_timeout_expiry_aborts_what_is_still_running(fake_model_dir: Any) -> None:
    """Graceful shutdown waits ``shutdown_timeout`` (1 s here) for in-flight requests, then aborts
    the rest: a request needing ~10 s more must not keep the server up, and the engine ends empty."""
    import threading

    from pypto_serving.server import build_app
    from tests.core.server.conftest import LiveServer, start_llm

    llm = start_llm(fake_model_dir, executor_options={"step_sleep": 0.1}, shutdown_timeout=1.0)
    server = LiveServer(build_app(llm, manage_engine=True), graceful_shutdown=1)
    seen: dict[str, Any] = {}

    def client() -> None:
        body = {"prompt": [5, 6, 7], "max_tokens": 100, "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=TIMEOUT) as r:
                for chunk in r.iter_text():
                    seen["first"] = True
                    seen["raw"] = seen.get("raw", "") + chunk
        except httpx.HTTPError as e:  # the server may cut the connection when it gives up waiting
            seen["error"] = e

    t = threading.Thread(target=client)
    t.start()
    deadline = time.monotonic() + 20
    while "first" not in seen:
        assert time.monotonic() < deadline, "no first chunk"
        time.sleep(0.01)
    t0 = time.monotonic()
    server.stop()
    t.join(15)
    took = time.monotonic() - t0
    assert not server.thread.is_alive() and not t.is_alive()
    assert took < 6.0, f"shutdown took {took:.1f}s; the request alone needed ~10 s more"
    assert '"finish_reason":"length"' not in seen.get("raw", "").replace(" ", "")
    assert llm.engine is not None and not llm.engine.has_unfinished()
