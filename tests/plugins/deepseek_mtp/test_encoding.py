"""DeepSeek-V4's chat encoding against hand-written prompts of the release's documented examples
(its encoding README and test conversations), the core's ``deepseek_v4`` parsers reading back what it
writes, and its selection for a DeepSeek-V4 checkpoint without a chat template."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from pypto_serving import PluginManager
from pypto_serving.parsers import DeepSeekDSMLToolParser
from pypto_serving.parsers.reasoning import ThinkReasoningParser
from pypto_serving.tokenizer import load_tokenizer
from pypto_serving_deepseek_mtp.encoding import DeepSeekV4ChatEncoder, encode_messages
from pypto_serving_deepseek_mtp.plugin import TINY_DEEPSEEK_V4

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the weather of a city",
        "parameters": {
            "type": "object",
            "properties": {
                "location": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["location"],
        },
    },
}

# The tool section as the release's README shows it, written out by hand.
TOOLS_TEXT = (
    "## Tools\n\nYou have access to a set of tools to help answer the user's question. You can invoke tools "
    'by writing a "<｜DSML｜tool_calls>" block like the following:\n\n<｜DSML｜tool_calls>\n'
    '<｜DSML｜invoke name="$TOOL_NAME">\n<｜DSML｜parameter name="$PARAMETER_NAME" string="true|false">'
    '$PARAMETER_VALUE</｜DSML｜parameter>\n...\n</｜DSML｜invoke>\n<｜DSML｜invoke name="$TOOL_NAME2">\n...\n'
    "</｜DSML｜invoke>\n</｜DSML｜tool_calls>\n\nString parameters should be specified as is and set "
    '`string="true"`. For all other types (numbers, booleans, arrays, objects), pass the value in JSON format '
    'and set `string="false"`.\n\nIf thinking_mode is enabled (triggered by <think>), you MUST output your '
    "complete reasoning inside <think>...</think> BEFORE any tool calls or final response.\n\nOtherwise, "
    "output directly after </think> with tool calls or final response.\n\n### Available Tool Schemas\n\n"
    '{"name": "get_weather", "description": "Get the weather of a city", "parameters": {"type": "object", '
    '"properties": {"location": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", '
    '"fahrenheit"]}}, "required": ["location"]}}\n\n'
    "You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n"
)

SYSTEM_USER = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is 2+2?"},
]


def test_system_and_user_in_thinking_and_chat_mode() -> None:
    """The README's quick start: the prompt opens the thinking, or closes it in chat mode."""
    head = f"{BOS}You are a helpful assistant.<｜User｜>What is 2+2?<｜Assistant｜>"
    assert encode_messages(SYSTEM_USER, thinking=True) == head + "<think>"
    assert encode_messages(SYSTEM_USER) == head + "</think>"
    assert encode_messages(SYSTEM_USER, add_generation_prompt=False) == head[: -len("<｜Assistant｜>")]


MULTI_TURN = [
    {"role": "user", "content": "hello"},
    {"role": "assistant", "reasoning_content": "The user said hello.", "content": "Hello! How can I help?"},
    {"role": "user", "content": "What is the capital of France?"},
]


def test_multi_turn_thinking_drops_the_reasoning_of_earlier_turns() -> None:
    answer = {
        "role": "assistant",
        "reasoning_content": "The user asks about the capital of France. It is Paris.",
        "content": "The capital of France is Paris.",
    }
    expected = (
        f"{BOS}<｜User｜>hello<｜Assistant｜></think>Hello! How can I help?{EOS}"
        "<｜User｜>What is the capital of France?<｜Assistant｜><think>"
    )
    assert encode_messages(MULTI_TURN, thinking=True) == expected
    last = "The user asks about the capital of France. It is Paris.</think>The capital of France is Paris." + EOS
    assert encode_messages([*MULTI_TURN, answer], thinking=True) == expected + last
    kept = encode_messages(MULTI_TURN, thinking=True, drop_thinking=False)
    assert kept == (
        f"{BOS}<｜User｜>hello<｜Assistant｜><think>The user said hello.</think>Hello! How can I help?{EOS}"
        "<｜User｜>What is the capital of France?<｜Assistant｜><think>"
    )
    chat = encode_messages(MULTI_TURN)  # chat mode never shows reasoning
    assert chat == (
        f"{BOS}<｜User｜>hello<｜Assistant｜></think>Hello! How can I help?{EOS}"
        "<｜User｜>What is the capital of France?<｜Assistant｜></think>"
    )


