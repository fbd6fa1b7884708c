"""The operator's metrics: /metrics/json carries exactly the samples of /metrics; the vLLM-named
latency histograms and counters mean what vLLM's do (checked against the engine's own request times
and totals); the Grafana dashboard in docs/ queries only metrics the server exports."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.core.server.server_helpers import parse_sse, wait_for

ROOT = Path(__file__).resolve().parents[3]
MODEL = {"model_name": "tiny-fake"}


def _text_samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _json_samples(body: dict[str, Any]) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {
        (s["name"], frozenset(s["labels"].items())): s["value"]
        for family in body["families"]
        for s in family["samples"]
    }


def _value(client: Any, name: str, **labels: str) -> float:
    samples = _text_samples(client.get("/metrics").text)
    return samples.get((name, frozenset({**MODEL, **labels}.items())), 0.0)


def _stream(client: Any, prompt: list[int], max_tokens: int) -> list[dict[str, Any]]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    events, done = parse_sse(r.text)
    assert done
    return events


def test_metrics_json_holds_the_samples_of_metrics(make_client: Any) -> None:
    client, _ = make_client()
    _stream(client, [5, 6, 7], 4)
    # The engine thread publishes its last snapshot just after the stream ends: compare once the
    # values hold still (two reads of /metrics around the read of /metrics/json agree).
    for _ in range(50):
        before = _text_samples(client.get("/metrics").text)
        body = client.get("/metrics/json")
        if _text_samples(client.get("/metrics").text) == before:
            break
    assert body.status_code == 200 and body.headers["content-type"].startswith("application/json")
    as_text, as_json = before, _json_samples(body.json())
    assert as_json == as_text
    assert len(as_json) > 50
    types = {f["name"]: f["type"] for f in body.json()["families"]}
    assert types["pypto_serving_inter_token_latency_seconds"] == "histogram"
    assert types["pypto_serving_generation_tokens"] == "counter"


def test_metrics_json_needs_the_key_only_where_metrics_does(make_client: Any) -> None:
    client, _ = make_client(api_key=["k"])
    assert client.get("/metrics/json").status_code == 200
    client, _ = make_client(api_key=["k"], protect_metrics=True)
    assert client.get("/metrics/json").status_code == 401
    assert client.get("/metrics/json", headers={"authorization": "Bearer k"}).status_code == 200


def test_latency_histograms_agree_with_the_request_times(make_client: Any) -> None:
    """One streamed request of 6 tokens on the sync scheduler, one forward a command (one token per
    step): 5 inter-token latencies that add up to its decode time, one
    queue/prefill/decode/TTFT/e2e observation each."""
    client, _ = make_client(num_scheduler_steps=1)
    _stream(client, [9, 10, 11, 12], 6)
    assert _value(client, "pypto_serving_inter_token_latency_seconds_count") == 5
    itl_sum = _value(client, "pypto_serving_inter_token_latency_seconds_sum")
    decode_sum = _value(client, "pypto_serving_request_decode_time_seconds_sum")
    assert itl_sum == pytest.approx(decode_sum, rel=1e-6, abs=1e-9) and decode_sum > 0
    for name in ("request_queue_time", "request_prefill_time", "request_decode_time", "time_to_first_token"):
        assert _value(client, f"pypto_serving_{name}_seconds_count") == 1, name
    ttft = _value(client, "pypto_serving_time_to_first_token_seconds_sum")
    queue = _value(client, "pypto_serving_request_queue_time_seconds_sum")
    prefill = _value(client, "pypto_serving_request_prefill_time_seconds_sum")
    assert queue + prefill == pytest.approx(ttft, rel=1e-6, abs=1e-9)  # arrival -> scheduled -> first token
    e2e = _value(client, "pypto_serving_e2e_request_latency_seconds_sum")
    # The scheduler stamps the finish as it commits the last token, the engine the token just after.
    assert e2e == pytest.approx(ttft + decode_sum, abs=0.005)
    assert _value(client, "pypto_serving_generation_tokens_total") == 6
    assert _value(client, "pypto_serving_prompt_tokens_total") == 4


def test_tokens_are_counted_while_a_request_runs(make_client: Any) -> None:
    client, _ = make_client(executor_options={"step_sleep": 0.02})
    body = {"prompt": [3, 4], "max_tokens": 40, "ignore_eos": True, "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as r:
        seen = 0
        for line in r.iter_lines():
            if line.startswith("data: {"):
                seen += 1
            if seen == 10:
                mid = _value(client, "pypto_serving_generation_tokens_total")
                assert 5 <= mid < 40  # counted as produced, not when the request finishes
                assert _value(client, "pypto_serving_prompt_tokens_total") == 2
    assert _value(client, "pypto_serving_generation_tokens_total") == 40


def test_prefix_cache_counters_are_the_engines_totals(make_client: Any) -> None:
    client, llm = make_client(enable_prefix_caching=True)
    prompt = list(range(20, 37))  # 17 tokens: four full blocks of 4 can be reused
    _stream(client, prompt, 2)
    _stream(client, prompt, 2)
    queries = _value(client, "pypto_serving_prefix_cache_queries_total")
    hits = _value(client, "pypto_serving_prefix_cache_hits_total")
    assert (queries, hits) == (llm.stats["prefix_cache_queries"], llm.stats["prefix_cache_hits"])
    assert queries == 34 and hits == 16
    # One group: it alone serves what the hit serves; its rate is the overall one.
    assert _value(client, "pypto_serving_prefix_cache_group_hits_total", group="kv") == 16
    assert llm.stats["prefix_cache_hits_per_group"] == {"kv": 16}
    wait_for(
        lambda: _value(client, "pypto_serving_prefix_cache_group_hit_rate", group="kv") == 16 / 34,
        5,
        "the group's hit rate",
    )
    # The engine thread's snapshot after the last step may land between a scrape and the read of stats.
    wait_for(
        lambda: _value(client, "pypto_serving_kv_cache_group_usage_perc", group="kv") == llm.stats["kv_usage"],
        5,
        "the group's usage to be the engine's",
    )


def test_per_position_acceptance_has_its_denominator(make_client: Any) -> None:
    client, llm = make_client(
        speculative_config={"method": "fake", "num_speculative_tokens": 2, "policy": "fixed"},
        executor_options={"max_draft": 2, "draft_error_rate": 0.3},
    )
    _stream(client, list(range(3, 12)), 24)
    wait_for(
        lambda: _value(client, "pypto_serving_spec_decode_num_drafts_total") == llm.stats["spec_verify_steps"],
        5,
        "the drafts counter to be the engine's verify steps",
    )
    drafts = _value(client, "pypto_serving_spec_decode_num_drafts_total")
    assert drafts > 0
    pos0 = _value(client, "pypto_serving_spec_decode_num_accepted_tokens_per_pos_total", position="0")
    assert 0 < pos0 / drafts <= 1  # the chance that position 0 is accepted


def _queried_metrics(expr: str) -> set[str]:
    return set(re.findall(r"\bpypto_serving_[a-z0-9_]+", expr))


def test_the_grafana_dashboard_queries_only_exported_metrics(make_client: Any) -> None:
    dashboard = json.loads((ROOT / "docs" / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    exprs.append(dashboard["templating"]["list"][1]["query"]["query"])
    queried = set().union(*map(_queried_metrics, exprs))
    client, _ = make_client(
        speculative_config={"method": "fake", "num_speculative_tokens": 2, "policy": "fixed"},
        executor_options={"max_draft": 2, "draft_error_rate": 0.3},
        enable_prefix_caching=True,
    )
    _stream(client, list(range(3, 12)), 8)
    exported = {name for name, _ in _text_samples(client.get("/metrics").text)}
    missing = sorted(queried - exported)
    assert not missing, f"the dashboard queries metrics /metrics does not export: {missing}"
    assert len(queried) >= 20
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds"):
        assert f"pypto_serving_{name}_bucket" in queried, name
