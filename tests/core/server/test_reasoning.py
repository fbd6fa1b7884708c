# ruff: noqa: F811  (the fixtures imported from test_tools are redefined as test parameters, as pytest wants)
"""Reasoning output through the OpenAI SDK against a real server: Qwen3-style ``<think>`` output moved
into ``reasoning_content`` (whole and streamed), ``chat_template_kwargs`` reaching the template, and
reasoning followed by a tool call. Uses the scripted executor and Qwen-like template of test_tools."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from tests.core.server.test_tools import WEATHER_TOOL, scripted_server, tools_model_dir  # noqa: F401 (fixtures)

THOUGHT = "\nThe user wants 2+3. That is 5.\n"
SCRIPT = [
    ["2+3", f"<think>{THOUGHT}</think>\n\nThe answer is 5."],
    ["quietly", "5."],
    [
        "weather in Paris",
        '<think>\nI need the weather tool.\n</think>\n\n<tool_call>\n{"name": "get_weather", '
        '"arguments": {"city": "Paris"}}\n</tool_call>',
    ],
]


def _ask(client: Any, text: str, stream: bool, **kw: Any) -> dict[str, Any]:
    """The assistant message's parts (streamed deltas put together) and the finish reason."""
    messages = [{"role": "user", "content": text}]
    if not stream:
        r = client.chat.completions.create(model="tiny-tools", messages=messages, temperature=0, **kw)
        m = r.choices[0].message
        calls = [(c.function.name, json.loads(c.function.arguments)) for c in m.tool_calls or ()]
        reasoning = getattr(m, "reasoning_content", None)
        return {"reasoning": reasoning, "content": m.content, "calls": calls, "finish": r.choices[0].finish_reason}
    parts: dict[str, Any] = {"reasoning": "", "content": "", "calls": {}, "finish": None, "order": []}
    for chunk in client.chat.completions.create(
        model="tiny-tools", messages=messages, temperature=0, stream=True, **kw
    ):
        delta = chunk.choices[0].delta
        extra = delta.model_extra or {}
        if extra.get("reasoning_content"):
            parts["reasoning"] += extra["reasoning_content"]
            parts["order"].append("reasoning")
        if delta.content:
            parts["content"] += delta.content
            parts["order"].append("content")
        for tc in delta.tool_calls or ():
            name, args = parts["calls"].get(tc.index, ("", ""))
            parts["calls"][tc.index] = (name + (tc.function.name or ""), args + (tc.function.arguments or ""))
            parts["order"].append("tool_calls")
        parts["finish"] = chunk.choices[0].finish_reason or parts["finish"]
    calls = [(n, json.loads(a)) for n, a in (parts["calls"][i] for i in sorted(parts["calls"]))]
    order = [k for i, k in enumerate(parts["order"]) if i == 0 or parts["order"][i - 1] != k]
    return {
        "reasoning": parts["reasoning"] or None,
        "content": parts["content"] or None,
        "calls": calls,
        "finish": parts["finish"],
        "order": order,
    }


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_reasoning_is_separated(scripted_server: Callable[..., Any], stream: bool) -> None:
    client = scripted_server(SCRIPT, reasoning_parser="qwen3")
    got = _ask(client, "What is 2+3?", stream)
    assert (got["reasoning"], got["content"], got["finish"]) == (THOUGHT, "The answer is 5.", "stop")
    if stream:  # the reasoning streams first, in pieces, then the answer
        assert got["order"] == ["reasoning", "content"]


def test_reasoning_parser_off_keeps_the_text_and_auto_picks_by_architecture(
    scripted_server: Callable[..., Any],
) -> None:
    client = scripted_server(SCRIPT)  # reasoning_parser = "none" by default
    r = client.chat.completions.create(model="tiny-tools", messages=[{"role": "user", "content": "2+3"}], temperature=0)
    assert r.choices[0].message.content == SCRIPT[0][1]
    assert getattr(r.choices[0].message, "reasoning_content", None) is None
    client = scripted_server(SCRIPT, reasoning_parser="auto")  # the scripted executor reports Qwen3ForCausalLM
    assert _ask(client, "2+3", False)["reasoning"] == THOUGHT


def test_chat_template_kwargs_reach_the_template(scripted_server: Callable[..., Any]) -> None:
    """``enable_thinking: false`` makes the template write the empty think block into the prompt; the
    answer then has no reasoning."""
    import httpx

    client = scripted_server(SCRIPT, reasoning_parser="qwen3")
    kwargs = {"chat_template_kwargs": {"enable_thinking": False}}
    got = _ask(client, "answer quietly", False, extra_body=kwargs)
    assert (got["reasoning"], got["content"]) == (None, "5.")
    base = str(client.base_url).removesuffix("/v1/")
    body = {"messages": [{"role": "user", "content": "hi"}], "return_token_strs": True, **kwargs}
    text = "".join(httpx.post(f"{base}/tokenize", json=body).json()["token_strs"])
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n"), text


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_reasoning_then_tool_call(scripted_server: Callable[..., Any], stream: bool) -> None:
    client = scripted_server(SCRIPT, reasoning_parser="qwen3")
    got = _ask(client, "weather in Paris?", stream, tools=[WEATHER_TOOL])
    assert got["reasoning"] == "\nI need the weather tool.\n"
    assert (got["content"], got["calls"], got["finish"]) == (None, [("get_weather", {"city": "Paris"})], "tool_calls")