def _weather_conversation() -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What's the weather in Beijing?"},
        {
            "role": "assistant",
            "reasoning_content": "The user wants to know the weather in Beijing. I should use the get_weather tool.",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"location": "Beijing", "unit": "celsius"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 22, "condition": "sunny"}'},
        {
            "role": "assistant",
            "reasoning_content": "Got the weather data. Let me format a nice response.",
            "content": "It is 22°C and sunny in Beijing.",
        },
    ]


def test_a_tool_call_and_its_result_in_dsml() -> None:
    """The release's tool example: tools in the system turn, the call as DSML, the result folded into a
    user turn; with tools every turn keeps its reasoning."""
    expected = (
        f"{BOS}You are a helpful assistant.\n\n{TOOLS_TEXT}"
        "<｜User｜>What's the weather in Beijing?<｜Assistant｜><think>"
        "The user wants to know the weather in Beijing. I should use the get_weather tool.</think>\n\n"
        '<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n'
        '<｜DSML｜parameter name="location" string="true">Beijing</｜DSML｜parameter>\n'
        '<｜DSML｜parameter name="unit" string="true">celsius</｜DSML｜parameter>\n'
        f"</｜DSML｜invoke>\n</｜DSML｜tool_calls>{EOS}"
        '<｜User｜><tool_result>{"temperature": 22, "condition": "sunny"}</tool_result><｜Assistant｜><think>'
        f"Got the weather data. Let me format a nice response.</think>It is 22°C and sunny in Beijing.{EOS}"
    )
    assert encode_messages(_weather_conversation(), thinking=True, tools=[WEATHER_TOOL]) == expected
    # Without a system turn the tools get an empty one; the server hands templates dict arguments.
    convo = _weather_conversation()[1:4]
    convo[1]["tool_calls"][0]["function"]["arguments"] = {"location": "Beijing", "unit": "celsius"}
    prompt = encode_messages(convo, tools=[WEATHER_TOOL])
    assert prompt.startswith(
        f"{BOS}\n\n{TOOLS_TEXT}<｜User｜>What's the weather in Beijing?<｜Assistant｜></think>\n\n"
    )
    assert prompt.endswith(
        f'{EOS}<｜User｜><tool_result>{{"temperature": 22, "condition": "sunny"}}</tool_result><｜Assistant｜></think>'
    )


def test_tool_results_follow_the_call_order_and_user_text_joins_them() -> None:
    calls = [{"id": i, "function": {"name": n, "arguments": "{}"}} for i, n in (("a", "first"), ("b", "second"))]
    messages = [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "b", "content": "B"},
        {"role": "tool", "tool_call_id": "a", "content": "A"},
        {"role": "user", "content": "and now?"},
    ]
    prompt = encode_messages(messages)
    assert prompt.endswith(
        '<｜DSML｜invoke name="first">\n\n</｜DSML｜invoke>\n<｜DSML｜invoke name="second">\n\n</｜DSML｜invoke>\n'
        f"</｜DSML｜tool_calls>{EOS}<｜User｜><tool_result>A</tool_result>\n\n<tool_result>B</tool_result>\n\n"
        "and now?<｜Assistant｜></think>"
    )


