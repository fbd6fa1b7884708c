"""The requests that froze or failed the server (issue 25), replayed against a real ``pypto-serving
serve`` of the embedded ``tiny-qwen3`` (Qwen3's real 151,936-token vocabulary, so grammar compiles cost
what they cost on a real Qwen checkpoint), with the default settings a user starts with.

For each attack, sent from a separate client process (an adversary's client shares nothing with the
server), this process meanwhile streams greedy completions and polls ``/health``: reported are the
attack's status and error code, its time, the worst ``/health`` answer, and the streams' inter-token
latency p99 against the same streams unloaded. Also measured: ``/health`` on a fresh and on a reused
keep-alive connection (``TCP_NODELAY``), and ``temperature`` 1e-39 / 5e-324 against greedy.

    python benchmarks/attack.py [--stream-tokens 48] [--port 0]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

_ATTACKER = """
import json, sys, time, httpx
with httpx.Client(timeout=600) as client:
    for line in sys.stdin:
        url, path = line.rstrip("\\n").split("\\t")
        with open(path, "rb") as f:
            body = f.read()
        t0 = time.monotonic()
        r = client.post(url, content=body, headers={"content-type": "application/json"})
        took = time.monotonic() - t0
        try:
            code = r.json()["error"]["code"] if r.status_code != 200 else ""
        except Exception:
            code = "?"
        print(json.dumps([r.status_code, code, took, len(r.content), len(body)]), flush=True)
