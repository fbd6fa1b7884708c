"""The ``<think>`` reasoning parser on real Qwen3 and DeepSeek output, whole and streamed in two pieces
split at every character boundary, and chained with the tool parser as the server chains them."""

from __future__ import annotations

import pytest

from pypto_serving.parsers import HermesToolParser, OutputParser, ParsedToolCall, ThinkReasoningParser

# Qwen3: the template leaves <think> to the model.
QWEN3_PROMPT = "<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n"
QWEN3_OUT = "<think>\nOkay, the user asks for 2+3. That is 5.\n</think>\n\nThe answer is **5**."
# Qwen3 with enable_thinking=False: the template writes an empty think block into the prompt.
QWEN3_NO_THINK_PROMPT = QWEN3_PROMPT + "<think>\n\n</think>\n\n"
# DeepSeek (R1, V3.1+, V4 thinking mode): the prompt opens the reasoning.
DEEPSEEK_PROMPT = "<｜User｜>What is 2+3?<｜Assistant｜><think>"
DEEPSEEK_OUT = "The user wants 2+3, which is 5.</think>2 + 3 = 5."

CASES = [
    (QWEN3_PROMPT, QWEN3_OUT, "\nOkay, the user asks for 2+3. That is 5.\n", "The answer is **5**."),
    (QWEN3_NO_THINK_PROMPT, "The answer is 5.", "", "The answer is 5."),
    (DEEPSEEK_PROMPT, DEEPSEEK_OUT, "The user wants 2+3, which is 5.", "2 + 3 = 5."),
    (QWEN3_PROMPT, "<think>\nStill thinking when max_tokens hit", "\nStill thinking when max_tokens hit", ""),
    (DEEPSEEK_PROMPT, "cut off mid-thought </thi", "cut off mid-thought </thi", ""),
    (QWEN3_PROMPT, "No think tags: <think> later is content", "", "No think tags: <think> later is content"),
    (QWEN3_PROMPT, "  <thin", "", "  <thin"),
]
IDS = ["qwen3", "qwen3-no-thinking", "deepseek", "unfinished", "deepseek-partial-end", "no-tags", "tag-prefix"]


@pytest.mark.parametrize(("prompt", "out", "reasoning", "content"), CASES, ids=IDS)
def test_split_at_every_boundary(prompt: str, out: str, reasoning: str, content: str) -> None:
    for cut in range(len(out) + 1):
        parser = ThinkReasoningParser(prompt)
        r1, c1 = parser.feed(out[:cut])
        r2, c2 = parser.feed(out[cut:])
        r3, c3 = parser.finish()
        assert (r1 + r2 + r3, c1 + c2 + c3) == (reasoning, content), cut
        # Nothing of a delimiter is ever released.
        assert "</think>" not in r1 + r2 + r3


def test_reasoning_streams_before_the_end_tag() -> None:
    parser = ThinkReasoningParser(QWEN3_PROMPT)
    assert parser.feed("<think>\nStep one") == ("\nStep one", "")
    assert parser.feed(", step two</th") == (", step two", "")  # "</th" may begin </think>: held
    assert parser.feed("ink>\n\nDone") == ("", "Done")
    assert parser.finish() == ("", "")


def test_reasoning_then_tool_call() -> None:
    """Qwen3 thinks, then calls a tool: the chain separates all three parts, streamed or not."""
    out = (
        "<think>\nI need the weather.\n</think>\n\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    )
    call = ParsedToolCall("get_weather", '{"city": "Paris"}')
    for cut in range(len(out) + 1):
        chain = OutputParser(ThinkReasoningParser(QWEN3_PROMPT), HermesToolParser())
        a, b, c = chain.feed(out[:cut]), chain.feed(out[cut:]), chain.finish()
        assert a.reasoning + b.reasoning + c.reasoning == "\nI need the weather.\n", cut
        assert (a.content + b.content + c.content, a.tool_calls + b.tool_calls + c.tool_calls) == ("", [call]), cut


def test_parallel_tool_calls_false_keeps_the_first_call() -> None:
    out = "".join(f'<tool_call>\n{{"name": "f{i}", "arguments": {{}}}}\n</tool_call>\n' for i in range(3))
    chain = OutputParser(None, HermesToolParser(), max_calls=1)
    assert chain.parse(out).tool_calls == [ParsedToolCall("f0", "{}")]
