"""Prometheus metrics of the OpenAI-compatible server.

Every :class:`ServerMetrics` owns its own ``CollectorRegistry``: two apps in one process (tests, or a
plugin embedding the server) must not share or collide on the global default registry.
Per-request histograms are fed when a request finishes; engine gauges and counters are refreshed from
the latest ``EngineCore.stats()`` snapshot at scrape time, so scraping never touches the engine thread.
The engine's running totals become Prometheus counters through :class:`_TotalsTracker`.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from .request import RequestOutput

__all__ = ["CONTENT_TYPE_LATEST", "ServerMetrics"]

K = TypeVar("K")

_PREFIX = "pypto_serving"
# Latency buckets cover sub-millisecond CPU fakes up to minute-long generations.
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_TPOT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class ServerMetrics:
    """Request counters, latency histograms and engine gauges in a private registry."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        labels = ["model_name"]
        self._model = model_name
        self.requests = Counter(
            f"{_PREFIX}_request_success",
            "Finished requests by finish reason.",
            [*labels, "finish_reason"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            f"{_PREFIX}_prompt_tokens", "Prompt tokens of finished requests.", labels, registry=r
        )
        self.generation_tokens = Counter(
            f"{_PREFIX}_generation_tokens", "Generated tokens of finished requests.", labels, registry=r
        )
        self.cached_prompt_tokens = Counter(
            f"{_PREFIX}_cached_prompt_tokens",
            "Prompt tokens served from the prefix cache.",
            labels,
            registry=r,
        )
        self.ttft = Histogram(
            f"{_PREFIX}_time_to_first_token_seconds",
            "Arrival to first token.",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            f"{_PREFIX}_time_per_output_token_seconds",
            "Mean time between output tokens of a request.",
            labels,
            buckets=_TPOT_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            f"{_PREFIX}_e2e_request_latency_seconds",
            "Arrival to finish.",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.running = Gauge(f"{_PREFIX}_num_requests_running", "Sequences running in the engine.", labels, registry=r)
        self.waiting = Gauge(
            f"{_PREFIX}_num_requests_waiting", "Sequences waiting to be scheduled.", labels, registry=r
        )
        self.preemptions = Counter(f"{_PREFIX}_num_preemptions", "Preemptions since start.", labels, registry=r)
        self.kv_usage = Gauge(
            f"{_PREFIX}_kv_cache_usage_perc", "Fraction of KV blocks in use (0..1).", labels, registry=r
        )
        self.prefix_hit_rate = Gauge(
            f"{_PREFIX}_prefix_cache_hit_rate",
            "Prefix-cache hit tokens / queried prompt tokens.",
            labels,
            registry=r,
        )
        self.spec_drafted = Counter(
            f"{_PREFIX}_spec_decode_num_draft_tokens", "Draft tokens proposed.", labels, registry=r
        )
        self.spec_accepted = Counter(
            f"{_PREFIX}_spec_decode_num_accepted_tokens", "Draft tokens accepted.", labels, registry=r
        )
        self.spec_acceptance = Gauge(
            f"{_PREFIX}_spec_decode_acceptance_rate",
            "Accepted / drafted tokens (0 when nothing was drafted).",
            labels,
            registry=r,
        )
        self.spec_mean_accepted = Gauge(
            f"{_PREFIX}_spec_decode_mean_accepted_length",
            "Accepted drafts per verifying request-step (0..k).",
            labels,
            registry=r,
        )
        self.spec_accepted_per_pos = Counter(
            f"{_PREFIX}_spec_decode_num_accepted_tokens_per_pos",
            "Accepted drafts by draft position.",
            [*labels, "position"],
            registry=r,
        )
        self.spec_config = Gauge(
            f"{_PREFIX}_spec_decode_config",
            "1 for the speculative decoding in use: drafting method, policy and deepest k (absent when off).",
            [*labels, "method", "policy", "num_speculative_tokens"],
            registry=r,
        )
        self.engine_dead = Gauge(
            f"{_PREFIX}_engine_dead", "1 when the engine is down for good (restarts exhausted).", labels, registry=r
        )
        self.worker_restarts = Counter(
            f"{_PREFIX}_worker_restarts", "Times a dead worker was replaced by a fresh one.", labels, registry=r
        )
        self._totals: _TotalsTracker[tuple[Counter, tuple[str, ...]]] = _TotalsTracker()

    def observe_finished(self, out: RequestOutput) -> None:
        """Record one finished user request (called from the engine thread; prometheus-client locks)."""
        m = self._model
        for c in out.outputs:
            self.requests.labels(m, c.finish_reason or "unknown").inc()
            self.generation_tokens.labels(m).inc(len(c.token_ids))
        self.prompt_tokens.labels(m).inc(len(out.prompt_token_ids))
        self.cached_prompt_tokens.labels(m).inc(out.num_cached_tokens)
        t = out.metrics
        if t is None:
            return
        if t.first_token_time is not None:
            self.ttft.labels(m).observe(max(0.0, t.first_token_time - t.arrival_time))
            n = max(len(c.token_ids) for c in out.outputs) if out.outputs else 0
            if n > 1 and t.last_token_time is not None:
                self.tpot.labels(m).observe(max(0.0, t.last_token_time - t.first_token_time) / (n - 1))
        end = t.finished_time or t.last_token_time
        if end is not None:
            self.e2e.labels(m).observe(max(0.0, end - t.arrival_time))

    def observe_restart(self) -> None:
        self.worker_restarts.labels(self._model).inc()
        self._totals.restart()

    def update_engine(self, stats: Mapping[str, Any], dead: bool) -> None:
        """Refresh from an engine snapshot (the engine thread after each step, and every scrape)."""
        m = self._model
        self.running.labels(m).set(stats.get("num_running", 0))
        self.waiting.labels(m).set(stats.get("num_waiting", 0))
        self.kv_usage.labels(m).set(stats.get("kv_usage", 0.0))
        queries = stats.get("prefix_cache_queries", 0)
        self.prefix_hit_rate.labels(m).set(stats.get("prefix_cache_hits", 0) / queries if queries else 0.0)
        drafted, accepted = stats.get("spec_drafted", 0), stats.get("spec_accepted", 0)
        self.spec_acceptance.labels(m).set(accepted / drafted if drafted else 0.0)
        self.spec_mean_accepted.labels(m).set(stats.get("spec_mean_accepted_length", 0.0))
        if stats.get("spec_method"):
            self.spec_config.labels(m, stats["spec_method"], stats["spec_policy"], str(stats["spec_k"])).set(1)
        self.engine_dead.labels(m).set(1 if dead else 0)
        totals: dict[tuple[Counter, tuple[str, ...]], float] = {
            (self.preemptions, ()): stats.get("num_preemptions", 0),
            (self.spec_drafted, ()): drafted,
            (self.spec_accepted, ()): accepted,
        }
        for pos, n in enumerate(stats.get("spec_accepted_per_pos", [])):
            totals[self.spec_accepted_per_pos, (str(pos),)] = n
        for (counter, extra), inc in self._totals.advance(stats.get("num_steps", 0), totals).items():
            counter.labels(m, *extra).inc(inc)

    def render(self) -> bytes:
        return generate_latest(self.registry)


@dataclass(slots=True)
class _TotalsTracker(Generic[K]):
    """Turns an engine's running totals into counter increments, so counters never go down.

    Snapshots come from the engine thread after every step and from scrapes, which may pass a
    snapshot older than one already seen: a snapshot whose totals or step count went down is stale
    and ignored. After a worker restart the new engine counts from 0: until its first snapshot
    arrives, scrapes still pass the dead engine's last one (identical to the last seen, ignored);
    the first that differs is the new engine's, and its totals count whole."""

    last: dict[K, float] = field(default_factory=dict)
    last_steps: int = 0
    restart_pending: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    def restart(self) -> None:
        with self.lock:
            self.restart_pending = True

    def advance(self, steps: int, totals: Mapping[K, float]) -> dict[K, float]:
        """The increments that bring the counters up to ``totals`` (only the positive ones)."""
        with self.lock:
            if self.restart_pending:
                if steps == self.last_steps and all(v == self.last.get(k, 0) for k, v in totals.items()):
                    return {}  # still the dead engine's last snapshot
                self.restart_pending, self.last = False, {}
            elif steps < self.last_steps or any(v < self.last.get(k, 0) for k, v in totals.items()):
                return {}
            increments = {k: v - self.last.get(k, 0) for k, v in totals.items() if v > self.last.get(k, 0)}
            self.last_steps = steps
            self.last.update(totals)
            return increments
