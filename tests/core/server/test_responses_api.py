# ruff: noqa: F811  (the fixture imported from test_tools is redefined as a test parameter, as pytest wants)
"""OpenAI's Responses API through the official ``openai`` SDK's ``client.responses`` against a real
server: the scripted executor and Qwen-like tools template of test_tools answer each turn with a fixed
reply, so text, function calls and reasoning come out exactly; the conversation a response request
renders is checked against the same chat sent to /tokenize (and to /v1/chat/completions), so
``instructions``, ``previous_response_id`` and function-call outputs are seen to reach the template.
Streams are checked against the documented event order and through the SDK's own stream
accumulator; structured output against ``jsonschema``; the store's bounds under a flood."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.core.server.conftest import LiveServer, fake_settings
from tests.core.server.test_tools import (
    ANSWER,
    CALL_REPLY,
    IM_END,
    WEATHER_TOOL,
    ScriptedPlugin,
    tools_model_dir,  # noqa: F401 (fixture)
)

openai = pytest.importorskip("openai")
pytest.importorskip("pypto_serving_sync_sched")

THOUGHT = "\nThe user wants 2+3. That is 5.\n"
SCRIPT = [
    ["weather in Paris", CALL_REPLY],
    ["<tool_response>", ANSWER],
    ["2+3", f"<think>{THOUGHT}</think>\n\nThe answer is 5."],
    ["Say hello", "Hello there, friend."],
    ["Describe a person", "Sure, a person."],
    ["Count", "one two three four five six seven eight nine ten"],
]
FUNCTION = {  # test_tools' tool as the Responses API writes a function tool
    "type": "function",
    "name": WEATHER_TOOL["function"]["name"],
    "description": WEATHER_TOOL["function"]["description"],
    "parameters": WEATHER_TOOL["function"]["parameters"],
    "strict": False,
}
# The same tool as a chat request sends it (``strict`` as sent reaches the template too).
CHAT_TOOL = {"type": "function", "function": {**WEATHER_TOOL["function"], "strict": False}}
BOUNDED = {  # arguments a random walk through the grammar finishes quickly
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}},
    "required": ["city"],
    "additionalProperties": False,
}
UNSUPPORTED_NAMES = ["background", "include", "reasoning", "truncation", "conversation", "top_logprobs"]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"enum": ["cat", "dog", "fish"]},
    },
    "required": ["name", "age", "pet"],
    "additionalProperties": False,
}


@dataclass
class Served:
    client: Any
    url: str
    app: Any


def _serve(model_dir: Path, **overrides: Any) -> tuple[Served, LiveServer, Any]:
    from pypto_serving import PluginManager
    from pypto_serving.server import AsyncLLM, build_app

    options = {"script": SCRIPT, "architecture": "Qwen3ForCausalLM", "eos": IM_END, "max_model_len": 512}
    settings = fake_settings(model_dir, executor="scripted", executor_options=options, **overrides)
    llm = AsyncLLM(settings, PluginManager(extra_plugins=[ScriptedPlugin]))
    llm.wait_ready(60)
    app = build_app(llm, manage_engine=False)
    live = LiveServer(app, llm=llm)
    client = openai.OpenAI(base_url=live.url + "/v1", api_key="none", max_retries=0)
    return Served(client, live.url, app), live, llm


@pytest.fixture(scope="module")
def served(tools_model_dir: Path) -> Iterator[Served]:
    """One server for most tests: Qwen3's reasoning parser and the hermes tool parser (by architecture)."""
    s, live, llm = _serve(tools_model_dir, reasoning_parser="qwen3")
    yield s
    live.stop()
    llm.shutdown(10)


@pytest.fixture
def serve(tools_model_dir: Path) -> Iterator[Callable[..., Served]]:
    """``serve(**settings) -> Served`` for tests that need their own settings."""
    made: list[tuple[LiveServer, Any]] = []

    def factory(**overrides: Any) -> Served:
        s, live, llm = _serve(tools_model_dir, **overrides)
        made.append((live, llm))
        return s

    yield factory
    for live, llm in made:
        live.stop()
        llm.shutdown(10)


