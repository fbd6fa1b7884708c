"""Request validation of the OpenAI app: values the engine cannot carry (int64 overflow, lone UTF-16
surrogates, ids outside the vocabulary) are a 400 naming the field and never reach the engine; strict
JSON types; unknown and unsupported fields refused by name; malformed bodies explained; ``n`` counted
against ``max_waiting_requests``."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pypto_serving_sync_sched")

from tests.core.server.conftest import VOCAB, start_llm
from tests.fakes import reference_tokens

BIG = 2**64  # does not fit the worker's msgpack wire
MAX_MODEL_LEN = 128
COMPLETION = "/v1/completions"
CHAT = "/v1/chat/completions"
USER_HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def process_client(fake_model_dir: Path) -> Iterator[tuple[Any, Any]]:
    """An app whose worker is a separate process: every request crosses the msgpack wire, where a
    value the engine cannot encode used to kill the engine thread."""
    from fastapi.testclient import TestClient

    from pypto_serving.server import build_app

    llm = start_llm(fake_model_dir, worker_mode="process")
    with TestClient(build_app(llm, manage_engine=False), raise_server_exceptions=False) as client:
        yield client, llm
    llm.shutdown(10)


def post(client: Any, path: str, body: dict[str, Any] | bytes) -> Any:
    # json.dumps escapes non-ASCII, so a lone surrogate travels as the JSON escape "\ud800" (valid UTF-8).
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return client.post(path, content=content, headers={"content-type": "application/json"})


def err(r: Any, param: str | None, code: str | None = None) -> dict[str, Any]:
    assert r.status_code == 400, r.text
    body = r.json()["error"]
    assert set(body) == {"message", "type", "param", "code"} and body["message"], body
    assert body["type"] == "invalid_request_error" and body["param"] == param, body
    if code is not None:
        assert body["code"] == code, body
    return dict(body)


def assert_serves(client: Any, llm: Any) -> None:
    """The engine survived: healthy, and a greedy completion is still the fake model's reference."""
    from pypto_serving.tokenizer import IncrementalDetokenizer

    assert client.get("/health").status_code == 200
    ids = [5, 6, 7]
    r = client.post(COMPLETION, json={"prompt": ids, "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    detok = IncrementalDetokenizer(llm.tokenizer, ids, [])
    for t in reference_tokens(ids, 4, VOCAB, eos=2)[0]:
        detok.append(t)
    assert r.json()["choices"][0]["text"] == detok.text


# --------------------------------------------------------------------------- poison values


def _completion(**fields: Any) -> dict[str, Any]:
    return {"prompt": "hi", "max_tokens": 2, **fields}


def _chat(**fields: Any) -> dict[str, Any]:
    return {"messages": USER_HI, **fields}


POISON_NUMBERS = [
    (COMPLETION, _completion(top_k=BIG), "top_k"),
    (COMPLETION, _completion(top_k=-BIG), "top_k"),
    (COMPLETION, _completion(top_k=VOCAB + 1), "top_k"),
    (COMPLETION, _completion(seed=BIG), "seed"),
    (COMPLETION, _completion(seed=2**63), "seed"),
    (COMPLETION, _completion(stop_token_ids=[3, BIG]), "stop_token_ids"),
    (COMPLETION, _completion(stop_token_ids=[VOCAB]), "stop_token_ids"),
    (COMPLETION, _completion(min_tokens=BIG), "min_tokens"),
    (COMPLETION, _completion(n=BIG), "n"),
    (COMPLETION, _completion(max_tokens=BIG), "max_tokens"),
    (COMPLETION, _completion(logprobs=BIG), "logprobs"),
    (COMPLETION, _completion(temperature=float("inf")), "temperature"),
    (COMPLETION, _completion(top_p=float("nan")), "top_p"),
    (COMPLETION, {"prompt": [5, BIG], "max_tokens": 2}, "prompt"),
    (COMPLETION, {"prompt": [[5], [6, BIG]], "max_tokens": 2}, "prompt"),
    (COMPLETION, {"prompt": [VOCAB], "max_tokens": 2}, "prompt"),
    (CHAT, _chat(min_tokens=BIG), "min_tokens"),
    (CHAT, _chat(min_tokens=MAX_MODEL_LEN + 1), "min_tokens"),
    (CHAT, _chat(top_k=BIG), "top_k"),
    (CHAT, _chat(stop_token_ids=[BIG]), "stop_token_ids"),
    (CHAT, _chat(seed=BIG), "seed"),
    (CHAT, _chat(priority=BIG), "priority"),
    (CHAT, _chat(n=BIG), "n"),
    (CHAT, _chat(max_tokens=BIG), "max_tokens"),
    (CHAT, _chat(max_completion_tokens=BIG), "max_completion_tokens"),
    (CHAT, _chat(logprobs=True, top_logprobs=BIG), "top_logprobs"),
]


@pytest.mark.parametrize(("path", "body", "param"), POISON_NUMBERS)
def test_poison_number_is_400_and_engine_survives(
    process_client: Any, path: str, body: dict[str, Any], param: str
) -> None:
    client, llm = process_client
    err(post(client, path, body), param)
    assert_serves(client, llm)


SURROGATE = "ok \ud800"
POISON_TEXT = [
    (COMPLETION, _completion(prompt=SURROGATE), "prompt"),
    (COMPLETION, _completion(prompt=["fine", SURROGATE]), "prompt"),
    (COMPLETION, _completion(stop=SURROGATE), "stop"),
    (COMPLETION, _completion(stop=["fine", "\udc00"]), "stop"),
    (COMPLETION, _completion(model=SURROGATE), "model"),
    (COMPLETION, _completion(user=SURROGATE), "user"),
    (COMPLETION, _completion(metadata={"k": SURROGATE}), "metadata"),
    (CHAT, _chat(messages=[{"role": "user", "content": SURROGATE}]), "messages"),
    (CHAT, _chat(messages=[{"role": "user", "content": [{"type": "text", "text": SURROGATE}]}]), "messages"),
    (CHAT, _chat(messages=[{"role": "user", "content": "hi", "name": SURROGATE}]), "messages"),
    (CHAT, _chat(messages=[{"role": "tool", "content": "1", "tool_call_id": SURROGATE}]), "messages"),
    (CHAT, _chat(messages=[{"role": "assistant", "content": "", "reasoning_content": SURROGATE}]), "messages"),
    (CHAT, _chat(messages=[{"role": "assistant", "tool_calls": [{"id": "c", "args": [SURROGATE]}]}]), "messages"),
    (CHAT, _chat(messages=[{"role": "user", "content": "hi", "thinking": {"x": SURROGATE}}]), "messages"),
    (CHAT, _chat(messages=[{"role": "user", "content": "hi", SURROGATE: 1}]), "messages"),
    (CHAT, _chat(metadata={SURROGATE: "v"}), "metadata"),
    (CHAT, _chat(stop=SURROGATE), "stop"),
    (CHAT, _chat(chat_template_kwargs={"enable_thinking": SURROGATE}), "chat_template_kwargs"),
    (CHAT, _chat(chat_template_kwargs={SURROGATE: True}), "chat_template_kwargs"),
]


@pytest.mark.parametrize(("path", "body", "param"), POISON_TEXT)
def test_lone_surrogate_is_400_naming_the_field(
    process_client: Any, path: str, body: dict[str, Any], param: str
) -> None:
    client, llm = process_client
    e = err(post(client, path, body), param)
    assert "surrogate" in e["message"], e
    assert_serves(client, llm)


def test_unknown_field_named_with_a_surrogate_is_400_not_500(shared_client: Any) -> None:
    client, llm = shared_client
    r = post(client, COMPLETION, b'{"prompt": "hi", "x\\ud800": 1}')
    e = err(r, "x\\ud800", "unknown_parameter")
    assert "x\\ud800" in e["message"]
    assert_serves(client, llm)


# --------------------------------------------------------------------------- n and max_waiting_requests


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (COMPLETION, {"prompt": "hi", "max_tokens": 1, "n": 3}, "n"),
        (COMPLETION, {"prompt": [[5], [6], [7]], "max_tokens": 1}, "prompt"),
        (COMPLETION, {"prompt": [[5], [6]], "max_tokens": 1, "n": 2}, "n"),
        (CHAT, {"messages": USER_HI, "max_tokens": 1, "n": 3}, "n"),
    ],
)
def test_request_with_more_sequences_than_max_waiting_is_400(
    make_client: Any, path: str, body: dict[str, Any], param: str
) -> None:
    client, llm = make_client(max_waiting_requests=2)
    e = err(post(client, path, body), param, "too_many_sequences")
    assert "max_waiting_requests=2" in e["message"]
    ok = {**body, "n": 2} if "messages" in body else {"prompt": [[5], [6]], "max_tokens": 1}
    assert post(client, path, ok).status_code == 200  # exactly the limit is admitted
    assert_serves(client, llm)


