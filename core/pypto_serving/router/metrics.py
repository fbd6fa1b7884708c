"""The router's Prometheus metrics, on a registry of its own (``pypto_router_*``)."""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from .routing import Choice, ReplicaLoad

__all__ = ["RouterMetrics"]


class RouterMetrics:
    """Counters fed as requests are routed; replica gauges refreshed from the loads at scrape time."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "pypto_router_requests", "Requests sent to each replica (retries included).", ["replica"], registry=r
        )
        self.failures = Counter(
            "pypto_router_replica_failures",
            "Requests a replica failed: before any byte (stage=connect) or mid-response (stage=response).",
            ["replica", "stage"],
            registry=r,
        )
        self.retries = Counter("pypto_router_retries", "Requests sent again to another replica.", registry=r)
        self.unrouted = Counter(
            "pypto_router_unrouted", "Requests answered 503 because no replica took requests.", registry=r
        )
        self.affinity = Counter(
            "pypto_router_session_affinity",
            "Requests with a session id: result=hit when the session's own replica took it.",
            ["result"],
            registry=r,
        )
        self.affinity_rate = Gauge(
            "pypto_router_session_affinity_hit_rate", "Session affinity hits / requests with a session id.", registry=r
        )
        self.prefix = Counter(
            "pypto_router_prefix",
            "Requests sharing leading blocks with an earlier one: hit (sent to that replica), miss (it "
            "takes no requests) or overloaded (passed over for load).",
            ["result"],
            registry=r,
        )
        self.outstanding = Gauge(
            "pypto_router_outstanding_tokens", "Estimated tokens in flight per replica.", ["replica"], registry=r
        )
        self.in_flight = Gauge("pypto_router_in_flight", "Requests in flight per replica.", ["replica"], registry=r)
        self.healthy = Gauge(
            "pypto_router_replica_healthy", "1 when the replica passes its checks.", ["replica"], registry=r
        )
        self.drained = Gauge("pypto_router_replica_drained", "1 when the replica is drained.", ["replica"], registry=r)
        self._hits = 0
        self._sessions = 0

    def routed(self, choice: Choice) -> None:
        """Count a first routing decision (retries are counted by :attr:`retries`)."""
        if choice.reason == "session":
            self._sessions += 1
            self._hits += bool(choice.hit)
            self.affinity.labels("hit" if choice.hit else "miss").inc()
            self.affinity_rate.set(self._hits / self._sessions)
        elif choice.reason == "prefix":
            self.prefix.labels("overloaded" if choice.overloaded else "hit" if choice.hit else "miss").inc()

    def render(self, loads: Iterable[ReplicaLoad]) -> bytes:
        for load in loads:
            self.outstanding.labels(load.name).set(load.outstanding_tokens)
            self.in_flight.labels(load.name).set(load.in_flight)
            self.healthy.labels(load.name).set(int(load.healthy))
            self.drained.labels(load.name).set(int(load.drained))
            self.requests.labels(load.name)  # a replica that got nothing yet still shows 0
        return generate_latest(self.registry)
