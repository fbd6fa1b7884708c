"""``pypto-serving router`` in front of two real replica servers (the fake executor behind the real
app and transport, on loopback ports): the OpenAI routes pass through unchanged (streams chunk by
chunk), every turn of 50 multi-turn conversations stays on its session's replica (and /metrics says
so), prompts sharing a prefix follow it, a drained replica finishes its requests and takes no new
ones, and the admin routes need the token."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.core.server.conftest import LiveServer, start_llm
from tests.core.server.router_helpers import RouterThread, replica_options
from tests.core.server.server_helpers import metric, parse_sse

pytest.importorskip("pypto_serving_sync_sched")

TOKEN = "admin-secret"


@pytest.fixture(scope="module")
def replicas(fake_model_dir: Path) -> Iterator[list[LiveServer]]:
    from pypto_serving.server import build_app

    made = []
    for _ in range(2):
        llm = start_llm(fake_model_dir, **replica_options(0.004))
        made.append((LiveServer(build_app(llm, manage_engine=False), llm=llm), llm))
    yield [server for server, _ in made]
    for server, llm in made:
        server.stop()
        llm.shutdown(10)


def make_router(servers: list[LiveServer], **overrides: Any) -> RouterThread:
    from pypto_serving.router import RouterSettings

    values: dict[str, Any] = {
        "replicas": [{"url": s.url, "name": f"r{i}"} for i, s in enumerate(servers)],
        "admin_token": TOKEN,
        "health_interval": 0.2,
        **overrides,
    }
    return RouterThread(RouterSettings(**values))


@pytest.fixture(scope="module")
def router(replicas: list[LiveServer]) -> Iterator[RouterThread]:
    r = make_router(replicas)
    yield r
    r.stop()


def admin(router: RouterThread, method: str, path: str, token: str | None = TOKEN) -> httpx.Response:
    headers = {"authorization": f"Bearer {token}"} if token else {}
    return httpx.request(method, router.url + path, headers=headers, timeout=10)


def test_completions_pass_through_unchanged(router: RouterThread, replicas: list[LiveServer]) -> None:
    body = {"prompt": [5, 6, 7, 8], "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    via = httpx.post(router.url + "/v1/completions", json=body, timeout=30)
    assert via.status_code == 200, via.text
    name = via.headers["x-pypto-replica"]
    direct = httpx.post(replicas[int(name[1])].url + "/v1/completions", json=body, timeout=30)
    assert via.json()["choices"] == direct.json()["choices"]
    chat = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 5, "temperature": 0}
    r = httpx.post(router.url + "/v1/chat/completions", json=chat, timeout=30)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"], r.text
    models = httpx.get(router.url + "/v1/models", timeout=10)
    assert models.status_code == 200 and models.json()["data"][0]["id"] == "tiny-fake"


def test_replica_errors_and_other_routes_pass_through(router: RouterThread) -> None:
    bad = httpx.post(router.url + "/v1/completions", json={"prompt": "hi", "max_tokens": -3}, timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens", bad.text
    junk = httpx.post(router.url + "/v1/completions", content=b"{not json", timeout=10)
    assert junk.status_code == 400 and junk.json()["error"]["code"] == "invalid_json", junk.text
    missing = httpx.get(router.url + "/v1/no-such-route", timeout=10)
    assert missing.status_code == 404 and "x-pypto-replica" in missing.headers
    own = httpx.get(router.url + "/nowhere", timeout=10)
    assert (
        own.status_code == 404 and own.json()["error"]["code"] == "not_found" and "x-pypto-replica" not in own.headers
    )
    assert httpx.delete(router.url + "/health", timeout=10).json()["error"]["code"] == "method_not_allowed"
    tok = httpx.post(router.url + "/tokenize", json={"prompt": "hello"}, timeout=10)
    assert tok.status_code == 200 and tok.json()["tokens"], tok.text


def test_a_body_over_the_limit_is_413(replicas: list[LiveServer]) -> None:
    small = make_router(replicas, max_request_body_bytes=1000)
    try:
        r = httpx.post(small.url + "/v1/completions", json={"prompt": "x" * 2000}, timeout=10)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    finally:
        small.stop()


def test_a_stream_passes_through_chunk_by_chunk(router: RouterThread, replicas: list[LiveServer]) -> None:
    body = {"prompt": [9, 10, 11], "max_tokens": 60, "ignore_eos": True, "stream": True, "temperature": 0}
    arrivals: list[float] = []
    raw = b""
    with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for chunk in r.iter_raw():
            arrivals.append(time.monotonic())
            raw += chunk
    events, done = parse_sse(raw.decode())
    assert done and len(events) >= 10
    text = "".join(e["choices"][0]["text"] for e in events if e["choices"])
    direct = httpx.post(replicas[0].url + "/v1/completions", json={**body, "stream": False}, timeout=30)
    assert text == direct.json()["choices"][0]["text"]
    # 60 steps of >= 4 ms each: a buffering router would deliver them in one burst at the end.
    assert len(arrivals) >= 10 and arrivals[-1] - arrivals[0] > 0.1, (len(arrivals), arrivals[-1] - arrivals[0])


def _turns(router: RouterThread, conversations: int, turns: int, header: bool = True) -> dict[str, set[str]]:
    """Chat ``turns`` turns in each of ``conversations`` sessions; the replicas each session's turns hit."""

    async def one(client: httpx.AsyncClient, sid: str) -> set[str]:
        messages: list[dict[str, str]] = []
        seen = set()
        for turn in range(turns):
            messages.append({"role": "user", "content": f"turn {turn} of {sid}"})
            body = {"messages": messages, "max_tokens": 3, "temperature": 0}
            r = await client.post("/v1/chat/completions", json=body, headers={"x-session-id": sid} if header else {})
            assert r.status_code == 200, r.text
            seen.add(r.headers["x-pypto-replica"])
            messages.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]})
        return seen

    async def run() -> dict[str, set[str]]:
        async with httpx.AsyncClient(base_url=router.url, timeout=60) as client:
            sids = [f"{'conversation' if header else 'unlabelled'}-{i}" for i in range(conversations)]
            return dict(zip(sids, await asyncio.gather(*(one(client, s) for s in sids))))

    return asyncio.run(run())


