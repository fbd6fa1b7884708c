"""A whole tool-call round trip (tools -> tool_calls -> tool message -> final answer) through the official
``openai`` SDK against a real server: a tiny random Qwen3 checkpoint served by the real Qwen executor with
the ``hermes`` parser, whose chat template renders tools, assistant calls and tool results the Qwen3 way.

The random model knows nothing of tools, so the first turn forces a call (``tool_choice`` ``required`` or
a named function) and the grammar makes it parseable; the second turn sends the call and its result back
with ``tool_choice: "none"``. That the template really rendered the round trip is read from the prompt's
token count (``usage.prompt_tokens``) and from /tokenize of the same chat, which must hold the call and
the result exactly where the template puts them."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.core.server.conftest import LiveServer
from tests.core.server.server_helpers import write_tokenizer
from tests.core.server.test_tool_choice import ADD as TOOL_CHOICE_ADD
from tests.core.server.test_tool_choice import WEATHER as TOOL_CHOICE_WEATHER

pytestmark = pytest.mark.requires_plugin("sync_sched")
pytest.importorskip("pypto_serving_qwen")
pytest.importorskip("openai")
pytest.importorskip("jsonschema")

# A Qwen3-style tools template: the tool list goes into the system turn between <tools></tools>, assistant
# calls come back as <tool_call> JSON blocks, and consecutive tool results share one user turn of
# <tool_response> blocks. Every newline is a Jinja string so the environment's trim_blocks cannot eat it.
TOOLS_TEMPLATE = (
    "{%- set has_system = messages and messages[0].role == 'system' -%}"
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if has_system -%}{{- messages[0].content ~ '\\n\\n' -}}{%- endif -%}"
    "{{- 'You can call these functions, listed inside <tools></tools>:\\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\\n' ~ (tool | tojson) -}}{%- endfor -%}"
    "{{- '\\n</tools>\\n\\nTo call one, write <tool_call></tool_call> around a JSON object with its '"
    ' ~ \'"name" and "arguments".<|im_end|>\\n\' -}}'
    "{%- elif has_system -%}"
    "{{- '<|im_start|>system\\n' ~ messages[0].content ~ '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'system' and loop.first -%}"
    "{%- elif m.role == 'tool' -%}"
    "{%- if loop.first or loop.previtem.role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\\n<tool_response>\\n' ~ m.content ~ '\\n</tool_response>' -}}"
    "{%- if loop.last or loop.nextitem.role != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- elif m.role == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' ~ (m.content or '') -}}"
    "{%- for call in m.tool_calls or [] -%}"
    "{%- set f = call.function if call.function is defined else call -%}"
    "{%- if m.content or not loop.first -%}{{- '\\n' -}}{%- endif -%}"
    "{{- '<tool_call>\\n{\"name\": ' ~ (f.name | tojson) ~ ', \"arguments\": ' -}}"
    "{%- if f.arguments is string -%}{{- f.arguments -}}{%- else -%}{{- f.arguments | tojson -}}{%- endif -%}"
    "{{- '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- else -%}"
    "{{- '<|im_start|>' ~ m.role ~ '\\n' ~ m.content ~ '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {  # test_tool_choice's function with a description, in the order the template dumps
        "name": TOOL_CHOICE_WEATHER["function"]["name"],
        "description": "The current weather in a city",
        "parameters": TOOL_CHOICE_WEATHER["function"]["parameters"],
    },
}
ADD: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": TOOL_CHOICE_ADD["function"]["name"],
        "description": "The sum of two integers",
        "parameters": TOOL_CHOICE_ADD["function"]["parameters"],
    },
}
TOOLS: list[dict[str, Any]] = [WEATHER, ADD]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
QUESTION: list[dict[str, Any]] = [{"role": "user", "content": "What is the weather in Paris, and what is 2 + 3?"}]
# Distinctive text, so finding it in the rendered prompt cannot be a coincidence.
RESULT = '{"temperature": 22, "sky": "sunny", "note": "round trip marker 4711"}'
CHOICES: dict[str, Any] = {
    "required": ("required", {"get_weather", "add"}),
    "named": ({"type": "function", "function": {"name": "add"}}, {"add"}),
}


@dataclass
class Served:
    client: Any
    url: str
    model: str
    path: Path


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """One server for the module: the checkpoint build and engine start are most of its cost."""
    import openai

    from pypto_serving import PluginManager, ServingSettings
    from pypto_serving.server import AsyncLLM, build_app
    from tests.plugins.qwen.qwen_fixtures import make_qwen_checkpoint

    # Only <|im_end|> (id 2) ends a turn: the fixture's default second EOS, id 3, is the byte "!", which a
    # forced call's string argument may sample and so end the call half-written.
    path = make_qwen_checkpoint(
        tmp_path_factory.mktemp("qwen_tools") / "tiny-qwen3-tools",
        "qwen3",
        num_hidden_layers=2,
        max_position_embeddings=2048,  # the tools system prompt alone is a few hundred byte-level tokens
        generation_config={"eos_token_id": [2]},
    )
    write_tokenizer(path, 320)  # the checkpoint's vocab_size
    config_file = path / "tokenizer_config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "chat_template": TOOLS_TEMPLATE}))
    values: dict[str, Any] = {
        "model": str(path), "device": "cpu", "dtype": "float32", "worker_mode": "inproc", "scheduler": "sync",
        "engine_mode": "thread", "tool_call_parser": "hermes", "num_kv_blocks": 256, "block_size": 16,
    }  # fmt: skip
    settings = ServingSettings(**values)
    llm = AsyncLLM(settings, PluginManager())
    llm.wait_ready(60)
    live = LiveServer(build_app(llm, manage_engine=False), llm=llm)
    client = openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0, timeout=60)
    yield Served(client, live.url, client.models.list().data[0].id, path)
    live.stop()
    llm.shutdown(10)


@dataclass
class Turn:
    role: str | None
    content: str | None
    calls: list[dict[str, Any]]  # {"id", "name", "arguments"} with arguments as the server's JSON text
    finish: str | None
    prompt_tokens: int


def _ask(served: Served, messages: list[Any], stream: bool, **kw: Any) -> Turn:
    """One chat turn, whole or streamed; a streamed answer is reassembled from its deltas."""
    kw = {"model": served.model, "messages": messages, "tools": TOOLS, "temperature": 1.0, **kw}
    if not stream:
        resp = served.client.chat.completions.create(**kw)
        (choice,) = resp.choices
        calls = [
            {"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
            for c in choice.message.tool_calls or ()
        ]
        assert all(c.type == "function" for c in choice.message.tool_calls or ())
        return Turn(choice.message.role, choice.message.content, calls, choice.finish_reason, resp.usage.prompt_tokens)
    role = content = finish = None
    parts: dict[int, dict[str, Any]] = {}
    usage = None
    for chunk in served.client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        usage = chunk.usage or usage
        for choice in chunk.choices:
            role = choice.delta.role or role
            finish = choice.finish_reason or finish
            if choice.delta.content:
                content = (content or "") + choice.delta.content
            for d in choice.delta.tool_calls or ():
                entry = parts.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                entry["id"] = d.id or entry["id"]
                entry["name"] += d.function.name or ""
                entry["arguments"] += d.function.arguments or ""
    assert usage is not None, "include_usage sends a last chunk with the usage"
    return Turn(role, content, [parts[i] for i in sorted(parts)], finish, usage.prompt_tokens)


def _tokenize(served: Served, messages: list[Any], **body: Any) -> dict[str, Any]:
    import httpx

    r = httpx.post(f"{served.url}/tokenize", json={"messages": messages, "tools": TOOLS, **body}, timeout=30)
    assert r.status_code == 200, r.text
    return dict(r.json())


def _detokenize(served: Served, tokens: list[int]) -> str:
    import httpx

    r = httpx.post(f"{served.url}/detokenize", json={"tokens": tokens}, timeout=30)
    assert r.status_code == 200, r.text
    return str(r.json()["prompt"])


def _count(served: Served, text: str) -> int:
    import httpx

    r = httpx.post(f"{served.url}/tokenize", json={"prompt": text, "add_special_tokens": False}, timeout=30)
    assert r.status_code == 200, r.text
    return int(r.json()["count"])


def _round_trip(served: Served, tool_choice: Any, allowed: set[str], stream: bool, seed: int) -> tuple[Turn, Turn]:
    import jsonschema

    call_kw: dict[str, Any] = {"tool_choice": tool_choice, "seed": seed, "max_tokens": 200}
    if tool_choice == "required":
        call_kw["parallel_tool_calls"] = False  # one call, then EOS: the cut-off-at-max_tokens case is elsewhere
    asked = _ask(served, QUESTION, stream, **call_kw)
    assert asked.finish == "tool_calls", asked
    assert asked.role == "assistant" and asked.content is None
    (call,) = asked.calls
    assert call["id"].startswith("call_")
    assert call["name"] in allowed
    arguments = json.loads(call["arguments"])
    jsonschema.validate(arguments, SCHEMAS[call["name"]])

    history: list[dict[str, Any]] = [
        *QUESTION,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call["id"],
                    "type": "function",
                    "function": {"name": call["name"], "arguments": call["arguments"]},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call["id"], "content": RESULT},
    ]
    answered = _ask(served, history, stream, tool_choice="none", seed=seed, max_tokens=8, extra_body={"min_tokens": 2})
    assert answered.role == "assistant"
    assert answered.calls == [] and answered.finish in ("stop", "length"), answered
    assert answered.content, answered  # min_tokens: the random model cannot end the turn at once

    # The template rendered the call and its result: the prompt grew by at least their tokens, and the
    # same chat through /tokenize (rendered as a chat request renders it) holds both where they belong.
    assert answered.prompt_tokens >= asked.prompt_tokens + _count(served, RESULT) + _count(served, call["arguments"])
    rendered = _tokenize(served, history)
    assert rendered["count"] == answered.prompt_tokens
    # The ids decoded together: a character the sampled arguments hold over several byte-level tokens
    # has no string of its own per token. The template writes JSON as it is, non-ASCII unescaped.
    text = _detokenize(served, rendered["tokens"])
    dumped = json.dumps(arguments, ensure_ascii=False)
    block = '<tool_call>\n{"name": ' + json.dumps(call["name"]) + ', "arguments": ' + dumped + "}\n"
    assert text.endswith(
        "<|im_start|>assistant\n" + block + "</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n" + RESULT + "\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    ), text
    assert text.count("<tool_response>") == 1 and "<tools>\n" + json.dumps(WEATHER) + "\n" in text
    return asked, answered


@pytest.mark.parametrize("choice", sorted(CHOICES))
def test_round_trip_whole_and_streamed(served: Served, choice: str) -> None:
    """The same seeded requests, whole and streamed: each turn's reassembled stream equals the whole one."""
    tool_choice, allowed = CHOICES[choice]
    seed = 7 if choice == "required" else 8
    whole = _round_trip(served, tool_choice, allowed, stream=False, seed=seed)
    streamed = _round_trip(served, tool_choice, allowed, stream=True, seed=seed)
    for w, s in zip(whole, streamed, strict=True):
        # Call ids are minted per response; everything the model produced must agree.
        strip = [{k: v for k, v in c.items() if k != "id"} for c in w.calls]
        assert [{k: v for k, v in c.items() if k != "id"} for c in s.calls] == strip
        assert (s.content, s.finish, s.prompt_tokens) == (w.content, w.finish, w.prompt_tokens)


