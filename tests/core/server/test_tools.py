"""Tool calling through the OpenAI SDK against a real server: a checkpoint whose chat template renders
tools, tool calls and tool results (Qwen's Hermes format), and a scripted executor that answers each
turn with a fixed reply, so the round trip (tools -> tool_calls -> tool message -> answer) is exact."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from pypto_serving import BatchInput, ExecutorInfo, ExecutorSpec, hookimpl
from pypto_serving.tokenizer import Tokenizer
from tests.core.server.conftest import VOCAB, LiveServer, fake_settings
from tests.core.server.server_helpers import write_tokenizer
from tests.fakes import FakeExecutor

pytest.importorskip("openai")

IM_START, IM_END = 1, 2  # the special tokens' ids in server_helpers' tokenizer
# A Qwen-like template: tools in a system turn, assistant tool calls as <tool_call> JSON, tool results as a
# user turn with <tool_response>, and Qwen3's empty think block when enable_thinking is false.
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>"
    "{% for t in tools %}{{ '\\n' }}{{ t | tojson }}{% endfor %}"
    "{{ '\\n' }}</tools><|im_end|>{{ '\\n' }}{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant{{ '\\n' }}{{ m.content or '' }}"
    "{% for c in m.tool_calls %}<tool_call>{{ '\\n' }}"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}'
    "{{ '\\n' }}</tool_call>{% endfor %}<|im_end|>{{ '\\n' }}"
    "{% elif m.role == 'tool' %}<|im_start|>user{{ '\\n' }}<tool_response>{{ '\\n' }}{{ m.content }}"
    "{{ '\\n' }}</tool_response><|im_end|>{{ '\\n' }}"
    "{% else %}<|im_start|>{{ m.role }}{{ '\\n' }}{{ m.content }}<|im_end|>{{ '\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant{{ '\\n' }}"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>{{ '\\n\\n' }}</think>{{ '\\n\\n' }}"
    "{% endif %}{% endif %}"
)

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CALL_REPLY = (
    "I will look it up.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
)
ANSWER = "It is 22 degrees and sunny in Paris."
SCRIPT = [
    ["weather in Paris", CALL_REPLY],
    ["<tool_response>", ANSWER],
    ["two cities", CALL_REPLY + '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'],
    ["broken call", 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call>'],
]


class ScriptedExecutor(FakeExecutor):
    """Answers the last user turn with the reply of the first ``script`` trigger found in it.

    The next token continues the reply where the context's tail leaves it (the longest tail that is a
    beginning of the reply's tokens), so the reply comes out token by token whatever the scheduling."""

    def __init__(self, settings: Any) -> None:
        super().__init__(settings)
        self.tok = Tokenizer(Path(settings.model))
        self.script = [(t, [*self.tok.encode(r), IM_END]) for t, r in self.opts.get("script", [])]

    def load(self) -> ExecutorInfo:
        info = super().load()
        return dataclasses.replace(info, architecture=str(self.opts.get("architecture", "ScriptedForCausalLM")))

    def reply_token(self, ctx: list[int]) -> int:
        text = self.tok.decode(ctx, skip_special_tokens=False)
        turn = text.rpartition("<|im_start|>user\n")[2].partition("<|im_end|>")[0]
        reply = next((ids for trigger, ids in self.script if trigger in turn), [IM_END])
        for k in range(min(len(ctx), len(reply) - 1), -1, -1):
            if ctx[len(ctx) - k :] == reply[:k]:
                return reply[k]
        return IM_END

    def execute(self, batch: BatchInput) -> torch.Tensor:
        self.cache[batch.slot_mapping["kv"]] = batch.input_ids
        rows = []
        qsl, pos = batch.query_start_loc.tolist(), batch.positions.tolist()
        for r in range(len(batch.request_ids)):
            for t in range(qsl[r + 1] - batch.num_logits[r], qsl[r + 1]):
                row = torch.zeros(self.vocab)
                row[self.reply_token(self._context(batch.block_tables["kv"][r], pos[t] + 1))] = 10.0
                rows.append(row)
        return torch.stack(rows) if rows else torch.empty(0, self.vocab)


def make_scripted_executor(settings: Any) -> ScriptedExecutor:
    return ScriptedExecutor(settings)