def test_n_counts_against_the_waiting_queue(make_client: Any) -> None:
    client, llm = make_client(max_waiting_requests=2, max_num_seqs=1, executor_options={"step_sleep": 0.02})
    long = {"prompt": "hi", "max_tokens": 60, "ignore_eos": True}
    results: list[int] = []

    def send() -> threading.Thread:
        t = threading.Thread(target=lambda: results.append(client.post(COMPLETION, json=long).status_code))
        t.start()
        return t

    def wait_for(running: int, waiting: int) -> None:
        deadline = time.monotonic() + 10
        while (llm.stats.get("num_running"), llm.num_waiting()) != (running, waiting):
            assert time.monotonic() < deadline, llm.stats
            time.sleep(0.005)

    first = send()
    wait_for(1, 0)
    second = send()
    wait_for(1, 1)  # one sequence waits: room for one more sequence, not two
    r = client.post(COMPLETION, json={**long, "n": 2})
    assert r.status_code == 503 and r.json()["error"]["code"] == "overloaded", r.text
    first.join(20)
    second.join(20)
    assert results == [200, 200]


# --------------------------------------------------------------------------- stop


def test_single_long_stop_string_is_accepted(shared_client: Any) -> None:
    client, _ = shared_client
    for stop in ("x" * 40, ["y" * 300] * 16):
        r = post(client, COMPLETION, _completion(stop=stop))
        assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    "stop",
    ["", [""], ["a", ""], "x" * 513, ["x" * 513], ["s"] * 17, 5, [5], {"a": 1}],
)
def test_invalid_stop_is_400(shared_client: Any, stop: Any) -> None:
    client, _ = shared_client
    err(post(client, COMPLETION, _completion(stop=stop)), "stop")