def test_sdk_message_objects_round_trip(served: Served) -> None:
    """Agents append the SDK's own response message to the history; the server takes it as it comes
    (its null ``refusal``, ``audio``... fields included) and renders the same prompt as the plain dicts."""
    named = {"type": "function", "function": {"name": "add"}}
    first = served.client.chat.completions.create(
        model=served.model, messages=QUESTION, tools=TOOLS, tool_choice=named, temperature=1.0, seed=3, max_tokens=200
    )
    message = first.choices[0].message
    (call,) = message.tool_calls
    history = [*QUESTION, message, {"role": "tool", "tool_call_id": call.id, "content": RESULT}]
    final = served.client.chat.completions.create(
        model=served.model, messages=history, tools=TOOLS, tool_choice="none", temperature=0.0, max_tokens=4
    )
    assert final.choices[0].message.tool_calls is None
    plain = [
        *QUESTION,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": RESULT},
    ]
    assert final.usage.prompt_tokens == _tokenize(served, plain)["count"]


def test_template_matches_transformers(served: Served) -> None:
    """The checkpoint's template renders the round trip as transformers' ``apply_chat_template`` does
    with the arguments as an object (its documented form), so the server's prompt is the reference one."""
    from transformers import PreTrainedTokenizerFast

    arguments = {"a": 2, "b": 3}
    history: list[dict[str, Any]] = [
        {"role": "system", "content": "Be brief."},
        *QUESTION,
        {
            "role": "assistant",
            "content": "Let me add.",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "add", "arguments": json.dumps(arguments)}},
                {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "5"},
        {"role": "tool", "tool_call_id": "c2", "content": RESULT},
    ]
    rendered = _tokenize(served, history, return_token_strs=True)
    tok = PreTrainedTokenizerFast(tokenizer_file=str(served.path / "tokenizer.json"))  # type: ignore[no-untyped-call]
    reference_history = [
        {
            **m,
            "tool_calls": [
                {**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                for c in m["tool_calls"]
            ],
        }
        if m.get("tool_calls")
        else m
        for m in history
    ]
    reference = tok.apply_chat_template(
        reference_history, tools=list(TOOLS), chat_template=TOOLS_TEMPLATE, tokenize=False, add_generation_prompt=True
    )
    assert "".join(rendered["token_strs"]) == reference
    # Two results in a row share one user turn, as Qwen3's template writes them.
    assert reference.count("<|im_start|>user\n<tool_response>") == 1 and reference.count("<tool_response>") == 2