def test_reasoning_effort_and_bad_input_are_named() -> None:
    assert encode_messages(SYSTEM_USER, thinking=True, reasoning_effort="max").startswith(
        BOS + "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    )
    assert encode_messages(SYSTEM_USER, reasoning_effort="max") == encode_messages(SYSTEM_USER)  # chat mode
    assert encode_messages(SYSTEM_USER, thinking=True, reasoning_effort="high") == encode_messages(
        SYSTEM_USER, thinking=True
    )
    with pytest.raises(ValueError, match="reasoning_effort 'extreme'"):
        encode_messages(SYSTEM_USER, reasoning_effort="extreme")
    with pytest.raises(ValueError, match="no role 'narrator'"):
        encode_messages([{"role": "narrator", "content": "x"}])


ARGS = {"city": "Paris", "days": 3, "units": ["c", "f"], "opts": {"rain": True}, "note": 'a "quoted" <tag>'}


@pytest.mark.parametrize("thinking", [True, False])
def test_the_deepseek_v4_parsers_read_back_what_the_encoder_writes(thinking: bool) -> None:
    """An assistant turn as the encoder writes it, fed to the core's ``deepseek_v4`` reasoning and tool
    parsers as if generated after the prompt, gives back its reasoning, answer and arguments."""
    call = {"id": "c1", "function": {"name": "plan_trip", "arguments": json.dumps(ARGS)}}
    turn = {"role": "assistant", "reasoning_content": "Plan it.", "content": "Sure.", "tool_calls": [call]}
    prompt = encode_messages(MULTI_TURN, thinking=thinking)
    full = encode_messages([*MULTI_TURN, turn], thinking=thinking)
    assert full.startswith(prompt) and full.endswith(EOS)
    generated = full[len(prompt) : -len(EOS)]
    reasoning_parser = ThinkReasoningParser(prompt)
    reasoning, content = reasoning_parser.feed(generated)
    r2, c2 = reasoning_parser.finish()
    assert reasoning + r2 == ("Plan it." if thinking else "")
    tool_parser = DeepSeekDSMLToolParser([])
    text, calls = tool_parser.feed(content + c2)
    rest, more = tool_parser.finish()
    assert text + rest == "Sure."
    assert [(c.name, json.loads(c.arguments)) for c in calls + more] == [("plan_trip", ARGS)]


def _checkpoint(tmp_path: Path, *, template: bool, architecture: str = "DeepseekV4ForCausalLM") -> Path:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TINY_DEEPSEEK_V4 / name, tmp_path / name)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    if not template:
        del cfg["chat_template"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    (tmp_path / "config.json").write_text(json.dumps({"architectures": [architecture]}))
    return tmp_path


def test_a_deepseek_v4_checkpoint_without_a_template_chats_with_the_encoder(tmp_path: Path) -> None:
    plugins = PluginManager()
    model = _checkpoint(tmp_path, template=False)
    encoder = plugins.chat_encoder(str(model))
    assert isinstance(encoder, DeepSeekV4ChatEncoder)
    tok = load_tokenizer(model, encoder)
    assert tok is not None and tok.can_chat
    kwargs: dict[str, Any] = {"thinking": True, "tools": [WEATHER_TOOL], "tool_choice": "auto"}
    assert tok.apply_chat_template(SYSTEM_USER, **kwargs) == encode_messages(
        SYSTEM_USER, thinking=True, tools=[WEATHER_TOOL]
    )
    assert tok.apply_chat_template(SYSTEM_USER, enable_thinking=True).endswith("<｜Assistant｜><think>")
    assert tok.apply_chat_template(SYSTEM_USER).endswith("<｜Assistant｜></think>")


def test_a_chat_template_wins_and_other_architectures_get_no_encoder(tmp_path: Path) -> None:
    plugins = PluginManager()
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    with_template = _checkpoint(tmp_path / "a", template=True)
    tok = load_tokenizer(with_template, plugins.chat_encoder(str(with_template)))
    assert tok is not None
    assert tok.apply_chat_template(SYSTEM_USER).startswith("<|im_start|>system\n")
    qwen = _checkpoint(tmp_path / "b", template=False, architecture="Qwen3ForCausalLM")
    assert plugins.chat_encoder(str(qwen)) is None
    tok = load_tokenizer(qwen, plugins.chat_encoder(str(qwen)))
    assert tok is not None and not tok.can_chat
    assert plugins.chat_encoder(None) is None


@pytest.mark.requires_plugin("sync_sched")
def test_the_server_renders_chats_of_a_template_less_checkpoint_with_the_encoder(tmp_path: Path) -> None:
    """Through ``/tokenize`` and ``/v1/chat/completions``: the release ships no template, and the
    prompt is the encoder's (thinking switched by ``chat_template_kwargs``, tools in DSML's section)."""
    from fastapi.testclient import TestClient

    from pypto_serving import ServingSettings
    from pypto_serving.server import AsyncLLM, build_app

    model = tmp_path / "v4"
    shutil.copytree(TINY_DEEPSEEK_V4, model)
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (model / "tokenizer_config.json").write_text(json.dumps(cfg))
    settings = ServingSettings(
        model=str(model), device="cpu", dtype="float32", worker_mode="inproc", engine_mode="thread", scheduler="sync"
    )
    llm = AsyncLLM(settings)
    llm.wait_ready(60)
    try:
        with TestClient(build_app(llm, manage_engine=False)) as client:
            body: dict[str, Any] = {"messages": SYSTEM_USER, "chat_template_kwargs": {"thinking": True}}
            tok = client.post("/tokenize", json={**body, "tools": [WEATHER_TOOL]})
            assert tok.status_code == 200, tok.text
            tokenizer = load_tokenizer(model)
            assert tokenizer is not None
            expected = encode_messages(SYSTEM_USER, thinking=True, tools=[WEATHER_TOOL])
            assert tok.json()["tokens"] == tokenizer.encode(expected)
            chat = client.post("/v1/chat/completions", json={**body, "max_tokens": 3, "temperature": 0})
            assert chat.status_code == 200, chat.text
            assert chat.json()["usage"]["prompt_tokens"] == len(
                tokenizer.encode(encode_messages(SYSTEM_USER, thinking=True))
            )
    finally:
        llm.shutdown(10)
