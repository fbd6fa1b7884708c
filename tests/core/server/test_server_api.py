"""Every endpoint, field and error of the OpenAI-compatible app, in-process (TestClient)."""

from __future__ import annotations

import json
import threading
from typing import Any

import pytest

pytest.importorskip("pypto_serving_sync_sched")

from tests.core.server.server_helpers import parse_sse
from tests.fakes import reference_tokens

VOCAB, EOS = 320, 2


def ref_text(llm: Any, ids: list[int], max_tokens: int) -> tuple[str, list[int], str]:
    """Greedy tokens of the fake model and their text as the engine's detokenizer streams it (byte-level
    BPE over arbitrary tokens leaves incomplete UTF-8 that the detokenizer holds back)."""
    from pypto_serving.tokenizer import IncrementalDetokenizer

    toks, reason = reference_tokens(ids, max_tokens, VOCAB, eos=EOS)
    detok = IncrementalDetokenizer(llm.tokenizer, ids, [])
    for t in toks:
        detok.append(t)
    return detok.text, toks, reason


def chat_ids(llm: Any, messages: list[dict[str, str]]) -> list[int]:
    return list(llm.tokenizer.encode(llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True)))


def err(r: Any, status: int, param: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    body = r.json()["error"]
    assert set(body) == {"message", "type", "param", "code"}
    assert body["message"]
    if param is not None:
        assert body["param"] == param, body
    return dict(body)


# --------------------------------------------------------------------------- completions


def test_completion_text_prompt_matches_reference(shared_client: Any) -> None:
    client, llm = shared_client
    r = client.post("/v1/completions", json={"prompt": "hello world", "max_tokens": 6, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    ids = llm.tokenizer.encode("hello world")
    text, toks, reason = ref_text(llm, ids, 6)
    assert body["object"] == "text_completion" and body["model"] == "tiny-fake"
    assert body["id"].startswith("cmpl-")
    [choice] = body["choices"]
    assert choice["text"] == text and choice["finish_reason"] == reason and choice["index"] == 0
    assert body["usage"] == {
        "prompt_tokens": len(ids),
        "completion_tokens": len(toks),
        "total_tokens": len(ids) + len(toks),
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def test_completion_prompt_forms_and_n(shared_client: Any) -> None:
    client, llm = shared_client
    p1, p2 = [5, 6, 7], [8, 9]
    r = client.post("/v1/completions", json={"prompt": [p1, p2], "max_tokens": 4, "temperature": 0, "n": 2})
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    assert choices[0]["text"] == choices[1]["text"] == ref_text(llm, p1, 4)[0]
    assert choices[2]["text"] == choices[3]["text"] == ref_text(llm, p2, 4)[0]
    assert r.json()["usage"]["prompt_tokens"] == 5
    r = client.post("/v1/completions", json={"prompt": p1, "max_tokens": 4, "temperature": 0})
    assert r.json()["choices"][0]["text"] == ref_text(llm, p1, 4)[0]
    r = client.post("/v1/completions", json={"prompt": ["the cat", "a dog"], "max_tokens": 3, "temperature": 0})
    texts = [c["text"] for c in r.json()["choices"]]
    assert texts == [ref_text(llm, llm.tokenizer.encode(p), 3)[0] for p in ("the cat", "a dog")]


def test_completion_echo_and_logprobs(shared_client: Any) -> None:
    """Echo and output logprobs here; echo with logprobs scores the prompt, which the fake executor's
    sampled-rows-only logits cannot do (tests/core/server/test_prompt_logprobs.py runs it on a real
    model): that request fails alone with a 500 naming the reason."""
    client, llm = shared_client
    ids = llm.tokenizer.encode("the cat")
    r = client.post("/v1/completions", json={"prompt": "the cat", "max_tokens": 3, "temperature": 0, "echo": True})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == "the cat" + ref_text(llm, ids, 3)[0]
    r = client.post("/v1/completions", json={"prompt": "the cat", "max_tokens": 3, "temperature": 0, "logprobs": 2})
    lp = r.json()["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == 3
    for value, top in zip(lp["token_logprobs"], lp["top_logprobs"]):
        assert value <= 0 and 2 <= len(top) <= 3 and max(top.values()) == pytest.approx(value)
    assert lp["text_offset"] == sorted(lp["text_offset"])
    body = {"prompt": "the cat", "max_tokens": 3, "echo": True, "logprobs": 2}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 500 and "no prompt logprobs" in r.json()["error"]["message"], r.text


def test_completion_stop_string_and_stop_token_ids(shared_client: Any) -> None:
    client, llm = shared_client
    ids = [11, 12, 13]
    text, toks, _ = ref_text(llm, ids, 12)
    stop = next(
        text[i : i + 2] for i in range(2, len(text) - 2) if text[i : i + 2].strip() and "\ufffd" not in text[i : i + 2]
    )
    r = client.post("/v1/completions", json={"prompt": ids, "max_tokens": 12, "temperature": 0, "stop": stop})
    c = r.json()["choices"][0]
    assert c["text"] == text[: text.index(stop)] and c["finish_reason"] == "stop" and c["stop_reason"] == stop
    for stream in (False, True):
        r = client.post(
            "/v1/completions",
            json={
                "prompt": ids,
                "max_tokens": 12,
                "temperature": 0,
                "stop_token_ids": [toks[3]],
                "stream": stream,
            },
        )
        assert r.status_code == 200
        if stream:
            events, done = parse_sse(r.text)
            assert done and events[-1]["choices"][0]["finish_reason"] == "stop"
        else:
            assert r.json()["choices"][0]["finish_reason"] == "stop"
            assert r.json()["usage"]["completion_tokens"] == toks.index(toks[3]) + 1


def test_sampling_fields_accepted_and_seed_reproducible(shared_client: Any) -> None:
    client, _ = shared_client
    body = {
        "prompt": "once upon",
        "max_tokens": 8,
        "temperature": 0.9,
        "top_p": 0.9,
        "top_k": 20,
        "min_p": 0.01,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.5,
        "repetition_penalty": 1.1,
        "seed": 42,
        "user": "u1",
        "ignore_eos": True,
        "min_tokens": 2,
        "skip_special_tokens": False,
        "metadata": {"team": "a"},  # accepted and ignored; unknown fields are refused (test_server_validation)
        "service_tier": "auto",
    }
    a = client.post("/v1/completions", json=body)
    b = client.post("/v1/completions", json=body)
    assert a.status_code == b.status_code == 200, a.text
    assert a.json()["choices"][0]["text"] == b.json()["choices"][0]["text"]
    assert a.json()["usage"]["completion_tokens"] == 8  # ignore_eos


def test_completion_streaming_matches_non_streaming(shared_client: Any) -> None:
    client, _ = shared_client
    body = {"prompt": ["the quick", "hello"], "max_tokens": 10, "temperature": 0, "n": 2, "logprobs": 1}
    full = client.post("/v1/completions", json=body).json()
    r = client.post("/v1/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events, done = parse_sse(r.text)
    assert done
    texts: dict[int, str] = {}
    tokens: dict[int, int] = {}
    finish: dict[int, str] = {}
    for e in events[:-1]:
        assert e["usage"] is None and e["object"] == "text_completion"
        for c in e["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
            tokens[c["index"]] = tokens.get(c["index"], 0) + len((c["logprobs"] or {}).get("tokens", []))
            if c["finish_reason"]:
                finish[c["index"]] = c["finish_reason"]
    for c in full["choices"]:
        assert texts[c["index"]] == c["text"] and finish[c["index"]] == c["finish_reason"]
        assert tokens[c["index"]] == len(c["logprobs"]["tokens"])
    assert events[-1]["choices"] == [] and events[-1]["usage"] == full["usage"]


# --------------------------------------------------------------------------- chat


def test_chat_matches_reference_and_logprobs(shared_client: Any) -> None:
    client, llm = shared_client
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}]
    ids = chat_ids(llm, messages)
    text, toks, reason = ref_text(llm, ids, 5)
    r = client.post(
        "/v1/chat/completions",
        json={
            "messages": messages,
            "max_completion_tokens": 5,
            "temperature": 0,
            "logprobs": True,
            "top_logprobs": 3,
        },
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    c = body["choices"][0]
    assert c["message"] == {"role": "assistant", "content": text} and c["finish_reason"] == reason
    assert len(c["logprobs"]["content"]) == len(toks)
    for entry in c["logprobs"]["content"]:
        assert len(entry["top_logprobs"]) == 3 and entry["logprob"] == entry["top_logprobs"][0]["logprob"]
        assert bytes(entry["bytes"]).decode() == entry["token"]
    assert body["usage"]["prompt_tokens"] == len(ids)
    # content parts are joined into text
    parts = [{"role": "user", "content": [{"type": "text", "text": "hello "}, {"type": "text", "text": "world"}]}]
    r2 = client.post("/v1/chat/completions", json={"messages": parts, "max_tokens": 5, "temperature": 0})
    assert (
        r2.json()["choices"][0]["message"]["content"]
        == ref_text(llm, chat_ids(llm, [{"role": "user", "content": "hello world"}]), 5)[0]
    )


def test_chat_streaming(shared_client: Any) -> None:
    client, _ = shared_client
    body = {
        "messages": [{"role": "user", "content": "count: one two"}],
        "max_tokens": 8,
        "temperature": 0,
        "n": 2,
    }
    full = client.post("/v1/chat/completions", json=body).json()
    r = client.post("/v1/chat/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}})
    events, done = parse_sse(r.text)
    assert done
    text = {0: "", 1: ""}
    roles = set()
    for e in events[:-1]:
        assert e["object"] == "chat.completion.chunk"
        for c in e["choices"]:
            if "role" in c["delta"]:
                roles.add(c["index"])
            text[c["index"]] += c["delta"].get("content", "")
    assert roles == {0, 1}
    assert [text[0], text[1]] == [c["message"]["content"] for c in full["choices"]]
    assert events[-1]["usage"] == full["usage"]


def test_chat_max_tokens_default_runs_to_context(make_client: Any) -> None:
    client, _ = make_client(executor_options={"max_model_len": 48})
    r = client.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "temperature": 0, "ignore_eos": True},
    )
    u = r.json()["usage"]
    assert r.status_code == 200 and u["prompt_tokens"] + u["completion_tokens"] == 48


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -1),
        ("top_p", 0),
        ("top_k", -5),
        ("min_p", 2),
        ("presence_penalty", 3),
        ("frequency_penalty", -3),
        ("repetition_penalty", 0),
        ("seed", -1),
        ("n", 0),
        ("logprobs", 30),
        ("max_tokens", 0),
        ("min_tokens", -1),
        ("stop", [""]),
        ("stop_token_ids", [-1]),
        ("temperature", "hot"),
        ("echo", "maybe"),
        ("prompt", []),
        ("prompt", ""),
        ("prompt", [[]]),
        ("prompt", [999999]),
        ("prompt", 5),
        ("max_tokens", 10_000),
        ("suffix", "x"),
        ("logit_bias", {"1": 500}),
        ("stream_options", 3),
    ],
)
def test_completion_invalid_field_is_400_naming_it(shared_client: Any, field: str, value: Any) -> None:
    client, _ = shared_client
    r = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4, field: value})
    err(r, 400, field)