# --------------------------------------------------------------------------- strict types


@pytest.mark.parametrize(
    ("path", "field", "value"),
    [
        (COMPLETION, "max_tokens", True),
        (COMPLETION, "max_tokens", 4.0),
        (COMPLETION, "stream", "yes"),
        (COMPLETION, "stream", 1),
        (COMPLETION, "echo", "true"),
        (COMPLETION, "n", True),
        (COMPLETION, "seed", 1.5),
        (COMPLETION, "top_k", "5"),
        (COMPLETION, "temperature", "1"),
        (COMPLETION, "temperature", True),
        (COMPLETION, "ignore_eos", 0),
        (COMPLETION, "logprobs", True),
        (COMPLETION, "stop_token_ids", [True]),
        (COMPLETION, "prompt", [True, False]),
        (COMPLETION, "model", 5),
        (COMPLETION, "stream_options", {"include_usage": "yes"}),
        (CHAT, "logprobs", "yes"),
        (CHAT, "top_logprobs", True),
        (CHAT, "add_generation_prompt", "no"),
        (CHAT, "max_completion_tokens", False),
    ],
)
def test_strict_types(shared_client: Any, path: str, field: str, value: Any) -> None:
    client, _ = shared_client
    base = _completion() if path == COMPLETION else _chat(max_tokens=2, logprobs=True)
    e = err(post(client, path, {**base, field: value}), field)
    assert e["message"].startswith(field), e


def test_floats_accept_json_integers(shared_client: Any) -> None:
    client, _ = shared_client
    r = post(client, COMPLETION, _completion(temperature=1, top_p=1, presence_penalty=0, repetition_penalty=1))
    assert r.status_code == 200, r.text


def test_null_means_the_default(shared_client: Any) -> None:
    """OpenAI's schema allows null for defaulted fields (some clients send every key)."""
    client, _ = shared_client
    nulls = {"n": None, "stream": None, "echo": None, "ignore_eos": None, "min_tokens": None}
    r = post(client, COMPLETION, _completion(temperature=0, max_tokens=4, **nulls))
    assert r.status_code == 200, r.text
    body = r.json()
    assert len(body["choices"]) == 1 and body["usage"]["completion_tokens"] == 4
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0}
    r = post(client, "/v1/chat/completions", {**chat, "n": None, "logprobs": None, "add_generation_prompt": None})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["logprobs"] is None


# --------------------------------------------------------------------------- chat's own names


