"""Prometheus metrics of the OpenAI-compatible server.

Every :class:`ServerMetrics` owns its own ``CollectorRegistry``: two apps in one process (tests, or a
plugin embedding the server) must not share or collide on the global default registry.
Per-request histograms are fed when a request finishes; engine gauges and counters are refreshed from
the latest ``EngineCore.stats()`` snapshot at scrape time, so scraping never touches the engine thread.
The engine's running totals become Prometheus counters through :class:`_TotalsTracker`.

Under data parallelism the engine series exist twice: summed over the replicas (the names of a single
engine) and per replica (``pypto_serving_replica_*``, labelled ``replica``). They are separate
families because one family holding both a sum and its parts would count twice in every ``sum()``.
Each replica's totals are tracked on their own, so a replica's restart adds to the summed counters.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from .request import RequestMetrics, RequestOutput

__all__ = ["CONTENT_TYPE_LATEST", "ServerMetrics", "registry_json"]

K = TypeVar("K")
# A running total's counter: its name and the values of its labels past the engine's own.
_Total = tuple[str, tuple[str, ...]]

_PREFIX = "pypto_serving"
# Latency buckets cover sub-millisecond CPU fakes up to minute-long generations.
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_TPOT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

_ENGINE_GAUGES = {
    "num_requests_running": "Sequences running in the engine.",
    "num_requests_waiting": "Sequences waiting to be scheduled.",
    "kv_cache_usage_perc": "Fraction of KV blocks in use (0..1).",
    "prefix_cache_hit_rate": "Prefix-cache hit tokens / queried prompt tokens.",
    "spec_decode_acceptance_rate": "Accepted / drafted tokens (0 when nothing was drafted).",
    "spec_decode_mean_accepted_length": "Accepted drafts per verifying request-step (0..k).",
    "engine_dead": "1 when the engine is down for good (restarts exhausted).",
}
_ENGINE_COUNTERS = {
    "num_preemptions": "Preemptions since start.",
    "spec_decode_num_draft_tokens": "Draft tokens proposed.",
    "spec_decode_num_accepted_tokens": "Draft tokens accepted.",
    "worker_restarts": "Times a dead worker was replaced by a fresh one.",
    "spec_decode_num_drafts": "Request-steps that verified drafts (per-position acceptance = per_pos / this).",
    "prefix_cache_queries": "Prompt tokens looked up in the prefix cache.",
    "prefix_cache_hits": "Prompt tokens of those lookups found cached.",
    "kv_transfer_sent": "Disaggregated prefill: requests whose KV a decode engine pulled completely.",
    "kv_transfer_send_failed": "Disaggregated prefill: offered KV whose send failed or timed out.",
    "kv_transfer_pulled": "Disaggregated decode: requests whose KV arrived completely.",
    "kv_transfer_pull_failed": "Disaggregated decode: requests failed by their KV transfer.",
    "kv_transfer_parts_sent": "Disaggregated prefill: parts of the completed sends (stream_kv: one per chunk).",
    "kv_transfer_parts_pulled": "Disaggregated decode: parts of the completed pulls (stream_kv: one per chunk).",
    "kv_offload_bytes_down": "KV offload tiers: bytes of prefix-cache blocks copied from the device down to a tier.",
    "kv_offload_bytes_up": "KV offload tiers: bytes of prefix-cache blocks loaded from a tier back to the device.",
    "kv_offload_loads": "KV offload tiers: loads of a prompt's blocks from the tiers.",
    "kv_offload_load_seconds": "KV offload tiers: seconds from a load's start to its end, summed over the loads.",
    "kv_offload_load_failed": "KV offload tiers: loads cut short by a missing or corrupt block (recomputed).",
}
_PER_POS = "spec_decode_num_accepted_tokens_per_pos"
# The engine's running totals (stats key) behind the counters.
_TOTALS = {
    "num_preemptions": "num_preemptions",
    "spec_drafted": "spec_decode_num_draft_tokens",
    "spec_accepted": "spec_decode_num_accepted_tokens",
    "spec_verify_steps": "spec_decode_num_drafts",
    "prefix_cache_queries": "prefix_cache_queries",
    "prefix_cache_hits": "prefix_cache_hits",
    "kv_sent": "kv_transfer_sent",
    "kv_send_failed": "kv_transfer_send_failed",
    "kv_pulled": "kv_transfer_pulled",
    "kv_pull_failed": "kv_transfer_pull_failed",
    "kv_parts_sent": "kv_transfer_parts_sent",
    "kv_parts_pulled": "kv_transfer_parts_pulled",
    "kv_offload_bytes_down": "kv_offload_bytes_down",
    "kv_offload_bytes_up": "kv_offload_bytes_up",
    "kv_offload_loads": "kv_offload_loads",
    "kv_offload_load_seconds": "kv_offload_load_seconds",
    "kv_offload_load_failed": "kv_offload_load_failed",
}
_GROUP_USAGE = "kv_cache_group_usage_perc"
_GROUP_HITS = "prefix_cache_group_hits"
_GROUP_HIT_RATE = "prefix_cache_group_hit_rate"
_TIER_HITS = "prefix_cache_tier_hits"
_TIER_BYTES = "kv_offload_tier_bytes"
# Requests whose last token time is remembered for the inter-token latency: more live requests than
# this means outputs of requests that never finished (a lost stream), and the oldest are forgotten.
_MAX_TRACKED = 65536


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
            f"{_PREFIX}_prompt_tokens", "Prompt tokens, counted with a request's first output.", labels, registry=r
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
        self.itl = Histogram(
            f"{_PREFIX}_inter_token_latency_seconds",
            "Time between two outputs of a request's tokens (one per engine step that gave it tokens).",
            labels,
            buckets=_TPOT_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            f"{_PREFIX}_request_queue_time_seconds",
            "Arrival to first scheduled (time in the waiting queue).",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.prefill_time = Histogram(
            f"{_PREFIX}_request_prefill_time_seconds",
            "First scheduled to first token.",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.decode_time = Histogram(
            f"{_PREFIX}_request_decode_time_seconds",
            "First token to last token.",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.spec_config = Gauge(
            f"{_PREFIX}_spec_decode_config",
            "1 for the speculative decoding in use: drafting method, policy and deepest k (absent when off).",
            [*labels, "method", "policy", "num_speculative_tokens"],
            registry=r,
        )
        self.engine = _EngineSeries(r, _PREFIX, labels)
        self._totals: _TotalsTracker[_Total] = _TotalsTracker()
        self._replicas: _ReplicaSeries | None = None
        self._lock = threading.Lock()
        self.on_finished: Callable[[RequestOutput], None] | None = None  # the server's request timelines
        self._seen: dict[str, _Seen] = {}  # live user requests: what their latest output showed

    def observe_finished(self, out: RequestOutput) -> None:
        """Record one finished user request (called from the engine thread; prometheus-client locks)."""
        m = self._model
        self.observe_output(out)
        for c in out.outputs:
            self.requests.labels(m, c.finish_reason or "unknown").inc()
        self.cached_prompt_tokens.labels(m).inc(out.num_cached_tokens)
        if out.metrics is not None:
            self._observe_latencies(out.metrics, max((len(c.token_ids) for c in out.outputs), default=0))
        if self.on_finished is not None:
            self.on_finished(out)

    def _observe_latencies(self, t: RequestMetrics, n: int) -> None:
        """The per-request histograms of a finished request with ``n`` output tokens (its longest choice)."""
        m = self._model
        if t.first_scheduled_time is not None:
            self.queue_time.labels(m).observe(max(0.0, t.first_scheduled_time - t.arrival_time))
            if t.first_token_time is not None:
                self.prefill_time.labels(m).observe(max(0.0, t.first_token_time - t.first_scheduled_time))
        if t.first_token_time is not None:
            self.ttft.labels(m).observe(max(0.0, t.first_token_time - t.arrival_time))
            if t.last_token_time is not None:
                self.decode_time.labels(m).observe(max(0.0, t.last_token_time - t.first_token_time))
                if n > 1:
                    self.tpot.labels(m).observe(max(0.0, t.last_token_time - t.first_token_time) / (n - 1))
        end = t.finished_time or t.last_token_time
        if end is not None:
            self.e2e.labels(m).observe(max(0.0, end - t.arrival_time))

    def observe_output(self, out: RequestOutput) -> None:
        """Any output of a user request (the engine thread passes every step's): the tokens it adds to
        the request's previous output are counted as they come (so tokens/s is live, not lumped at the
        finish; the prompt counts with the first output), and a newer last token time is one
        inter-token latency. A finished output forgets the request."""
        t = out.metrics
        last = t.last_token_time if t is not None else None
        tokens = sum(len(c.token_ids) for c in out.outputs)
        with self._lock:
            seen = self._seen.pop(out.request_id, None) if out.finished else self._seen.get(out.request_id)
            if not out.finished:
                if seen is None and len(self._seen) >= _MAX_TRACKED:
                    del self._seen[next(iter(self._seen))]
                self._seen[out.request_id] = _Seen(last, tokens)
        if seen is None:
            self.prompt_tokens.labels(self._model).inc(len(out.prompt_token_ids))
        if tokens > (seen.tokens if seen else 0):
            self.generation_tokens.labels(self._model).inc(tokens - (seen.tokens if seen else 0))
        if seen is not None and seen.last_token_time is not None and last is not None and last > seen.last_token_time:
            self.itl.labels(self._model).observe(last - seen.last_token_time)

    def observe_restart(self) -> None:
        self.engine.counters["worker_restarts"].labels(self._model).inc()
        self._totals.restart()

    def observe_replica_finished(self, replica: int, out: RequestOutput) -> None:
        """A request finished on data-parallel replica ``replica``: counted overall and for the replica."""
        self.observe_finished(out)
        requests = self.replica_series().requests
        for c in out.outputs:
            requests.labels(self._model, str(replica), c.finish_reason or "unknown").inc()

    def observe_replica_restart(self, replica: int) -> None:
        """Replica ``replica`` restarted its worker: its next engine's totals count whole."""
        series = self.replica_series()
        self.engine.counters["worker_restarts"].labels(self._model).inc()
        series.engine.counters["worker_restarts"].labels(self._model, str(replica)).inc()
        series.tracker(replica).restart()

    def update_engine(self, stats: Mapping[str, Any], dead: bool) -> None:
        """Refresh from an engine snapshot (the engine thread after each step, and every scrape).

        A data-parallel snapshot (summed, with each replica's own under ``replicas``) also refreshes
        the per-replica series, and the summed counters grow by the replicas' own increments."""
        m = self._model
        self.engine.refresh((m,), stats, dead)
        if stats.get("spec_method"):
            self.spec_config.labels(m, stats["spec_method"], stats["spec_policy"], str(stats["spec_k"])).set(1)
        replicas = stats.get("replicas")
        if replicas is None:
            increments = self._totals.advance(stats.get("num_steps", 0), _running_totals(stats))
        else:
            increments = self._update_replicas(replicas)
        self.engine.add((m,), increments)

    def _update_replicas(self, snaps: Sequence[Mapping[str, Any]]) -> dict[_Total, float]:
        """Refresh each replica's series; the sum of their counter increments."""
        series = self.replica_series()
        summed: dict[_Total, float] = {}
        for i, snap in enumerate(snaps):
            labels = (self._model, str(i))
            series.engine.refresh(labels, snap, bool(snap.get("dead", False)))
            series.outstanding.labels(*labels).set(snap.get("outstanding_tokens", 0))
            increments = series.tracker(i).advance(snap.get("num_steps", 0), _running_totals(snap))
            series.engine.add(labels, increments)
            for key, inc in increments.items():
                summed[key] = summed.get(key, 0) + inc
        return summed

    def replica_series(self) -> _ReplicaSeries:
        """The per-replica series, declared on first use: a single engine's scrape carries none."""
        with self._lock:
            if self._replicas is None:
                self._replicas = _ReplicaSeries.declare(self.registry)
            return self._replicas

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def render_json(self) -> dict[str, Any]:
        """The samples of :meth:`render`, as JSON (``/metrics/json``)."""
        return registry_json(self.registry)


