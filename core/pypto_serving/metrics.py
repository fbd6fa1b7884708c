"""Prometheus metrics of the OpenAI-compatible server.

Every :class:`ServerMetrics` owns its own ``CollectorRegistry``: two apps in one process (tests, or a
plugin embedding the server) must not share or collide on the global default registry.
Per-request histograms are fed when a request finishes; engine gauges are refreshed from the latest
``EngineCore.stats()`` snapshot at scrape time, so scraping never touches the engine thread.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from .request import RequestOutput

__all__ = ["CONTENT_TYPE_LATEST", "ServerMetrics"]

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
        self.preemptions = Gauge(
            f"{_PREFIX}_num_preemptions", "Preemptions since start (engine counter).", labels, registry=r
        )
        self.kv_usage = Gauge(
            f"{_PREFIX}_kv_cache_usage_perc", "Fraction of KV blocks in use (0..1).", labels, registry=r
        )
        self.prefix_hit_rate = Gauge(
            f"{_PREFIX}_prefix_cache_hit_rate",
            "Prefix-cache hit tokens / queried prompt tokens.",
            labels,
            registry=r,
        )
        self.spec_drafted = Gauge(
            f"{_PREFIX}_spec_decode_num_draft_tokens", "Draft tokens proposed.", labels, registry=r
        )
        self.spec_accepted = Gauge(
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
        self.spec_accepted_per_pos = Gauge(
            f"{_PREFIX}_spec_decode_num_accepted_tokens_per_pos",
            "Accepted drafts by draft position.",
            [*labels, "position"],
            registry=r,
        )
        self.engine_dead = Gauge(
            f"{_PREFIX}_engine_dead", "1 when the engine is down for good (restarts exhausted).", labels, registry=r
        )
        self.worker_restarts = Counter(
            f"{_PREFIX}_worker_restarts", "Times a dead worker was replaced by a fresh one.", labels, registry=r
        )

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

    def update_engine(self, stats: Mapping[str, Any], dead: bool) -> None:
        m = self._model
        self.running.labels(m).set(stats.get("num_running", 0))
        self.waiting.labels(m).set(stats.get("num_waiting", 0))
        self.preemptions.labels(m).set(stats.get("num_preemptions", 0))
        self.kv_usage.labels(m).set(stats.get("kv_usage", 0.0))
        queries = stats.get("prefix_cache_queries", 0)
        self.prefix_hit_rate.labels(m).set(stats.get("prefix_cache_hits", 0) / queries if queries else 0.0)
        drafted, accepted = stats.get("spec_drafted", 0), stats.get("spec_accepted", 0)
        self.spec_drafted.labels(m).set(drafted)
        self.spec_accepted.labels(m).set(accepted)
        self.spec_acceptance.labels(m).set(accepted / drafted if drafted else 0.0)
        self.spec_mean_accepted.labels(m).set(stats.get("spec_mean_accepted_length", 0.0))
        for pos, n in enumerate(stats.get("spec_accepted_per_pos", [])):
            self.spec_accepted_per_pos.labels(m, str(pos)).set(n)
        self.engine_dead.labels(m).set(1 if dead else 0)

    def render(self) -> bytes:
        return generate_latest(self.registry)
