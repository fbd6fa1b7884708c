"""Built-in tool-call parsers: Qwen's Hermes-style ``<tool_call>{json}</tool_call>``, DeepSeek's DSML
blocks (V3.2 and V4) and DeepSeek V3 / V3.1's ``<｜tool▁calls▁begin｜>`` blocks.

Both formats delimit calls with fixed tags, so one block scanner serves them: text outside a block is
content, a block is held until its closing tag and then parsed as a whole. A call therefore reaches
the client only once it is complete and valid; a block that does not parse is released as content,
exactly as generated, and an unterminated one becomes content when the generation ends."""

from __future__ import annotations

import json
import re
from abc import abstractmethod
from collections.abc import Sequence
from typing import Any

from .base import ParsedToolCall, ToolParser, partial_suffix
from .grammar import ToolChoiceError, arguments_schema, calls_grammar, json_rule, lit, tool_by_name

__all__ = ["BlockToolParser", "DeepSeekDSMLToolParser", "DeepSeekV3ToolParser", "HermesToolParser"]


class BlockToolParser(ToolParser):
    """Scans for blocks opened by one of ``tags``' start strings and closed by the matching end.

    Whitespace next to a call (the newlines between calls, after the last one) is not content: content
    that is only whitespace is held until non-whitespace content follows it, and dropped when a block
    starts or the generation ends after a call."""

    tags: tuple[tuple[str, str], ...] = ()

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        self.tools = tools or []
        self._buf = ""
        self._open: tuple[str, str] | None = None  # the tags of the block being read
        self._space = ""  # trailing whitespace of the content, held
        self._before = ""  # the whitespace before the open block: content again if the block is malformed
        self._made_calls = False

    def feed(self, text: str) -> tuple[str, list[ParsedToolCall]]:
        self._buf += text
        content: list[str] = []
        calls: list[ParsedToolCall] = []
        while True:
            if self._open is None:
                if not self._scan_outside(content):
                    break
            elif not self._scan_block(content, calls):
                break
        return "".join(content), calls

    def finish(self) -> tuple[str, list[ParsedToolCall]]:
        rest = self._buf if self._open is None else self._before + self._open[0] + self._buf
        self._buf, self._open = "", None
        out: list[str] = []
        self._release(rest, out)
        if not self._made_calls:
            out.append(self._space)
        self._space = ""
        return "".join(out), []

    def _release(self, text: str, out: list[str]) -> None:
        """Release content, holding its trailing whitespace back."""
        if not text:
            return
        body = text.rstrip()
        if body:
            out.append(self._space + body)
            self._space = text[len(body) :]
        else:
            self._space += text

    def _scan_outside(self, content: list[str]) -> bool:
        starts = [(i, pair) for pair in self.tags if (i := self._buf.find(pair[0])) != -1]
        if not starts:
            keep = partial_suffix(self._buf, *(s for s, _ in self.tags))
            self._release(self._buf[: len(self._buf) - keep], content)
            self._buf = self._buf[len(self._buf) - keep :]
            return False
        i, pair = min(starts, key=lambda x: x[0])
        self._release(self._buf[:i], content)
        self._before, self._space = self._space, ""  # whitespace before a call is not content
        self._buf = self._buf[i + len(pair[0]) :]
        self._open = pair
        return True

    def _scan_block(self, content: list[str], calls: list[ParsedToolCall]) -> bool:
        assert self._open is not None
        start, end = self._open
        j = self._buf.find(end)
        if j == -1:
            return False
        body = self._buf[:j]
        self._buf = self._buf[j + len(end) :]
        self._open = None
        parsed = self.parse_block(body)
        if parsed is None:
            self._release(self._before + start + body + end, content)
        else:
            calls.extend(parsed)
            self._made_calls = True
        return True

    @abstractmethod
    def parse_block(self, body: str) -> list[ParsedToolCall] | None:
        """The calls of one block's ``body`` (between its tags), or None when it is malformed."""