"""


def attacks() -> dict[str, tuple[str, dict[str, Any]]]:
    """The issue's requests at the sizes it reported."""
    enum = {"enum": [f"value-{i}" for i in range(20000)]}
    branches = {"anyOf": [{"type": "object", "properties": {f"k{i}": {"type": "integer"}}} for i in range(5000)]}
    words = "the quick brown fox jumps over the lazy dog " * 60
    user = {"role": "user", "content": "hi"}
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "[" * 5000 + "]" * 5000}}
    cmpl, chat = "/v1/completions", "/v1/chat/completions"
    return {
        "1. enum of 20,000 x 1,000 prompts": (cmpl, {"prompt": ["a"] * 1000, "guided_json": enum, "max_tokens": 1}),
        "1. nested regex, n=128": (
            cmpl,
            {"prompt": "a", "n": 128, "guided_regex": "(?:(?:a{100}){100}){100}", "max_tokens": 2},
        ),
        "1. anyOf of 5,000, n=32": (cmpl, {"prompt": "a", "n": 32, "guided_json": branches, "max_tokens": 2}),
        "2. $ref loop": (cmpl, {"prompt": "a", "guided_json": {"$ref": "#"}, "max_tokens": 2}),
        "2. [^\\x00-\\x{10FFFF}]": (cmpl, {"prompt": "a", "guided_regex": "[^\\x00-\\x{10FFFF}]", "max_tokens": 2}),
        "2. a{1000000}": (cmpl, {"prompt": "a", "guided_regex": "a{1000000}", "max_tokens": 2}),
        "2. (?:a{1000}){1000}": (cmpl, {"prompt": "a", "guided_regex": "(?:a{1000}){1000}", "max_tokens": 2}),
        "5. tool-call arguments 5,000 deep": (chat, {"messages": [user, {"role": "assistant", "tool_calls": [call]}]}),
        "9. n=128, prompt_logprobs 20, ~500-token prompt": (
            cmpl,
            {"prompt": words, "n": 128, "prompt_logprobs": 20, "max_tokens": 1},
        ),
        "9. n=128, echo + logprobs 20, ~100-token prompt": (
            cmpl,
            {"prompt": words[: len(words) // 5], "n": 128, "echo": True, "logprobs": 20, "max_tokens": 4},
        ),
    }


class Bench:
    def __init__(self, url: str, tokens: int, tmp: Path) -> None:
        self.url, self.tmp = url, tmp
        self.stream_body = {"prompt": "def main():", "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
        self.attacker = subprocess.Popen(
            [sys.executable, "-c", _ATTACKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )

    async def stream_gaps(self, client: httpx.AsyncClient) -> list[float]:
        times: list[float] = []
        body = {**self.stream_body, "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {") and '"text":' in line:
                    times.append(time.monotonic())
        return [b - a for a, b in itertools.pairwise(times[1:])]

    async def attack(self, path: str, body: dict[str, Any]) -> list[Any]:
        file = self.tmp / "body.json"
        file.write_text(json.dumps(body))
        assert self.attacker.stdin is not None and self.attacker.stdout is not None
        self.attacker.stdin.write(f"{self.url}{path}\t{file}\n")
        self.attacker.stdin.flush()
        return list(json.loads(await asyncio.to_thread(self.attacker.stdout.readline)))

    async def under(self, client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> dict[str, Any]:
        first = asyncio.create_task(self.stream_gaps(client))
        await asyncio.sleep(0.3)
        attack = asyncio.create_task(self.attack(path, body))
        worst = 0.0
        gaps: list[float] = []
        more = asyncio.create_task(self._streams_until(client, attack, gaps))
        while not attack.done():
            t0 = time.monotonic()
            await client.get("/health")
            worst = max(worst, time.monotonic() - t0)
            await asyncio.sleep(0.05)
        status, code, took, size, sent = await attack
        await more
        gaps += await first
        return {"status": status, "code": code, "s": took, "response_bytes": size, "body_bytes": sent,
                "health_worst_s": worst, "itl_p99_s": p99(gaps)}  # fmt: skip

    async def _streams_until(self, client: httpx.AsyncClient, done: asyncio.Task[Any], out: list[float]) -> None:
        while not done.done():
            out += await self.stream_gaps(client)


def p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[98] if len(values) > 1 else float("nan")


def keep_alive(url: str) -> dict[str, float]:
    fresh, reused = [], []
    for _ in range(30):
        t0 = time.monotonic()
        httpx.get(url + "/health")
        fresh.append(time.monotonic() - t0)
    with httpx.Client(base_url=url) as client:
        client.get("/health")
        for _ in range(30):
            t0 = time.monotonic()
            client.get("/health")
            reused.append(time.monotonic() - t0)
    return {"fresh_ms": statistics.median(fresh) * 1e3, "reused_ms": statistics.median(reused) * 1e3}


def tiny_temperatures(url: str) -> bool:
    body = {"prompt": "def main():", "max_tokens": 24}
    greedy = httpx.post(url + "/v1/completions", json={**body, "temperature": 0}, timeout=60).json()
    texts = {greedy["choices"][0]["text"]}
    for t, seed in ((1e-39, 1), (1e-39, 2), (5e-324, 3)):
        r = httpx.post(url + "/v1/completions", json={**body, "temperature": t, "seed": seed}, timeout=60).json()
        texts.add(r["choices"][0]["text"])
    return len(texts) == 1


def start_server(port: int, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    cmd = [sys.executable, "-m", "pypto_serving.cli", "serve", "--model", "tiny-qwen3", "--port", str(port)]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        m = re.search(r"serving \S+ on (http://\S+)", log.read_text())
        if m and httpx.get(m.group(1) + "/health").status_code == 200:
            return proc, m.group(1)
        time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"the server did not start:\n{log.read_text()[-2000:]}")


async def run(bench: Bench) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=bench.url, timeout=600) as client:
        await bench.stream_gaps(client)
        unloaded = p99(await bench.stream_gaps(client) + await bench.stream_gaps(client))
        rows = {}
        for name, (path, body) in attacks().items():
            rows[name] = await bench.under(client, path, body)
            print(name, json.dumps(rows[name]), flush=True)
        return {"unloaded_itl_p99_s": unloaded, "attacks": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stream-tokens", type=int, default=48)
    ap.add_argument("--port", type=int, default=0)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    proc, url = start_server(args.port, tmp / "server.log")
    try:
        bench = Bench(url, args.stream_tokens, tmp)
        report = asyncio.run(run(bench))
        report["keep_alive"] = keep_alive(url)
        report["tiny_temperatures_are_greedy"] = tiny_temperatures(url)
        report["server_alive"] = proc.poll() is None and httpx.get(url + "/health").status_code == 200
        report["cpus"], report["load_average"] = os.cpu_count(), os.getloadavg()
        print(json.dumps(report, indent=2))
    finally:
        proc.terminate()
        proc.wait(60)


if __name__ == "__main__":
    main()