def _count(s: Served, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> int:
    """The prompt tokens of ``messages`` rendered as a chat request renders them (/tokenize)."""
    body: dict[str, Any] = {"messages": messages, **({"tools": tools} if tools else {})}
    r = httpx.post(f"{s.url}/tokenize", json=body)
    assert r.status_code == 200, r.text
    return int(r.json()["count"])


def _calls(response: Any) -> list[Any]:
    return [item for item in response.output if item.type == "function_call"]


# --------------------------------------------------------------------------- text


def test_text_response_renders_instructions_and_input_as_chat_does(served: Served) -> None:
    r = served.client.responses.create(
        model="tiny-tools", input="Say hello", instructions="Be brief.", temperature=0, top_p=1.0
    )
    assert r.status == "completed" and r.object == "response" and r.id.startswith("resp_")
    assert r.output_text == "Hello there, friend."
    [message] = r.output
    assert message.type == "message" and message.role == "assistant" and message.status == "completed"
    assert [p.type for p in message.content] == ["output_text"]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello"}]
    chat = served.client.chat.completions.create(model="tiny-tools", messages=messages, temperature=0)
    assert chat.choices[0].message.content == r.output_text
    assert r.usage.input_tokens == _count(served, messages) == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert (r.temperature, r.top_p, r.instructions, r.store) == (0, 1.0, "Be brief.", True)


def test_input_items_with_text_parts(served: Served) -> None:
    items = [
        {"role": "developer", "content": [{"type": "input_text", "text": "Be brief."}]},
        {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "Say "}, {"type": "input_text", "text": "hello"}],
        },
    ]
    r = served.client.responses.create(model="tiny-tools", temperature=0, input=items)
    assert r.output_text == "Hello there, friend."
    expected = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Say hello"}]
    assert r.usage.input_tokens == _count(served, expected)


def test_max_output_tokens_makes_an_incomplete_response(served: Served) -> None:
    r = served.client.responses.create(model="tiny-tools", temperature=0, input="Count", max_output_tokens=3)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3 and r.output[0].status == "incomplete"
    assert "one two three".startswith(r.output_text) and r.output_text


# --------------------------------------------------------------------------- function calls


def _round_trip(s: Served, stream: bool) -> tuple[Any, Any]:
    """A call, then its output sent back with ``previous_response_id``: (first, second) responses."""
    first = _create(s, stream, input="What is the weather in Paris?", tools=[FUNCTION])
    call = _calls(first)[0]
    output = {"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature": 22}'}
    second = _create(s, stream, input=[output], previous_response_id=first.id, tools=[FUNCTION])
    return first, second


def _create(s: Served, stream: bool, **kw: Any) -> Any:
    if not stream:
        return s.client.responses.create(model="tiny-tools", temperature=0, **kw)
    with s.client.responses.stream(model="tiny-tools", temperature=0, **kw) as events:
        types = [e.type for e in events]
        final = events.get_final_response()
    _check_order(types)
    return final


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_function_call_round_trip_with_previous_response_id(served: Served, stream: bool) -> None:
    first, second = _round_trip(served, stream)
    assert [item.type for item in first.output] == ["message", "function_call"]
    assert first.output_text == "I will look it up."
    call = _calls(first)[0]
    assert call.name == "get_weather" and call.call_id.startswith("call_") and call.status == "completed"
    assert json.loads(call.arguments) == {"city": "Paris", "unit": "celsius"}
    assert second.output_text == ANSWER and second.previous_response_id == first.id
    # The second turn rendered the whole conversation: the question, the assistant's text and call, the output.
    history = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {
            "role": "assistant",
            "content": "I will look it up.",
            "tool_calls": [
                {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
            ],
        },
        {"role": "tool", "tool_call_id": call.call_id, "content": '{"temperature": 22}'},
    ]
    assert second.usage.input_tokens == _count(served, history, [CHAT_TOOL])
    assert first.usage.input_tokens == _count(served, history[:1], [CHAT_TOOL])


