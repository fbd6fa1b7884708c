"""Request timelines: the engine notes each prefill chunk and preemption; the server keeps the last
``request_timeline_capacity`` records (``/v1/requests/{id}/timeline``) and, with
``otlp_traces_endpoint`` set, sends each as OpenTelemetry spans, here to an in-test OTLP collector."""

from __future__ import annotations

import http.server
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from pypto_serving import SamplingParams
from pypto_serving.server.timeline import timeline_record


def _kinds(record: dict[str, Any]) -> list[str]:
    return [e["event"] for e in record["events"]]


def test_a_chunked_prefill_is_one_event_per_chunk(make_client: Any) -> None:
    client, _ = make_client(max_num_batched_tokens=8, max_num_seqs=4)
    r = client.post("/v1/completions", json={"prompt": list(range(3, 33)), "max_tokens": 5, "ignore_eos": True})
    assert r.status_code == 200
    rid = r.json()["id"]
    tl = client.get(f"/v1/requests/{rid}/timeline")
    assert tl.status_code == 200, tl.text
    record = tl.json()
    assert record["request_id"] == rid and record["prompt_tokens"] == 30 and record["output_tokens"] == [5]
    assert _kinds(record) == ["arrival", "scheduled", *["prefill_chunk"] * 4, "first_token", "finished"]
    chunks = [(e["start"], e["tokens"]) for e in record["events"] if e["event"] == "prefill_chunk"]
    assert chunks == [(0, 8), (8, 8), (16, 8), (24, 6)]
    times = [e["t"] for e in record["events"]]
    assert times == sorted(times) and times[0] == 0.0
    assert record["events"][-1]["reason"] == "length" and record["finish_reasons"] == ["length"]
    assert record["queue_time"] <= record["time_to_first_token"] <= record["e2e_latency"]


def test_preemptions_are_on_the_timeline(make_llm: Any) -> None:
    """A KV cache too small for every request at once preempts; each preemption is an event, and the
    recompute after it is a prefill chunk from position 0."""
    llm = make_llm(
        block_size=4,
        num_kv_blocks=14,
        max_num_seqs=4,
        enable_prefix_caching=False,
        executor_options={"max_model_len": 64},
    )
    outs = llm.generate([[5, 6, 7, 8, 9, 10 + i] for i in range(4)], SamplingParams(max_tokens=30, ignore_eos=True))
    records = [timeline_record(o, o.metrics) for o in outs]
    preempted = [r for r in records if r["num_preemptions"]]
    assert preempted, "the cache was meant to run out"
    for r in preempted:
        kinds = _kinds(r)
        assert kinds.count("preempted") == r["num_preemptions"]
        after = kinds.index("preempted")
        recompute = next(e for e in r["events"][after:] if e["event"] == "prefill_chunk")
        assert recompute["start"] == 0 and recompute["tokens"] > 6  # the prompt and the outputs so far
    for r in records:
        times = [e["t"] for e in r["events"]]
        assert times == sorted(times)


def test_timelines_are_a_bounded_ring(make_client: Any) -> None:
    client, _ = make_client(request_timeline_capacity=2)
    ids = [client.post("/v1/completions", json={"prompt": [4, i], "max_tokens": 2}).json()["id"] for i in range(3)]
    assert client.get(f"/v1/requests/{ids[0]}/timeline").status_code == 404
    assert all(client.get(f"/v1/requests/{i}/timeline").status_code == 200 for i in ids[1:])
    missing = client.get("/v1/requests/nope/timeline")
    assert missing.status_code == 404 and "request_timeline_capacity=2" in missing.json()["error"]["message"]


# -- OpenTelemetry


class _Collector(http.server.BaseHTTPRequestHandler):
    bodies: list[bytes]

    def do_POST(self) -> None:
        self.bodies.append(self.rfile.read(int(self.headers["content-length"])))
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def collector() -> Iterator[tuple[str, list[bytes]]]:
    bodies: list[bytes] = []
    handler = type("Handler", (_Collector,), {"bodies": bodies})
    server = http.server.HTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1/traces", bodies
    server.shutdown()


def test_spans_arrive_at_an_otlp_collector_with_their_parents(make_client: Any, collector: Any) -> None:
    pytest.importorskip("opentelemetry.sdk", reason="the 'otel' extra is not installed")
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    endpoint, bodies = collector
    client, _ = make_client(otlp_traces_endpoint=endpoint, max_num_batched_tokens=8)
    r = client.post("/v1/completions", json={"prompt": list(range(3, 23)), "max_tokens": 4, "ignore_eos": True})
    rid = r.json()["id"]
    client.__exit__(None, None, None)  # the lifespan's end flushes the batched spans
    spans = []
    for body in bodies:
        req = ExportTraceServiceRequest.FromString(body)
        spans += [s for rs in req.resource_spans for ss in rs.scope_spans for s in ss.spans]
    by_name: dict[str, list[Any]] = {}
    for s in spans:
        by_name.setdefault(s.name, []).append(s)
    assert sorted(by_name) == ["decode", "llm_request", "prefill", "prefill_chunk", "queue"]
    (root,) = by_name["llm_request"]
    assert root.parent_span_id == b""
    attrs = {a.key: a.value for a in root.attributes}
    assert attrs["gen_ai.request.id"].string_value == rid
    assert attrs["gen_ai.usage.completion_tokens"].int_value == 4
    for name in ("queue", "prefill", "decode"):
        (span,) = by_name[name]
        assert span.parent_span_id == root.span_id and span.trace_id == root.trace_id, name
        assert root.start_time_unix_nano <= span.start_time_unix_nano <= span.end_time_unix_nano
        assert span.end_time_unix_nano <= root.end_time_unix_nano
    (prefill,) = by_name["prefill"]
    chunks = by_name["prefill_chunk"]
    assert len(chunks) == 3 and all(c.parent_span_id == prefill.span_id for c in chunks)
    assert by_name["queue"][0].end_time_unix_nano == prefill.start_time_unix_nano


def test_tracing_off_imports_no_opentelemetry() -> None:
    code = (
        "import sys; from pypto_serving import ServingSettings; "
        "from pypto_serving.server.timeline import timeline_store; "
        "timeline_store(ServingSettings(model='x'), 'm'); "
        "print(sorted(m for m in sys.modules if m.startswith(PREFIXES)))"
    ).replace("PREFIXES", repr(("opentelemetry.sdk", "opentelemetry.exporter", "pypto_serving.server.tracing")))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    # FastAPI itself imports the OpenTelemetry API when it is installed; the SDK and exporter stay out.
    assert out.stdout.strip() == "[]"