def test_session_affinity_keeps_every_turn_on_one_replica(router: RouterThread) -> None:
    before = httpx.get(router.url + "/metrics").text
    seen = _turns(router, conversations=50, turns=3)
    assert all(len(replicas) == 1 for replicas in seen.values()), seen
    used = [next(iter(s)) for s in seen.values()]
    assert 10 <= used.count("r0") <= 40, used  # rendezvous hashing spreads the sessions over both
    text = httpx.get(router.url + "/metrics").text
    hits = metric(text, 'pypto_router_session_affinity_total{result="hit"}')
    assert hits - metric(before, 'pypto_router_session_affinity_total{result="hit"}') == 150
    assert metric(text, 'pypto_router_session_affinity_total{result="miss"}') == 0
    assert metric(text, "pypto_router_session_affinity_hit_rate") == 1.0


def test_prompts_sharing_a_prefix_follow_it(router: RouterThread) -> None:
    shared = "the quick brown fox jumps over the lazy dog " * 4  # 176 characters: two whole 64-char blocks
    where = set()
    for i in range(8):
        body = {"prompt": shared + f"variant {i}", "max_tokens": 2}
        r = httpx.post(router.url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 200, r.text
        where.add(r.headers["x-pypto-replica"])
    assert len(where) == 1
    assert metric(httpx.get(router.url + "/metrics").text, 'pypto_router_prefix_total{result="hit"}') >= 7


def test_conversations_without_a_session_id_follow_their_prefix(router: RouterThread) -> None:
    before = metric(httpx.get(router.url + "/metrics").text, 'pypto_router_prefix_total{result="hit"}')
    seen = _turns(router, conversations=10, turns=3, header=False)
    assert all(len(replicas) == 1 for replicas in seen.values()), seen
    after = metric(httpx.get(router.url + "/metrics").text, 'pypto_router_prefix_total{result="hit"}')
    assert after - before == 20  # turns 2 and 3 of each


def test_a_drained_replica_finishes_its_requests_and_takes_no_new_ones(router: RouterThread) -> None:
    async def stream(client: httpx.AsyncClient, sid: str) -> tuple[str, list[dict[str, Any]], bool]:
        body = {"prompt": [5, 6], "max_tokens": 80, "ignore_eos": True, "stream": True}
        async with client.stream("POST", "/v1/completions", json=body, headers={"x-session-id": sid}) as r:
            raw = b"".join([c async for c in r.aiter_raw()])
        return r.headers["x-pypto-replica"], *parse_sse(raw.decode())

    async def run() -> None:
        async with httpx.AsyncClient(base_url=router.url, timeout=60) as client:
            streams = [asyncio.create_task(stream(client, f"drain-{i}")) for i in range(6)]
            await asyncio.sleep(0.15)  # the streams are in flight
            r = await client.post("/router/replicas/r0/drain", headers={"authorization": f"Bearer {TOKEN}"})
            assert r.status_code == 200 and r.json()["drained"] is True
            in_flight = r.json()["in_flight"]
            after = [await client.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 2}) for _ in range(6)]
            assert {a.headers["x-pypto-replica"] for a in after} == {"r1"}
            results = await asyncio.gather(*streams)
            on_r0 = [(events, done) for name, events, done in results if name == "r0"]
            assert len(on_r0) == in_flight > 0, results  # the sessions drain-* hash partly to r0
            for events, done in on_r0:
                assert done and sum(len(e["choices"][0]["text"]) > 0 for e in events if e["choices"]) > 0
                assert events[-1]["choices"][0]["finish_reason"] == "length"
            r = await client.post("/router/replicas/r0/undrain", headers={"authorization": f"Bearer {TOKEN}"})
            assert r.json()["drained"] is False

    asyncio.run(run())
    assert httpx.get(router.url + "/health").json()["replicas"] == ["r0", "r1"]


