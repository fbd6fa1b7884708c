"""A real ``pypto-serving serve`` subprocess (tiny Qwen3, engine-core process, worker process) around
the moments a process stops or dies, and the transport details the last attack found (issue 25):

* a reused keep-alive connection answers without Nagle's 40 ms (``TCP_NODELAY`` on accepted sockets);
* an empty API key is refused at start-up, and the Bearer token is compared raw (no ``strip()``);
* ``/health`` says 503 ``stalled`` once a SIGSTOPped core or worker has frozen the engine for
  ``health_step_timeout``, and 200 again after SIGCONT;
* a request sent just after an idle worker's SIGKILL gets 503 ``restarting`` with ``Retry-After``,
  and a non-streamed request in flight at an engine-core SIGKILL gets 500 ``generation_failed``;
* during a SIGTERM drain ``/health`` answers 503 instead of refusing connections.

One server serves the whole file, its tests run in file order (the kills after the freezes, the drain
last), so the file costs one start-up and two restarts."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import statistics
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

pytest.importorskip("pypto_serving_sync_sched")
pytest.importorskip("pypto_serving_qwen")

from tests.core.server.server_helpers import core_pids, wait_for, worker_pids
from tests.core.server.test_server_process import COMMON, SERVE, Proc, _env, qwen_dir  # noqa: F401 - a fixture

KEY = "sk-test"
AUTH = {"authorization": f"Bearer {KEY}"}
ARGS = [
    *COMMON,
    "--worker-mode",
    "process",
    "--engine-mode",
    "process",
    "--api-key",
    KEY,
    "--health-step-timeout",
    "1",
    "--max-worker-restarts",
    "5",
]
LONG = {"prompt": "the quick brown fox", "max_tokens": 400, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(qwen_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:  # noqa: F811
    proc = Proc(["--model", str(qwen_dir), *ARGS], tmp_path_factory.mktemp("liveness") / "server.log")
    try:
        proc.wait_healthy(120)
        yield proc
    finally:
        proc.kill()


def _health(url: str) -> httpx.Response:
    return httpx.get(url + "/health", timeout=5)


def _wait_health(proc: Proc, status: int, timeout: float) -> tuple[httpx.Response, float]:
    """The first /health answer with ``status`` and how long it took to come."""
    start = time.monotonic()
    seen: list[httpx.Response] = []

    def check() -> bool:
        assert proc.p.poll() is None, proc.log.read_text()
        try:
            seen[:] = [_health(proc.url)]
        except httpx.HTTPError:
            return False
        return seen[0].status_code == status

    wait_for(check, timeout, f"/health {status}", interval=0.05)
    return seen[0], time.monotonic() - start


def _one(pids: list[int]) -> int:
    assert len(pids) == 1, pids
    return pids[0]


# --------------------------------------------------------------------------- no server needed


def test_accepted_connections_have_tcp_nodelay() -> None:
    """The listening socket says IPPROTO_TCP, so asyncio sets TCP_NODELAY on every accepted one
    (protocol 0 left Nagle on: 40 ms per response on a reused connection)."""
    from pypto_serving.server.cli import _bind

    async def accept_one() -> int:
        sock = _bind("127.0.0.1", 0)
        seen: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        async def on_client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            seen.set_result(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(on_client, sock=sock)
        async with server:
            _, writer = await asyncio.open_connection(*sock.getsockname()[:2])
            value = await asyncio.wait_for(seen, 5)
            writer.close()
        return value

    assert asyncio.run(accept_one()) != 0


@pytest.mark.parametrize("keys", ['["sk-test", ""]', '["sk-test", "\\u00a0"]'])
def test_blank_api_keys_are_refused_at_start_up(keys: str) -> None:
    """An empty key matched a blank token (``Bearer \\xa0`` once stripped): anyone got in."""
    r = subprocess.run(
        [*SERVE, "--api-key", keys, "--port", "0"], capture_output=True, text=True, env=_env(), timeout=60
    )
    assert r.returncode == 2, r.stdout + r.stderr
    assert "api_key entry" in r.stderr and "serving" not in r.stdout


# --------------------------------------------------------------------------- one server, in order


def test_reused_connection_answers_without_delayed_ack(server: Proc) -> None:
    """A keep-alive connection's later responses come as fast as its first (was +40 ms each)."""
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=10) as client:
        for path in ("/health", "/v1/models"):
            times = []
            for _ in range(15):
                start = time.perf_counter()
                assert client.get(path).status_code == 200
                times.append(time.perf_counter() - start)
            assert statistics.median(times[1:]) < 0.02, (path, times)
            print(f"keep-alive {path}: median {statistics.median(times[1:]) * 1e3:.1f} ms after the first")
        body = {"prompt": "hi", "max_tokens": 1}
        times = []
        for _ in range(6):
            start = time.perf_counter()
            assert client.post("/v1/completions", json=body).status_code == 200
            times.append(time.perf_counter() - start)
        assert statistics.median(times[1:]) < 0.1, times


