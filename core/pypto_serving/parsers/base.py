"""The contracts of output parsers: a tool-call parser turns a model's tool-call syntax into
:class:`ParsedToolCall` values, a reasoning parser separates its thinking from its answer. Both are
incremental (``feed`` the text as it is generated, then ``finish``), so one state machine serves
streamed and whole responses alike and the two always agree."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

from .grammar import ToolChoiceError

__all__ = ["ParsedToolCall", "ReasoningParser", "ToolParser", "partial_suffix"]


@dataclass(frozen=True, slots=True)
class ParsedToolCall:
    """One complete, well-formed tool call: the function's name and its arguments as JSON text."""

    name: str
    arguments: str


class ToolParser(ABC):
    """Finds tool calls in generated text. ``feed`` returns the text that is certainly content and the
    calls that completed; text that may still become part of a call is held back. A call that turns
    out malformed is released as content, unchanged."""

    @abstractmethod
    def feed(self, text: str) -> tuple[str, list[ParsedToolCall]]:
        """Take the next piece of generated text; return (content released, calls completed)."""

    @abstractmethod
    def finish(self) -> tuple[str, list[ParsedToolCall]]:
        """The generation ended: release everything held back (an unterminated call is content)."""

    def call_grammar(self, names: Sequence[str], *, parallel: bool, opened: str = "") -> str:
        """Lark rules (llguidance's dialect, see :mod:`pypto_serving.parsers.grammar`) defining
        ``tool_calls``: output that is only calls, in this parser's syntax, to the functions ``names``
        of the request's tools, with arguments valid against their ``parameters``; one call, or one or
        more with ``parallel``. This is how ``tool_choice: "required"`` and a named function are kept;
        with ``opened`` (the tag that starts its calls, already in the output) how ``auto`` is.
        Raises :class:`ToolChoiceError` when the parser cannot express it."""
        raise ToolChoiceError(f"the tool-call parser {type(self).__name__} cannot constrain tool calls")


class ReasoningParser(ABC):
    """Separates reasoning from the answer. ``feed`` returns (reasoning, content) released so far;
    text that may be the start of a delimiter is held back until it is decided."""

    @abstractmethod
    def feed(self, text: str) -> tuple[str, str]:
        """Take the next piece of generated text; return (reasoning released, content released)."""

    def grammar_rules(self) -> str:
        """Lark rules defining ``reasoning``: the reasoning a constrained answer (a forced tool call) may
        follow. Raises :class:`ToolChoiceError` when the parser cannot express it."""
        raise ToolChoiceError(f"the reasoning parser {type(self).__name__} cannot constrain its output")

    @abstractmethod
    def finish(self) -> tuple[str, str]:
        """The generation ended: release everything held back."""


def partial_suffix(text: str, *tags: str) -> int:
    """The length of the longest end of ``text`` that is a proper beginning of one of ``tags``: the
    part that must wait for more text before anyone can say whether a tag starts there."""
    best = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:n]):
                best = n
                break
    return best