def registry_json(registry: CollectorRegistry) -> dict[str, Any]:
    """Every metric family of ``registry`` with its samples, named as the text exposition names them
    (a counter's samples end in ``_total``, a histogram's in ``_bucket``/``_sum``/``_count``). A value
    that is not finite (a NaN gauge, never one of ours) becomes ``null``: JSON has no NaN."""
    families = []
    for family in registry.collect():
        samples = [
            {"name": s.name, "labels": s.labels, "value": s.value if math.isfinite(s.value) else None}
            for s in family.samples
        ]
        families.append({"name": family.name, "type": family.type, "help": family.documentation, "samples": samples})
    return {"families": families}


class _EngineSeries:
    """The gauges and counters refreshed from engine snapshots, under one name prefix and label set."""

    def __init__(self, registry: CollectorRegistry, prefix: str, labels: list[str]) -> None:
        self.gauges = {
            name: Gauge(f"{prefix}_{name}", doc, labels, registry=registry) for name, doc in _ENGINE_GAUGES.items()
        }
        self.counters = {
            name: Counter(f"{prefix}_{name}", doc, labels, registry=registry) for name, doc in _ENGINE_COUNTERS.items()
        }
        self.counters[_PER_POS] = Counter(
            f"{prefix}_{_PER_POS}", "Accepted drafts by draft position.", [*labels, "position"], registry=registry
        )
        self.group_usage = Gauge(
            f"{prefix}_{_GROUP_USAGE}",
            "Fraction of one KV cache group's blocks in use (0..1).",
            [*labels, "group"],
            registry=registry,
        )
        self.counters[_GROUP_HITS] = Counter(
            f"{prefix}_{_GROUP_HITS}",
            "Queried prompt tokens one KV cache group alone could have served (a hit is the shortest).",
            [*labels, "group"],
            registry=registry,
        )
        self.counters[_TIER_HITS] = Counter(
            f"{prefix}_{_TIER_HITS}",
            "Queried prompt tokens served by a KV offload tier (host, disk) after missing the device cache.",
            [*labels, "tier"],
            registry=registry,
        )
        self.tier_bytes = Gauge(
            f"{prefix}_{_TIER_BYTES}",
            "Bytes of prefix-cache blocks a KV offload tier (host, disk) holds.",
            [*labels, "tier"],
            registry=registry,
        )
        self.group_hit_rate = Gauge(
            f"{prefix}_{_GROUP_HIT_RATE}",
            "Per KV cache group: prefix_cache_group_hits / prefix_cache_queries.",
            [*labels, "group"],
            registry=registry,
        )

    def refresh(self, labels: tuple[str, ...], stats: Mapping[str, Any], dead: bool) -> None:
        """Set the gauges from one snapshot (counters move only through :meth:`add`)."""
        queries = stats.get("prefix_cache_queries", 0)
        drafted, accepted = stats.get("spec_drafted", 0), stats.get("spec_accepted", 0)
        values = {
            "num_requests_running": stats.get("num_running", 0),
            "num_requests_waiting": stats.get("num_waiting", 0),
            "kv_cache_usage_perc": stats.get("kv_usage", 0.0),
            "prefix_cache_hit_rate": stats.get("prefix_cache_hits", 0) / queries if queries else 0.0,
            "spec_decode_acceptance_rate": accepted / drafted if drafted else 0.0,
            "spec_decode_mean_accepted_length": stats.get("spec_mean_accepted_length", 0.0),
            "engine_dead": 1 if dead else 0,
        }
        for name, value in values.items():
            self.gauges[name].labels(*labels).set(value)
        for group, usage in stats.get("kv_usage_per_group", {}).items():
            self.group_usage.labels(*labels, group).set(usage)
        for group, hits in stats.get("prefix_cache_hits_per_group", {}).items():
            self.group_hit_rate.labels(*labels, group).set(hits / queries if queries else 0.0)
        for tier, used in stats.get("kv_offload_bytes_per_tier", {}).items():
            self.tier_bytes.labels(*labels, tier).set(used)
        for name in _ENGINE_COUNTERS:  # present at 0 from the first snapshot: rate() sees the first increment
            self.counters[name].labels(*labels)

    def add(self, labels: tuple[str, ...], increments: Mapping[_Total, float]) -> None:
        for (name, extra), inc in increments.items():
            self.counters[name].labels(*labels, *extra).inc(inc)


