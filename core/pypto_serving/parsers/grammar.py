"""Grammars of tool calls, for ``tool_choice: "required"`` and a named function: the output is forced,
by constrained decoding (:mod:`pypto_serving.structured`), into the model's own tool-call syntax with
arguments that validate against the function's ``parameters`` schema.

Grammars are written in llguidance's Lark dialect: string literals take JSON's escapes (so
``json.dumps`` quotes any text exactly), ``%json {schema}`` is a rule whose text is JSON valid
against ``schema``, and a ``[lazy]`` rule ends at the first place its text can end (the reasoning
before ``</think>``)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

__all__ = [
    "ToolChoiceError",
    "arguments_schema",
    "auto_calls_grammar",
    "calls_grammar",
    "json_rule",
    "lit",
    "reasoning_rules",
    "tool_by_name",
]

# Compact JSON: with flexible whitespace a sampled model can pad arguments with blanks until
# max_tokens cuts the call short. A schema may still ask for whitespace through its "x-guidance".
_COMPACT = {"whitespace_flexible": False}


class ToolChoiceError(ValueError):
    """The tool choice cannot be enforced for these tools (the server answers 400 naming it)."""


def lit(text: str) -> str:
    """``text`` as a Lark string literal."""
    return json.dumps(text, ensure_ascii=False)


def tool_by_name(tools: Sequence[dict[str, Any]], name: str) -> dict[str, Any]:
    """The ``function`` dict of the tool called ``name``."""
    for tool in tools:
        function = tool.get("function") or {}
        if function.get("name") == name:
            return dict(function)
    raise ToolChoiceError(f"tool_choice names the function {name!r}, which is not among the request's tools")


def arguments_schema(function: dict[str, Any], *, flexible: bool = False) -> dict[str, Any]:
    """The JSON schema a call's arguments match: the function's ``parameters`` (any object when it has
    none), generated compactly unless ``flexible``: under ``tool_choice: auto`` the model writes its
    calls in its own style (Qwen's ``{"city": "Paris"}``), and the grammar keeps only the schema."""
    schema = dict(function.get("parameters") or {"type": "object"})
    style = {"whitespace_flexible": True} if flexible else _COMPACT
    schema["x-guidance"] = {**style, **dict(schema.get("x-guidance") or {})}
    return schema


def calls_grammar(
    call_rules: Sequence[str],
    *,
    separator: str,
    parallel: bool,
    open_tag: str = "",
    close_tag: str = "",
    opened: str = "",
) -> str:
    """Rules defining ``tool_calls``: one call (one of ``call_rules``' bodies), or with ``parallel`` one
    or more; inside ``open_tag`` ... ``close_tag`` each call is followed by ``separator``, without them
    calls are separated by it. A body's first line is the call's rule, its further lines are rules the
    call refers to. The separator never starts the closing tag: llguidance's lexer takes the longest
    literal and does not back up, so a ``"\\n"`` next to a ``"\\n</end>"`` would strand the output.

    ``opened``: the output already holds this start of the calls (the tag that ended ``tool_choice:
    auto``'s free text, :func:`auto_calls_grammar`), so the first call's text starts after it."""
    heads, firsts, rules = [], [], []
    for i, body in enumerate(call_rules):
        head, _, rest = body.partition("\n")
        heads.append(f"call_{i}")
        rules.append(f"call_{i}: {head}")
        if opened and not close_tag:
            firsts.append(f"first_{i}")
            rules.append(f"first_{i}: {_without_prefix(head, opened)}")
        if rest:
            rules.append(rest)
    if close_tag:
        item = f"call {lit(separator)}" if separator else "call"
        start = open_tag[len(opened) :] if opened else open_tag
        calls = f"{lit(start) if start else ''} ({item}){'+' if parallel else ''} {lit(close_tag)}"
    else:
        first = "first" if opened else "call"
        calls = f"{first} ({lit(separator)} call)*" if parallel else first
        if opened:
            rules.append(f"first: {' | '.join(firsts)}")
    return "\n".join([f"tool_calls: {calls}", f"call: {' | '.join(heads)}", *rules])


def _without_prefix(head: str, prefix: str) -> str:
    """The Lark expression ``head``, which starts with a string literal starting with ``prefix``,
    without that prefix."""
    quoted = lit(prefix)[:-1]  # the literal's opening quote and the prefix, not its closing quote
    if head.startswith(lit(prefix) + " "):  # the literal is the prefix whole
        return head[len(lit(prefix)) + 1 :]
    if not head.startswith(quoted):
        raise ToolChoiceError("the tool-call syntax cannot be constrained under tool_choice 'auto'")
    return '"' + head[len(quoted) :]


def auto_calls_grammar(calls_rules: str, open_tag: str) -> str:
    """Rules defining ``answer``: free text without ``open_tag``, or free text up to the first
    ``open_tag`` followed by the calls of ``calls_rules`` (written with ``opened=open_tag``): how
    ``tool_choice: auto`` keeps a strict tool's arguments to its schema and ``parallel_tool_calls:
    false`` to one call. llguidance's lexer is greedy and never backs up, so the text before the calls
    is one lazy lexeme that ends at the first tag, beside a greedy one that never holds the tag."""
    tag = "".join("\\" + c if c in _REGEX_SPECIAL else c for c in open_tag)
    return "\n".join(
        [
            "answer: TEXT | before tool_calls",
            f"TEXT: /(.|\\n)*/ & ~/(.|\\n)*{tag}(.|\\n)*/",
            f"before[lazy]: /(.|\\n)*/ {lit(open_tag)}",
            calls_rules,
        ]
    )


_REGEX_SPECIAL = frozenset("\\.+*?()|[]{}^$/-")


def json_rule(name: str, schema: dict[str, Any]) -> str:
    """A rule ``name`` whose text is JSON valid against ``schema``."""
    return f"{name}: %json {json.dumps(schema, ensure_ascii=False)}"


def reasoning_rules(*, opened: bool, start: str = "<think>", end: str = "</think>") -> str:
    """Rules defining ``reasoning``: what may precede the calls. ``opened``: the prompt ends inside the
    thinking, so the output starts with reasoning up to ``end``; otherwise an optional ``start`` ...
    ``end`` block. Newlines after it are allowed (the reasoning parser drops them)."""
    block = "think gap" if opened else f"({lit(start)} think gap)?"
    # One lazy rule up to and including ``end``: it stops at the first ``end``.
    return "\n".join([f"reasoning: {block}", f"think[lazy]: /(.|\\n)*/ {lit(end)}", 'gap: "\\n"*'])
