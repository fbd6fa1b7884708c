"""A real ``pypto-serving serve`` subprocess (tiny Qwen3, ``--worker-mode process``) against the ways
production goes wrong: clients that time out under load, poison values, stalled connections, a
worker killed with SIGKILL while idle or busy, and a worker that keeps dying past the restart
budget. After each, the server must be healthy again by itself, give the same greedy text as before,
hold no request or KV block, and have logged no traceback.

One server (``--http-header-timeout 1 --http-body-timeout 1``) serves every test here but the
restart-budget one; tests run in file order, so the worker kills come after the rest and the
server's own SIGKILL last. The file costs two server start-ups."""

from __future__ import annotations

import asyncio
import json
import os
import random
import select
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("pypto_serving_sync_sched")
pytest.importorskip("pypto_serving_qwen")

from tests.core.server.server_helpers import (
    descendant_pids,
    is_running,
    json_bytes,
    metric,
    parse_sse,
    poison_requests,
    wait_for,
    worker_pids,
)
from tests.core.server.test_server_process import COMMON, Proc, qwen_dir  # noqa: F401 - qwen_dir is a fixture

# A real worker process to kill, and room for every sequence of the load test without preemption.
PROCESS = [*COMMON, "--worker-mode", "process", "--num-kv-blocks", "2048"]
GREEDY = {"prompt": "the quick brown fox", "max_tokens": 16, "temperature": 0, "ignore_eos": True}
START_TIMEOUT = 120  # two loaded cores start torch twice (server and worker)


def _stop(proc: Proc) -> None:
    if proc.p.poll() is None:
        proc.p.send_signal(signal.SIGTERM)
        try:
            proc.p.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def _clean_log(proc: Proc) -> None:
    log = proc.log.read_text()
    for needle in ("Traceback", "Exception in ASGI application"):
        assert needle not in log, log


def _greedy(url: str) -> str:
    r = httpx.post(url + "/v1/completions", json=GREEDY, timeout=60)
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["text"]
    assert isinstance(text, str)
    return text


def _metrics(url: str) -> str:
    r = httpx.get(url + "/metrics", timeout=10)
    assert r.status_code == 200
    return r.text


def _idle_gauges(url: str) -> tuple[float, float, float]:
    text = _metrics(url)
    return (
        metric(text, "pypto_serving_num_requests_running"),
        metric(text, "pypto_serving_num_requests_waiting"),
        metric(text, "pypto_serving_kv_cache_usage_perc"),
    )


def _wait_idle(url: str, timeout: float = 15) -> None:
    """Running, waiting and KV usage all back to zero (aborts land within the disconnect poll)."""
    last: list[tuple[float, float, float]] = []

    def idle() -> bool:
        last[:] = [_idle_gauges(url)]
        return last[0] == (0.0, 0.0, 0.0)

    try:
        wait_for(idle, timeout, "running/waiting/kv usage back to 0", interval=0.1)
    except AssertionError as e:
        raise AssertionError(f"{e}: (running, waiting, kv) = {last}") from None


def _health(url: str) -> httpx.Response:
    return httpx.get(url + "/health", timeout=5)


def _wait_healthy(proc: Proc, timeout: float = START_TIMEOUT) -> None:
    def ok() -> bool:
        assert proc.p.poll() is None, proc.log.read_text()
        try:
            return _health(proc.url).status_code == 200
        except httpx.HTTPError:
            return False

    wait_for(ok, timeout, "/health 200", interval=0.1)


def _the_worker(proc: Proc) -> int:
    workers = wait_for(lambda: worker_pids(proc.p.pid), 10, "a worker process")
    assert len(workers) == 1, workers
    return int(workers[0])


def _restarts(url: str) -> float:
    return metric(_metrics(url), "pypto_serving_worker_restarts_total")