@pytest.mark.parametrize("token", [b"sk-test\xa0", b"sk-test\x85", b"\xa0", b"\x85", b"sk-tes"])
def test_bearer_token_is_compared_raw(server: Proc, token: bytes) -> None:
    r = httpx.get(server.url + "/v1/models", headers={"authorization": b"Bearer " + token}, timeout=5)
    assert r.status_code == 401, r.text
    assert httpx.get(server.url + "/v1/models", headers=AUTH, timeout=5).status_code == 200


def test_a_stopped_core_process_makes_health_stalled(server: Proc) -> None:
    core = _one(core_pids(server.p.pid))
    os.kill(core, signal.SIGSTOP)
    try:
        r, took = _wait_health(server, 503, 10)
    finally:
        os.kill(core, signal.SIGCONT)
    assert r.json()["status"] == "stalled" and "engine core process" in r.json()["reason"], r.text
    assert r.headers["retry-after"] and took < 4, took  # the bound (1 s) from the last beat heard
    print(f"SIGSTOPped core: /health 503 after {took:.2f}s")
    _wait_health(server, 200, 10)


def test_a_stopped_worker_makes_health_stalled_while_a_step_waits(server: Proc) -> None:
    worker = _one(worker_pids(server.p.pid))
    result: list[httpx.Response] = []
    thread = threading.Thread(
        target=lambda: result.append(httpx.post(server.url + "/v1/completions", json=LONG, headers=AUTH, timeout=60))
    )
    os.kill(worker, signal.SIGSTOP)
    try:
        thread.start()
        r, took = _wait_health(server, 503, 10)
    finally:
        os.kill(worker, signal.SIGCONT)
    assert r.json()["status"] == "stalled" and "step has run for" in r.json()["reason"], r.text
    print(f"SIGSTOPped worker: /health 503 {took:.2f}s after the request")
    thread.join(60)
    assert result and result[0].status_code == 200, result
    _wait_health(server, 200, 10)


def test_a_request_right_after_an_idle_worker_kill_is_told_to_retry(server: Proc) -> None:
    """Sent 50 ms after the kill, before the 0.5 s idle poll: 503 restarting, never a broken pipe 500."""
    worker = _one(worker_pids(server.p.pid))
    os.kill(worker, signal.SIGKILL)
    time.sleep(0.05)
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=AUTH, timeout=30)
    assert r.status_code == 503, r.text
    assert r.json()["error"]["code"] == "restarting" and r.headers["retry-after"], r.text
    _, took = _wait_health(server, 200, 60)
    print(f"idle worker SIGKILL: serving again after {took:.2f}s")


def test_a_core_kill_fails_the_request_in_flight_with_500_and_then_says_restarting(server: Proc) -> None:
    core = _one(core_pids(server.p.pid))
    result: list[httpx.Response] = []
    thread = threading.Thread(
        target=lambda: result.append(httpx.post(server.url + "/v1/completions", json=LONG, headers=AUTH, timeout=60))
    )
    thread.start()
    wait_for(lambda: _running(server.url) >= 1, 10, "the request to run")
    os.kill(core, signal.SIGKILL)
    thread.join(30)
    assert result and result[0].status_code == 500, result
    assert result[0].json()["error"]["code"] == "generation_failed", result[0].text
    after = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=AUTH, timeout=30)
    if after.status_code != 200:  # the new core may already serve
        assert after.status_code == 503 and after.json()["error"]["code"] == "restarting", after.text
        assert after.headers["retry-after"], after.headers
    _, took = _wait_health(server, 200, 60)
    print(f"core SIGKILL: serving again after {took:.2f}s")


def test_health_answers_503_during_a_sigterm_drain(server: Proc) -> None:
    """Last: the drain ends the server. Connections are still accepted while a stream is in flight."""
    with (
        httpx.Client(timeout=30) as client,
        client.stream("POST", server.url + "/v1/completions", json={**LONG, "stream": True}, headers=AUTH) as stream,
    ):
        lines = stream.iter_lines()
        assert next(lines).startswith("data: ")
        server.p.send_signal(signal.SIGTERM)
        r, _ = _wait_health(server, 503, 5)
        assert r.json() == {"status": "unavailable", "reason": "shutting down"} and r.headers["retry-after"]
        late = httpx.post(server.url + "/v1/completions", json={"prompt": "hi"}, headers=AUTH, timeout=5)
        assert late.status_code == 503 and late.json()["error"]["code"] == "shutting_down", late.text
        rest = list(lines)
    assert rest[-2:] == ["data: [DONE]", ""] or rest[-1] == "data: [DONE]", rest[-3:]
    assert server.p.wait(30) == 0


def _running(url: str) -> float:
    text = httpx.get(url + "/metrics", headers=AUTH, timeout=5).text
    for line in text.splitlines():
        if line.startswith("pypto_serving_num_requests_running"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0
