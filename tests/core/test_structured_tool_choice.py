"""The grammars of forced tool calls (``parsers/grammar.py`` and each tool parser's ``call_grammar``),
checked against hand-written outputs: a matcher over the tiny Qwen3 tokenizer accepts the calls a
model would write in each parser's syntax (and the parser reads them back), and refuses other
functions, invalid arguments, stray text, and reasoning where the prompt did not open it."""

from __future__ import annotations

import json
from typing import Any

import pytest

from pypto_serving.parsers import DeepSeekDSMLToolParser, DeepSeekV3ToolParser, HermesToolParser, ThinkReasoningParser
from pypto_serving.parsers.base import ToolParser
from pypto_serving.parsers.grammar import ToolChoiceError
from pypto_serving.request import StructuredSpec
from pypto_serving.structured import GrammarCompiler, check_spec, grammar_text

ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer", "maximum": 9}, "b": {"type": "integer"}},
            "required": ["a"],
        },
    },
}
ECHO = {"type": "function", "function": {"name": "echo", "parameters": {"type": "object"}}}
TOOLS = [ADD, ECHO]
DSML = "｜DSML｜"


def _accepts(grammar: str, text: str) -> bool:
    """Whether the grammar's matcher takes all of ``text`` and may end right after it."""
    import llguidance
    from tokenizers import Tokenizer

    model = pytest.importorskip("pypto_serving_qwen.plugin").TINY_QWEN3
    spec = StructuredSpec("lark", grammar)
    check_spec(spec)
    matcher = llguidance.LLMatcher(GrammarCompiler(model).tokenizer((2,)), grammar_text(spec), log_level=0)
    ids = Tokenizer.from_file(str(model / "tokenizer.json")).encode(text).ids
    if matcher.validate_tokens(ids) != len(ids):
        return False
    assert matcher.consume_tokens(ids)
    return bool(matcher.is_accepting())


def _grammar(parser: ToolParser, names: list[str], parallel: bool, reasoning: str | None = None) -> str:
    rules = [parser.call_grammar(names, parallel=parallel)]
    start = "start: tool_calls"
    if reasoning is not None:
        rules.append(ThinkReasoningParser(reasoning).grammar_rules())
        start = "start: reasoning tool_calls"
    return "\n".join([start, *rules])


def _hermes(name: str, args: dict[str, Any]) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(args, separators=(",", ":"))}}}\n</tool_call>'


def test_hermes_grammar_takes_valid_calls_only() -> None:
    g = _grammar(HermesToolParser(TOOLS), ["add", "echo"], parallel=True)
    one, two = _hermes("add", {"a": 3, "b": -4}), _hermes("echo", {"x": [1]})
    assert _accepts(g, one) and _accepts(g, one + "\n" + two)
    assert not _accepts(g, _hermes("add", {"a": 10}))  # a > maximum
    assert not _accepts(g, _hermes("add", {"b": 1}))  # a is required
    assert not _accepts(g, _hermes("sub", {"a": 1}))  # not an offered function
    assert not _accepts(g, "Sure. " + one)  # nothing but calls
    single = _grammar(HermesToolParser(TOOLS), ["add"], parallel=False)
    assert _accepts(single, one) and not _accepts(single, one + "\n" + one)
    content, calls = HermesToolParser(TOOLS).feed(one + "\n" + two)
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("add", {"a": 3, "b": -4}),
        ("echo", {"x": [1]}),
    ]


def test_reasoning_precedes_the_calls_as_the_prompt_says() -> None:
    parser = HermesToolParser(TOOLS)
    call = _hermes("add", {"a": 1})
    opened = _grammar(parser, ["add"], parallel=False, reasoning="<|im_start|>assistant\n<think>\n")
    assert _accepts(opened, "Let me add </think> and\n</think>\n\n" + call) is False  # ends at the first </think>
    assert _accepts(opened, "Let me add.\n</think>\n\n" + call)
    assert not _accepts(opened, call)  # the prompt opened the thinking: it must be closed first
    closed = _grammar(parser, ["add"], parallel=False, reasoning="<|im_start|>assistant\n")
    assert _accepts(closed, call) and _accepts(closed, "<think>\nhm\n</think>\n\n" + call)
    assert not _accepts(closed, "hm</think>" + call)


def test_dsml_grammar_writes_json_parameters() -> None:
    g = _grammar(DeepSeekDSMLToolParser(TOOLS), ["add", "echo"], parallel=True)
    body = (
        f'<{DSML}invoke name="add">\n<{DSML}parameter name="a" string="false">3</{DSML}parameter>\n'
        f'<{DSML}parameter name="b" string="false">-2</{DSML}parameter>\n</{DSML}invoke>'
    )
    block = f"<{DSML}tool_calls>\n{body}\n</{DSML}tool_calls>"
    assert _accepts(g, block)
    assert _accepts(g, block.replace(f'<{DSML}parameter name="b" string="false">-2</{DSML}parameter>\n', ""))
    assert not _accepts(g, block.replace(">3<", ">30<"))  # a > maximum
    assert not _accepts(g, block.replace('string="false">3', 'string="true">3'))
    echo = f'<{DSML}invoke name="echo">\n</{DSML}invoke>'
    assert _accepts(g, f"<{DSML}tool_calls>\n{body}\n{echo}\n</{DSML}tool_calls>")
    _, calls = DeepSeekDSMLToolParser(TOOLS).feed(block)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("add", {"a": 3, "b": -2})]
    any_of = {"type": "function", "function": {"name": "f", "parameters": {"anyOf": [{"type": "object"}]}}}
    with pytest.raises(ToolChoiceError, match="anyOf"):
        DeepSeekDSMLToolParser([any_of]).call_grammar(["f"], parallel=False)


def test_deepseek_v3_grammar() -> None:
    g = _grammar(DeepSeekV3ToolParser(TOOLS), ["add"], parallel=False)
    text = '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>add<｜tool▁sep｜>{"a":1}<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
    assert _accepts(g, text)
    assert not _accepts(g, text.replace('"a":1', '"b":1'))
    _, calls = DeepSeekV3ToolParser(TOOLS).feed(text)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("add", {"a": 1})]


def test_unknown_named_function_is_refused() -> None:
    with pytest.raises(ToolChoiceError, match="not among"):
        HermesToolParser(TOOLS).call_grammar(["sub"], parallel=False)
