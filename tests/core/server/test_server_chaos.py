"""Bounded chaos against a real ``pypto-serving serve`` subprocess (tiny Qwen3, ``--worker-mode process``).

A seeded plan of a few hundred requests runs from an asyncio httpx client at bounded concurrency:
streamed and non-streamed completions and chats, clients that time out or leave mid-stream, poison
values, the attacks of issue 25 (grammars that exploded or failed in the worker, JSON nested far
past ``max_json_depth``, a few bytes asking for a response over ``max_response_bytes``), and exactly
one worker SIGKILL half-way while streams are decoding. The server must fail
only the requests in flight at the kill (503 ``restarting`` while the worker comes back is allowed,
counted and retried), recover by itself, answer the greedy requests as before, and end with no
request, KV block, worker process or file descriptor left over.

``pytest -s`` prints the summary; ``PYPTO_CHAOS_REPORT=path`` also writes it as JSON;
``PYPTO_CHAOS_SEED`` replays another plan."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("pypto_serving_sync_sched")
pytest.importorskip("pypto_serving_qwen")

from tests.core.server.server_helpers import (
    attack_requests,
    descendant_pids,
    is_running,
    json_bytes,
    metric,
    open_fds,
    parse_sse,
    poison_requests,
    wait_for,
    worker_pids,
)
from tests.core.server.test_server_process import COMMON, Proc, qwen_dir  # noqa: F401 - qwen_dir is a fixture

SEED = int(os.environ.get("PYPTO_CHAOS_SEED", "20261130"))
NUM_REQUESTS = 300
CONCURRENCY = 12
PROCESS = [*COMMON, "--worker-mode", "process", "--num-kv-blocks", "2048", "--max-response-bytes", "1000000"]
KINDS = {  # kind: weight in the plan
    "completion": 22,
    "completion_stream": 18,
    "chat": 15,
    "chat_stream": 12,
    "poison": 10,
    "attack": 6,
    "timeout": 10,
    "disconnect": 10,
}
WORDS = "the quick brown fox jumps over lazy dog hello world count one two three cat sat on mat".split()  # noqa: SIM905
GREEDY_COMPLETION = {"prompt": "once upon a time", "max_tokens": 16, "temperature": 0, "ignore_eos": True}
GREEDY_CHAT = {"messages": [{"role": "user", "content": "count: one two"}], "max_tokens": 16, "temperature": 0}
POISON = poison_requests()
ATTACKS = attack_requests()


@dataclass(slots=True)
class Spec:
    """One planned request: where it goes, its body, and how the client misbehaves."""

    kind: str
    path: str
    body: dict[str, Any]
    timeout: float = 60.0  # client timeout of a ``timeout`` request
    leave_after: int = 0  # SSE events a ``disconnect`` request reads before closing
    param: str | None = ""  # the field a ``poison`` or ``attack`` request's 400 names


@dataclass
class Run:
    """What the client saw, filled in while the plan runs."""

    outcomes: Counter[str] = field(default_factory=Counter)
    failed_in_flight: Counter[str] = field(default_factory=Counter)  # code of each in-flight failure
    restarting_503: int = 0
    problems: list[str] = field(default_factory=list)
    in_flight: set[int] = field(default_factory=set)
    decoding: set[int] = field(default_factory=set)  # streams past their first token
    at_kill: set[int] | None = None
    completed: int = 0
    killed_at: float = 0.0
    noticed_s: float = 0.0
    recovered_s: float = 0.0
    old_worker: int = 0
    new_worker: int = 0


def plan(rng: random.Random) -> list[Spec]:
    kinds, weights = list(KINDS), list(KINDS.values())
    specs = []
    for _ in range(NUM_REQUESTS):
        kind = rng.choices(kinds, weights)[0]
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 12)))
        sampling: dict[str, Any] = {"temperature": rng.choice([0, 0, 0.8]), "seed": rng.randint(0, 2**31)}
        if kind in ("poison", "attack"):
            _, path, body, param = rng.choice(POISON if kind == "poison" else ATTACKS)
            specs.append(Spec(kind, path, body, param=param))
        elif kind.startswith("chat"):
            body = {"messages": [{"role": "user", "content": text}], "max_tokens": rng.randint(4, 48), **sampling}
            specs.append(Spec(kind, "/v1/chat/completions", {**body, "stream": kind == "chat_stream"}))
        elif kind in ("completion", "completion_stream"):
            body = {"prompt": text, "max_tokens": rng.randint(4, 48), **sampling}
            if rng.random() < 0.2:
                body["logprobs"] = 2
            specs.append(Spec(kind, "/v1/completions", {**body, "stream": kind == "completion_stream"}))
        elif kind == "timeout":
            body = {"prompt": text, "max_tokens": rng.randint(48, 96), "ignore_eos": True}
            specs.append(Spec(kind, "/v1/completions", body, timeout=rng.uniform(0.05, 0.4)))
        else:  # disconnect: a stream read for a few events, then closed
            body = {"prompt": text, "max_tokens": rng.randint(48, 96), "ignore_eos": True, "stream": True}
            specs.append(Spec(kind, "/v1/completions", body, leave_after=rng.randint(1, 3)))
    return specs


def _error_code(text: str) -> str:
    try:
        return str(json.loads(text)["error"]["code"])
    except (ValueError, KeyError, TypeError):
        return "?"


class Chaos:
    def __init__(self, proc: Proc, specs: list[Spec], rng: random.Random) -> None:
        self.proc, self.specs, self.rng = proc, specs, rng
        self.run = Run()
        self.gate = asyncio.Event()  # closed from the kill until the server knows its worker died

    # ------------------------------------------------------------------ outcomes
    def _failed(self, i: int, what: str) -> None:
        """A 5xx or a stream error: allowed only for a request in flight at the kill."""
        run = self.run
        if run.at_kill is not None and i in run.at_kill:
            run.outcomes["5xx_in_flight"] += 1
            run.failed_in_flight[what] += 1
        else:
            run.problems.append(f"request {i} ({self.specs[i].kind}) failed outside the kill: {what}")

    def _unexpected(self, i: int, what: str) -> None:
        self.run.problems.append(f"request {i} ({self.specs[i].kind}): {what}")

    # ------------------------------------------------------------------ one request
    async def _attempt(self, client: httpx.AsyncClient, i: int) -> bool:
        """One try of request ``i``; False when it got 503 ``restarting`` (to be retried)."""
        spec = self.specs[i]
        if spec.kind in ("poison", "attack"):
            headers = {"content-type": "application/json"}
            r = await client.post(spec.path, content=json_bytes(spec.body), headers=headers)
            return self._plain(i, r)
        if not spec.body.get("stream"):
            try:
                r = await client.post(spec.path, json=spec.body, timeout=spec.timeout)
            except httpx.TimeoutException:
                if spec.kind == "timeout":
                    self.run.outcomes["timeout"] += 1
                else:
                    self._unexpected(i, "client timeout (60 s)")
                return True
            return self._plain(i, r)
        async with client.stream("POST", spec.path, json=spec.body) as r:
            if r.status_code != 200:
                return self._plain(i, r, (await r.aread()).decode())
            text = ""
            async for chunk in r.aiter_text():
                text += chunk
                if '"choices": [{' in text and spec.kind != "disconnect":
                    self.run.decoding.add(i)
                if spec.leave_after and text.count("data: ") >= spec.leave_after and "[DONE]" not in text:
                    self.run.outcomes["disconnect"] += 1
                    return True  # leaving the block closes the connection mid-stream
        self.run.decoding.discard(i)
        try:
            events, done = parse_sse(text)
        except (AssertionError, ValueError) as e:
            self._unexpected(i, f"malformed SSE ({e}): {text[-300:]!r}")
            return True
        if not done:
            self._unexpected(i, f"stream without [DONE]: {text[-300:]!r}")
        elif events and "error" in events[-1]:
            self._failed(i, f"stream error event {events[-1]['error'].get('code')}")
        elif not any(c.get("finish_reason") for e in events for c in e.get("choices", [])):
            self._unexpected(i, f"stream without finish_reason: {text[-300:]!r}")
        else:
            self.run.outcomes["200"] += 1
        return True

    def _plain(self, i: int, r: httpx.Response, text: str | None = None) -> bool:
        spec, run = self.specs[i], self.run
        text = r.text if text is None else text
        code = _error_code(text) if r.status_code != 200 else ""
        if r.status_code == 503 and code == "restarting":
            run.restarting_503 += 1
            return False
        if spec.kind in ("poison", "attack"):
            if r.status_code == 400 and json.loads(text)["error"]["param"] == spec.param:
                run.outcomes[f"400_{spec.kind}"] += 1
            else:
                self._unexpected(i, f"{spec.kind} expected 400 param={spec.param}, got {r.status_code} {text[:300]}")
        elif r.status_code == 200:
            choices = r.json()["choices"]
            if all(c.get("finish_reason") in ("stop", "length") for c in choices):
                run.outcomes["200"] += 1
            else:
                self._unexpected(i, f"200 with finish reasons {[c.get('finish_reason') for c in choices]}")
        elif r.status_code >= 500:
            self._failed(i, f"{r.status_code} {code}")
        else:
            self._unexpected(i, f"{r.status_code} {text[:300]}")
        return True

    async def _one(self, client: httpx.AsyncClient, sem: asyncio.Semaphore, i: int) -> None:
        async with sem:
            await self.gate.wait()
            self.run.in_flight.add(i)
            try:
                deadline = time.monotonic() + 90
                while not await self._attempt(client, i):  # 503 restarting: retry shortly, as a client would
                    if time.monotonic() > deadline:
                        self._unexpected(i, "still 503 restarting after 90 s of retries")
                        break
                    await asyncio.sleep(self.rng.uniform(0.1, 0.3))
            except httpx.HTTPError as e:
                self._unexpected(i, f"{type(e).__name__}: {e}")
            finally:
                self.run.in_flight.discard(i)
                self.run.decoding.discard(i)
                self.run.completed += 1

    # ------------------------------------------------------------------ the kill
    async def _kill_once(self, health: httpx.AsyncClient) -> None:
        run = self.run
        deadline = time.monotonic() + 90
        while run.completed < NUM_REQUESTS // 2 or len(run.decoding) < 2:  # half-way, with streams decoding
            assert time.monotonic() < deadline and run.completed < NUM_REQUESTS, "no moment to kill the worker"
            await asyncio.sleep(0.002)
        self.gate.clear()  # no new request until the old engine is out of play
        [run.old_worker] = worker_pids(self.proc.p.pid)
        run.at_kill = set(run.in_flight)
        os.kill(run.old_worker, signal.SIGKILL)
        run.killed_at = time.monotonic()
        while (await health.get("/health")).status_code == 200:  # 503 restarting: the old engine is gone
            assert time.monotonic() - run.killed_at < 10, "the server did not notice the dead worker"
            await asyncio.sleep(0.01)
        run.noticed_s = time.monotonic() - run.killed_at
        self.gate.set()
        while (await health.get("/health")).status_code != 200:
            assert time.monotonic() - run.killed_at < 90, "the server did not recover from the kill"
            await asyncio.sleep(0.02)
        run.recovered_s = time.monotonic() - run.killed_at
        [run.new_worker] = worker_pids(self.proc.p.pid)

    async def main(self) -> Run:
        self.gate.set()
        sem = asyncio.Semaphore(CONCURRENCY)
        limits = httpx.Limits(max_connections=CONCURRENCY + 4)
        async with (
            httpx.AsyncClient(base_url=self.proc.url, timeout=60, limits=limits) as client,
            httpx.AsyncClient(base_url=self.proc.url, timeout=10) as health,
        ):
            killer = asyncio.create_task(self._kill_once(health))
            await asyncio.gather(*(self._one(client, sem, i) for i in range(len(self.specs))))
            await killer
        return self.run


# --------------------------------------------------------------------------- the test


def _greedy(url: str, **sampling: Any) -> tuple[str, str]:
    a = httpx.post(url + "/v1/completions", json={**GREEDY_COMPLETION, **sampling}, timeout=60)
    b = httpx.post(url + "/v1/chat/completions", json={**GREEDY_CHAT, **sampling}, timeout=60)
    assert a.status_code == 200 and b.status_code == 200, (a.text, b.text)
    return a.json()["choices"][0]["text"], b.json()["choices"][0]["message"]["content"]


def _gauges(url: str) -> tuple[float, float, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    names = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
    return tuple(metric(text, f"pypto_serving_{n}") for n in names)  # type: ignore[return-value]


@pytest.fixture
def server(qwen_dir: Path, tmp_path: Path) -> Iterator[Proc]:  # noqa: F811
    proc = Proc(["--model", str(qwen_dir), *PROCESS], tmp_path / "server.log")
    try:
        proc.wait_healthy(120)
        yield proc
    finally:
        if proc.p.poll() is None:
            proc.p.send_signal(signal.SIGTERM)
            try:
                proc.p.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


def test_chaos_one_worker_kill_in_a_few_hundred_requests(server: Proc) -> None:
    started = time.monotonic()
    pid = server.p.pid
    greedy_before = _greedy(server.url)
    children_before = descendant_pids(pid)
    fds_before = open_fds(pid)

    rng = random.Random(SEED)
    chaos = Chaos(server, plan(rng), rng)
    run_started = time.monotonic()
    run = asyncio.run(chaos.main())
    run_s = time.monotonic() - run_started

    assert not run.problems, "\n".join(run.problems)
    assert run.at_kill is not None and run.new_worker != run.old_worker and not is_running(run.old_worker)
    assert run.outcomes["5xx_in_flight"] >= 1, run  # the kill hit requests that were decoding
    assert run.outcomes["5xx_in_flight"] <= len(run.at_kill)
    assert sum(run.outcomes.values()) == NUM_REQUESTS, run.outcomes
    # The server came back by itself and answers as before.
    assert server.p.poll() is None, server.log.read_text()
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    assert _greedy(server.url) == greedy_before
    # A temperature that float32 turns into 0 or a denormal is greedy, whatever the seed.
    assert _greedy(server.url, temperature=1e-39, seed=5) == _greedy(server.url, temperature=5e-324, seed=6)
    assert _greedy(server.url, temperature=1e-39, seed=7) == greedy_before
    last: list[tuple[float, float, float]] = []
    wait_for(lambda: last.append(_gauges(server.url)) or last[-1] == (0, 0, 0), 15, f"idle gauges, saw {last[-1:]}")
    # No worker or descriptor leak: one worker (plus the resource tracker), fds back to where they were.
    assert worker_pids(pid) == [run.new_worker]
    assert len(descendant_pids(pid)) == len(children_before), (children_before, descendant_pids(pid))
    fds: list[int] = []
    wait_for(lambda: fds.append(open_fds(pid)) or fds[-1] <= fds_before + 3, 10, f"fds <= {fds_before} + 3: {fds}")
    log = server.log.read_text()
    assert "Traceback" not in log and "Exception in ASGI application" not in log, log

    report = {
        "seed": SEED,
        "requests": NUM_REQUESTS,
        "concurrency": CONCURRENCY,
        "run_s": round(run_s, 1),
        "test_s": round(time.monotonic() - started, 1),
        "outcomes": dict(sorted(run.outcomes.items())),
        "in_flight_at_kill": len(run.at_kill),
        "failed_in_flight": dict(run.failed_in_flight),
        "503_restarting_retried": run.restarting_503,
        "server_499_lines": log.count(" 499 "),
        "kill_noticed_s": round(run.noticed_s, 3),
        "recovery_s": round(run.recovered_s, 2),
        "fds_before": fds_before,
        "fds_after": fds[-1],
        "cpus": os.cpu_count(),
    }
    print("chaos:", json.dumps(report))
    if path := os.environ.get("PYPTO_CHAOS_REPORT"):
        Path(path).write_text(json.dumps(report, indent=2) + "\n")
    # A drained shutdown after all that still exits 0.
    server.p.send_signal(signal.SIGTERM)
    assert server.p.wait(30) == 0, server.log.read_text()