@pytest.mark.parametrize(
    ("fields", "param", "named"),
    [
        ({"max_completion_tokens": 0}, "max_completion_tokens", "max_completion_tokens"),
        ({"max_completion_tokens": -3}, "max_completion_tokens", "max_completion_tokens"),
        ({"max_completion_tokens": 2, "min_tokens": 3}, "min_tokens", "max_completion_tokens"),
        ({"max_completion_tokens": True}, "max_completion_tokens", "max_completion_tokens"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "top_logprobs"),
        ({"logprobs": True, "top_logprobs": -1}, "top_logprobs", "top_logprobs"),
        ({"logprobs": True, "top_logprobs": "3"}, "top_logprobs", "top_logprobs"),
    ],
)
def test_chat_errors_use_chat_field_names(shared_client: Any, fields: dict[str, Any], param: str, named: str) -> None:
    client, _ = shared_client
    e = err(post(client, CHAT, _chat(**fields)), param)
    assert named in e["message"], e
    # The engine's names for these fields must not leak into chat errors.
    assert not re.search(r"\bmax_tokens\b|\blogprobs\b", e["message"]), e


# --------------------------------------------------------------------------- malformed bodies


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (b'{"prompt": "hi" "max_tokens": 1}', "Expecting ',' delimiter: line 1 column 17 (char 16)"),
        (b'{"prompt": "hi",\n "max_tokens": }', "Expecting value: line 2 column 16 (char 32)"),
        (b"{not json", "Expecting property name enclosed in double quotes: line 1 column 2 (char 1)"),
        (b'{"prompt": "hi"', "line 1 column 16 (char 15)"),
        (b"   ", "Expecting value: line 1 column 4 (char 3)"),
        (b"", "the request body is empty"),
        (b"null", "must be a JSON object, not null"),
        (b"[]", "must be a JSON object, not an array"),
        (b'"x"', "must be a JSON object, not a string"),
        (b"42", "must be a JSON object, not a number"),
    ],
)
def test_malformed_body_says_what_and_where(shared_client: Any, body: bytes, expected: str) -> None:
    client, llm = shared_client
    for path in (COMPLETION, CHAT):
        e = err(post(client, path, body), None, "invalid_json")
        assert expected in e["message"], e
    assert_serves(client, llm)


# --------------------------------------------------------------------------- unknown and unsupported fields

UNSUPPORTED = [
    ("tools", [{"type": "function", "function": {"name": "f", "parameters": {}}}]),
    ("tool_choice", "auto"),
    ("parallel_tool_calls", False),
    ("functions", [{"name": "f"}]),
    ("function_call", "auto"),
    ("guided_grammar", "root ::= 'a'"),
    ("suffix", "x"),
    ("best_of", 3),
    ("audio", {"voice": "alloy", "format": "wav"}),
    ("modalities", ["text", "audio"]),
    ("prediction", {"type": "content", "content": "x"}),
    ("web_search_options", {}),
]


# Chat serves tools (tests/core/server/test_tools.py); completions has no messages to call them from.
CHAT_ONLY = {"tools", "tool_choice", "parallel_tool_calls"}


@pytest.mark.parametrize(("field", "value"), UNSUPPORTED)
def test_unsupported_field_is_refused_by_name(shared_client: Any, field: str, value: Any) -> None:
    client, _ = shared_client
    for path, base in ((COMPLETION, _completion()), (CHAT, _chat(max_tokens=2))):
        if path == CHAT and field in CHAT_ONLY:
            continue
        e = err(post(client, path, {**base, field: value}), field, "unsupported_parameter")
        assert e["message"].startswith(f"{field} is not supported by this server"), e


@pytest.mark.parametrize("field", ["foo", "prompt_tokens", "include_stop_string", "max_token"])
def test_unknown_field_is_refused_by_name(shared_client: Any, field: str) -> None:
    client, _ = shared_client
    for path, base in ((COMPLETION, _completion()), (CHAT, _chat(max_tokens=2))):
        e = err(post(client, path, {**base, field: 1}), field, "unknown_parameter")
        assert e["message"] == f"unknown field {field!r}", e


