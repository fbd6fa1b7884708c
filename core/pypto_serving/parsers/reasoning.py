"""The built-in reasoning parser: thinking delimited by ``<think>`` ... ``</think>``, as Qwen3 and
DeepSeek (R1, V3.1+, V4) write it.

Whether the output starts inside the thinking is read from the rendered prompt, not guessed from the
output: Qwen3's template leaves the ``<think>`` to the model (or, with ``enable_thinking=False``, puts
an empty ``<think></think>`` in the prompt), while DeepSeek's and Qwen3's thinking-only templates end
the prompt with ``<think>`` so the output opens in the middle of the reasoning."""

from __future__ import annotations

from .base import ReasoningParser, partial_suffix
from .grammar import reasoning_rules

__all__ = ["ThinkReasoningParser"]


class ThinkReasoningParser(ReasoningParser):
    """Reasoning between ``start`` and ``end``; the answer after ``end`` (leading whitespace dropped).

    States: ``open`` (nothing decided: leading whitespace or a beginning of ``start`` is held),
    ``reasoning``, ``after`` (just past ``end``: whitespace is dropped) and ``content``. Output that
    does not open with ``start`` (and whose prompt does not end with it) is all content; output that
    never reaches ``end`` is all reasoning."""

    start = "<think>"
    end = "</think>"

    def __init__(self, prompt_text: str = "") -> None:
        self._state = "reasoning" if prompt_text.rstrip().endswith(self.start) else "open"
        self._buf = ""

    def grammar_rules(self) -> str:
        """Lark rules defining ``reasoning``: what may come before a constrained answer (the prompt's
        open thinking up to its end, or an optional whole thinking block)."""
        return reasoning_rules(opened=self._state == "reasoning", start=self.start, end=self.end)

    def feed(self, text: str) -> tuple[str, str]:
        self._buf += text
        reasoning: list[str] = []
        content: list[str] = []
        while self._buf and self._step(reasoning, content):
            pass
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        rest, self._buf = self._buf, ""
        if self._state == "reasoning":
            return rest, ""
        return "", "" if self._state == "after" else rest

    def _step(self, reasoning: list[str], content: list[str]) -> bool:
        """Consume what the current state can decide; False when it must wait for more text."""
        if self._state == "open":
            head = self._buf.lstrip()
            if head.startswith(self.start):
                self._buf, self._state = head[len(self.start) :], "reasoning"
                return True
            if not head or self.start.startswith(head):
                return False
            self._state = "content"
            return True
        if self._state == "reasoning":
            j = self._buf.find(self.end)
            if j == -1:
                keep = partial_suffix(self._buf, self.end)
                reasoning.append(self._buf[: len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep :]
                return False
            reasoning.append(self._buf[:j])
            self._buf, self._state = self._buf[j + len(self.end) :], "after"
            return True
        if self._state == "after":
            self._buf = self._buf.lstrip()
            if not self._buf:
                return False
            self._state = "content"
            return True
        content.append(self._buf)
        self._buf = ""
        return False
