"""No single request stalls everyone (issue 25, "done when"): while each of the attack requests that
once froze the server is served (huge grammars, many sequences of one grammar, bad grammars, bodies
of hundreds of MB asked for in a few KB), ``/health`` answers within 1 s and a concurrent greedy
stream's inter-token latency p99 stays within 2x its unloaded value (an attack missing that is sent
once more, and fails the test where it misses again: what the attack itself stalls stalls twice).

A live uvicorn server with the engine core in its own process (``serve``'s default), the fake
executor stepping every 50 ms (a small model's decode step on a CPU: the stream's inter-token latency
is the step, not timer noise), scoring prompt rows (``prompt_logits``) and with a context long enough
for the issue's 500-token ``prompt_logprobs`` request. The attacks come from
another process, as an adversary's would: a client in the test's own process would share the
server's GIL while it encodes a 300 KB body."""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.requires_plugin("sync_sched")

STEP_S = 0.05
STREAM = {"prompt": [5, 6, 7], "max_tokens": 30, "temperature": 0, "ignore_eos": True, "stream": True}


def _whole_tokens(model_dir: Path) -> list[int]:
    """Ids of the fake tokenizer's lowercase-word tokens: a stream allowed only these sends an event per
    token (a byte-level token holding part of a character would be held back, doubling some gaps)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    return [i for i in range(tok.get_vocab_size()) if re.fullmatch("[a-z]+", tok.decode([i]))]


def _attacks() -> dict[str, dict[str, Any]]:
    """The issue's requests, at the sizes it reported (bodies of 1 KB to 300 KB asking for up to 100 MB)."""
    enum = {"enum": [f"value-{i}" for i in range(20000)]}
    branches = {"anyOf": [{"type": "object", "properties": {f"k{i}": {"type": "integer"}}} for i in range(5000)]}
    long_prompt = [3 + i % 300 for i in range(500)]
    return {
        "enum-20000 x 1000 prompts": {"prompt": ["a"] * 1000, "guided_json": enum, "max_tokens": 1},
        "nested regex x n=128": {"prompt": "a", "n": 128, "guided_regex": "(?:(?:a{100}){100}){100}", "max_tokens": 2},
        "anyOf-5000 x n=32": {"prompt": "a", "n": 32, "guided_json": branches, "max_tokens": 2},
        "$ref loop": {"prompt": "a", "guided_json": {"$ref": "#"}, "max_tokens": 2},
        "prompt_logprobs 20 x n=128": {"prompt": long_prompt, "n": 128, "prompt_logprobs": 20, "max_tokens": 1},
        # The issue's 8.7 MB echo body: a 100-token prompt (500 tokens would be a 40 MB body).
        "echo logprobs 20 x n=128": {
            "prompt": long_prompt[:100],
            "n": 128,
            "echo": True,
            "logprobs": 20,
            "max_tokens": 4,
        },
    }


_ATTACKER = """
import json, sys, httpx
with httpx.Client(timeout=120) as client:
    for line in sys.stdin:
        url, path = line.rstrip("\\n").split("\\t")
        with open(path, "rb") as f:
            r = client.post(url, content=f.read(), headers={"content-type": "application/json"})
        print(json.dumps([r.status_code, r.text[:300]]), flush=True)
"""


class _Attacker:
    """A client process that posts each body it is given (started once: its start-up is no attack)."""

    def __init__(self, url: str, tmp: Path) -> None:
        self.url, self.tmp = url + "/v1/completions", tmp
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _ATTACKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )

    async def post(self, body: dict[str, Any]) -> tuple[int, str]:
        path = self.tmp / "body.json"
        path.write_text(json.dumps(body))
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"{self.url}\t{path}\n")
        self.proc.stdin.flush()
        status, text = json.loads(await asyncio.to_thread(self.proc.stdout.readline))
        return int(status), str(text)

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(10)