def _arguments_json(value: Any) -> str | None:
    """Arguments as JSON text of an object (json.dumps spacing): a dict, or a string holding one."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            return None
    if not isinstance(value, dict):
        return None
    return json.dumps(value, ensure_ascii=False)


class HermesToolParser(BlockToolParser):
    """Qwen2.5/Qwen3 (Hermes format): ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``."""

    tags = (("<tool_call>", "</tool_call>"),)

    def parse_block(self, body: str) -> list[ParsedToolCall] | None:
        try:
            obj = json.loads(body)
        except json.JSONDecodeError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
            return None
        args = _arguments_json(obj.get("arguments", obj.get("parameters", {})))
        return None if args is None else [ParsedToolCall(obj["name"], args)]

    def call_grammar(self, names: Sequence[str], *, parallel: bool, opened: str = "") -> str:
        bodies = []
        for i, name in enumerate(names):
            schema = arguments_schema(tool_by_name(self.tools, name), flexible=bool(opened))
            head = lit(f'<tool_call>\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": ')
            bodies.append(
                f"{head} args_{i} {lit(chr(125) + chr(10) + '</tool_call>')}\n{json_rule(f'args_{i}', schema)}"
            )
        return calls_grammar(bodies, separator="\n", parallel=parallel, opened=opened)


_DSML = "｜DSML｜"  # the bars are U+FF5C FULLWIDTH VERTICAL LINE, as in DeepSeek's special tokens
_INVOKE = re.compile(rf'\s*<{_DSML}invoke name="([^"]+)">(.*?)</{_DSML}invoke>', re.DOTALL)
_PARAM = re.compile(rf'\s*<{_DSML}parameter name="([^"]+)" string="(true|false)">(.*?)</{_DSML}parameter>', re.DOTALL)


class DeepSeekDSMLToolParser(BlockToolParser):
    """DeepSeek V4 (``<｜DSML｜tool_calls>``) and V3.2 (``<｜DSML｜function_calls>``) DSML blocks::

        <｜DSML｜tool_calls>
        <｜DSML｜invoke name="get_weather">
        <｜DSML｜parameter name="city" string="true">Paris</｜DSML｜parameter>
        <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
        </｜DSML｜invoke>
        </｜DSML｜tool_calls>

    ``string="true"`` values are raw text, ``string="false"`` ones JSON."""

    tags = (
        (f"<{_DSML}tool_calls>", f"</{_DSML}tool_calls>"),
        (f"<{_DSML}function_calls>", f"</{_DSML}function_calls>"),
    )

    def parse_block(self, body: str) -> list[ParsedToolCall] | None:
        calls: list[ParsedToolCall] = []
        pos = 0
        while (m := _INVOKE.match(body, pos)) is not None:
            args = _dsml_arguments(m.group(2))
            if args is None:
                return None
            calls.append(ParsedToolCall(m.group(1), json.dumps(args, ensure_ascii=False)))
            pos = m.end()
        if not calls or body[pos:].strip():
            return None
        return calls

    def call_grammar(self, names: Sequence[str], *, parallel: bool, opened: str = "") -> str:
        bodies = [_dsml_invoke(i, name, tool_by_name(self.tools, name)) for i, name in enumerate(names)]
        start, end = self.tags[0]
        return calls_grammar(
            bodies, separator="\n", parallel=parallel, open_tag=start + "\n", close_tag=end, opened=opened
        )


# Top-level keywords of a parameters schema that DSML's one-element-per-parameter form keeps exactly;
# others (anyOf, patternProperties, minProperties...) constrain the object as a whole.
_DSML_SCHEMA_KEYS = frozenset(
    {"type", "properties", "required", "additionalProperties", "$defs", "definitions", "description", "title"}
    | {"$schema", "x-guidance", "strict"}
)


def _dsml_invoke(i: int, name: str, function: dict[str, Any]) -> str:
    """One DSML call's rule and its parameters' rules. Every value is written ``string="false"`` (JSON),
    so a string parameter's own constraints (``maxLength``, ``enum``, ``pattern``) hold too."""
    schema = arguments_schema(function)
    extra = sorted(set(schema) - _DSML_SCHEMA_KEYS)
    props = schema.get("properties") or {}
    required = schema.get("required") or []
    if extra or schema.get("type", "object") != "object" or not isinstance(props, dict):
        raise ToolChoiceError(
            f"the parameters of {name!r} use {extra or 'a non-object type'}, which DSML calls cannot keep"
        )
    if '"' in name or any('"' in str(p) for p in props):
        raise ToolChoiceError(f"DSML calls cannot carry a double quote in the name of {name!r} or its parameters")
    if any(r not in props for r in required):
        raise ToolChoiceError(f"the parameters of {name!r} require a property they do not define")
    shared: dict[str, Any] = {k: schema[k] for k in ("$defs", "definitions", "x-guidance") if k in schema}
    parts, rules = [], []
    for j, (prop, sub) in enumerate(props.items()):
        head = lit(f'<{_DSML}parameter name="{prop}" string="false">')
        rules.append(f"param_{i}_{j}: {head} value_{i}_{j} {lit(f'</{_DSML}parameter>' + chr(10))}")
        rules.append(json_rule(f"value_{i}_{j}", {**(sub if isinstance(sub, dict) else {}), **shared}))
        parts.append(f"param_{i}_{j}" + ("" if prop in required else "?"))
    head = lit(f'<{_DSML}invoke name="{name}">' + "\n")
    return "\n".join([" ".join([head, *parts, lit(f"</{_DSML}invoke>")]), *rules])