class ScriptedPlugin:
    @staticmethod
    @hookimpl
    def pypto_serving_register_executors() -> list[ExecutorSpec]:
        return [ExecutorSpec("scripted", make_scripted_executor, ("ScriptedForCausalLM",), "scripted test replies")]


def write_tools_model(path: Path) -> Path:
    write_tokenizer(path, VOCAB)
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TOOLS_TEMPLATE}))
    (path / "config.json").write_text(json.dumps({"architectures": ["ScriptedForCausalLM"]}))
    return path


@pytest.fixture(scope="module")
def tools_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tools_model(tmp_path_factory.mktemp("tools_model") / "tiny-tools")


@pytest.fixture
def scripted_server(tools_model_dir: Path) -> Iterator[Callable[..., Any]]:
    """``scripted_server(script, **settings) -> openai.OpenAI`` on a live uvicorn server."""
    pytest.importorskip("pypto_serving_sync_sched")
    import openai

    from pypto_serving import PluginManager
    from pypto_serving.server import AsyncLLM, build_app

    made: list[tuple[LiveServer, Any]] = []

    def factory(script: list[list[str]], architecture: str = "Qwen3ForCausalLM", **overrides: Any) -> Any:
        options = {"script": script, "architecture": architecture, "eos": IM_END, "max_model_len": 512}
        settings = fake_settings(tools_model_dir, executor="scripted", executor_options=options, **overrides)
        llm = AsyncLLM(settings, PluginManager(extra_plugins=[ScriptedPlugin]))
        llm.wait_ready(60)
        server = LiveServer(build_app(llm, manage_engine=False), llm=llm)
        made.append((server, llm))
        return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)

    yield factory
    for server, llm in made:
        server.stop()
        llm.shutdown(10)


def _ask(client: Any, messages: list[dict[str, Any]], stream: bool, **kw: Any) -> tuple[Any, str]:
    """(the assistant message, the finish reason), streamed responses put together the way a client does."""
    if not stream:
        r = client.chat.completions.create(model="tiny-tools", messages=messages, temperature=0, **kw)
        return r.choices[0].message, r.choices[0].finish_reason
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(
        model="tiny-tools", messages=messages, temperature=0, stream=True, **kw
    ):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or ():
            if tc.id is not None:  # the first delta of a call: id, type and name, no arguments yet
                assert tc.index not in calls and tc.type == "function" and tc.function.arguments == ""
                calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": ""}
            else:
                calls[tc.index]["arguments"] += tc.function.arguments
        finish = chunk.choices[0].finish_reason or finish
    message = {"content": content or None, "tool_calls": [calls[i] for i in sorted(calls)]}
    return message, str(finish)


def _calls(message: Any) -> list[dict[str, Any]]:
    if isinstance(message, dict):
        return [
            {"name": c["name"], "arguments": json.loads(c["arguments"]), "id": c["id"]} for c in message["tool_calls"]
        ]
    return [
        {"name": c.function.name, "arguments": json.loads(c.function.arguments), "id": c.id}
        for c in message.tool_calls or ()
    ]


def _content(message: Any) -> str | None:
    return message["content"] if isinstance(message, dict) else message.content


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_tool_call_round_trip(scripted_server: Callable[..., Any], stream: bool) -> None:
    client = scripted_server(SCRIPT)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What is the weather in Paris?"}]
    message, finish = _ask(client, messages, stream, tools=[WEATHER_TOOL])
    calls = _calls(message)
    assert finish == "tool_calls"
    assert _content(message) == "I will look it up."
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_weather", {"city": "Paris", "unit": "celsius"})]
    assert calls[0]["id"].startswith("call_")
    messages += [
        {
            "role": "assistant",
            "content": _content(message),
            "tool_calls": [
                {
                    "id": c["id"],
                    "type": "function",
                    "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])},
                }
                for c in calls
            ],
        },
        {"role": "tool", "tool_call_id": calls[0]["id"], "content": '{"temperature": 22, "sky": "sunny"}'},
    ]
    answer, finish = _ask(client, messages, stream, tools=[WEATHER_TOOL])
    assert (_content(answer), finish, _calls(answer)) == (ANSWER, "stop", [])