def test_prompt_too_long_and_min_tokens_over_max(shared_client: Any) -> None:
    client, _ = shared_client
    e = err(client.post("/v1/completions", json={"prompt": [1] * 128, "max_tokens": 1}), 400, "prompt")
    assert e["code"] == "context_length_exceeded"
    err(client.post("/v1/completions", json={"prompt": [1] * 120, "max_tokens": 9}), 400, "max_tokens")
    err(
        client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "min_tokens": 3}),
        400,
        "min_tokens",
    )


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
        (
            {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
            "top_logprobs",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
            "max_completion_tokens",
        ),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 500}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "x" * 400}]}, "messages"),
        ({"messages": [{"role": "user", "content": "x"}], "temperature": -2}, "temperature"),
    ],
)
def test_chat_invalid_is_400(shared_client: Any, body: dict[str, Any], param: str) -> None:
    client, _ = shared_client
    err(client.post("/v1/chat/completions", json=body), 400, param)


def test_malformed_json_and_unknown_routes(shared_client: Any) -> None:
    client, _ = shared_client
    r = client.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    err(r, 400)
    err(client.get("/v1/nothing"), 404)
    err(client.get("/v1/completions"), 405)


def test_unknown_model_is_404(shared_client: Any) -> None:
    client, _ = shared_client
    e = err(client.post("/v1/completions", json={"model": "gpt-9", "prompt": "hi"}), 404, "model")
    assert e["code"] == "model_not_found"
    err(
        client.post("/v1/chat/completions", json={"model": "x", "messages": [{"role": "user", "content": "a"}]}),
        404,
    )
    assert (
        client.post("/v1/completions", json={"model": "tiny-fake", "prompt": "hi", "max_tokens": 1}).status_code == 200
    )