def _dsml_arguments(body: str) -> dict[str, Any] | None:
    args: dict[str, Any] = {}
    pos = 0
    while (m := _PARAM.match(body, pos)) is not None:
        name, is_string, value = m.groups()
        if is_string == "true":
            args[name] = value
        else:
            try:
                args[name] = json.loads(value)
            except json.JSONDecodeError:
                return None
        pos = m.end()
    return None if body[pos:].strip() else args


# The bars are U+FF5C and the spaces U+2581 LOWER ONE EIGHTH BLOCK, as in DeepSeek V3's special tokens.
_V3_CALL = re.compile(r"\s*<｜tool▁call▁begin｜>(.*?)<｜tool▁sep｜>(.*?)<｜tool▁call▁end｜>", re.DOTALL)
_V3_FENCED = re.compile(r"([^\n]+)\n```json\n(.*)\n```", re.DOTALL)


class DeepSeekV3ToolParser(BlockToolParser):
    """DeepSeek V3 / R1 and V3.1 calls in a ``<｜tool▁calls▁begin｜>`` ... ``<｜tool▁calls▁end｜>`` block.

    V3 writes ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\n{ARGS}\n```<｜tool▁call▁end｜>``;
    V3.1 writes ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{ARGS}<｜tool▁call▁end｜>``."""

    tags = (("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"),)

    def parse_block(self, body: str) -> list[ParsedToolCall] | None:
        calls: list[ParsedToolCall] = []
        pos = 0
        while (m := _V3_CALL.match(body, pos)) is not None:
            head, rest = m.group(1), m.group(2)
            fenced = _V3_FENCED.fullmatch(rest.strip()) if head == "function" else None
            name, args_text = (fenced.group(1).strip(), fenced.group(2)) if fenced else (head.strip(), rest)
            args = _arguments_json(args_text)
            if not name or args is None:
                return None
            calls.append(ParsedToolCall(name, args))
            pos = m.end()
        if not calls or body[pos:].strip():
            return None
        return calls

    def call_grammar(self, names: Sequence[str], *, parallel: bool, opened: str = "") -> str:
        """Calls in V3.1's form (``NAME<｜tool▁sep｜>{ARGS}``), which the parser reads for V3 and R1 too."""
        bodies = []
        for i, name in enumerate(names):
            schema = arguments_schema(tool_by_name(self.tools, name), flexible=bool(opened))
            head = lit(f"<｜tool▁call▁begin｜>{name}<｜tool▁sep｜>")
            bodies.append(f"{head} args_{i} {lit('<｜tool▁call▁end｜>')}\n{json_rule(f'args_{i}', schema)}")
        start, end = self.tags[0]
        return calls_grammar(bodies, separator="", parallel=parallel, open_tag=start, close_tag=end, opened=opened)