def test_the_same_round_trip_with_the_items_sent_back(served: Served) -> None:
    """Without the store: the first response's output items go back as input items, as a client does."""
    first = served.client.responses.create(
        model="tiny-tools", temperature=0, input="What is the weather in Paris?", tools=[FUNCTION], store=False
    )
    call = _calls(first)[0]
    items = [
        {"role": "user", "content": "What is the weather in Paris?"},
        *[item.model_dump(exclude_none=True) for item in first.output],
        {"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature": 22}'},
    ]
    second = served.client.responses.create(
        model="tiny-tools", temperature=0, input=items, tools=[FUNCTION], store=False
    )
    assert second.output_text == ANSWER
    with pytest.raises(openai.NotFoundError):
        served.client.responses.retrieve(first.id)


def test_forced_function_call(serve: Callable[..., Served]) -> None:
    """``tool_choice`` naming a function is kept by the same constrained decoding as chat's (without a
    reasoning parser, so the grammar is the call alone and its one string is bounded); the server
    schedules by priority, so vLLM's ``priority`` is accepted as on chat requests."""
    r = serve(scheduling_policy="priority").client.responses.create(
        extra_body={"priority": 2},
        model="tiny-tools",
        input="Say hello",
        tools=[{**FUNCTION, "parameters": BOUNDED}],
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=128,
        temperature=1.0,
    )
    [call] = _calls(r)
    assert call.name == "get_weather" and isinstance(json.loads(call.arguments)["city"], str)


