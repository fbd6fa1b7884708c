"""``tool_choice: auto`` grammars (issue 25 item 10): a ``strict`` tool's arguments and
``parallel_tool_calls: false`` were accepted and ignored (the server dropped every call after the
first). The grammar now allows free text, or free text up to the first call tag and then calls in
the parser's syntax with arguments valid against the schema (one of them without parallel calls):
checked against hand-written outputs with a matcher over the tiny Qwen3 tokenizer, and end to end
(the request carries the grammar to the engine)."""

from __future__ import annotations

from typing import Any

import pytest

from pypto_serving.parsers import DeepSeekDSMLToolParser, DeepSeekV3ToolParser, HermesToolParser, ThinkReasoningParser
from pypto_serving.parsers.base import ToolParser
from pypto_serving.parsers.grammar import auto_calls_grammar
from tests.core.test_structured_tool_choice import DSML, TOOLS, _accepts, _hermes


def _auto(parser: Any, parallel: bool, reasoning: str | None = None) -> str:
    tag = parser.tags[0][0]
    rules = [auto_calls_grammar(parser.call_grammar(["add", "echo"], parallel=parallel, opened=tag), tag)]
    start = "start: answer"
    if reasoning is not None:
        rules.append(ThinkReasoningParser(reasoning).grammar_rules())
        start = "start: reasoning answer"
    return "\n".join([start, *rules])


def test_hermes_auto_takes_text_or_valid_calls() -> None:
    g = _auto(HermesToolParser(TOOLS), parallel=True)
    call, other = _hermes("add", {"a": 1, "b": 2}), _hermes("echo", {"x": "y"})
    assert _accepts(g, "Paris is sunny < 30 degrees today.")
    assert _accepts(g, call)
    assert _accepts(g, f"Let me add.\n{call}")
    assert _accepts(g, f"{call}\n{other}")
    assert _accepts(g, '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>')  # its own style
    assert not _accepts(g, f"Let me add.\n{_hermes('add', {'a': 10})}")  # a > maximum: strict
    assert not _accepts(g, _hermes("add", {"b": 2}))  # a is required
    assert not _accepts(g, _hermes("sub", {"a": 1}))  # not a tool


def test_hermes_auto_without_parallel_calls_takes_one() -> None:
    g = _auto(HermesToolParser(TOOLS), parallel=False)
    call = _hermes("add", {"a": 1})
    assert _accepts(g, f"Sure.\n{call}")
    assert not _accepts(g, f"{call}\n{call}")  # the old server parsed both and dropped the second
    assert not _accepts(g, f"{call} and more text")


def test_auto_after_reasoning() -> None:
    g = _auto(HermesToolParser(TOOLS), parallel=False, reasoning="<|im_start|>assistant\n<think>\n")
    assert _accepts(g, f"I should add.</think>\n\n{_hermes('add', {'a': 1})}")
    assert _accepts(g, "I should not.</think>\n\nNo tool needed.")


@pytest.mark.parametrize("parser", [DeepSeekDSMLToolParser(TOOLS), DeepSeekV3ToolParser(TOOLS)])
def test_block_syntaxes_under_auto(parser: ToolParser) -> None:
    g = _auto(parser, parallel=False)
    if isinstance(parser, DeepSeekDSMLToolParser):
        param = f'<{DSML}parameter name="a" string="false">{{}}</{DSML}parameter>'
        block = f'<{DSML}tool_calls>\n<{DSML}invoke name="add">\n{param}\n</{DSML}invoke>\n</{DSML}tool_calls>'
    else:
        call = '<｜tool▁call▁begin｜>add<｜tool▁sep｜>{{"a":{}}}<｜tool▁call▁end｜>'
        block = f"<｜tool▁calls▁begin｜>{call}<｜tool▁calls▁end｜>"
    assert _accepts(g, "No call.")
    assert _accepts(g, "One call: " + block.format(3))
    assert not _accepts(g, "One call: " + block.format(30))


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "strict": True,
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


@pytest.fixture(scope="module")
def qwen_client() -> Any:
    pytest.importorskip("pypto_serving_sync_sched")
    from fastapi.testclient import TestClient

    from pypto_serving import PluginManager, ServingSettings
    from pypto_serving.server import AsyncLLM, build_app

    model = pytest.importorskip("pypto_serving_qwen.plugin").TINY_QWEN3
    settings = ServingSettings(
        model=str(model), device="cpu", worker_mode="inproc", scheduler="sync", engine_mode="thread"
    )
    llm = AsyncLLM(settings, PluginManager())
    llm.wait_ready(60)
    with TestClient(build_app(llm, manage_engine=False), raise_server_exceptions=False) as c:
        yield c, llm
    llm.shutdown(10)


LOOSE = {**WEATHER, "function": {**WEATHER["function"], "strict": False}}


@pytest.mark.parametrize(
    ("tool", "parallel", "constrained"), [(WEATHER, None, True), (LOOSE, False, True), (LOOSE, None, False)]
)
def test_auto_requests_carry_the_grammar(qwen_client: Any, tool: Any, parallel: Any, constrained: bool) -> None:
    """The spec reaches the engine (the old server sent none), and the answer is a 200."""
    client, llm = qwen_client
    sent: list[Any] = []
    real = llm.generate

    def recording(rid: str, prompt: Any, params: Any) -> Any:
        sent.append(params.structured)
        return real(rid, prompt, params)

    llm.generate = recording
    try:
        body: dict[str, Any] = {"messages": [{"role": "user", "content": "weather?"}], "tools": [tool], "max_tokens": 8}
        if parallel is not None:
            body["parallel_tool_calls"] = parallel
        r = client.post("/v1/chat/completions", json=body)
    finally:
        del llm.generate
    assert r.status_code == 200, r.text
    assert len(sent) == 1
    assert (sent[0] is not None and sent[0].kind == "lark" and "before[lazy]" in sent[0].source) is constrained
