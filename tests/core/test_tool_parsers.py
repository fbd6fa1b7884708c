"""Tool-call parsers on real Qwen3 and DeepSeek V4 output: whole, and streamed in two pieces split at
every character boundary (the streamed pieces must add up to exactly the whole result, and a call is
never released before it is complete); malformed calls come back as content, unchanged."""

from __future__ import annotations

import json

import pytest

from pypto_serving.parsers import (
    DeepSeekDSMLToolParser,
    DeepSeekV3ToolParser,
    HermesToolParser,
    ParsedToolCall,
    ToolParser,
)

# Qwen3-8B's output for "What's the weather in Paris and in Rome?" with a get_weather tool.
QWEN3_TWO_CALLS = (
    "I'll check the weather in both cities for you.\n"
    "<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
    "</tool_call>\n"
    "<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Rome", "unit": "celsius"}}\n'
    "</tool_call>"
)
QWEN3_CALLS = [
    ParsedToolCall("get_weather", '{"city": "Paris", "unit": "celsius"}'),
    ParsedToolCall("get_weather", '{"city": "Rome", "unit": "celsius"}'),
]
D = "｜DSML｜"
# DeepSeek V4's DSML, as its encoding documents it: string="true" raw text, string="false" JSON.
DEEPSEEK_V4_CALLS = (
    "Let me look that up.\n\n"
    f"<{D}tool_calls>\n"
    f'<{D}invoke name="get_weather">\n'
    f'<{D}parameter name="city" string="true">San Francisco, CA</{D}parameter>\n'
    f'<{D}parameter name="days" string="false">3</{D}parameter>\n'
    f'<{D}parameter name="units" string="false">{{"temp": "F", "wind": ["mph"]}}</{D}parameter>\n'
    f"</{D}invoke>\n"
    f'<{D}invoke name="get_time">\n'
    f"</{D}invoke>\n"
    f"</{D}tool_calls>"
)
DEEPSEEK_CALLS = [
    ParsedToolCall(
        "get_weather",
        json.dumps({"city": "San Francisco, CA", "days": 3, "units": {"temp": "F", "wind": ["mph"]}}),
    ),
    ParsedToolCall("get_time", "{}"),
]
DEEPSEEK_V32_CALL = (
    f'<{D}function_calls>\n<{D}invoke name="search">\n<{D}parameter name="q" string="true">a < b & "c"'
    f"</{D}parameter>\n</{D}invoke>\n</{D}function_calls>"
)

# DeepSeek V3 / R1 (the type, then the name and fenced JSON) and V3.1 (the name, then bare JSON), as their
# chat templates write an assistant's tool calls.
V3_BEGIN, V3_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
V3_CALL, V3_SEP, V3_CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
DEEPSEEK_V3_CALLS = (
    f"{V3_BEGIN}{V3_CALL}function{V3_SEP}get_weather\n```json\n"
    f'{{"city": "Paris", "unit": "celsius"}}\n```{V3_CALL_END}\n'
    f"{V3_CALL}function{V3_SEP}get_time\n```json\n{{}}\n```{V3_CALL_END}{V3_END}"
)
DEEPSEEK_V31_CALLS = f'Checking.{V3_BEGIN}{V3_CALL}get_weather{V3_SEP}{{"city": "Paris"}}{V3_CALL_END}{V3_END}'


def whole(parser: ToolParser, text: str) -> tuple[str, list[ParsedToolCall]]:
    content, calls = parser.feed(text)
    rest, more = parser.finish()
    return content + rest, calls + more


def streamed(parser: ToolParser, pieces: list[str]) -> tuple[str, list[ParsedToolCall], list[int]]:
    """Content, calls, and for each call the index of the piece that released it."""
    content, calls, released_at = "", [], []
    for i, piece in enumerate(pieces):
        c, new = parser.feed(piece)
        content += c
        calls += new
        released_at += [i] * len(new)
    c, new = parser.finish()
    return content + c, calls + new, released_at + [len(pieces)] * len(new)


CASES = [
    (HermesToolParser, QWEN3_TWO_CALLS, "I'll check the weather in both cities for you.", QWEN3_CALLS),
    (DeepSeekDSMLToolParser, DEEPSEEK_V4_CALLS, "Let me look that up.", DEEPSEEK_CALLS),
    (DeepSeekDSMLToolParser, DEEPSEEK_V32_CALL, "", [ParsedToolCall("search", '{"q": "a < b & \\"c\\""}')]),
    (
        DeepSeekV3ToolParser,
        DEEPSEEK_V3_CALLS,
        "",
        [ParsedToolCall("get_weather", '{"city": "Paris", "unit": "celsius"}'), ParsedToolCall("get_time", "{}")],
    ),
    (DeepSeekV3ToolParser, DEEPSEEK_V31_CALLS, "Checking.", [ParsedToolCall("get_weather", '{"city": "Paris"}')]),
]
IDS = ["qwen3", "deepseek_v4", "deepseek_v32", "deepseek_v3", "deepseek_v31"]


