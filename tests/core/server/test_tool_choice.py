"""``tool_choice: "required"`` and a named function, kept by constrained decoding: the official
``openai`` SDK against real servers on the embedded trained tiny Qwen3 (Hermes calls) and tiny
DeepSeek-V4 (DSML calls). The tiny models know nothing of tools, so every sampled response carrying
a parseable call to an allowed function with valid arguments is the grammar's doing."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from tests.core.server.conftest import LiveServer

pytestmark = pytest.mark.requires_plugin("sync_sched")
pytest.importorskip("openai")

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "minimum": -100, "maximum": 100},
                "b": {"type": "integer", "minimum": -100, "maximum": 100},
            },
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris, and what is 2 + 3?"}]


def _server(model: Any, **settings: Any) -> tuple[LiveServer, Any]:
    from pypto_serving import PluginManager, ServingSettings
    from pypto_serving.server import AsyncLLM, build_app

    config = ServingSettings(
        model=str(model), device="cpu", worker_mode="inproc", scheduler="sync", engine_mode="thread", **settings
    )
    llm = AsyncLLM(config, PluginManager())
    llm.wait_ready(60)
    return LiveServer(build_app(llm, manage_engine=False), llm=llm), llm


@pytest.fixture(scope="module", params=["qwen", "deepseek"])
def client(request: pytest.FixtureRequest) -> Iterator[Any]:
    openai = pytest.importorskip("openai")
    if request.param == "qwen":
        model = pytest.importorskip("pypto_serving_qwen.plugin").TINY_QWEN3
    else:
        model = pytest.importorskip("pypto_serving_deepseek_mtp.plugin").TINY_DEEPSEEK_V4
    live, llm = _server(model)
    yield openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)
    live.stop()
    llm.shutdown(10)


def _check_calls(calls: Any, allowed: set[str]) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    assert calls, "every forced response carries a call"
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in allowed
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_required_always_calls_an_offered_function(client: Any) -> None:
    resp = client.chat.completions.create(
        model=client.models.list().data[0].id, messages=MESSAGES, tools=TOOLS, tool_choice="required",
        n=12, temperature=1.0, seed=11, max_tokens=200, parallel_tool_calls=False,
    )  # fmt: skip
    for choice in resp.choices:
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.content is None
        assert len(choice.message.tool_calls) == 1
        _check_calls(choice.message.tool_calls, {"get_weather", "add"})
    names = {c.function.name for choice in resp.choices for c in choice.message.tool_calls}
    assert names == {"get_weather", "add"}  # sampled: both functions come up over 12 choices


def test_required_parallel_calls_are_all_valid(client: Any) -> None:
    """With parallel calls the grammar allows EOS after every complete call; a tiny model that keeps
    calling until max_tokens leaves its cut-off last call as content, and every complete one is valid."""
    resp = client.chat.completions.create(
        model=client.models.list().data[0].id, messages=MESSAGES, tools=TOOLS, tool_choice="required",
        n=8, temperature=1.0, seed=14, max_tokens=200,
    )  # fmt: skip
    for choice in resp.choices:
        assert choice.finish_reason in ("tool_calls", "length"), choice
        _check_calls(choice.message.tool_calls, {"get_weather", "add"})
        if choice.finish_reason == "tool_calls":
            assert choice.message.content is None


def test_named_function_is_the_only_call(client: Any) -> None:
    named = {"type": "function", "function": {"name": "add"}}
    resp = client.chat.completions.create(
        model=client.models.list().data[0].id, messages=MESSAGES, tools=TOOLS, tool_choice=named,
        n=12, temperature=1.0, seed=12, max_tokens=200,
    )  # fmt: skip
    for choice in resp.choices:
        assert choice.finish_reason == "tool_calls", choice
        assert len(choice.message.tool_calls) == 1
        _check_calls(choice.message.tool_calls, {"add"})


def test_streamed_forced_calls_equal_whole(client: Any) -> None:
    kw: dict[str, Any] = {
        "model": client.models.list().data[0].id, "messages": MESSAGES, "tools": TOOLS,
        "tool_choice": "required", "temperature": 1.0, "seed": 13, "max_tokens": 200,
        "parallel_tool_calls": False,
    }  # fmt: skip
    whole = client.chat.completions.create(**kw).choices[0]
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for d in choice.delta.tool_calls or ():
                entry = calls.setdefault(d.index, {"name": "", "arguments": ""})
                entry["name"] += d.function.name or ""
                entry["arguments"] += d.function.arguments or ""
    assert finish == "tool_calls" and whole.finish_reason == "tool_calls"
    assert len(whole.message.tool_calls) == 1
    assert [calls[i] for i in sorted(calls)] == [
        {"name": c.function.name, "arguments": c.function.arguments} for c in whole.message.tool_calls
    ]
    _check_calls(whole.message.tool_calls, {"get_weather", "add"})


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among the request's tools"),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "already constrains"),
    ],
)
def test_bad_forced_choices_are_400s(client: Any, extra: dict[str, Any], message: str) -> None:
    openai = pytest.importorskip("openai")
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=client.models.list().data[0].id, messages=MESSAGES, tools=TOOLS, max_tokens=8, **extra
        )
    assert info.value.body["param"] == "tool_choice"
    assert message in info.value.body["message"]