@pytest.fixture(scope="module")
def server(qwen_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:  # noqa: F811
    log = tmp_path_factory.mktemp("resilience") / "server.log"
    proc = Proc(
        ["--model", str(qwen_dir), *PROCESS, "--http-header-timeout", "1", "--http-body-timeout", "1"],
        log,
    )
    try:
        _wait_healthy(proc)
        yield proc
    finally:
        _stop(proc)


@pytest.fixture(scope="module")
def reference(server: Proc) -> str:
    """The greedy text of the fresh server, before anything went wrong."""
    return _greedy(server.url)


# --------------------------------------------------------------------------- a. client timeouts under load


async def _stream(client: httpx.AsyncClient, i: int, started: list[int]) -> dict[str, Any]:
    body = {
        "prompt": f"stream number {i}",
        "max_tokens": 64,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        text = ""
        async for chunk in r.aiter_text():
            if not text:
                started.append(i)
            text += chunk
    events, done = parse_sse(text)
    assert done, text
    return events[-1]


async def _impatient(url: str, i: int, timeout: float) -> str:
    body = {"prompt": f"impatient {i}", "max_tokens": 256, "ignore_eos": True}
    async with httpx.AsyncClient(base_url=url) as client:
        try:
            r = await client.post("/v1/completions", json=body, timeout=timeout)
        except httpx.TimeoutException:
            return "timeout"
    return str(r.status_code)


async def _load(url: str, rng: random.Random) -> tuple[list[dict[str, Any]], list[str]]:
    started: list[int] = []
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=httpx.Limits(max_connections=64)) as client:
        streams = [asyncio.create_task(_stream(client, i, started)) for i in range(24)]
        deadline = time.monotonic() + 60
        while len(started) < 16:  # the load is on: most streams are decoding
            assert time.monotonic() < deadline, f"only {len(started)} streams started"
            assert not any(t.done() and t.exception() for t in streams), [t.exception() for t in streams if t.done()]
            await asyncio.sleep(0.02)
        impatient = []
        for i in range(30):
            impatient.append(asyncio.create_task(_impatient(url, i, rng.uniform(0.05, 0.4))))
            await asyncio.sleep(rng.uniform(0, 0.02))
        outcomes = list(await asyncio.gather(*impatient))
        finals = list(await asyncio.gather(*streams))
    return finals, outcomes


def test_client_timeouts_under_load_leave_the_server_clean(server: Proc, reference: str) -> None:
    finals, outcomes = asyncio.run(_load(server.url, random.Random(10)))
    # The streams were not disturbed by their impatient neighbours: all ran to max_tokens.
    assert [f["usage"]["completion_tokens"] for f in finals] == [64] * 24
    timeouts = outcomes.count("timeout")
    assert set(outcomes) <= {"timeout", "200"}, outcomes
    assert timeouts >= 20, outcomes  # 256 tokens beside 24 streams take longer than 0.4 s
    _wait_idle(server.url)  # the abandoned requests were aborted, their blocks freed
    assert _health(server.url).status_code == 200
    assert _greedy(server.url) == reference
    # Every client that left is one 499 line (none for a client that left before its headers were read).
    n499 = wait_for(lambda: server.log.read_text().count("POST /v1/completions 499"), 5, "499 access lines")
    assert 1 <= n499 <= timeouts
    _clean_log(server)
    print(f"client timeouts under load: {timeouts}/30 timed out, {n499} logged as 499")


# --------------------------------------------------------------------------- b. poison values

POISON = poison_requests()


@pytest.mark.parametrize(("path", "body", "param"), [c[1:] for c in POISON], ids=[c[0] for c in POISON])
def test_poison_values_get_400_naming_the_field(
    server: Proc, reference: str, path: str, body: dict[str, Any], param: str
) -> None:
    r = httpx.post(
        server.url + path, content=json_bytes(body), headers={"content-type": "application/json"}, timeout=30
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    assert _health(server.url).status_code == 200
    assert _greedy(server.url) == reference
    _clean_log(server)


# --------------------------------------------------------------------------- e. stalled connections


def _stalled(port: int, first: bytes, trickle: bytes = b"") -> tuple[bytes, float]:
    """Send ``first``, then ``trickle`` one byte per 0.2 s, until the server answers; returns everything
    it sent before closing and the seconds from the first byte to the close."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        start = time.monotonic()
        s.sendall(first)
        pending = trickle
        while pending and not select.select([s], [], [], 0.2)[0]:
            try:
                s.sendall(pending[:1])
            except OSError:
                break
            pending = pending[1:]
        received = b""
        while chunk := s.recv(4096):  # socket timeout 5 s: a server that never closes fails here
            received += chunk
        return received, time.monotonic() - start


@pytest.mark.parametrize(
    ("first", "trickle"),
    [
        (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-", b""),
        (
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: 100\r\n\r\n" + b'{"prompt":',
            b"",
        ),
        (b"POST /v1/completions HTTP/1.1\r\n", b"x-slow: " + b"a" * 40),
    ],
    ids=["half-headers", "short-body", "trickled-headers"],
)
def test_stalled_connection_gets_408_and_is_closed(server: Proc, reference: str, first: bytes, trickle: bytes) -> None:
    received, seconds = _stalled(server.port, first, trickle)
    assert received.startswith(b"HTTP/1.1 408"), received
    # The deadline (1 s) counts from the phase's start, so trickling bytes does not extend it.
    assert 0.9 <= seconds <= 2.5, seconds
    assert _greedy(server.url) == reference
    _clean_log(server)


# --------------------------------------------------------------------------- c. worker SIGKILL


def test_worker_killed_while_idle_is_replaced(server: Proc, reference: str) -> None:
    old = _the_worker(server)
    restarts = _restarts(server.url)
    os.kill(old, signal.SIGKILL)
    killed = time.monotonic()

    def noticed() -> str | None:
        r = _health(server.url)
        if r.status_code == 503:
            assert r.json()["status"] == "restarting" and "exit code -9" in r.json()["reason"], r.text
            return "restarting"
        new = [w for w in worker_pids(server.p.pid) if w != old]
        return "replaced" if r.status_code == 200 and new and old not in worker_pids(server.p.pid) else None

    state = wait_for(noticed, 1.5, "/health to notice the dead idle worker")
    if state == "restarting":
        r = httpx.post(server.url + "/v1/completions", json=GREEDY, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "restarting", r.text
        assert r.headers["retry-after"]
    _wait_healthy(server, 60)
    recovered = time.monotonic() - killed
    new = _the_worker(server)
    assert new != old and not is_running(old)
    assert _greedy(server.url) == reference
    assert _restarts(server.url) == restarts + 1
    _wait_idle(server.url)
    _clean_log(server)
    print(f"idle worker kill: /health 200 again after {recovered:.2f}s")


def _has_content(sse: str) -> bool:
    """Whether the complete events of a partial SSE body carry generated text (completion or chat)."""
    for block in sse.split("\n\n")[:-1]:
        data = block.strip().removeprefix("data: ")
        if data and data != "[DONE]":
            choices = json.loads(data).get("choices", [])
            if any(c.get("text") or c.get("delta", {}).get("content") for c in choices):
                return True
    return False


async def _busy_kill(proc: Proc, old: int) -> tuple[list[str], list[httpx.Response]]:
    long = {"max_tokens": 400, "ignore_eos": True}
    decoding: set[int] = set()  # streams that got generated text
    async with httpx.AsyncClient(base_url=proc.url, timeout=120) as client:

        async def stream(i: int) -> str:
            if i == 0:
                path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": "busy stream"}]}
            else:
                path, body = "/v1/completions", {"prompt": f"busy stream {i}"}
            async with client.stream("POST", path, json={**body, "stream": True, **long}) as r:
                assert r.status_code == 200
                text = ""
                async for chunk in r.aiter_text():
                    text += chunk
                    if _has_content(text):
                        decoding.add(i)
                return text

        plain = [
            asyncio.create_task(client.post("/v1/completions", json={"prompt": f"busy {i}", **long})) for i in range(2)
        ]
        chat = asyncio.create_task(
            client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "busy"}], **long})
        )
        streams = [asyncio.create_task(stream(i)) for i in range(4)]

        async def all_running() -> None:
            running = 0.0
            while running < 7 or len(decoding) < len(streams):
                running = metric((await client.get("/metrics")).text, "pypto_serving_num_requests_running")
                assert not any(t.done() for t in [*plain, chat, *streams]), "a request ended before the kill"
                await asyncio.sleep(0.02)

        await asyncio.wait_for(all_running(), 60)
        os.kill(old, signal.SIGKILL)
        bodies = list(await asyncio.gather(*streams))
        responses = list(await asyncio.gather(*plain, chat))
    return bodies, responses


def test_worker_killed_while_busy_fails_in_flight_then_serves(server: Proc, reference: str) -> None:
    old = _the_worker(server)
    restarts = _restarts(server.url)
    bodies, responses = asyncio.run(_busy_kill(server, old))
    for body in bodies:  # each stream: some tokens, then an error event, then [DONE]
        events, done = parse_sse(body)
        assert done, body
        assert events[-1]["error"]["code"] == "generation_failed", events[-1]
        assert "died" in events[-1]["error"]["message"], events[-1]
        assert any(c.get("text") or c.get("delta", {}).get("content") for e in events[:-1] for c in e["choices"])
    for r in responses:
        assert r.status_code == 500 and r.json()["error"]["code"] == "generation_failed", r.text
    _wait_healthy(server, 60)
    new = _the_worker(server)
    assert new != old and not is_running(old)
    assert _greedy(server.url) == reference
    assert _restarts(server.url) == restarts + 1
    _wait_idle(server.url)
    _clean_log(server)


def test_serve_killed_leaves_no_worker_behind(server: Proc) -> None:
    """A supervisor's SIGKILL of ``serve`` (last user of the shared server): its worker and resource
    tracker notice the closed pipes and exit; nothing is left running."""
    children = descendant_pids(server.p.pid)
    assert len(worker_pids(server.p.pid)) == 1 and len(children) >= 1
    server.p.kill()
    server.p.wait(10)
    wait_for(lambda: not any(is_running(p) for p in children), 10, f"the children {children} of a killed serve to exit")


# --------------------------------------------------------------------------- d. restart budget


def test_restart_budget_exhausted_exits_1(qwen_dir: Path, tmp_path: Path) -> None:  # noqa: F811
    proc = Proc(["--model", str(qwen_dir), *PROCESS, "--max-worker-restarts", "1"], tmp_path / "server.log")
    try:
        _wait_healthy(proc)
        first = _the_worker(proc)
        seen = set(descendant_pids(proc.p.pid))
        os.kill(first, signal.SIGKILL)  # the one restart the budget allows
        wait_for(lambda: worker_pids(proc.p.pid) not in ([], [first]), 60, "a replacement worker")
        _wait_healthy(proc, 60)
        second = _the_worker(proc)
        seen |= set(descendant_pids(proc.p.pid))
        assert second != first
        os.kill(second, signal.SIGKILL)  # one too many: nobody has to stop the server
        try:
            code = proc.p.wait(60)
        except subprocess.TimeoutExpired:
            log = proc.log.read_text()
            raise AssertionError(f"serve did not exit after its restart budget ran out:\n{log}") from None
        log = proc.log.read_text()
        assert code == 1, log
        errors = [line for line in log.splitlines() if line.startswith("pypto-serving: error:")]
        assert len(errors) == 1 and "no restart left (max_worker_restarts=1 per 600s)" in errors[0], log
        assert "Traceback" not in log, log
        # No process of the server outlives it (worker, resource tracker).
        wait_for(lambda: not any(is_running(p) for p in seen), 10, f"the children {sorted(seen)} to exit")
    finally:
        _stop(proc)