def test_models_version_health(shared_client: Any) -> None:
    client, _ = shared_client
    models = client.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "tiny-fake"
    assert models["data"][0]["max_model_len"] == 128
    assert client.get("/version").json() == {"version": "0.1.0"}
    assert client.get("/health").status_code == 200


def test_metrics(shared_client: Any) -> None:
    client, _ = shared_client
    client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "temperature": 0})
    text = client.get("/metrics").text
    for name in (
        'pypto_serving_request_success_total{finish_reason="length",model_name="tiny-fake"}',
        "pypto_serving_prompt_tokens_total",
        "pypto_serving_generation_tokens_total",
        "pypto_serving_time_to_first_token_seconds_bucket",
        "pypto_serving_time_per_output_token_seconds_bucket",
        "pypto_serving_e2e_request_latency_seconds_count",
        "pypto_serving_num_requests_running",
        "pypto_serving_num_requests_waiting",
        "pypto_serving_num_preemptions_total",
        "pypto_serving_kv_cache_usage_perc",
        "pypto_serving_prefix_cache_hit_rate",
        "pypto_serving_spec_decode_acceptance_rate",
    ):
        assert name in text, name


def test_cached_tokens_in_usage(make_client: Any) -> None:
    client, _ = make_client(enable_prefix_caching=True)
    body = {"prompt": list(range(3, 40)), "max_tokens": 2, "temperature": 0}
    client.post("/v1/completions", json=body)
    usage = client.post("/v1/completions", json=body).json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] > 0


