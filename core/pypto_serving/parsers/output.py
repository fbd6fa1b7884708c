"""One choice's output parsing: reasoning first (thinking comes before the answer), then tool calls
in the answer."""

from __future__ import annotations

from dataclasses import dataclass, field

from .base import ParsedToolCall, ReasoningParser, ToolParser

__all__ = ["OutputParser", "ParsedOutput"]


@dataclass(slots=True)
class ParsedOutput:
    """What a piece of generated text released: reasoning, answer text and completed tool calls."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ParsedToolCall] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)

    def __add__(self, later: ParsedOutput) -> ParsedOutput:
        return ParsedOutput(
            self.reasoning + later.reasoning, self.content + later.content, self.tool_calls + later.tool_calls
        )


class OutputParser:
    """Chains an optional reasoning parser and an optional tool parser over one choice's text.

    :param max_calls: the most tool calls kept (``parallel_tool_calls=false``: 1); later ones are dropped.
    """

    def __init__(
        self, reasoning: ReasoningParser | None, tools: ToolParser | None, *, max_calls: int | None = None
    ) -> None:
        self.reasoning, self.tools, self.max_calls = reasoning, tools, max_calls
        self.num_calls = 0

    def feed(self, text: str) -> ParsedOutput:
        reasoning, answer = self.reasoning.feed(text) if self.reasoning is not None else ("", text)
        return self._answer(reasoning, answer, finish=False)

    def finish(self) -> ParsedOutput:
        reasoning, answer = self.reasoning.finish() if self.reasoning is not None else ("", "")
        return self._answer(reasoning, answer, finish=True)

    def _answer(self, reasoning: str, answer: str, *, finish: bool) -> ParsedOutput:
        if self.tools is None:
            return ParsedOutput(reasoning, answer)
        content, calls = self.tools.feed(answer)
        if finish:
            rest, more = self.tools.finish()
            content, calls = content + rest, calls + more
        if self.max_calls is not None:
            calls = calls[: max(0, self.max_calls - self.num_calls)]
        self.num_calls += len(calls)
        return ParsedOutput(reasoning, content, calls)

    def parse(self, text: str) -> ParsedOutput:
        """The whole of a finished generation's ``text`` at once."""
        first = self.feed(text)
        return first + self.finish()