class _Probe:
    """A client that streams greedy completions (an event per token) and polls ``/health``."""

    def __init__(self, client: httpx.AsyncClient, model_dir: Path, attacker: _Attacker) -> None:
        self.client, self.attacker = client, attacker
        self.stream_body = {**STREAM, "allowed_token_ids": _whole_tokens(model_dir)}

    async def stream_gaps(self) -> list[float]:
        """Seconds between one stream's consecutive token events (the first token's wait excluded)."""
        times: list[float] = []
        async with self.client.stream("POST", "/v1/completions", json=self.stream_body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {") and '"text":' in line:
                    times.append(time.monotonic())
        return [b - a for a, b in itertools.pairwise(times[1:])]

    async def streams_until(self, done: asyncio.Task[Any]) -> list[float]:
        """Token gaps of streams run one after another until ``done`` (at least one stream)."""
        gaps = await self.stream_gaps()
        while not done.done():
            gaps += await self.stream_gaps()
        return gaps

    async def health_worst(self, until: asyncio.Task[Any]) -> float:
        worst = 0.0
        while not until.done():
            t0 = time.monotonic()
            r = await self.client.get("/health", timeout=30)
            worst = max(worst, time.monotonic() - t0)
            assert r.status_code == 200, r.text
            await asyncio.sleep(0.05)
        return worst

    async def under_attack(self, body: dict[str, Any]) -> tuple[int, float, float]:
        """(the attack's status, /health's worst answer time, the streams' ITL p99) while ``body`` runs."""
        first = asyncio.create_task(self.stream_gaps())
        await asyncio.sleep(10 * STEP_S)  # the stream is decoding
        attack = asyncio.create_task(self.attacker.post(body))
        health = asyncio.create_task(self.health_worst(attack))
        more = asyncio.create_task(self.streams_until(attack))
        status, text = await attack
        gaps = await first + await more
        assert status in (200, 400), f"{status}: {text}"
        return status, await health, _p99(gaps)


def _p99(gaps: list[float]) -> float:
    return statistics.quantiles(gaps, n=100, method="inclusive")[98]


def test_no_single_request_stalls_health_or_other_streams(
    live_server: Any, fake_model_dir: Path, tmp_path: Path
) -> None:
    server, _ = live_server(
        engine_mode="process",
        num_kv_blocks=4096,
        max_num_seqs=256,
        executor_options={"step_sleep": STEP_S, "max_model_len": 1024, "prompt_logits": True},
    )

    async def main() -> None:
        limits = httpx.Limits(max_connections=16)
        async with httpx.AsyncClient(base_url=server.url, timeout=60, limits=limits) as client:
            probe = _Probe(client, fake_model_dir, attacker)
            await probe.stream_gaps()  # warm-up
            unloaded = _p99(await probe.stream_gaps() + await probe.stream_gaps())
            report = [f"unloaded ITL p99 {unloaded * 1e3:.0f} ms"]
            for name, body in _attacks().items():
                # A stall the attack causes comes back when it is sent again; a burst of the machine's
                # other work (CI runs two test envs side by side on two cores) does not: one retry.
                for attempt in (1, 2):
                    status, health_s, p99 = await probe.under_attack(body)
                    line = f"{name}: {status}, /health worst {health_s:.3f}s, ITL p99 {p99 * 1e3:.0f} ms"
                    report.append(line if attempt == 1 else f"{line} (sent again)")
                    if health_s < 1.0 and p99 <= 2 * unloaded:
                        break
                assert health_s < 1.0, report
                assert p99 <= 2 * unloaded, report
            print("\n".join(report))

    attacker = _Attacker(server.url, tmp_path)
    try:
        asyncio.run(main())
    finally:
        attacker.close()


def test_start_up_heap_is_frozen(live_server: Any) -> None:
    """The server's start-up objects are out of the collector's reach: a full collection walking them
    (more than 100 ms in this process) was the one long gap of a stream under the echo attack."""
    import gc

    gc.unfreeze()
    assert gc.get_freeze_count() == 0
    live_server()
    frozen = gc.get_freeze_count()
    gc.unfreeze()
    assert frozen > 10_000, frozen
