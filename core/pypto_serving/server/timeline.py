"""Request timelines: what happened to each finished request, as one record (``/v1/requests/{id}/timeline``
for the last ``request_timeline_capacity`` requests) and, with ``otlp_traces_endpoint`` set, as
OpenTelemetry spans (:mod:`.tracing`, imported only then).

A record is built when the request's final output reaches the server: from its ``RequestMetrics``
(arrival, first scheduled, first and last token, finish: monotonic times of the engine process, on
the same clock as this process's ``time.monotonic`` on Linux) and the events the engine noted on the
way (each prefill chunk, each preemption). Times in a record are seconds since the arrival, whose
unix time the record gives.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Any, Protocol

from fastapi import FastAPI

from ..config import ServingSettings
from ..request import RequestMetrics, RequestOutput
from .protocol import APIError

__all__ = ["SpanExporter", "TimelineStore", "add_timeline_route", "timeline_record", "timeline_store"]


class SpanExporter(Protocol):
    def export(self, record: dict[str, Any]) -> None: ...

    def shutdown(self) -> None: ...


def timeline_record(out: RequestOutput, t: RequestMetrics) -> dict[str, Any]:
    """The timeline of a finished user request (its first choice's times)."""
    start = t.arrival_time
    events: list[dict[str, Any]] = [{"event": "arrival", "t": 0.0}]
    if t.first_scheduled_time is not None:
        events.append({"event": "scheduled", "t": t.first_scheduled_time - start})
    for kind, at, first, n in t.events:
        event: dict[str, Any] = {"event": kind, "t": at - start}
        if kind == "prefill_chunk":
            event.update(start=first, tokens=n)
        events.append(event)
    if t.first_token_time is not None:
        events.append({"event": "first_token", "t": t.first_token_time - start})
    end = t.finished_time or t.last_token_time or start
    reasons = [c.finish_reason for c in out.outputs]
    events.append({"event": "finished", "t": end - start, "reason": reasons[0] if reasons else None})
    events.sort(key=lambda e: e["t"])  # stable: equal times keep the order above
    return {
        "request_id": out.request_id,
        "arrival_unix": time.time() - (time.monotonic() - start),
        "prompt_tokens": len(out.prompt_token_ids),
        "output_tokens": [len(c.token_ids) for c in out.outputs],
        "cached_tokens": out.num_cached_tokens,
        "finish_reasons": reasons,
        "num_preemptions": t.num_preemptions,
        "queue_time": None if t.first_scheduled_time is None else t.first_scheduled_time - start,
        "time_to_first_token": None if t.first_token_time is None else t.first_token_time - start,
        "e2e_latency": end - start,
        "events": events,
        "events_dropped": t.events_dropped,
    }


class TimelineStore:
    """The timelines of the last ``capacity`` finished requests (0: none kept), oldest forgotten first;
    each also goes to ``exporter`` (OpenTelemetry) when there is one."""

    def __init__(self, capacity: int, exporter: SpanExporter | None = None) -> None:
        self.capacity = capacity
        self.exporter = exporter
        self._records: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._lock = threading.Lock()

    def add(self, out: RequestOutput) -> None:
        """Record a finished output (called from the engine thread)."""
        if out.metrics is None or (self.capacity == 0 and self.exporter is None):
            return
        record = timeline_record(out, out.metrics)
        if self.capacity:
            with self._lock:
                self._records[out.request_id] = record
                self._records.move_to_end(out.request_id)
                while len(self._records) > self.capacity:
                    self._records.popitem(last=False)
        if self.exporter is not None:
            self.exporter.export(record)

    def get(self, request_id: str) -> dict[str, Any] | None:
        with self._lock:
            return self._records.get(request_id)

    def shutdown(self) -> None:
        if self.exporter is not None:
            self.exporter.shutdown()


def timeline_store(settings: ServingSettings, model_name: str) -> TimelineStore:
    """The store of the settings, with the OpenTelemetry exporter when ``otlp_traces_endpoint`` is set."""
    exporter: SpanExporter | None = None
    if settings.otlp_traces_endpoint:
        from .tracing import OtlpRequestTracer  # the only import of OpenTelemetry, and only when on

        exporter = OtlpRequestTracer(settings.otlp_traces_endpoint, model_name)
    return TimelineStore(settings.request_timeline_capacity, exporter)


def add_timeline_route(app: FastAPI, store: TimelineStore) -> None:
    @app.get("/v1/requests/{request_id}/timeline")
    async def request_timeline(request_id: str) -> dict[str, Any]:
        record = store.get(request_id)
        if record is None:
            raise APIError(
                404,
                f"no timeline of request {request_id!r}: unknown, still running, or older than the last "
                f"request_timeline_capacity={store.capacity} finished requests",
                code="not_found",
            )
        return record
