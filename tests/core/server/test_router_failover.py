"""Failover of ``pypto-serving router``: the router runs as the real command, launches its two replica
processes from its TOML config (each a fake-executor server), and one replica is killed with SIGKILL
while streams run on both. Only the killed replica's streams fail, each with an SSE error event and
``[DONE]`` (no hang); the other's finish; the killed replica's sessions move, and come back once the
router has started it again; SIGTERM to the router stops the replicas it launched. A request whose
replica refuses the connection is sent once to another replica."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.core.server.conftest import LiveServer, start_llm
from tests.core.server.router_helpers import RouterThread, replica_options
from tests.core.server.server_helpers import free_port, metric, parse_sse, wait_for

pytest.importorskip("pypto_serving_sync_sched")

ROOT = Path(__file__).resolve().parents[3]
TOKEN = "t0ken"


def _toml_list(items: list[str]) -> str:
    return "[" + ", ".join(f'"{i}"' for i in items) + "]"


@pytest.fixture
def launched(fake_model_dir: Path, tmp_path: Path) -> Iterator[tuple[str, subprocess.Popen[bytes], Path]]:
    """(router URL, router process, log dir): a router that launched two replica processes."""
    lines = [
        'admin_token = "t0ken"',
        "health_interval = 0.2",
        "restart_delay = 2.0",
        f'log_dir = "{tmp_path / "logs"}"',
    ]
    for name in ("r0", "r1"):
        port = free_port()
        command = [sys.executable, "-m", "tests.core.server.router_helpers", str(fake_model_dir), str(port), "0.01"]
        lines += [
            "[[replicas]]",
            f'name = "{name}"',
            f'url = "http://127.0.0.1:{port}"',
            f"command = {_toml_list(command)}",
        ]
    config = tmp_path / "router.toml"
    config.write_text("\n".join(lines) + "\n")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYPTO_")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    log = (tmp_path / "router.log").open("wb")
    cmd = [sys.executable, "-m", "pypto_serving.cli", "router", "--config", str(config), "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"

    def both_healthy() -> bool:
        assert proc.poll() is None, (tmp_path / "router.log").read_text()
        try:
            return len(httpx.get(url + "/health", timeout=2).json().get("replicas", [])) == 2
        except httpx.HTTPError:
            return False

    try:
        wait_for(both_healthy, 120, "the router and both launched replicas")
        yield url, proc, tmp_path / "logs"
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(60)
        log.close()


def _replicas(url: str) -> dict[str, dict[str, Any]]:
    r = httpx.get(url + "/router/replicas", headers={"authorization": f"Bearer {TOKEN}"}, timeout=5)
    return {row["name"]: row for row in r.json()["replicas"]}


async def _stream(client: httpx.AsyncClient, sid: str, started: asyncio.Event) -> tuple[str, list[Any], bool]:
    body = {"prompt": [5, 6, 7], "max_tokens": 200, "ignore_eos": True, "stream": True}
    raw = b""
    async with client.stream("POST", "/v1/completions", json=body, headers={"x-session-id": sid}) as r:
        async for chunk in r.aiter_raw():
            raw += chunk
            started.set()
    events, done = parse_sse(raw.decode())
    return r.headers["x-pypto-replica"], events, done


def test_killing_a_replica_fails_only_its_streams_and_its_sessions_move(
    launched: tuple[str, subprocess.Popen[bytes], Path],
) -> None:
    url, router, logs = launched
    pids = {name: row["pid"] for name, row in _replicas(url).items()}

    async def run() -> list[tuple[str, list[Any], bool]]:
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            flags = [asyncio.Event() for _ in range(8)]
            streams = [asyncio.create_task(_stream(client, f"s{i}", flags[i])) for i in range(8)]
            await asyncio.wait_for(asyncio.gather(*(f.wait() for f in flags)), 30)  # every stream is producing
            os.kill(pids["r0"], signal.SIGKILL)
            return await asyncio.wait_for(asyncio.gather(*streams), 30)  # none hangs

    results = asyncio.run(run())
    on = {name: [(events, done) for n, events, done in results if n == name] for name in ("r0", "r1")}
    assert on["r0"] and on["r1"], results  # the eight sessions spread over both
    for events, done in on["r0"]:
        assert done and "error" in events[-1] and "r0" in events[-1]["error"]["message"], events[-1:]
    for events, done in on["r1"]:
        assert done and events[-1]["choices"][0]["finish_reason"] == "length"
    # Every session, r0's included, is served now: by r1.
    for i in range(8):
        r = httpx.post(
            url + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 2}, headers={"x-session-id": f"s{i}"}
        )
        assert r.status_code == 200 and r.headers["x-pypto-replica"] == "r1", r.text
    state = _replicas(url)
    assert state["r0"]["healthy"] is False and state["r0"]["last_exit_code"] == -signal.SIGKILL
    assert state["r1"]["healthy"] is True and state["r1"]["in_flight"] == 0
    text = httpx.get(url + "/metrics").text
    assert metric(text, 'pypto_router_replica_failures_total{replica="r0",stage="response"}') == len(on["r0"])
    assert metric(text, 'pypto_router_session_affinity_total{result="miss"}') >= 1
    assert (logs / "r0.log").stat().st_size > 0 and (logs / "r1.log").stat().st_size > 0
    # The router starts r0 again (restart_delay later); once healthy it takes its sessions back.
    wait_for(lambda: _replicas(url)["r0"]["healthy"], 120, "r0 started again")
    again = _replicas(url)["r0"]
    assert again["restarts"] == 1 and again["pid"] != pids["r0"] and again["exit_code"] is None
    back = [i for i in range(8) if _routed(url, f"s{i}") == "r0"]
    assert back, "no session returned to the restarted r0"
    router.send_signal(signal.SIGTERM)
    assert router.wait(60) == 0
    for pid in (pids["r1"], again["pid"]):
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # stopped with the router


def _routed(url: str, sid: str) -> str:
    r = httpx.post(url + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 2}, headers={"x-session-id": sid})
    assert r.status_code == 200, r.text
    return r.headers["x-pypto-replica"]


def test_a_refused_request_is_retried_once_elsewhere(fake_model_dir: Path) -> None:
    from pypto_serving.router import RouterSettings, rendezvous_order
    from pypto_serving.server import build_app

    llm = start_llm(fake_model_dir, **replica_options(0.0))
    live = LiveServer(build_app(llm, manage_engine=False), llm=llm)
    dead_url = f"http://127.0.0.1:{free_port()}"  # nothing listens here
    settings = RouterSettings(
        replicas=[{"url": live.url, "name": "live"}, {"url": dead_url, "name": "dead"}], health_interval=60
    )
    router = RouterThread(settings)
    try:
        router.state.replicas["dead"].load.healthy = True  # as if it died after its last good poll
        sid = next(f"s{i}" for i in range(100) if rendezvous_order(f"s{i}", ["live", "dead"])[0] == "dead")
        r = httpx.post(
            router.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers={"x-session-id": sid}
        )
        assert r.status_code == 200 and r.headers["x-pypto-replica"] == "live", r.text
        text = httpx.get(router.url + "/metrics").text
        assert metric(text, "pypto_router_retries_total") == 1
        assert metric(text, 'pypto_router_replica_failures_total{replica="dead",stage="connect"}') == 1
        assert router.state.replicas["dead"].load.healthy is False  # marked at once, not at the next poll
        again = httpx.post(
            router.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers={"x-session-id": sid}
        )
        assert (
            again.status_code == 200
            and metric(httpx.get(router.url + "/metrics").text, "pypto_router_retries_total") == 1
        )
    finally:
        router.stop()
        live.stop()
        llm.shutdown(10)


def test_a_replica_command_that_cannot_start_fails_the_router(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    from pypto_serving.router import RouterSettings
    from pypto_serving.router.cli import run_router

    settings = RouterSettings(
        port=0,
        log_dir=tmp_path / "logs",
        replicas=[
            {
                "url": f"http://127.0.0.1:{free_port()}",
                "name": "ok",
                "command": [sys.executable, "-c", "import time; time.sleep(60)"],
            },
            {"url": "http://127.0.0.1:9", "name": "bad", "command": ["/nonexistent/serve"]},
        ],
    )
    caplog.set_level(logging.INFO, logger="pypto_serving.router")
    started = time.monotonic()
    assert run_router(settings) == 1
    err = capsys.readouterr().err
    assert "the router did not start" in err
    assert "cannot start replica bad (/nonexistent/serve)" in err + caplog.text  # uvicorn's log, on stderr
    assert "stopped replica ok" in caplog.text  # the one launched before the failure does not outlive it
    assert time.monotonic() - started < 30
