"""Client JSON the server cannot take is a 400 that names why, never a 500: nesting past
``max_json_depth`` in the body or in a tool call's ``arguments`` text (the decoder and the chat
template recurse over it), bodies ``json.loads`` refuses with other errors than ``JSONDecodeError``
(invalid UTF-8, an integer past Python's digit limit), and ``chat_template_kwargs`` that would set
the template's own arguments. Also: temperatures below ``GREEDY_TEMPERATURE`` are greedy (float32
makes 1e-39 a denormal and 5e-324 zero, which sampled the same garbage for every seed)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.core.server.server_helpers import parse_sse

pytest.importorskip("pypto_serving_sync_sched")

DEEP = "[" * 5000 + "]" * 5000
HI = [{"role": "user", "content": "hi"}]


def _nested(depth: int) -> Any:
    """A JSON value ``depth`` arrays deep."""
    return json.loads("[" * depth + "]" * depth)


def _with_arguments(arguments: str) -> list[dict[str, Any]]:
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    return [*HI, {"role": "assistant", "content": "", "tool_calls": [call]}, {"role": "user", "content": "ok"}]


def _error(r: Any, code: str, param: str | None = None) -> str:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == code and error["param"] == param, error
    return str(error["message"])


@pytest.mark.parametrize("stream", [False, True])
def test_deep_tool_call_arguments_are_400(shared_client: Any, stream: bool) -> None:
    client, _ = shared_client
    body = {"messages": _with_arguments(DEEP), "max_tokens": 2, "stream": stream}
    message = _error(client.post("/v1/chat/completions", json=body), "invalid_value", "messages")
    assert message == "messages.1.tool_calls.0.function.arguments is nested deeper than max_json_depth=64"
    r = client.post("/tokenize", json={"messages": _with_arguments(DEEP)})
    assert "max_json_depth=64" in _error(r, "invalid_value", "messages")


def test_tool_call_arguments_at_the_depth_limit_render(shared_client: Any) -> None:
    client, _ = shared_client
    at_limit = json.dumps({"a": _nested(63)})
    r = client.post("/tokenize", json={"messages": _with_arguments(at_limit)})
    assert r.status_code == 200, r.text
    r = client.post("/tokenize", json={"messages": _with_arguments(json.dumps({"a": _nested(64)}))})
    assert "max_json_depth=64" in _error(r, "invalid_value", "messages")


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize"])
def test_deep_body_is_invalid_json(shared_client: Any, path: str) -> None:
    client, _ = shared_client
    raw = b'{"prompt": "a", "messages": ' + DEEP.encode() + b"}"
    message = _error(client.post(path, content=raw, headers={"content-type": "application/json"}), "invalid_json")
    assert message == "could not parse the JSON body of the request: the body is nested deeper than max_json_depth=64"


def test_body_depth_counts_every_level(shared_client: Any) -> None:
    """The body itself is a level: chat_template_kwargs' value at 62 arrays is 64 deep in all."""
    client, _ = shared_client
    for depth, status in [(62, 200), (63, 400)]:
        body = {"messages": HI, "max_tokens": 1, "chat_template_kwargs": {"k": _nested(depth)}}
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == status, r.text
    body = {"prompt": "a", "max_tokens": 1, "guided_json": {"type": "object", "properties": _nested(63)}}
    assert "max_json_depth" in _error(client.post("/v1/completions", json=body), "invalid_json")


def test_depth_limit_is_the_setting(make_client: Any) -> None:
    client, _ = make_client(max_json_depth=6)  # a body with a tool call is 6 deep at its function
    body = {"messages": HI, "max_tokens": 1, "chat_template_kwargs": {"k": _nested(5)}}
    assert "max_json_depth=6" in _error(client.post("/v1/chat/completions", json=body), "invalid_json")
    r = client.post("/tokenize", json={"messages": _with_arguments('{"a": [[[[[[1]]]]]]}')})
    assert "max_json_depth=6" in _error(r, "invalid_value", "messages")


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b'{"prompt": "a", "seed": ' + b"1" * 5000 + b"}", "an integer of more than 4300 digits"),
        (b'{"prompt": "a\xff\xfe"}', "not valid UTF-8"),
        (b'{"prompt": [' + b"[" * 990 + b"]" * 990 + b"]}", "max_json_depth=64"),
    ],
    ids=["huge-integer", "invalid-utf8", "nested-990"],
)
def test_unreadable_bodies_are_invalid_json(shared_client: Any, raw: bytes, reason: str) -> None:
    client, _ = shared_client
    r = client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    message = _error(r, "invalid_json")
    assert reason in message and "sys." not in message


@pytest.mark.parametrize("key", ["add_generation_prompt", "messages", "bos_token"])
def test_chat_template_kwargs_cannot_set_the_templates_own_arguments(shared_client: Any, key: str) -> None:
    client, _ = shared_client
    body = {"messages": HI, "max_tokens": 1, "chat_template_kwargs": {key: False}}
    message = _error(client.post("/v1/chat/completions", json=body), "invalid_value", "chat_template_kwargs")
    assert key in message and "keyword argument" not in message
    r = client.post("/tokenize", json={"messages": HI, "chat_template_kwargs": {key: 1}})
    assert key in _error(r, "invalid_value", "chat_template_kwargs")


def test_tiny_temperatures_are_greedy(shared_client: Any) -> None:
    client, _ = shared_client

    def text(temperature: float, seed: int, stream: bool = False) -> str:
        body = {"prompt": "hello", "max_tokens": 8, "temperature": temperature, "seed": seed, "stream": stream}
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        if stream:
            events, _ = parse_sse(r.text)
            return "".join(e["choices"][0]["text"] for e in events if e.get("choices"))
        return str(r.json()["choices"][0]["text"])

    greedy = text(0.0, 0)
    assert {text(t, seed) for t in (1e-39, 5e-324, 9e-6) for seed in (0, 1, 2)} == {greedy}
    assert text(5e-324, 3, stream=True) == greedy


def test_sampling_params_treat_tiny_temperatures_as_greedy() -> None:
    from pypto_serving.request import GREEDY_TEMPERATURE, SamplingParams

    for t in (5e-324, 1e-39, GREEDY_TEMPERATURE / 2):
        params = SamplingParams(temperature=t)
        assert params.temperature == 0.0 and params.greedy
    assert SamplingParams(temperature=GREEDY_TEMPERATURE).temperature == GREEDY_TEMPERATURE
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1e-39)
