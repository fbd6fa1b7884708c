"""Online latency: streamed ``/v1/completions`` requests against an OpenAI-compatible server, at a
fixed concurrency or with Poisson arrivals, measuring TTFT, TPOT, ITL and end-to-end latency.

The client is httpx, a dependency of the core imported here only (the engine does not need it)."""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from .progress import Progress
from .stats import summarize

__all__ = ["RequestRecord", "ServeConfig", "import_httpx", "run_serve", "serve_figures"]


@dataclass(frozen=True, slots=True)
class ServeConfig:
    """One online run (see ``pypto-serving bench serve --help``)."""

    base_url: str
    prompts: Sequence[list[int] | str]
    max_tokens: int = 128
    concurrency: int | None = None  # None: unbounded (only the request rate limits)
    request_rate: float = math.inf  # requests per second, Poisson arrivals; inf: all at once
    seed: int = 0
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    ignore_eos: bool = True
    model_name: str | None = None  # None: the server's first model from /v1/models
    api_key: str | None = None
    timeout: float = 600.0
    logprobs: bool = False  # ask for logprobs=0: every step's tokens become their own chunk (even empty text)
    warmup: bool = True  # one untimed 2-token request first


@dataclass(slots=True)
class RequestRecord:
    """What one streamed request measured (seconds, relative to its own send time)."""

    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float | None = None
    e2e: float | None = None
    chunk_gaps: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first: (e2e - ttft) / (tokens - 1); None below 2 tokens."""
        if self.ttft is None or self.e2e is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def import_httpx() -> Any:
    """httpx, or a one-line error for an environment that installed the core without its dependencies."""
    try:
        import httpx
    except ImportError:
        raise ValueError("bench serve needs httpx: pip install httpx") from None
    return httpx


def _body(config: ServeConfig, model: str, prompt: list[int] | str) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": config.max_tokens,
        "temperature": config.temperature,
        "top_p": config.top_p,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if config.top_k:
        body["top_k"] = config.top_k
    if config.ignore_eos:
        body["ignore_eos"] = True
    if config.logprobs:
        body["logprobs"] = 0
    return body


def _apply_event(rec: RequestRecord, data: dict[str, Any], now: float, last: float | None) -> float | None:
    """Record one SSE event's timing; returns the time of the last chunk that carried choices."""
    if data.get("usage"):
        rec.output_tokens = int(data["usage"].get("completion_tokens", rec.output_tokens))
        rec.prompt_tokens = int(data["usage"].get("prompt_tokens", rec.prompt_tokens))
    if "error" in data:
        rec.error = str(data["error"].get("message", data["error"]))
    if not data.get("choices"):
        return last
    if rec.ttft is None:
        rec.ttft = now
    elif last is not None:
        rec.chunk_gaps.append(now - last)
    return now


async def _stream_one(client: Any, config: ServeConfig, model: str, prompt: list[int] | str) -> RequestRecord:
    rec = RequestRecord(prompt_tokens=len(prompt) if isinstance(prompt, list) else 0)
    start = time.perf_counter()
    last: float | None = None
    chunks = 0
    try:
        async with client.stream("POST", "/v1/completions", json=_body(config, model, prompt)) as resp:
            if resp.status_code != 200:
                rec.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:300]}"
                return rec
            async for line in resp.aiter_lines():
                if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                    continue
                seen = last
                last = _apply_event(rec, json.loads(line[5:]), time.perf_counter() - start, last)
                chunks += last is not seen
    except Exception as e:  # a benchmark reports failed requests instead of stopping
        rec.error = f"{type(e).__name__}: {e}"
        return rec
    rec.e2e = time.perf_counter() - start
    rec.output_tokens = rec.output_tokens or chunks
    return rec


async def _first_model(client: Any) -> str:
    resp = await client.get("/v1/models")
    resp.raise_for_status()
    models = resp.json().get("data") or []
    if not models:
        raise ValueError("the server lists no model at /v1/models: pass --served-model-name")
    return str(models[0]["id"])


def arrival_delays(count: int, rate: float, seed: int) -> list[float]:
    """Seeded exponential gaps (a Poisson process of ``rate`` per second); all zero for inf."""
    if math.isinf(rate):
        return [0.0] * count
    if rate <= 0:
        raise ValueError(f"request rate {rate} must be > 0")
    rng = random.Random(seed)
    return [rng.expovariate(rate) for _ in range(count)]


async def _run(config: ServeConfig) -> tuple[list[RequestRecord], float]:
    httpx = import_httpx()
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    limits = httpx.Limits(max_connections=config.concurrency or len(config.prompts) or 1)
    async with httpx.AsyncClient(
        base_url=config.base_url.rstrip("/"), headers=headers, timeout=config.timeout, limits=limits
    ) as client:
        try:
            model = config.model_name or await _first_model(client)
        except httpx.HTTPError as e:
            raise ValueError(f"cannot reach {config.base_url}: {e or type(e).__name__}") from None
        if config.warmup:
            warm = await _stream_one(client, replace(config, max_tokens=2), model, config.prompts[0])
            if warm.error is not None:
                raise ValueError(f"the warm-up request failed: {warm.error}")
        sem = asyncio.Semaphore(config.concurrency or len(config.prompts))
        progress = Progress("bench serve", len(config.prompts))

        async def one(prompt: list[int] | str) -> RequestRecord:
            async with sem:
                rec = await _stream_one(client, config, model, prompt)
            progress.advance()
            return rec

        start = time.perf_counter()
        tasks = []
        for prompt, delay in zip(config.prompts, arrival_delays(len(config.prompts), config.request_rate, config.seed)):
            await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(prompt)))
        records = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - start
        progress.close()
    return records, duration


def run_serve(config: ServeConfig) -> dict[str, Any]:
    """Send every prompt, wait for all, return the figures (see :func:`serve_figures`)."""
    if config.concurrency is not None and config.concurrency < 1:
        raise ValueError(f"concurrency {config.concurrency} must be >= 1")
    records, duration = asyncio.run(_run(config))
    return serve_figures(config, records, duration)


def serve_figures(config: ServeConfig, records: list[RequestRecord], duration: float) -> dict[str, Any]:
    """Latencies in ms (mean/p50/p99/min/max over finished requests) and rates over the whole run."""
    ok = [r for r in records if r.error is None]
    errors = sorted({r.error for r in records if r.error is not None})
    out_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    return {
        "benchmark": "serve",
        "base_url": config.base_url,
        "num_requests": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "errors": errors[:5],
        "max_tokens": config.max_tokens,
        "concurrency": config.concurrency,
        "request_rate": None if math.isinf(config.request_rate) else config.request_rate,
        "duration_s": duration,
        "prompt_tokens": prompt_tokens,
        "output_tokens": out_tokens,
        "requests_per_s": len(ok) / duration if duration else math.nan,
        "output_tok_s": out_tokens / duration if duration else math.nan,
        "total_tok_s": (out_tokens + prompt_tokens) / duration if duration else math.nan,
        "ttft_ms": summarize([r.ttft for r in ok if r.ttft is not None], 1000),
        "tpot_ms": summarize([t for r in ok if (t := r.tpot) is not None], 1000),
        "itl_ms": summarize([g for r in ok for g in r.chunk_gaps], 1000),
        "e2e_ms": summarize([r.e2e for r in ok if r.e2e is not None], 1000),
    }