def test_api_key(make_client: Any) -> None:
    client, _ = make_client(api_key=["k1", "sekrit"])
    body = {"prompt": "hi", "max_tokens": 1}
    err(client.post("/v1/completions", json=body), 401)
    err(client.post("/v1/completions", json=body, headers={"authorization": "Bearer wrong"}), 401)
    err(client.get("/v1/models", headers={"authorization": "Basic sekrit"}), 401)
    assert client.post("/v1/completions", json=body, headers={"authorization": "Bearer sekrit"}).status_code == 200
    assert client.get("/v1/models", headers={"authorization": "Bearer k1"}).status_code == 200
    assert client.get("/health").status_code == 200
    assert client.get("/metrics").status_code == 200
    client2, _ = make_client(api_key=["k"], protect_metrics=True)
    err(client2.get("/metrics"), 401)
    assert client2.get("/metrics", headers={"authorization": "Bearer k"}).status_code == 200


def test_body_limit_413(make_client: Any) -> None:
    client, _ = make_client(max_request_body_bytes=200)
    big = {"prompt": "x" * 300, "max_tokens": 1}
    err(client.post("/v1/completions", json=big), 413)

    def chunks() -> Any:  # no content-length: the limit must hold for chunked bodies too
        data = json.dumps(big).encode()
        for i in range(0, len(data), 64):
            yield data[i : i + 64]

    err(client.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"}), 413)
    assert client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 200


def test_backpressure_503_retry_after(make_client: Any) -> None:
    import time

    client, llm = make_client(max_waiting_requests=1, max_num_seqs=1, executor_options={"step_sleep": 0.02})
    body = {"prompt": "hi", "max_tokens": 60, "ignore_eos": True}
    results: list[int] = []

    def send() -> threading.Thread:
        t = threading.Thread(target=lambda: results.append(client.post("/v1/completions", json=body).status_code))
        t.start()
        return t

    def wait_for(running: int, waiting: int) -> None:
        deadline = time.monotonic() + 10
        while (llm.stats.get("num_running"), llm.num_waiting()) != (running, waiting):
            assert time.monotonic() < deadline, llm.stats
            time.sleep(0.005)

    first = send()
    wait_for(1, 0)  # max_num_seqs=1: the first runs ...
    second = send()
    wait_for(1, 1)  # ... and the second waits, filling the waiting queue
    r = client.post("/v1/completions", json=body)
    e = err(r, 503)
    assert r.headers["retry-after"] == "1" and e["code"] == "overloaded"
    first.join(20)
    second.join(20)
    assert results == [200, 200]


def test_health_503_while_loading(fake_model_dir: Any) -> None:
    from fastapi.testclient import TestClient

    from pypto_serving import EngineCore, PluginManager
    from pypto_serving.server import AsyncLLM, build_app
    from tests.core.server.conftest import fake_settings
    from tests.fakes import FakePlugin

    gate = threading.Event()
    settings = fake_settings(fake_model_dir)
    pm = PluginManager(extra_plugins=[FakePlugin])

    def slow_engine() -> EngineCore:
        gate.wait(10)
        return EngineCore(settings, pm)

    llm = AsyncLLM(settings, pm, engine_factory=slow_engine)
    with TestClient(build_app(llm), raise_server_exceptions=False) as client:  # lifespan starts the engine
        r = client.get("/health")
        assert r.status_code == 503 and r.json()["reason"] == "loading"
        err(client.post("/v1/completions", json={"prompt": "hi"}), 503)
        gate.set()
        llm.wait_ready(10)
        assert client.get("/health").status_code == 200


def test_plugin_routes_and_500_with_error_id(fake_model_dir: Any) -> None:
    from fastapi.testclient import TestClient

    from pypto_serving import PluginManager, hookimpl
    from pypto_serving.server import AsyncLLM, build_app
    from tests.core.server.conftest import fake_settings
    from tests.fakes import FakePlugin

    class RoutesPlugin:
        @staticmethod
        @hookimpl
        def pypto_serving_add_routes(app: Any) -> None:
            @app.get("/plugin/hello")
            async def hello() -> dict[str, str]:
                return {"hello": "plugin"}

            @app.get("/plugin/boom")
            async def boom() -> None:
                raise RuntimeError("kaboom")

    llm = AsyncLLM(fake_settings(fake_model_dir), PluginManager(extra_plugins=[FakePlugin, RoutesPlugin]))
    with TestClient(build_app(llm), raise_server_exceptions=False) as client:
        llm.wait_ready(30)
        assert client.get("/plugin/hello").json() == {"hello": "plugin"}
        r = client.get("/plugin/boom")
        e = err(r, 500)
        assert r.headers["x-error-id"] in e["message"] and "kaboom" not in e["message"]


def test_step_failure_is_500_and_error_chunk(make_client: Any) -> None:
    client, _ = make_client(executor_options={"fail_on_token": 7})
    e = err(client.post("/v1/completions", json={"prompt": [7, 8], "max_tokens": 3}), 500)
    assert e["code"] == "generation_failed"
    r = client.post("/v1/completions", json={"prompt": [7, 8], "max_tokens": 3, "stream": True})
    events, done = parse_sse(r.text)
    assert done and "error" in events[-1]
    assert client.get("/health").status_code == 200  # one failed step does not kill the engine
    assert client.post("/v1/completions", json={"prompt": [8, 9], "max_tokens": 2}).status_code == 200


def test_speculative_metrics(make_client: Any) -> None:
    client, _ = make_client(
        # Policy fixed: both draft positions every step (the default, adaptive, may stop drafting on
        # a fake model whose steps cost nothing), so both positions' counters exist.
        speculative_config={"method": "fake", "num_speculative_tokens": 2, "policy": "fixed"},
        executor_options={"max_draft": 2, "draft_error_rate": 0.3},
    )
    r = client.post("/v1/completions", json={"prompt": list(range(3, 12)), "max_tokens": 24, "temperature": 0})
    assert r.status_code == 200
    lines = {
        line.split(" ")[0]: float(line.split(" ")[1])
        for line in client.get("/metrics").text.splitlines()
        if line.startswith("pypto_serving_spec_decode")
    }
    drafted = lines['pypto_serving_spec_decode_num_draft_tokens_total{model_name="tiny-fake"}']
    accepted = lines['pypto_serving_spec_decode_num_accepted_tokens_total{model_name="tiny-fake"}']
    assert 0 < accepted < drafted
    mean = lines['pypto_serving_spec_decode_mean_accepted_length{model_name="tiny-fake"}']
    assert 0 < mean < 2
    pos0 = lines['pypto_serving_spec_decode_num_accepted_tokens_per_pos_total{model_name="tiny-fake",position="0"}']
    pos1 = lines['pypto_serving_spec_decode_num_accepted_tokens_per_pos_total{model_name="tiny-fake",position="1"}']
    assert pos0 >= pos1 and pos0 + pos1 == accepted