@pytest.mark.parametrize(
    "fields",
    [
        {"tools": [], "tool_choice": "none", "functions": [], "function_call": "none"},
        {"tools": None, "tool_choice": None, "parallel_tool_calls": None, "response_format": None},
        {"logit_bias": {}, "suffix": None, "best_of": None, "response_format": {"type": "text"}},
        {"best_of": 1},
        {"best_of": 2, "n": 2},
        {"modalities": ["text"], "audio": None, "prediction": None, "web_search_options": None},
        {"user": "u", "metadata": {"k": "v"}, "store": False, "service_tier": "auto"},
        {"safety_identifier": "s", "prompt_cache_key": "p", "stream_options": None},
        {"stream": True, "stream_options": {"include_usage": True, "include_obfuscation": False}},
    ],
)
def test_ignored_fields_and_neutral_values_are_accepted(shared_client: Any, fields: dict[str, Any]) -> None:
    client, _ = shared_client
    for path, base in ((COMPLETION, _completion()), (CHAT, _chat(max_tokens=2))):
        r = post(client, path, {**base, **fields})
        assert r.status_code == 200, (path, r.text)


@pytest.mark.parametrize(
    ("path", "fields", "param", "says"),
    [
        (COMPLETION, {"stream_options": {"include_usage": True}}, "stream_options", "only when stream is true"),
        (COMPLETION, {"stream": None, "stream_options": {}}, "stream_options", "only when stream is true"),
        (CHAT, {"stream": False, "stream_options": {"include_usage": False}}, "stream_options", "stream is true"),
        (CHAT, {"tool_choice": "auto"}, "tool_choice", "tool_choice 'auto' needs tools"),
        (CHAT, {"tools": [], "tool_choice": "auto"}, "tool_choice", "tool_choice 'auto' needs tools"),
        (CHAT, {"tools": None, "tool_choice": "required"}, "tool_choice", "tool_choice 'required' needs tools"),
        (CHAT, {"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice", "needs tools"),
    ],
)
def test_options_of_what_the_request_does_not_ask_for_are_400(
    shared_client: Any, path: str, fields: dict[str, Any], param: str, says: str
) -> None:
    """As OpenAI: ``stream_options`` without ``stream: true`` and a ``tool_choice`` other than ``none``
    without tools are refused naming the field, not silently dropped."""
    client, _ = shared_client
    base = _completion() if path == COMPLETION else _chat(max_tokens=2)
    e = err(post(client, path, {**base, **fields}), param, "invalid_value")
    assert says in e["message"], e


def test_parallel_tool_calls_without_tools_is_accepted(shared_client: Any) -> None:
    """OpenAI accepts ``parallel_tool_calls`` (and ``tool_choice: "none"``) without tools: nothing to call."""
    client, _ = shared_client
    for fields in ({"parallel_tool_calls": False}, {"parallel_tool_calls": True, "tool_choice": "none", "tools": []}):
        r = post(client, CHAT, _chat(max_tokens=2, **fields))
        assert r.status_code == 200, (fields, r.text)


def test_chat_template_keys_of_messages_are_kept(shared_client: Any) -> None:
    client, _ = shared_client
    messages = [
        {"role": "user", "content": "add", "name": "alice"},
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "think",
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
        },
        {"role": "tool", "content": "3", "tool_call_id": "c1"},
    ]
    r = post(client, CHAT, {"messages": messages, "max_tokens": 2})
    assert r.status_code == 200, r.text
    e = err(post(client, CHAT, {"messages": [{"role": "wizard", "content": "x"}]}), "messages")
    assert "messages.0.role" in e["message"] and "'user'" in e["message"], e


# --------------------------------------------------------------------------- messages name the field


@pytest.mark.parametrize(
    ("path", "body", "param", "message"),
    [
        (COMPLETION, {"prompt": 5}, "prompt", "prompt: Input should be a valid string or a valid list"),
        (COMPLETION, {"prompt": [1.5]}, "prompt", "prompt.0: Input should be a valid string or a valid integer"),
        (COMPLETION, {"prompt": [-1]}, "prompt", "prompt.0: Input should be greater than or equal to 0"),
        (COMPLETION, {"prompt": "hi", "stop": 5}, "stop", "stop: Input should be a valid string or a valid list"),
        (COMPLETION, {"max_tokens": 3}, "prompt", "prompt: Field required"),
        (
            CHAT,
            {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
            "messages",
            "messages.0.content.0.text: Input should be a valid string",
        ),
        (CHAT, {"messages": [{"role": "user", "content": 5}]}, "messages", "messages.0.content: Input should be"),
    ],
)
def test_validation_message_names_fields_not_union_branches(
    shared_client: Any, path: str, body: dict[str, Any], param: str, message: str
) -> None:
    client, _ = shared_client
    e = err(post(client, path, body), param)
    assert e["message"].startswith(message), e
    assert not re.search(r"\[|function-|constrained|ContentPart", e["message"].split(": ", 1)[0]), e
