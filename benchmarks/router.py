"""Router overhead per request and the session-affinity hit rate of ``pypto-serving router``.

Starts two ``pypto-serving serve`` replicas (the default embedded model unless ``--model``) and a
``pypto-serving router`` in front of them, all as processes on this host, then:

* **overhead**: many small requests, one at a time, sent alternately straight to a replica and
  through the router (so both see the same machine load); the p50 latency of each and the p50
  difference. Two kinds: ``GET /v1/models`` (no engine work: the router's own cost shows alone) and
  ``POST /v1/completions`` with a 2-token prompt and ``max_tokens = 1``.
* **affinity**: ``--conversations`` multi-turn chats (``--turns`` turns each, 8 at a time) through
  the router, once with an ``x-session-id`` header per conversation and once without (prefix routing
  alone); for each, the share of conversations whose every turn hit one replica, and the router's
  own counters.

    python benchmarks/router.py                       # 500 requests of each kind, 50 conversations
    python benchmarks/router.py --requests 2000 --model tiny-qwen3
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

PY = [sys.executable, "-m", "pypto_serving.cli"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout: float, want: int = 0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{proc.args!r} exited with {proc.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            r = httpx.get(url + "/health", timeout=2)
            if r.status_code == 200 and len(r.json().get("replicas", [])) >= want:
                return
        time.sleep(0.2)
    raise SystemExit(f"{url} not healthy after {timeout}s")


@contextlib.contextmanager
def _processes(args: argparse.Namespace, logs: Path) -> Iterator[tuple[list[str], str, int]]:
    """(replica URLs, router URL, router pid) of two serve processes and a router, all stopped on exit."""
    procs: list[subprocess.Popen[bytes]] = []
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYPTO_")}
    try:
        urls = []
        for i in range(2):
            port = _free_port()
            cmd = [*PY, "serve", "--device", "cpu", "--port", str(port), "--worker-threads", "1"]
            cmd += ["--model", args.model] if args.model else []
            procs.append(
                subprocess.Popen(cmd, stdout=(logs / f"replica{i}.log").open("wb"), stderr=subprocess.STDOUT, env=env)
            )
            urls.append(f"http://127.0.0.1:{port}")
        for url, proc in zip(urls, procs):
            _wait_healthy(url, proc, 300)
        port = _free_port()
        cmd = [*PY, "router", "--port", str(port), "--log-level", "warning"]
        for url in urls:
            cmd += ["--replica", url]
        procs.append(subprocess.Popen(cmd, stdout=(logs / "router.log").open("wb"), stderr=subprocess.STDOUT, env=env))
        router = f"http://127.0.0.1:{port}"
        _wait_healthy(router, procs[-1], 120, want=2)
        yield urls, router, procs[-1].pid
    finally:
        for proc in reversed(procs):
            proc.terminate()
        for proc in procs:
            proc.wait(60)


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux), which machine load does not inflate."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _timed(client: httpx.Client, method: str, path: str, body: dict[str, Any] | None) -> float:
    start = time.perf_counter()
    r = client.request(method, path, json=body)
    elapsed = time.perf_counter() - start
    r.raise_for_status()
    return elapsed


def overhead(urls: list[str], router: str, pid: int, n: int) -> dict[str, dict[str, float]]:
    """p50/p90 latency (ms) direct and through the router, per request kind, interleaved, and the
    router process's CPU time per request."""
    kinds = {
        "GET /v1/models": ("GET", "/v1/models", None),
        "POST /v1/completions (max_tokens 1)": ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 1}),
    }
    out = {}
    directs = [httpx.Client(base_url=u, timeout=30) for u in urls]
    via = httpx.Client(base_url=router, timeout=30)
    for name, (method, path, body) in kinds.items():
        for _ in range(20):  # warm both paths' connections
            _timed(via, method, path, body)
            _timed(directs[0], method, path, body)
        d, r = [], []
        cpu = _cpu_seconds(pid)
        for i in range(n):
            d.append(_timed(directs[i % 2], method, path, body))
            r.append(_timed(via, method, path, body))
        cpu_ms = (_cpu_seconds(pid) - cpu) / n * 1e3  # includes the router's health polls (every 2 s)
        p50d, p50r = statistics.median(d) * 1e3, statistics.median(r) * 1e3
        q = statistics.quantiles
        out[name] = {
            "direct_p50_ms": p50d,
            "router_p50_ms": p50r,
            "added_p50_ms": p50r - p50d,
            "direct_p90_ms": q(d, n=10)[-1] * 1e3,
            "router_p90_ms": q(r, n=10)[-1] * 1e3,
            "router_cpu_ms_per_request": cpu_ms,
        }
    return out


async def _conversation(client: httpx.AsyncClient, sid: str, turns: int, header: bool) -> set[str]:
    messages: list[dict[str, str]] = []
    seen = set()
    for t in range(turns):
        messages.append({"role": "user", "content": f"Conversation {sid}, question {t}: tell me a number."})
        headers = {"x-session-id": sid} if header else {}
        body = {"messages": messages, "max_tokens": 8, "temperature": 0}
        r = await client.post("/v1/chat/completions", json=body, headers=headers)
        r.raise_for_status()
        seen.add(r.headers["x-pypto-replica"])
        messages.append({"role": "assistant", "content": r.json()["choices"][0]["message"]["content"] or ""})
    return seen


async def _affinity(router: str, conversations: int, turns: int, header: bool) -> float:
    limit = asyncio.Semaphore(8)

    async def one(client: httpx.AsyncClient, i: int) -> set[str]:
        async with limit:
            return await _conversation(client, f"{'s' if header else 'p'}{i}", turns, header)

    async with httpx.AsyncClient(base_url=router, timeout=120) as client:
        seen = await asyncio.gather(*(one(client, i) for i in range(conversations)))
    return sum(len(s) == 1 for s in seen) / conversations


def _counters(router: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(router + "/metrics").text.splitlines():
        if line.startswith(("pypto_router_session_affinity", "pypto_router_prefix_total")) and "_created" not in line:
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model of the replicas (default: the default embedded one)")
    p.add_argument("--requests", type=int, default=500, help="requests of each kind per path")
    p.add_argument("--conversations", type=int, default=50)
    p.add_argument("--turns", type=int, default=4)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp, _processes(args, Path(tmp)) as (urls, router, pid):
        print(f"load average at start: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
        for name, row in overhead(urls, router, pid, args.requests).items():
            print(f"{name}: " + ", ".join(f"{k} {v:.2f}" for k, v in row.items()))
        with_header = asyncio.run(_affinity(router, args.conversations, args.turns, header=True))
        after_sessions = _counters(router)
        without = asyncio.run(_affinity(router, args.conversations, args.turns, header=False))
        after_prefix = _counters(router)
        print(f"session header: {with_header:.0%} of conversations on one replica; {after_sessions}")
        print(f"prefix only:    {without:.0%} of conversations on one replica; {after_prefix}")
        print(f"load average at end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
