"""The Anthropic Messages API (/v1/messages, /v1/messages/count_tokens) through the official ``anthropic``
SDK against a real server: the scripted executor and Qwen-like tools template of test_tools answer each
turn with a fixed reply, so tool-use round trips, thinking blocks, stop sequences and prefills are exact.
Streams are checked against Anthropic's documented event order, errors against its error shape, and
the prompt against the one the equivalent chat-completions request renders (/tokenize)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.core.server.conftest import LiveServer, fake_settings
from tests.core.server.test_tools import ANSWER, CALL_REPLY, IM_END, WEATHER_TOOL, ScriptedPlugin, write_tools_model

pytestmark = pytest.mark.requires_plugin("sync_sched")
anthropic = pytest.importorskip("anthropic")

THOUGHT = "\nThe user wants 2+3. That is 5.\n"
SCRIPT = [
    ["weather in Paris", CALL_REPLY],
    ["<tool_response>", ANSWER],
    ["2+3", f"<think>{THOUGHT}</think>\n\nThe answer is 5."],
    ["quietly", "5."],
    ["count", "one two three four five"],
    ["Greek", "The answer is (B) Helios."],
    ["hello", "<think>\nA greeting.\n</think>\n\nHello there, how can I help?"],
]
WEATHER = {  # test_tools' tool, as Anthropic spells it
    "name": WEATHER_TOOL["function"]["name"],
    "description": WEATHER_TOOL["function"]["description"],
    "input_schema": WEATHER_TOOL["function"]["parameters"],
}
MODEL = "tiny-tools"
# The scripted replies are the argmax; the SDK of today no longer names the sampling fields, which
# Anthropic's API (and this server) still take.
GREEDY = {"temperature": 0.0}
# Bounded, so that a call the grammar forces on a model that would rather talk ends within max_tokens.
FORCED_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city"],
    "additionalProperties": False,
}


@dataclass
class Served:
    client: Any  # anthropic.Anthropic
    url: str
    llm: Any


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """One scripted server for the module, with the Qwen3 reasoning parser (and Hermes tool calls)."""
    pytest.importorskip("pypto_serving_sync_sched")
    from pypto_serving import PluginManager
    from pypto_serving.server import AsyncLLM, build_app

    model = write_tools_model(tmp_path_factory.mktemp("anthropic") / MODEL)
    options = {"script": SCRIPT, "architecture": "Qwen3ForCausalLM", "eos": IM_END, "max_model_len": 4096}
    settings = fake_settings(
        model, executor="scripted", executor_options=options, reasoning_parser="qwen3", num_kv_blocks=1100
    )
    llm = AsyncLLM(settings, PluginManager(extra_plugins=[ScriptedPlugin]))
    llm.wait_ready(60)
    live = LiveServer(build_app(llm, manage_engine=False), llm=llm)
    yield Served(anthropic.Anthropic(base_url=live.url, api_key="unused", max_retries=0, timeout=60), live.url, llm)
    live.stop()
    llm.shutdown(10)


def _create(served: Served, stream: bool, **kw: Any) -> Any:
    """A Message, whole or put together from the stream by the SDK's own accumulator. ``extra`` holds
    fields sent as they are, whichever of them the installed SDK names."""
    extra = {**GREEDY, **kw.pop("extra", {})}
    kw = {"model": MODEL, "max_tokens": 200, **kw, "extra_body": extra}
    if not stream:
        return served.client.messages.create(**kw)
    with served.client.messages.stream(**kw) as events:
        for _ in events:
            pass
        return events.get_final_message()


def _blocks(message: Any) -> list[dict[str, Any]]:
    """The content blocks without the ids minted per response."""
    return [{k: v for k, v in b.model_dump(exclude_none=True).items() if k != "id"} for b in message.content]


def _sse(
    served: Served, body: dict[str, Any], headers: dict[str, str] | None = None
) -> list[tuple[str, dict[str, Any]]]:
    """The (event name, data) pairs of a raw streamed response: the SDK skips pings and names nothing."""
    body = {"model": MODEL, "max_tokens": 200, "temperature": 0.0, "stream": True, **body}
    r = httpx.post(f"{served.url}/v1/messages", json=body, headers=headers or {}, timeout=60)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.text
    events = []
    for block in r.text.split("\n\n"):
        if block.strip():
            name, data = block.split("\n")
            assert name.startswith("event: ") and data.startswith("data: "), block
            events.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return events


# Anthropic's documented order: message_start; per content block a start, its deltas and a stop; a
# message_delta and message_stop; one ping (the example streams send it after the first block opens).
_ORDER = re.compile(r"S(?:B(?:P)?D*E)*(?:P)?M X")
_LETTERS = {
    "message_start": "S",
    "content_block_start": "B",
    "ping": "P",
    "content_block_delta": "D",
    "content_block_stop": "E",
    "message_delta": "M",
    "message_stop": " X",
}


def _check_order(events: list[tuple[str, dict[str, Any]]]) -> None:
    letters = "".join(_LETTERS[name] for name, _ in events)
    assert _ORDER.fullmatch(letters) and letters.count("P") == 1, letters
    assert all(data["type"] == name for name, data in events)
    open_index = -1
    for name, data in events:  # blocks are numbered from 0, and deltas and stops name the open one
        if name == "content_block_start":
            assert data["index"] == open_index + 1
            open_index = data["index"]
        elif name in ("content_block_delta", "content_block_stop"):
            assert data["index"] == open_index


def _message(events: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """The message a stream describes, put together by hand (text, thinking and tool input deltas)."""
    message = dict(events[0][1]["message"])
    blocks: list[dict[str, Any]] = []
    for name, data in events:
        if name == "content_block_start":
            blocks.append({**data["content_block"], "json": ""})
        elif name == "content_block_delta":
            delta, block = data["delta"], blocks[data["index"]]
            key = {"text_delta": "text", "thinking_delta": "thinking", "input_json_delta": "json"}[delta["type"]]
            block[key] += delta["partial_json" if key == "json" else key]
        elif name == "message_delta":
            message.update(data["delta"], usage=data["usage"])
    for block in blocks:
        if block["type"] == "tool_use":
            block["input"] = json.loads(block["json"])
        del block["json"]
    return {**message, "content": blocks}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_tool_use_round_trip(served: Served, stream: bool) -> None:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = _create(served, stream, messages=messages, tools=[WEATHER])
    assert first.type == "message" and first.role == "assistant" and first.id.startswith("msg_")
    assert first.stop_reason == "tool_use" and first.stop_sequence is None
    assert _blocks(first) == [
        {"type": "text", "text": "I will look it up."},
        {"type": "tool_use", "name": "get_weather", "input": {"city": "Paris", "unit": "celsius"}},
    ]
    call = first.content[1]
    assert call.id.startswith("toolu_")
    # The SDK's own content blocks go back as the assistant turn, as agents send them.
    messages += [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "22 degrees, sunny"}]},
    ]
    second = _create(served, stream, messages=messages, tools=[WEATHER])
    assert (_blocks(second), second.stop_reason) == ([{"type": "text", "text": ANSWER}], "end_turn")
    assert second.usage.input_tokens > first.usage.input_tokens and second.usage.output_tokens > 0


def test_round_trip_renders_as_the_equivalent_chat_request(served: Served) -> None:
    """The Messages request's prompt is the one the same conversation in chat-completions form renders
    (system, tools, the assistant's call with its input as arguments, the tool result), and count_tokens
    says its length, as the engine's usage does."""
    system = "You are terse."
    messages = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {
            "role": "assistant",
            "content": [  # thinking reaches the template as reasoning_content, which this one does not write
                {"type": "redacted_thinking", "data": "opaque"},
                {"type": "thinking", "thinking": "The tool knows.", "signature": ""},
                {"type": "text", "text": "I will look it up."},
                {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
            ],
        },
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]},
    ]
    chat = [
        {"role": "system", "content": system},
        messages[0],
        {
            "role": "assistant",
            "content": "I will look it up.",
            "reasoning_content": "The tool knows.",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
    ]
    reference = httpx.post(f"{served.url}/tokenize", json={"messages": chat, "tools": [WEATHER_TOOL]}).json()
    counted = served.client.messages.count_tokens(model=MODEL, system=system, messages=messages, tools=[WEATHER])
    assert counted.input_tokens == reference["count"]
    answer = _create(  # with the fields that change nothing generated: accepted, as Anthropic accepts them
        served,
        False,
        model=MODEL,
        system=[{"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}],
        extra={"metadata": {"user_id": "user-1"}, "service_tier": "auto"},
        messages=messages,
        tools=[WEATHER],
        max_tokens=50,
    )
    assert answer.usage.input_tokens == reference["count"] and answer.usage.cache_read_input_tokens == 0
    assert _blocks(answer) == [{"type": "text", "text": ANSWER}]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_thinking_is_a_block_of_its_own(served: Served, stream: bool) -> None:
    got = _create(served, stream, messages=[{"role": "user", "content": "What is 2+3?"}])
    assert _blocks(got) == [
        {"type": "thinking", "thinking": THOUGHT, "signature": ""},
        {"type": "text", "text": "The answer is 5."},
    ]
    assert got.stop_reason == "end_turn"


def test_thinking_config_reaches_the_template(served: Served) -> None:
    """``thinking: disabled`` is the template's ``enable_thinking: false`` (Qwen3's empty think block in
    the prompt); ``display: omitted`` keeps the thinking block and drops its text."""
    ask = {"model": MODEL, "messages": [{"role": "user", "content": "answer quietly"}]}
    plain = served.client.messages.count_tokens(**ask).input_tokens
    off = served.client.messages.count_tokens(**ask, thinking={"type": "disabled"}).input_tokens
    empty_think = httpx.post(f"{served.url}/tokenize", json={"prompt": "<think>\n\n</think>\n\n"}).json()["count"]
    assert off == plain + empty_think
    got = _create(served, False, **ask, max_tokens=20, thinking={"type": "disabled"})
    assert _blocks(got) == [{"type": "text", "text": "5."}]
    thought = _create(
        served,
        False,
        model=MODEL,
        messages=[{"role": "user", "content": "2+3"}],
        max_tokens=2000,
        thinking={"type": "enabled", "budget_tokens": 1024, "display": "omitted"},
    )
    assert _blocks(thought)[0] == {"type": "thinking", "thinking": "", "signature": ""}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_stop_sequences(served: Served, stream: bool) -> None:
    messages = [{"role": "user", "content": "count to five"}]
    got = _create(served, stream, messages=messages, stop_sequences=["three", "zzz"])
    assert (_blocks(got), got.stop_reason, got.stop_sequence) == (
        [{"type": "text", "text": "one two "}],
        "stop_sequence",
        "three",
    )
    cut = _create(served, stream, messages=messages, max_tokens=2)
    assert (cut.stop_reason, cut.stop_sequence, cut.usage.output_tokens) == ("max_tokens", None, 2)


def test_prefill_continues_the_last_assistant_message(served: Served) -> None:
    messages = [
        {"role": "user", "content": "What's the Greek name for Sun? (A) Sol (B) Helios"},
        {"role": "assistant", "content": "The answer is ("},
    ]
    got = _create(served, False, model=MODEL, messages=messages, max_tokens=20)
    assert _blocks(got) == [{"type": "text", "text": "B) Helios."}]
    counted = served.client.messages.count_tokens(model=MODEL, messages=messages).input_tokens
    assert got.usage.input_tokens == counted
    # The prompt is the conversation rendered without a generation prompt, less the end of the turn the
    # template closes after the prefill.
    body = {"messages": messages, "add_generation_prompt": False, "return_token_strs": True}
    closed = httpx.post(f"{served.url}/tokenize", json=body).json()
    assert closed["token_strs"][-3:] == ["(", "<|im_end|>", "\n"]
    assert counted == closed["count"] - 2
    # An empty (or blank) last assistant turn leaves nothing to continue: the answer is a new turn.
    blank = served.client.messages.count_tokens(
        model=MODEL, messages=[messages[0], {"role": "assistant", "content": " "}]
    )
    assert blank.input_tokens == served.client.messages.count_tokens(model=MODEL, messages=messages[:1]).input_tokens


@pytest.mark.parametrize(
    ("body", "events"),
    [
        ({"messages": [{"role": "user", "content": "What is the weather in Paris?"}], "tools": [WEATHER]}, 2),
        ({"messages": [{"role": "user", "content": "What is 2+3?"}]}, 2),
        ({"messages": [{"role": "user", "content": "count"}], "stop_sequences": ["one"]}, 0),
    ],
    ids=["tool_use", "thinking", "empty"],
)
def test_event_stream_follows_the_documented_order(served: Served, body: dict[str, Any], events: int) -> None:
    stream = _sse(served, body, headers={"anthropic-version": "2023-06-01"})
    _check_order(stream)
    assert sum(name == "content_block_start" for name, _ in stream) == events
    plain = {"model": MODEL, "max_tokens": 200, **GREEDY, **body}
    whole = httpx.post(f"{served.url}/v1/messages", json=plain, timeout=60).json()
    streamed = _message(stream)
    start = stream[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["output_tokens"] == 0
    strip = [{k: v for k, v in b.items() if k != "id"} for b in whole["content"]]
    assert [{k: v for k, v in b.items() if k != "id"} for b in streamed["content"]] == strip
    assert (streamed["stop_reason"], streamed["usage"]) == (whole["stop_reason"], whole["usage"])


def test_tool_choice_tool_forces_a_valid_call(served: Served) -> None:
    """The scripted reply to "hello" is plain text; a named tool choice makes it a call, by grammar, with
    input valid against the schema (``any`` the same, to any offered tool); ``none`` leaves the text."""
    import jsonschema

    tool = {**WEATHER, "input_schema": FORCED_SCHEMA}
    ask = {"messages": [{"role": "user", "content": "hello"}], "tools": [tool], "max_tokens": 400}
    free = _create(served, False, model=MODEL, **ask)
    assert _blocks(free) == [
        {"type": "thinking", "thinking": "\nA greeting.\n", "signature": ""},
        {"type": "text", "text": "Hello there, how can I help?"},
    ]
    for choice in ({"type": "tool", "name": "get_weather"}, {"type": "any", "disable_parallel_tool_use": True}):
        got = _create(served, False, model=MODEL, tool_choice=choice, **ask)
        assert got.stop_reason == "tool_use", got.model_dump_json()
        thought, call = got.content  # the reasoning is free; then only the call
        assert thought.type == "thinking" and thought.thinking == "\nA greeting.\n"
        assert call.type == "tool_use" and call.name == "get_weather"
        jsonschema.validate(call.input, FORCED_SCHEMA)
    none = _create(served, False, model=MODEL, tool_choice={"type": "none"}, **ask)
    assert _blocks(none) == _blocks(free)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"foo": 1}, "foo: Extra inputs are not permitted"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "text-only model (no vision)"),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "y": 1}]}]},
            "messages.0.content.0.y: Extra inputs are not permitted",
        ),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "server tools"),
        ({"tool_choice": {"type": "any"}}, "tool_choice 'any' needs tools"),
        ({"thinking": {"type": "enabled", "budget_tokens": 100}}, "budget_tokens must be at least 1024"),
        ({"thinking": {"type": "enabled", "budget_tokens": 2000}}, "budget_tokens: must be less than max_tokens"),
        ({"mcp_servers": [{"type": "url"}]}, "mcp_servers: not supported by this server"),
        ({"max_tokens": 5000}, "exceeds the context length"),
        ({"temperature": "hot"}, "temperature: Input should be a valid number"),
    ],
)
def test_bad_requests_are_anthropic_400s(served: Served, change: dict[str, Any], message: str) -> None:
    body = {"model": MODEL, "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}], "extra_body": change}
    with pytest.raises(anthropic.BadRequestError) as e:
        served.client.messages.create(**body)
    assert e.value.status_code == 400
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "invalid_request_error"
    assert message in e.value.body["error"]["message"], e.value.body


def test_other_errors_are_anthropic_shaped(served: Served) -> None:
    with pytest.raises(anthropic.NotFoundError) as e:
        served.client.messages.create(model="claude-nope", max_tokens=8, messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["error"]["type"] == "not_found_error" and "claude-nope" in e.value.body["error"]["message"]
    for r in (
        httpx.get(f"{served.url}/v1/messages"),
        httpx.post(f"{served.url}/v1/messages/nothing", json={}),
        httpx.post(f"{served.url}/v1/messages", content=b"{not json", headers={"content-type": "application/json"}),
        httpx.post(f"{served.url}/v1/messages", content=b"[" * 200 + b"]" * 200),
    ):
        assert r.status_code in (400, 404, 405) and r.json()["type"] == "error", r.text
        assert set(r.json()["error"]) == {"type", "message"}
    # The OpenAI routes keep OpenAI's shape.
    r = httpx.post(f"{served.url}/v1/chat/completions", json={"messages": [], "foo": 1})
    assert r.status_code == 400 and "type" not in r.json() and r.json()["error"]["code"] == "unknown_parameter"


def test_auth_size_overload_and_failure_in_anthropic_shape(live_server: Any, fake_model_dir: Path) -> None:
    """x-api-key as Anthropic's clients send it (and Bearer, as the SDK does), 401 and 413 from the
    guard, a 503 overloaded_error with retry-after, and a failure mid-stream as an ``error`` event."""
    from pypto_serving.tokenizer import load_tokenizer

    messages = [{"role": "user", "content": "hi"}]
    tok = load_tokenizer(str(fake_model_dir))
    assert tok is not None
    first = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True))[0]
    server, llm = live_server(
        api_key=["sekret"], max_request_body_bytes=4096, executor_options={"fail_on_token": first}
    )
    url, body = f"{server.url}/v1/messages", {"model": "tiny-fake", "max_tokens": 4, "messages": messages}
    count = {"model": "tiny-fake", "messages": [{"role": "user", "content": "hello world"}]}
    assert httpx.post(f"{url}/count_tokens", json=count, headers={"x-api-key": "sekret"}).status_code == 200
    assert httpx.get(f"{server.url}/v1/models", headers={"x-api-key": "sekret"}).status_code == 200  # any route
    refused = httpx.get(f"{server.url}/v1/models", headers={"x-api-key": "wrong"})
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"  # OpenAI's shape there
    sdk = anthropic.Anthropic(base_url=server.url, api_key="sekret", max_retries=0)
    assert sdk.messages.count_tokens(**count).input_tokens == len(
        tok.encode(tok.apply_chat_template(count["messages"], add_generation_prompt=True))
    )
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(**body)
    assert e.value.body == {
        "type": "error",
        "error": {"type": "authentication_error", "message": "missing or invalid API key"},
    }
    r = httpx.post(url, json={**body, "system": "x" * 5000}, headers={"x-api-key": "sekret"})
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"
    with pytest.raises(anthropic.InternalServerError) as e:
        sdk.messages.create(**body)
    assert e.value.status_code == 500 and e.value.body["error"]["type"] == "api_error"
    with pytest.raises(anthropic.APIStatusError) as e:  # the stream has begun: the failure is an event
        for _ in sdk.messages.create(**body, stream=True):
            pass
    assert (
        e.value.body["error"]["type"] == "api_error"
        and "fake executor asked to fail" in e.value.body["error"]["message"]
    )
    llm.drain()
    r = httpx.post(url, json=body, headers={"x-api-key": "sekret"})
    assert r.status_code == 503 and r.headers["retry-after"] == "5"
    assert r.json()["error"]["type"] == "overloaded_error"