def test_tool_messages_render_through_the_template(scripted_server: Callable[..., Any]) -> None:
    """/tokenize renders chat messages as chat completions does: the assistant's call (arguments sent
    as JSON text) and the tool result reach the template as Qwen's template expects them."""
    import httpx

    client = scripted_server(SCRIPT)
    messages = [
        {"role": "user", "content": "weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    base = str(client.base_url).removesuffix("/v1/")
    r = httpx.post(f"{base}/tokenize", json={"messages": messages, "tools": [WEATHER_TOOL], "return_token_strs": True})
    assert r.status_code == 200, r.text
    text = "".join(r.json()["token_strs"])
    expected = (
        "<|im_start|>system\n# Tools\n<tools>\n"
        + json.dumps(WEATHER_TOOL, ensure_ascii=False)
        + "\n</tools><|im_end|>\n"
        "<|im_start|>user\nweather in Paris?<|im_end|>\n"
        "<|im_start|>assistant\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert text == expected


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_parallel_calls_and_the_parallel_tool_calls_switch(scripted_server: Callable[..., Any], stream: bool) -> None:
    client = scripted_server(SCRIPT)
    messages = [{"role": "user", "content": "weather in two cities"}]
    message, finish = _ask(client, messages, stream, tools=[WEATHER_TOOL])
    assert finish == "tool_calls"
    assert [c["arguments"]["city"] for c in _calls(message)] == ["Paris", "Rome"]
    assert len({c["id"] for c in _calls(message)}) == 2
    message, _ = _ask(client, messages, stream, tools=[WEATHER_TOOL], parallel_tool_calls=False)
    assert [c["arguments"]["city"] for c in _calls(message)] == ["Paris"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_malformed_call_is_content(scripted_server: Callable[..., Any], stream: bool) -> None:
    client = scripted_server(SCRIPT)
    message, finish = _ask(client, [{"role": "user", "content": "a broken call"}], stream, tools=[WEATHER_TOOL])
    assert (_content(message), finish, _calls(message)) == (SCRIPT[3][1], "stop", [])


def test_tool_choice_none_and_no_tools_leave_the_text_alone(scripted_server: Callable[..., Any]) -> None:
    client = scripted_server(SCRIPT)
    messages = [{"role": "user", "content": "weather in Paris"}]
    for kw in ({"tools": [WEATHER_TOOL], "tool_choice": "none"}, {}):
        message, finish = _ask(client, messages, False, **kw)
        assert (message.content, finish, message.tool_calls) == (CALL_REPLY, "stop", None), kw


def test_forced_tool_choice_needs_a_parser(scripted_server: Callable[..., Any]) -> None:
    """``tool_choice: "required"`` and a named function are kept by a grammar in the tool parser's
    syntax: with ``tool_call_parser = "none"`` there is none, so they are a 400 naming ``tool_choice``."""
    import openai

    client = scripted_server(SCRIPT, tool_call_parser="none")
    messages = [{"role": "user", "content": "weather in Paris"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice in ("required", named):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(
                model="tiny-tools", messages=messages, tools=[WEATHER_TOOL], tool_choice=choice
            )
        assert e.value.body["param"] == "tool_choice" and "tool_call_parser" in str(e.value), choice


def test_parser_by_setting_and_by_architecture(scripted_server: Callable[..., Any]) -> None:
    """``auto`` finds no parser for an unknown architecture (a clear 400), a named parser serves any."""
    import openai

    messages = [{"role": "user", "content": "weather in Paris"}]
    client = scripted_server(SCRIPT, architecture="ScriptedForCausalLM")
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny-tools", messages=messages, tools=[WEATHER_TOOL])
    assert "tool_call_parser" in str(e.value)
    client = scripted_server(SCRIPT, architecture="ScriptedForCausalLM", tool_call_parser="hermes")
    message, finish = _ask(client, messages, False, tools=[WEATHER_TOOL])
    assert finish == "tool_calls" and _calls(message)[0]["arguments"] == {"city": "Paris", "unit": "celsius"}


def test_unknown_parser_name_fails_at_start(tools_model_dir: Path) -> None:
    from pypto_serving import PluginError, PluginManager
    from pypto_serving.server import AsyncLLM, build_app

    settings = fake_settings(tools_model_dir, executor="scripted", tool_call_parser="nope")
    llm = AsyncLLM(settings, PluginManager(extra_plugins=[ScriptedPlugin]))
    with pytest.raises(PluginError, match="unknown tool parser 'nope'"):
        build_app(llm, manage_engine=False)


def test_each_streamed_choice_parses_its_own_calls(scripted_server: Callable[..., Any]) -> None:
    """With n=2 every choice has its own parser: each streams its two calls with call indices 0 and 1."""
    client = scripted_server(SCRIPT)
    args: dict[int, dict[int, str]] = {}
    finish: dict[int, str] = {}
    usage = None
    for chunk in client.chat.completions.create(
        model="tiny-tools",
        messages=[{"role": "user", "content": "weather in two cities"}],
        tools=[WEATHER_TOOL],
        n=2,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    ):
        usage = chunk.usage or usage
        for choice in chunk.choices:
            for tc in choice.delta.tool_calls or ():
                calls = args.setdefault(choice.index, {})
                calls[tc.index] = calls.get(tc.index, "") + (tc.function.arguments or "")
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    cities = {i: [json.loads(a)["city"] for _, a in sorted(calls.items())] for i, calls in args.items()}
    assert cities == {0: ["Paris", "Rome"], 1: ["Paris", "Rome"]}
    assert finish == {0: "tool_calls", 1: "tool_calls"}
    assert usage is not None and usage.completion_tokens > 0


DSML_REPLY = (
    '<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n'
    '<｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>\n'
    '<｜DSML｜parameter name="days" string="false">2</｜DSML｜parameter>\n'
    "</｜DSML｜invoke>\n</｜DSML｜tool_calls>"
)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_deepseek_v4_architecture_picks_the_dsml_parser(scripted_server: Callable[..., Any], stream: bool) -> None:
    client = scripted_server([["weather in Paris", DSML_REPLY]], architecture="DeepseekV4ForCausalLM")
    message, finish = _ask(client, [{"role": "user", "content": "weather in Paris"}], stream, tools=[WEATHER_TOOL])
    assert finish == "tool_calls" and _content(message) is None
    assert [(c["name"], c["arguments"]) for c in _calls(message)] == [("get_weather", {"city": "Paris", "days": 2})]


def test_tool_choice_and_parallel_calls_reach_the_template(
    scripted_server: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With tools, the template gets ``tool_choice`` and ``parallel_tool_calls`` as sent (a named
    function as its object), and ``chat_template_kwargs`` override them."""
    from pypto_serving.tokenizer import Tokenizer

    seen: list[dict[str, Any]] = []
    render = Tokenizer.apply_chat_template

    def recording(
        self: Tokenizer, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kw: Any
    ) -> str:
        seen.append(kw)
        return render(self, messages, add_generation_prompt, **kw)

    monkeypatch.setattr(Tokenizer, "apply_chat_template", recording)
    client = scripted_server(SCRIPT)
    ask = [{"role": "user", "content": "weather in Paris?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    client.chat.completions.create(
        model="tiny-tools", messages=ask, tools=[WEATHER_TOOL], tool_choice="auto", max_tokens=4
    )
    client.chat.completions.create(
        model="tiny-tools",
        messages=ask,
        tools=[WEATHER_TOOL],
        tool_choice=named,
        parallel_tool_calls=False,
        max_tokens=4,
    )
    client.chat.completions.create(
        model="tiny-tools",
        messages=ask,
        tools=[WEATHER_TOOL],
        parallel_tool_calls=True,
        max_tokens=4,
        extra_body={"chat_template_kwargs": {"parallel_tool_calls": "from kwargs"}},
    )
    client.chat.completions.create(model="tiny-tools", messages=ask, max_tokens=4)
    picked = [{k: kw.get(k) for k in ("tool_choice", "parallel_tool_calls")} for kw in seen]
    assert picked == [
        {"tool_choice": "auto", "parallel_tool_calls": None},
        {"tool_choice": named, "parallel_tool_calls": False},
        {"tool_choice": None, "parallel_tool_calls": "from kwargs"},
        {"tool_choice": None, "parallel_tool_calls": None},
    ]