def test_the_admin_routes_need_the_token(router: RouterThread, replicas: list[LiveServer]) -> None:
    assert admin(router, "GET", "/router/replicas", token=None).status_code == 401
    assert admin(router, "GET", "/router/replicas", token="wrong").status_code == 401
    assert admin(router, "POST", "/router/replicas/r0/drain", token="wrong").status_code == 401
    listing = admin(router, "GET", "/router/replicas")
    assert listing.status_code == 200
    assert [(r["name"], r["healthy"], r["drained"]) for r in listing.json()["replicas"]] == [
        ("r0", True, False),
        ("r1", True, False),
    ]
    assert admin(router, "POST", "/router/replicas/nope/drain").status_code == 404
    assert not any(r["drained"] for r in admin(router, "GET", "/router/replicas").json()["replicas"])
    off = make_router(replicas, admin_token=None)
    try:
        r = httpx.get(off.url + "/router/replicas", headers={"authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 403 and r.json()["error"]["code"] == "admin_disabled"
    finally:
        off.stop()


def test_api_keys_guard_the_api_routes_not_health(replicas: list[LiveServer]) -> None:
    keyed = make_router(replicas, api_key=["k1"])
    try:
        body = {"prompt": "hi", "max_tokens": 2}
        assert httpx.post(keyed.url + "/v1/completions", json=body).status_code == 401
        ok = httpx.post(keyed.url + "/v1/completions", json=body, headers={"authorization": "Bearer k1"}, timeout=30)
        assert ok.status_code == 200, ok.text
        assert httpx.get(keyed.url + "/health").status_code == 200
    finally:
        keyed.stop()


def test_metrics_and_health(router: RouterThread) -> None:
    text = httpx.get(router.url + "/metrics").text
    for name in ("r0", "r1"):
        assert metric(text, f'pypto_router_replica_healthy{{replica="{name}"}}') == 1
        assert metric(text, f'pypto_router_requests_total{{replica="{name}"}}') > 0
        assert metric(text, f'pypto_router_outstanding_tokens{{replica="{name}"}}') == 0
    assert httpx.get(router.url + "/health").json()["status"] == "ok"


def test_no_replica_is_503() -> None:
    dead = make_router([], replicas=[{"url": "http://127.0.0.1:9", "name": "gone"}])
    try:
        assert httpx.get(dead.url + "/health").status_code == 503
        r = httpx.post(dead.url + "/v1/completions", json={"prompt": "hi"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_replica"
        assert metric(httpx.get(dead.url + "/metrics").text, "pypto_router_unrouted_total") == 1
    finally:
        dead.stop()


def test_a_client_leaving_before_the_answer_aborts_it_on_the_replica(
    router: RouterThread, replicas: list[LiveServer]
) -> None:
    body = {"prompt": [3, 4], "max_tokens": 600, "ignore_eos": True}  # >= 2.4 s of 4 ms steps, not streamed
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(router.url + "/v1/completions", json=body, timeout=httpx.Timeout(30, read=0.5))

    def running() -> float:
        return sum(metric(httpx.get(s.url + "/metrics").text, "pypto_serving_num_requests_running") for s in replicas)

    started = time.monotonic()
    while running() and time.monotonic() - started < 1.5:
        time.sleep(0.05)
    assert running() == 0, "the replica kept generating for a client that left"
    rows = admin(router, "GET", "/router/replicas").json()["replicas"]
    assert [r["in_flight"] for r in rows] == [0, 0] and [r["outstanding_tokens"] for r in rows] == [0, 0]