# --------------------------------------------------------------------------- reasoning


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_reasoning_becomes_a_reasoning_item(served: Served, stream: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    from pypto_serving.tokenizer import Tokenizer

    rendered: list[list[dict[str, Any]]] = []
    render = Tokenizer.apply_chat_template

    def recording(self: Tokenizer, messages: list[dict[str, Any]], *args: Any, **kw: Any) -> str:
        rendered.append(messages)
        return render(self, messages, *args, **kw)

    monkeypatch.setattr(Tokenizer, "apply_chat_template", recording)
    r = _create(served, stream, input="What is 2+3?")
    assert [item.type for item in r.output] == ["reasoning", "message"]
    assert [c.text for c in r.output[0].content] == [THOUGHT]
    assert r.output_text == "The answer is 5."
    assert 0 < r.usage.output_tokens_details.reasoning_tokens < r.usage.output_tokens
    # Passed back, the reasoning item reaches the template as the assistant turn's reasoning_content.
    follow = served.client.responses.create(
        model="tiny-tools", temperature=0, previous_response_id=r.id, input="Say hello"
    )
    assert follow.output_text == "Hello there, friend."
    assert rendered[-1] == [
        {"role": "user", "content": "What is 2+3?"},
        {"role": "assistant", "content": "The answer is 5.", "reasoning_content": THOUGHT},
        {"role": "user", "content": "Say hello"},
    ]


# --------------------------------------------------------------------------- structured output


def test_json_schema_format_is_kept_by_the_grammar(served: Served) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    fmt = {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}
    plain = served.client.responses.create(model="tiny-tools", temperature=0, input="Describe a person")
    assert plain.output_text == "Sure, a person."  # what the model says unconstrained: not JSON
    outputs = []
    for _ in range(4):
        r = served.client.responses.create(
            model="tiny-tools", input="Describe a person", text={"format": fmt}, temperature=1.0, max_output_tokens=96
        )
        assert r.status == "completed" and r.text.format.type == "json_schema"
        jsonschema.validate(json.loads(r.output_text), PERSON)
        outputs.append(r.output_text)
    r = served.client.responses.create(
        model="tiny-tools",
        temperature=0,
        input="Describe a person",
        text={"format": {"type": "json_object"}},
        max_output_tokens=96,
    )
    assert r.status != "completed" or isinstance(json.loads(r.output_text), dict)


# --------------------------------------------------------------------------- streaming

# The documented order: created, in_progress, then per output item its added event, its content part
# (text or reasoning deltas, their done) or its arguments (deltas, done), its done event; then the end.
_LETTERS = {
    "response.output_item.added": "A",
    "response.content_part.added": "P",
    "response.output_text.delta": "T",
    "response.output_text.done": "X",
    "response.reasoning_text.delta": "R",
    "response.reasoning_text.done": "Y",
    "response.content_part.done": "Q",
    "response.function_call_arguments.delta": "F",
    "response.function_call_arguments.done": "G",
    "response.output_item.done": "D",
}
_ITEM = re.compile(r"(?:AP(?:T*X|R*Y)QD|AF+GD)+")


def _check_order(types: list[str]) -> None:
    assert types[:2] == ["response.created", "response.in_progress"], types
    assert types[-1] in ("response.completed", "response.incomplete"), types
    letters = "".join(_LETTERS[t] for t in types[2:-1])
    assert _ITEM.fullmatch(letters), types


def _raw_events(s: Served, body: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The stream's (event name, data) pairs as sent."""
    r = httpx.post(f"{s.url}/v1/responses", json={**body, "stream": True}, timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.text
    return _parse_events(r.text)


def _parse_events(text: str) -> list[tuple[str, dict[str, Any]]]:
    out = []
    for block in text.strip().split("\n\n"):
        name, data = block.split("\n", 1)
        assert name.startswith("event: ") and data.startswith("data: "), block
        out.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return out


@pytest.mark.parametrize("ask", ["What is the weather in Paris?", "What is 2+3?", "Say hello"])
def test_stream_events_are_in_the_documented_order_and_agree_with_the_whole_response(served: Served, ask: str) -> None:
    body = {"model": "tiny-tools", "input": ask, "tools": [FUNCTION], "temperature": 0}
    events = _raw_events(served, body)
    assert all(name == data["type"] for name, data in events)
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    _check_order([name for name, _ in events])
    final = events[-1][1]["response"]
    assert final["status"] == "completed" and events[0][1]["response"]["status"] == "in_progress"
    assert len({data["response"]["id"] for name, data in events if "response" in data}) == 1
    # Each item's deltas add up to its done text, and the done items are the final response's output.
    done_items = [data["item"] for name, data in events if name == "response.output_item.done"]
    assert done_items == final["output"]
    for item in final["output"]:
        deltas = "".join(d["delta"] for _, d in events if d.get("item_id") == item["id"] and "delta" in d)
        assert deltas == (item["arguments"] if item["type"] == "function_call" else item["content"][0]["text"])
    whole = httpx.post(f"{served.url}/v1/responses", json=body).json()
    strip = re.compile(r'"(?:id|call_id)": "[^"]*"')
    assert strip.sub("", json.dumps(whole["output"])) == strip.sub("", json.dumps(final["output"]))
    assert whole["usage"] == final["usage"]


def test_streamed_incomplete_response_ends_with_response_incomplete(served: Served) -> None:
    events = _raw_events(served, {"input": "Count", "max_output_tokens": 3, "temperature": 0})
    _check_order([name for name, _ in events])
    assert events[-1][0] == "response.incomplete"
    assert events[-1][1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


def test_a_failing_stream_sends_error_then_response_failed(make_client: Any, fake_model_dir: Path) -> None:
    from pypto_serving.tokenizer import load_tokenizer

    tok = load_tokenizer(str(fake_model_dir))
    assert tok is not None
    first = tok.encode(tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True))[0]
    client, _ = make_client(executor_options={"fail_on_token": first})
    r = client.post("/v1/responses", json={"input": "hi", "stream": True, "max_output_tokens": 3})
    events = _parse_events(r.text)
    assert [name for name, _ in events] == ["response.created", "response.in_progress", "error", "response.failed"]
    assert [d["sequence_number"] for _, d in events] == [0, 1, 2, 3]
    error, failed = events[2][1], events[3][1]["response"]
    assert error["code"] == "generation_failed" and "fake executor asked to fail" in error["message"]
    assert failed["status"] == "failed" and failed["error"]["message"] == error["message"]
    r = client.post("/v1/responses", json={"input": "hi", "max_output_tokens": 3})
    assert r.status_code == 500 and r.json()["error"]["code"] == "generation_failed"


# --------------------------------------------------------------------------- store, GET, DELETE


def test_get_and_delete(served: Served) -> None:
    r = served.client.responses.create(model="tiny-tools", temperature=0, input="Say hello", metadata={"k": "v"})
    got = served.client.responses.retrieve(r.id)
    assert got.model_dump() == r.model_dump() and got.metadata == {"k": "v"}
    served.client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        served.client.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        served.client.responses.delete(r.id)
    with pytest.raises(openai.BadRequestError) as e:
        served.client.responses.create(model="tiny-tools", temperature=0, input="Say hello", previous_response_id=r.id)
    assert e.value.body["param"] == "previous_response_id"
    unstored = served.client.responses.create(model="tiny-tools", temperature=0, input="Say hello", store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        served.client.responses.retrieve(unstored.id)


def _flood(s: Served, n: int, threads: int = 8) -> list[str]:
    ids: list[str] = []
    lock = threading.Lock()

    def worker(k: int) -> None:
        for _ in range(k, n, threads):
            r = s.client.responses.create(model="tiny-tools", temperature=0, input="Say hello", max_output_tokens=2)
            with lock:
                ids.append(r.id)

    pool = [threading.Thread(target=worker, args=(k,)) for k in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    assert len(ids) == n
    return ids


def _retrievable(s: Served, ids: list[str]) -> list[str]:
    return [rid for rid in ids if httpx.get(f"{s.url}/v1/responses/{rid}").status_code == 200]


@pytest.mark.parametrize(
    "bounds",
    [{"response_store_max_entries": 5}, {"response_store_max_bytes": 8000}],
    ids=["entries", "bytes"],
)
def test_the_store_stays_bounded_under_a_flood(serve: Callable[..., Served], bounds: dict[str, Any]) -> None:
    import msgspec

    s = serve(**bounds)
    store = s.app.state.response_store
    ids = _flood(s, 24)
    kept = _retrievable(s, ids)
    assert 1 <= len(store) == len(kept) <= store.max_entries
    assert len(kept) < len(ids)
    sizes = [len(msgspec.json.encode([e.body, e.items])) for e in store._entries.values()]
    assert store.bytes == sum(sizes) <= store.max_bytes
    if "response_store_max_bytes" in bounds:
        assert store.bytes + max(sizes) > store.max_bytes * 0.5  # filled, not emptied
    # The newest is kept: eviction takes the least recently used.
    newest = s.client.responses.create(model="tiny-tools", temperature=0, input="Say hello")
    assert s.client.responses.retrieve(newest.id).id == newest.id


def test_stored_responses_expire(serve: Callable[..., Served]) -> None:
    s = serve(response_store_max_age=1.5)  # room for a loaded machine between the create and the first get
    r = s.client.responses.create(model="tiny-tools", temperature=0, input="Say hello")
    assert s.client.responses.retrieve(r.id).id == r.id
    time.sleep(1.6)
    with pytest.raises(openai.NotFoundError):
        s.client.responses.retrieve(r.id)
    assert len(s.app.state.response_store) == 0


def test_the_store_is_lru_and_counts_its_bytes() -> None:
    from pypto_serving.server.responses_api import ResponseStore

    now = [0.0]
    store = ResponseStore(max_entries=3, max_age=10.0, max_bytes=10_000, clock=lambda: now[0])
    for k in range(3):
        assert store.put(f"r{k}", {"id": f"r{k}"}, [])
    assert store.get("r0") is not None  # r0 becomes the most recently used: r1 goes next
    now[0] = 6.0
    store.put("r3", {"id": "r3"}, [])
    assert [r for r in ("r0", "r1", "r2", "r3") if store.get(r)] == ["r0", "r2", "r3"]
    assert not store.put("big", {"id": "x" * 20_000}, [])  # larger than the whole bound: not kept
    assert len(store) == 3 and store.bytes == 3 * len(b'[{"id":"r0"},[]]')
    now[0] = 10.5  # r0 and r2 are past max_age, however recently used; r3 is not
    assert store.get("r3") is not None and store.get("r0") is None
    assert len(store) == 1 and store.bytes == len(b'[{"id":"r3"},[]]')
    now[0] = 16.5
    assert store.get("r3") is None and len(store) == 0 and store.bytes == 0
    assert ResponseStore(0, 10.0, 10_000).put("r", {}, []) is False


# --------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"background": True}, "background"),
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"tools": [{"type": "file_search", "vector_store_ids": ["v"]}]}, "tools"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]}, "input"),
        ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "file-1"}]}]}, "input"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input"),
        ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "abc"}]}, "input"),
        ({"include": ["reasoning.encrypted_content"]}, "include"),
        ({"truncation": "auto"}, "truncation"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"tool_choice": {"type": "web_search_preview"}, "tools": [FUNCTION]}, "tool_choice"),
        ({"text": {"verbosity": "low"}}, "text"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"top_logprobs": 5}, "top_logprobs"),
    ],
)
def test_unsupported_fields_are_400s(served: Served, extra: dict[str, Any], param: str) -> None:
    r = httpx.post(f"{served.url}/v1/responses", json={"input": "Say hello", **extra})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    assert "not supported" in error["message"] or "Input should be None" in error["message"], error


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "Say hello", "nope": 1}, "nope"),
        ({"input": []}, "input"),
        ({"input": "Say hello", "max_output_tokens": 100_000}, "max_output_tokens"),
        ({"input": "Say hello", "temperature": "hot"}, "temperature"),
        ({"input": "Say hello", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
        ({"input": "Say hello", "tool_choice": "required"}, "tool_choice"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input"),
        ({"input": "Say hello", "model": "other"}, "model"),
        ({"input": "Say hello", "priority": 3}, "priority"),  # the server's scheduling_policy is fcfs
        ({}, "input"),
        ({"input": "Say hello", "metadata": {"k" * 65: "v"}}, "metadata"),
        (
            {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[" * 80 + "]" * 80}]},
            "input",
        ),
    ],
)
def test_bad_requests_name_the_field(served: Served, body: dict[str, Any], param: str) -> None:
    r = httpx.post(f"{served.url}/v1/responses", json=body)
    assert r.status_code in (400, 404), r.text
    assert r.json()["error"]["param"] == param, r.text
    for chat_name in ("max_completion_tokens", "response_format", "messages."):
        assert chat_name not in r.text


@pytest.mark.parametrize(
    ("content", "headers", "says"),
    [
        (b'{"input": "Say hello"}', {"content-type": "text/plain"}, "content-type: application/json"),
        (b"[]", {"content-type": "application/json"}, "must be a JSON object"),
        (b'{"input": ', {"content-type": "application/json"}, "could not parse"),
    ],
)
def test_bodies_that_are_not_json_objects(served: Served, content: bytes, headers: dict[str, str], says: str) -> None:
    r = httpx.post(f"{served.url}/v1/responses", content=content, headers=headers)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", r.text
    assert says in r.json()["error"]["message"]


# --------------------------------------------------------------------------- fuzzing


def _fuzz_strategies() -> tuple[Any, Any]:
    """(bodies, corruptions): bodies shaped like response requests, typed but with any texts, items of
    every type (the wrong fields for their type included), parts of every type, and tools and formats
    that may be invalid; a corruption is None or a field (known, unsupported or unknown) and any JSON
    value to put there."""
    from hypothesis import strategies as st

    floats = st.floats(allow_nan=False, allow_infinity=False)  # what JSON can carry
    scalars = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | floats | st.text(max_size=8)
    json_values = st.recursive(
        scalars,
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
        max_leaves=8,
    )
    text = st.sampled_from(["hi", "", "Say hello", "\u00e9t\u00e9"]) | st.text(max_size=6)
    part = st.fixed_dictionaries(
        {"type": st.sampled_from(["input_text", "output_text", "input_image", "reasoning_text", "summary_text"])},
        optional={"text": text},
    )
    content = text | st.lists(part, max_size=3)
    item = st.fixed_dictionaries(
        {},
        optional={
            "type": st.sampled_from(
                ["message", "function_call", "function_call_output", "reasoning", "item_reference"]
            ),
            "role": st.sampled_from(["user", "assistant", "system", "developer", "tool"]),
            "content": content,
            "call_id": text,
            "name": text,
            "arguments": st.sampled_from(['{"city": "Paris"}', "{", "[]", '"x"']),
            "output": content,
            "summary": st.lists(part, max_size=2),
        },
    )
    schemas = st.sampled_from([{"type": "object"}, PERSON, BOUNDED, {"type": "bogus"}, {}])
    tool = st.fixed_dictionaries(
        {"type": st.sampled_from(["function", "web_search"])},
        optional={"name": text, "parameters": schemas, "strict": st.booleans()},
    )
    fmt = st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "json_object", "json_schema"])},
        optional={"name": text, "schema": schemas, "strict": st.booleans()},
    )
    choices = st.sampled_from(["auto", "none", "required", {"type": "function", "name": "get_weather"}])
    fields = {
        "input": text | st.lists(item, min_size=1, max_size=4),
        "instructions": text,
        "tools": st.lists(tool, max_size=2),
        "tool_choice": choices,
        "parallel_tool_calls": st.booleans(),
        "text": st.fixed_dictionaries({}, optional={"format": fmt}),
        "max_output_tokens": st.integers(1, 3),
        "temperature": st.floats(0, 2),
        "store": st.booleans(),
        "stream": st.booleans(),
    }
    names = st.sampled_from([*fields, *UNSUPPORTED_NAMES, "previous_response_id", "metadata", "nope"])
    # Most bodies keep their types, so that the work past the checks is reached too.
    corrupt = st.sampled_from([False, False, True]).flatmap(lambda c: st.tuples(names, json_values) if c else st.none())
    return st.fixed_dictionaries({"input": fields.pop("input")}, optional=fields), corrupt


def test_fuzzed_bodies_are_answered_never_a_5xx(make_client: Any) -> None:
    from hypothesis import HealthCheck, given, settings

    client, _ = make_client()

    bodies, corruptions = _fuzz_strategies()
    seen: dict[int, int] = {}

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(bodies, corruptions)
    def check(body: dict[str, Any], corrupt: tuple[str, Any] | None) -> None:
        body.setdefault("max_output_tokens", 2)
        if corrupt is not None:
            body[corrupt[0]] = corrupt[1]
        r = client.post("/v1/responses", json=body)
        seen[r.status_code] = seen.get(r.status_code, 0) + 1
        assert r.status_code in (200, 400, 404), (body, r.status_code, r.text)
        if r.status_code != 200:
            assert r.json()["error"]["message"], r.text
        elif body.get("stream") is True:
            names = [name for name, _ in _parse_events(r.text)]
            assert names[0] == "response.created" and names[-1] in ("response.completed", "response.incomplete")
        else:
            assert r.json()["status"] in ("completed", "incomplete")

    check()
    assert seen.get(200, 0) >= 10 and seen.get(400, 0) >= 10, seen  # both the work and the refusals are reached