@pytest.mark.parametrize(("cls", "text", "content", "calls"), CASES, ids=IDS)
def test_whole_output(cls: type[ToolParser], text: str, content: str, calls: list[ParsedToolCall]) -> None:
    assert whole(cls(), text) == (content, calls)


@pytest.mark.parametrize(("cls", "text", "content", "calls"), CASES, ids=IDS)
def test_split_at_every_boundary(cls: type[ToolParser], text: str, content: str, calls: list[ParsedToolCall]) -> None:
    for cut in range(len(text) + 1):
        got_content, got_calls, released_at = streamed(cls(), [text[:cut], text[cut:]])
        assert (got_content, got_calls) == (content, calls), cut
        # A call is complete only once its block closes: before that cut, it is not released.
        closing = ("</tool_call>", f"</{D}tool_calls>", f"</{D}function_calls>", V3_END)
        ends = [text.index(e) + len(e) for e in closing if e in text]
        for at in released_at:
            assert at == 1 or cut >= min(ends), (cut, released_at)


@pytest.mark.parametrize(("cls", "text", "content", "calls"), CASES, ids=IDS)
def test_one_character_at_a_time(cls: type[ToolParser], text: str, content: str, calls: list[ParsedToolCall]) -> None:
    parser = cls()
    got, released = "", []
    for ch in text:
        c, new = parser.feed(ch)
        got += c
        released += new
        assert "<" not in c  # no tag leaks into content
    c, new = parser.finish()
    assert (got + c, released + new) == (content, calls)


def test_content_without_calls_is_unchanged() -> None:
    text = "Plain answer with <tool and <｜DSML｜ look-alikes, a <b>tag</b>, and trailing space \n "
    for cls in (HermesToolParser, DeepSeekDSMLToolParser, DeepSeekV3ToolParser):
        for cut in range(len(text) + 1):
            assert streamed(cls(), [text[:cut], text[cut:]])[:2] == (text, []), (cls, cut)


MALFORMED_HERMES = [
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call>',  # truncated JSON
    '<tool_call>\n{"arguments": {"city": "Paris"}}\n</tool_call>',  # no name
    '<tool_call>\n["get_weather"]\n</tool_call>',  # not an object
    '<tool_call>\n{"name": "f", "arguments": [1, 2]}\n</tool_call>',  # arguments not an object
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}',  # never closed (max_tokens)
]


@pytest.mark.parametrize("bad", MALFORMED_HERMES)
def test_malformed_hermes_call_is_content(bad: str) -> None:
    text = "Checking.\n" + bad
    for cut in range(len(text) + 1):
        assert streamed(HermesToolParser(), [text[:cut], text[cut:]])[:2] == (text, []), cut


def test_malformed_call_next_to_a_good_one() -> None:
    bad = '<tool_call>\n{"name": "oops"\n</tool_call>'
    good = '<tool_call>\n{"name": "f", "arguments": "{\\"x\\": 1}"}\n</tool_call>'
    assert whole(HermesToolParser(), bad + "\n" + good) == (bad, [ParsedToolCall("f", '{"x": 1}')])


@pytest.mark.parametrize(
    "bad",
    [
        f'<{D}tool_calls>\n<{D}invoke name="f">\n<{D}parameter name="n" string="false">[1,</{D}parameter>\n'
        f"</{D}invoke>\n</{D}tool_calls>",  # a JSON value that does not parse
        f"<{D}tool_calls>\nno invoke here\n</{D}tool_calls>",
        f'<{D}tool_calls>\n<{D}invoke name="f">\nstray text\n</{D}invoke>\n</{D}tool_calls>',
        f'<{D}tool_calls>\n<{D}invoke name="f">\n</{D}invoke>',  # never closed
    ],
)
def test_malformed_dsml_is_content(bad: str) -> None:
    for cut in range(len(bad) + 1):
        assert streamed(DeepSeekDSMLToolParser(), [bad[:cut], bad[cut:]])[:2] == (bad, []), cut


@pytest.mark.parametrize(
    "bad",
    [
        f'{V3_BEGIN}{V3_CALL}function{V3_SEP}get_weather\n```json\n{{"city": }}\n```{V3_CALL_END}{V3_END}',
        f"{V3_BEGIN}{V3_CALL}{V3_SEP}{{}}{V3_CALL_END}{V3_END}",  # no name
        f"{V3_BEGIN}{V3_CALL}f{V3_SEP}[1]{V3_CALL_END}{V3_END}",  # arguments not an object
        f"{V3_BEGIN}{V3_CALL}f{V3_SEP}{{}}{V3_CALL_END}",  # never closed
    ],
)
def test_malformed_deepseek_v3_is_content(bad: str) -> None:
    for cut in range(len(bad) + 1):
        assert streamed(DeepSeekV3ToolParser(), [bad[:cut], bad[cut:]])[:2] == (bad, []), cut