def _running_totals(stats: Mapping[str, Any]) -> dict[_Total, float]:
    """The engine's running totals in a snapshot, keyed by the counter each one feeds."""
    totals: dict[_Total, float] = {(name, ()): stats.get(key, 0) for key, name in _TOTALS.items()}
    for pos, n in enumerate(stats.get("spec_accepted_per_pos", [])):
        totals[_PER_POS, (str(pos),)] = n
    for group, n in stats.get("prefix_cache_hits_per_group", {}).items():
        totals[_GROUP_HITS, (group,)] = n
    for tier, n in stats.get("kv_offload_hits_per_tier", {}).items():
        totals[_TIER_HITS, (tier,)] = n
    return totals


@dataclass(slots=True)
class _Seen:
    """What the latest output of a live user request showed: its last token time and token count."""

    last_token_time: float | None
    tokens: int


@dataclass(slots=True)
class _ReplicaSeries:
    """The per-replica series of data parallelism, and each replica's own totals tracker."""

    engine: _EngineSeries
    outstanding: Gauge
    requests: Counter
    trackers: dict[int, _TotalsTracker[_Total]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def declare(cls, registry: CollectorRegistry) -> _ReplicaSeries:
        prefix, labels = f"{_PREFIX}_replica", ["model_name", "replica"]
        outstanding = Gauge(
            f"{prefix}_outstanding_tokens",
            "Tokens booked by the replica's in-flight requests (what least_tokens routing compares).",
            labels,
            registry=registry,
        )
        requests = Counter(
            f"{prefix}_request_success",
            "Finished requests by finish reason.",
            [*labels, "finish_reason"],
            registry=registry,
        )
        return cls(_EngineSeries(registry, prefix, labels), outstanding, requests)

    def tracker(self, replica: int) -> _TotalsTracker[_Total]:
        with self.lock:
            if replica not in self.trackers:
                self.trackers[replica] = _TotalsTracker()
            return self.trackers[replica]


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