def test_output_config_format_is_the_json_schema_grammar(served: Served) -> None:
    """``output_config.format`` keeps the answer to the schema: the scripted reply (thinking, then a
    greeting) becomes JSON valid against it."""
    import jsonschema

    schema = {"type": "object", "properties": {"mood": {"enum": ["happy", "sad"]}}, "required": ["mood"]}
    schema["additionalProperties"] = False
    ask = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 60}
    got = _create(served, False, extra={"output_config": {"format": {"type": "json_schema", "schema": schema}}}, **ask)
    (block,) = got.content
    assert block.type == "text" and got.stop_reason == "end_turn", got.model_dump_json()
    jsonschema.validate(json.loads(block.text), schema)


def test_usage_splits_the_prompt_by_the_prefix_cache(live_server: Any) -> None:
    """A repeated prompt is read from the prefix cache: ``input_tokens`` are the rest, and with
    ``cache_read_input_tokens`` they add up to the prompt count_tokens counts."""
    server, _ = live_server(enable_prefix_caching=True)
    sdk = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    ask = {"model": "tiny-fake", "messages": [{"role": "user", "content": "the quick brown fox jumps over the dog"}]}
    prompt = sdk.messages.count_tokens(**ask).input_tokens
    first = sdk.messages.create(max_tokens=4, **ask).usage
    second = sdk.messages.create(max_tokens=4, **ask).usage
    assert (first.input_tokens, first.cache_read_input_tokens) == (prompt, 0)
    assert second.cache_read_input_tokens > 0 and second.input_tokens + second.cache_read_input_tokens == prompt


def test_consecutive_turns_are_combined(served: Served) -> None:
    """As Anthropic combines consecutive turns of one role, two user turns render as one."""
    split = [{"role": "user", "content": "What is"}, {"role": "user", "content": [{"type": "text", "text": "2+3?"}]}]
    one = [{"role": "user", "content": "What is\n2+3?"}]
    count = served.client.messages.count_tokens
    assert count(model=MODEL, messages=split).input_tokens == count(model=MODEL, messages=one).input_tokens
    got = _create(served, False, messages=split)
    assert _blocks(got)[-1] == {"type": "text", "text": "The answer is 5."}
