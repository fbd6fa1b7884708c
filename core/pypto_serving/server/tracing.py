"""OpenTelemetry spans of finished requests, sent over OTLP/HTTP to ``otlp_traces_endpoint``.

Imported only when that setting is set (the ``otel`` extra: ``opentelemetry-sdk`` and
``opentelemetry-exporter-otlp-proto-http``). The spans are made after the request finished, from its
timeline record, with the record's times, and a batch processor of this server's own tracer provider
(never the global one) sends them from its thread. One trace per request:

* ``llm_request``: arrival to finish; attributes ``gen_ai.request.id``, ``gen_ai.response.model``,
  ``gen_ai.usage.prompt_tokens``, ``gen_ai.usage.completion_tokens``, ``gen_ai.latency.time_in_queue``,
  ``gen_ai.latency.time_to_first_token``, ``gen_ai.latency.e2e``, ``pypto_serving.finish_reason``,
  ``pypto_serving.num_preemptions``, ``pypto_serving.cached_tokens``; an event ``preempted`` per
  preemption. Its children:
* ``queue``: arrival to first scheduled;
* ``prefill``: first scheduled to first token, with a child ``prefill_chunk`` per chunk (from its
  step to the next chunk's, or the first token; attributes ``pypto_serving.start``,
  ``pypto_serving.tokens``);
* ``decode``: first token to finish.
"""

from __future__ import annotations

from typing import Any

__all__ = ["OtlpRequestTracer"]


class OtlpRequestTracer:
    """Sends each timeline record as a trace (see the module docstring)."""

    def __init__(self, endpoint: str, model_name: str) -> None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        self.model_name = model_name
        self.provider = TracerProvider(resource=Resource.create({"service.name": "pypto-serving"}))
        self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        self.tracer = self.provider.get_tracer("pypto_serving")

    def export(self, record: dict[str, Any]) -> None:
        from opentelemetry import trace

        start_ns = int(record["arrival_unix"] * 1e9)

        def at(seconds: float) -> int:
            return start_ns + int(seconds * 1e9)

        events = record["events"]
        times = {e["event"]: e["t"] for e in reversed(events)}  # the first time of each kind
        end = times["finished"]
        root = self.tracer.start_span(
            "llm_request", start_time=start_ns, attributes=_attributes(record, self.model_name)
        )
        for e in events:
            if e["event"] == "preempted":
                root.add_event("preempted", timestamp=at(e["t"]))
        parent = trace.set_span_in_context(root)
        scheduled, first = times.get("scheduled"), times.get("first_token")
        if scheduled is not None:
            self._span("queue", parent, at(0.0), at(scheduled))
            prefill = self.tracer.start_span("prefill", context=parent, start_time=at(scheduled))
            self._chunks(trace.set_span_in_context(prefill), events, at, first if first is not None else end)
            prefill.end(end_time=at(first if first is not None else end))
        if first is not None:
            self._span("decode", parent, at(first), at(end))
        root.end(end_time=at(end))

    def _chunks(self, parent: Any, events: list[dict[str, Any]], at: Any, until: float) -> None:
        chunks = [e for e in events if e["event"] == "prefill_chunk" and e["t"] <= until]
        for i, chunk in enumerate(chunks):
            stop = chunks[i + 1]["t"] if i + 1 < len(chunks) else until
            attrs = {"pypto_serving.start": chunk["start"], "pypto_serving.tokens": chunk["tokens"]}
            self._span("prefill_chunk", parent, at(chunk["t"]), at(stop), attrs)

    def _span(self, name: str, parent: Any, start: int, end: int, attributes: dict[str, Any] | None = None) -> None:
        span = self.tracer.start_span(name, context=parent, start_time=start, attributes=attributes)
        span.end(end_time=max(start, end))

    def shutdown(self) -> None:
        """Send what is batched, then stop (the server's shutdown)."""
        self.provider.shutdown()


def _attributes(record: dict[str, Any], model_name: str) -> dict[str, Any]:
    attrs: dict[str, Any] = {
        "gen_ai.request.id": record["request_id"],
        "gen_ai.response.model": model_name,
        "gen_ai.usage.prompt_tokens": record["prompt_tokens"],
        "gen_ai.usage.completion_tokens": sum(record["output_tokens"]),
        "gen_ai.latency.e2e": record["e2e_latency"],
        "pypto_serving.finish_reason": [r or "unknown" for r in record["finish_reasons"]],
        "pypto_serving.num_preemptions": record["num_preemptions"],
        "pypto_serving.cached_tokens": record["cached_tokens"],
    }
    if record["queue_time"] is not None:
        attrs["gen_ai.latency.time_in_queue"] = record["queue_time"]
    if record["time_to_first_token"] is not None:
        attrs["gen_ai.latency.time_to_first_token"] = record["time_to_first_token"]
    return attrs
