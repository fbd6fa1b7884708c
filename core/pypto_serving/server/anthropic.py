"""The Anthropic Messages API: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

A Messages request is translated into the chat-completions request it means (system prompt, turns,
tool uses and results, tools, tool choice, thinking switch, stop sequences) and then runs through the
chat machinery unchanged: the same chat template, tool-call and reasoning parsers, tool-choice
grammars, sampling mapping and checks. Only the two ends are Anthropic's: the request models here, and
the answer as content blocks (``thinking``, ``text``, ``tool_use``), whole or as the documented event
stream, with errors in Anthropic's shape.

Bodies are validated as strictly as the OpenAI routes' (see :mod:`.protocol`). As Anthropic's API
does, a field it does not define is refused (400 ``"X: Extra inputs are not permitted"``); fields it
defines that this server cannot honour (server tools, images and documents, ``container``,
``mcp_servers``...) are refused with a message naming them, never ignored.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from fastapi import APIRouter, FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..engine import EngineDeadError
from ..parsers import OutputParser, ParsedOutput, ParsedToolCall
from ..request import CompletionOutput, RequestOutput
from .async_llm import EngineFailure
from .openai_requests import (
    _check_capacity,
    _check_model,
    _check_ready,
    _Ctx,
    _output_parsers,
    _Prompt,
    _render_chat,
    _request_grammar,
    _sampling_params,
    _shown_model,
    _tool_choice_spec,
    _validate_ids,
)
from .protocol import (
    MAX_STOP,
    MAX_TOOLS,
    APIError,
    Bool,
    ChatCompletionRequest,
    Float,
    Int64,
    JSONObject,
    StopString,
    Text,
    json_depth_route,
    validation_api_error,
)
from .responses import _failure_message, _json_response, _run_all
from .streaming import _ChoiceState, _sse, _start_stream, _StreamRunner

__all__ = [
    "ANTHROPIC_PATH",
    "CountTokensRequest",
    "MessagesRequest",
    "add_anthropic_routes",
    "anthropic_error_body",
]

ANTHROPIC_PATH = "/v1/messages"
# Anthropic's error types by HTTP status; any other 4xx is an invalid request, any other 5xx an api_error.
_ERROR_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
}
MIN_THINKING_BUDGET = 1024  # Anthropic's least budget_tokens


def anthropic_error_body(status: int, message: str) -> dict[str, Any]:
    """Anthropic's error shape, ``{"type": "error", "error": {"type", "message"}}``, for ``status``."""
    kind = _ERROR_TYPES.get(status) or ("api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


# --------------------------------------------------------------------------- request models


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextBlock(_Strict):
    type: Literal["text"]
    text: Text
    cache_control: JSONObject | None = None  # prompt caching is automatic here (the prefix cache)
    citations: list[JSONObject] | None = None


class ThinkingBlock(_Strict):
    type: Literal["thinking"]
    thinking: Text
    signature: Text | None = None  # this server signs nothing and checks nothing


class RedactedThinkingBlock(_Strict):
    type: Literal["redacted_thinking"]
    data: Text


class ToolUseBlock(_Strict):
    type: Literal["tool_use"]
    id: Text
    name: Text
    input: JSONObject
    cache_control: JSONObject | None = None


_KNOWN_BLOCKS = ("text", "thinking", "redacted_thinking", "tool_use", "tool_result")


def _known_blocks(value: Any, allowed: Sequence[str]) -> Any:
    """Refuses, by name, a content block this server cannot read (an image, a document, a server
    tool's result) before the union reports every branch it did not match."""
    if not isinstance(value, list):
        return value
    for i, block in enumerate(value):
        kind = block.get("type") if isinstance(block, dict) else None
        if isinstance(kind, str) and kind not in allowed:
            why = "this server serves a text-only model (no vision)" if kind in ("image", "document") else ""
            raise PydanticCustomError(
                "unsupported_block",
                "block {i}: content blocks of type '{kind}' are not supported{why}",
                {"i": i, "kind": kind[:64], "why": f": {why}" if why else f"; send one of {', '.join(allowed)}"},
            )
    return value


class ToolResultBlock(_Strict):
    type: Literal["tool_result"]
    tool_use_id: Text
    content: Text | list[TextBlock] | None = None
    is_error: Bool | None = None
    cache_control: JSONObject | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, value: Any) -> Any:
        return _known_blocks(value, ("text",))


def _block_type(value: Any) -> str | None:
    return value.get("type") if isinstance(value, dict) else getattr(value, "type", None)


InputBlock = Annotated[
    Annotated[TextBlock, Tag("text")]
    | Annotated[ThinkingBlock, Tag("thinking")]
    | Annotated[RedactedThinkingBlock, Tag("redacted_thinking")]
    | Annotated[ToolUseBlock, Tag("tool_use")]
    | Annotated[ToolResultBlock, Tag("tool_result")],
    Discriminator(_block_type),
]


class InputMessage(_Strict):
    role: Literal["user", "assistant"]
    content: Text | list[InputBlock]

    @field_validator("content", mode="before")
    @classmethod
    def _readable(cls, value: Any) -> Any:
        return _known_blocks(value, _KNOWN_BLOCKS)


class Tool(_Strict):
    """A client tool: what the chat request's ``function`` is, under Anthropic's names."""

    name: Annotated[Text, Field(min_length=1, max_length=256)]
    description: Text | None = None
    input_schema: JSONObject
    type: Literal["custom"] | None = None
    strict: Bool | None = None
    cache_control: JSONObject | None = None

    @model_validator(mode="before")
    @classmethod
    def _client_tools_only(cls, data: Any) -> Any:
        kind = data.get("type") if isinstance(data, dict) else None
        if isinstance(kind, str) and kind != "custom":
            raise PydanticCustomError(
                "unsupported_tool",
                "server tools ('{kind}') are not supported; send client tools (name, description, input_schema)",
                {"kind": kind[:64]},
            )
        return data


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: Text | None = None
    disable_parallel_tool_use: Bool | None = None

    @model_validator(mode="after")
    def _name_with_tool(self) -> ToolChoice:
        if (self.type == "tool") != (self.name is not None):
            raise PydanticCustomError("tool_choice_name", "name is required with type 'tool' and only with it")
        return self


class ThinkingConfig(_Strict):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Int64 | None = None
    display: Literal["summarized", "omitted"] | None = None

    @model_validator(mode="after")
    def _budget(self) -> ThinkingConfig:
        if self.type == "enabled" and (self.budget_tokens is None or self.budget_tokens < MIN_THINKING_BUDGET):
            raise PydanticCustomError("thinking_budget", f"budget_tokens must be at least {MIN_THINKING_BUDGET}")
        return self


class OutputFormat(_Strict):
    type: Literal["json_schema"]
    # "schema" shadows a BaseModel attribute: the field is json_schema under its JSON name "schema".
    json_schema: JSONObject = Field(alias="schema")


class OutputConfig(_Strict):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None  # accepted; no effort control here
    format: OutputFormat | None = None


class Metadata(_Strict):
    user_id: Text | None = None


# Fields of Anthropic's API that ask for something this server does not have: refused by name unless
# they ask for nothing (null, [], speed "standard").
UNSUPPORTED_FIELDS = ("container", "mcp_servers", "context_management", "inference_geo", "speed", "diagnostics")


class _MessagesFields(_Strict):
    """What a Messages request and a token count share: everything that makes the prompt."""

    model: Text
    messages: Annotated[list[InputMessage], Field(min_length=1)]
    system: Text | list[TextBlock] | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    cache_control: JSONObject | None = None

    # UNSUPPORTED_FIELDS: declared so that a value asking for nothing passes and any other is refused by name.
    container: Any = None
    mcp_servers: Any = None
    context_management: Any = None
    inference_geo: Any = None
    speed: Any = None
    diagnostics: Any = None

    @field_validator(*UNSUPPORTED_FIELDS, mode="before")
    @classmethod
    def _refuse_unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        if value not in (None, []) and not (info.field_name == "speed" and value == "standard"):
            raise PydanticCustomError("unsupported_field", "not supported by this server", {})
        return None

    @field_validator("system", mode="before")
    @classmethod
    def _text_system(cls, value: Any) -> Any:
        return _known_blocks(value, ("text",))


class CountTokensRequest(_MessagesFields):
    """``/v1/messages/count_tokens``: the prompt a Messages request with these fields would have."""


class MessagesRequest(_MessagesFields):
    max_tokens: Int64
    stop_sequences: Annotated[list[StopString], Field(max_length=MAX_STOP)] | None = None
    stream: Bool = False
    temperature: Float | None = None
    top_p: Float | None = None
    top_k: Int64 | None = None
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None  # one tier here


_FIELD_NAMES = (
    frozenset(
        name
        for m in (MessagesRequest, InputMessage, TextBlock, ThinkingBlock, RedactedThinkingBlock, ToolUseBlock)
        for name in m.model_fields
    )
    | frozenset(
        name
        for m in (ToolResultBlock, Tool, ToolChoice, ThinkingConfig, OutputConfig, OutputFormat)
        for name in m.model_fields
    )
    | {"schema"}
)


# --------------------------------------------------------------------------- translation


def _text(blocks: str | Sequence[TextBlock] | None) -> str:
    if blocks is None or isinstance(blocks, str):
        return blocks or ""
    return "\n".join(b.text for b in blocks)


def _user_turns(content: list[Any]) -> list[dict[str, Any]]:
    """A user message's blocks as chat messages: each tool result a ``tool`` message, each run of
    text blocks one ``user`` message, in their order."""
    out: list[dict[str, Any]] = []
    for block in content:
        if isinstance(block, ToolResultBlock):
            turn: dict[str, Any] = {"role": "tool", "tool_call_id": block.tool_use_id, "content": _text(block.content)}
            if block.is_error:
                turn["is_error"] = True  # for templates that mark failed calls
            out.append(turn)
        elif isinstance(block, TextBlock):
            if out and out[-1]["role"] == "user":
                out[-1]["content"] += "\n" + block.text
            else:
                out.append({"role": "user", "content": block.text})
        else:
            raise APIError(400, f"a user message cannot hold {block.type} blocks", param="messages")
    return out


def _assistant_turn(content: list[Any]) -> dict[str, Any]:
    """An assistant message's blocks as one chat message: text as ``content``, thinking as
    ``reasoning_content``, tool uses as ``tool_calls`` with their input as the object templates write."""
    texts = [b.text for b in content if isinstance(b, TextBlock)]
    thoughts = [b.thinking for b in content if isinstance(b, ThinkingBlock)]
    calls = [
        {"id": b.id, "type": "function", "function": {"name": b.name, "arguments": b.input}}
        for b in content
        if isinstance(b, ToolUseBlock)
    ]
    if any(isinstance(b, ToolResultBlock) for b in content):
        raise APIError(400, "tool_result blocks belong in user messages", param="messages")
    turn: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
    if thoughts:
        turn["reasoning_content"] = "\n".join(thoughts)
    if calls:
        turn["tool_calls"] = calls
    return turn


def _append_turn(out: list[dict[str, Any]], turn: dict[str, Any]) -> None:
    """Appends ``turn``, combined with the one before when both are the same role's (``user`` text, or
    ``assistant``): as Anthropic's API combines consecutive turns, and as templates that insist on
    alternating roles need."""
    last = out[-1] if out else None
    if last is None or last["role"] != turn["role"] or turn["role"] not in ("user", "assistant"):
        out.append(turn)
        return
    for key in ("content", "reasoning_content"):
        parts = [t[key] for t in (last, turn) if t.get(key)]
        if parts:
            last[key] = "\n".join(parts)
    if turn.get("tool_calls"):
        last["tool_calls"] = [*last.get("tool_calls", ()), *turn["tool_calls"]]


def _chat_messages(req: _MessagesFields) -> tuple[list[dict[str, Any]], str | None]:
    """The chat messages of ``req`` and the prefill: the text of a last assistant message, which the
    answer continues (Anthropic's prefill) rather than a new turn."""
    out: list[dict[str, Any]] = []
    system = _text(req.system)
    if system:
        out.append({"role": "system", "content": system})
    for m in req.messages:
        blocks: list[Any] = [TextBlock(type="text", text=m.content)] if isinstance(m.content, str) else m.content
        for turn in _user_turns(blocks) if m.role == "user" else [_assistant_turn(blocks)]:
            _append_turn(out, turn)
    prefill = None
    if req.messages[-1].role == "assistant":
        last = out.pop()
        if last.get("tool_calls"):
            raise APIError(
                400, "the last message cannot be an assistant's tool_use: send its tool_result", param="messages"
            )
        prefill = last["content"] if last["content"].strip() else None  # nothing to continue: a new turn
        if prefill is not None:
            out.append(last)
    return out, prefill


def _chat_tools(req: _MessagesFields) -> dict[str, Any]:
    """The chat fields of ``tools`` and ``tool_choice``: ``any`` is chat's ``required``, a named tool
    chat's named function, ``disable_parallel_tool_use`` chat's ``parallel_tool_calls: false``."""
    choice = req.tool_choice
    if choice is not None and choice.type != "none" and not req.tools:
        raise APIError(
            400, f"tool_choice '{choice.type}' needs tools; send tools or drop tool_choice", param="tool_choice"
        )
    tools = [
        {
            "type": "function",
            "function": {
                "name": t.name,
                "description": t.description,
                "parameters": t.input_schema,
                "strict": t.strict,
            },
        }
        for t in req.tools or ()
    ]
    fields: dict[str, Any] = {"tools": tools or None}
    if choice is not None:
        names = {"auto": "auto", "any": "required", "none": "none"}
        fields["tool_choice"] = names.get(choice.type) or {"type": "function", "function": {"name": choice.name}}
        if choice.disable_parallel_tool_use:
            fields["parallel_tool_calls"] = False
    return fields


def _chat_request(req: _MessagesFields) -> tuple[ChatCompletionRequest, str | None]:
    """The chat-completions request ``req`` means, and its prefill (see :func:`_chat_messages`)."""
    messages, prefill = _chat_messages(req)
    body: dict[str, Any] = {"messages": messages, "add_generation_prompt": prefill is None, **_chat_tools(req)}
    body["model"] = req.model  # a LoRA adapter's name selects it, as on the chat route
    if req.thinking is not None:  # Qwen3's and DeepSeek's templates read the switch by this name
        body["chat_template_kwargs"] = {"enable_thinking": req.thinking.type != "disabled"}
    fmt = req.output_config.format if req.output_config is not None else None
    if fmt is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt.json_schema}}
    if isinstance(req, MessagesRequest):
        sampling = {"temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k}
        body.update(max_tokens=req.max_tokens, stop=req.stop_sequences, stream=req.stream, **sampling)
    try:
        return ChatCompletionRequest.model_validate(body), prefill
    except ValidationError as e:  # a value Anthropic's schema allows and chat's does not
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise APIError(400, f"{where}: {first['msg']}", param="messages") from None


def _prompt_text(ctx: _Ctx, chat: ChatCompletionRequest, prefill: str | None) -> str:
    """The rendered prompt; with a prefill, cut right after its text, so the answer continues it (as
    transformers' ``continue_final_message``: the template closed the turn after it)."""
    text = _render_chat(ctx, chat)
    if prefill is None:
        return text
    at = text.rfind(prefill.strip())
    if at < 0:
        raise APIError(400, "the chat template does not render the last assistant message's text", param="messages")
    return text[: at + len(prefill.strip())]


def _prompt(ctx: _Ctx, chat: ChatCompletionRequest, prefill: str | None) -> _Prompt:
    text = _prompt_text(ctx, chat, prefill)
    tok = ctx.llm.tokenizer
    assert tok is not None  # _render_chat refused a model without one
    return _validate_ids(ctx, tok.encode(text), text, param="messages")


def _count(ctx: _Ctx, req: CountTokensRequest) -> dict[str, int]:
    chat, prefill = _chat_request(req)
    text = _prompt_text(ctx, chat, prefill)
    tok = ctx.llm.tokenizer
    assert tok is not None
    return {"input_tokens": len(tok.encode(text))}


# --------------------------------------------------------------------------- answers


def _usage(prompt: _Prompt, out: RequestOutput | None, output_tokens: int) -> dict[str, int]:
    """Anthropic's usage: ``input_tokens`` are the prompt tokens not read from the prefix cache, which
    are ``cache_read_input_tokens`` (their sum is the prompt the engine saw, what count_tokens says)."""
    cached = out.num_cached_tokens if out is not None else 0
    return {
        "input_tokens": len(prompt.ids) - cached,
        "output_tokens": output_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
    }


def _stop(c: CompletionOutput, called: bool) -> tuple[str | None, str | None]:
    """(stop_reason, stop_sequence) of a finished answer."""
    if c.finish_reason == "length":
        return "max_tokens", None
    if called:
        return "tool_use", None
    if isinstance(c.stop_reason, str):
        return "stop_sequence", c.stop_reason
    return ("end_turn", None) if c.finish_reason is not None else (None, None)


def _tool_use(call: ParsedToolCall) -> dict[str, Any]:
    return {
        "type": "tool_use",
        "id": f"toolu_{uuid.uuid4().hex[:24]}",
        "name": call.name,
        "input": json.loads(call.arguments),
    }


def _blocks(parsed: ParsedOutput, show_thinking: bool) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if parsed.reasoning:
        blocks.append({"type": "thinking", "thinking": parsed.reasoning if show_thinking else "", "signature": ""})
    if parsed.content:
        blocks.append({"type": "text", "text": parsed.content})
    return blocks + [_tool_use(c) for c in parsed.tool_calls]


def _message_body(
    ctx: _Ctx,
    rid: str,
    prompt: _Prompt,
    out: RequestOutput,
    parsers: Callable[[], OutputParser] | None,
    *,
    show: bool,
    lora: str | None,
) -> dict[str, Any]:
    (c,) = out.outputs
    parsed = parsers().parse(c.text) if parsers is not None else ParsedOutput(content=c.text)
    stop_reason, stop_sequence = _stop(c, bool(parsed.tool_calls))
    return {
        "id": rid,
        "type": "message",
        "role": "assistant",
        "model": _shown_model(ctx, lora),
        "content": _blocks(parsed, show),
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": _usage(prompt, out, len(c.token_ids)),
    }


def _event(kind: str, data: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"


@dataclass(slots=True)
class _BlockStream:
    """The content blocks of a streamed answer: which one is open, and the events that open, fill and
    close them as the parser releases reasoning, text and tool calls."""

    show_thinking: bool
    index: int = -1
    open: str | None = None  # the open block's type
    pinged: bool = False
    called: bool = False
    events: list[str] = field(default_factory=list)

    def _start(self, block: dict[str, Any]) -> None:
        self.close()
        self.index += 1
        self.open = block["type"]
        self.events.append(_event("content_block_start", {"index": self.index, "content_block": block}))
        self.ping()

    def ping(self) -> None:
        if not self.pinged:  # once, after the first block opens, as Anthropic's streams do
            self.pinged = True
            self.events.append(_event("ping", {}))

    def _delta(self, delta: dict[str, Any]) -> None:
        self.events.append(_event("content_block_delta", {"index": self.index, "delta": delta}))

    def close(self) -> None:
        if self.open is not None:
            self.events.append(_event("content_block_stop", {"index": self.index}))
            self.open = None

    def feed(self, parsed: ParsedOutput) -> list[str]:
        """The events of what the parser released; returned and forgotten."""
        if parsed.reasoning:
            if self.open != "thinking":
                self._start({"type": "thinking", "thinking": "", "signature": ""})
            if self.show_thinking:
                self._delta({"type": "thinking_delta", "thinking": parsed.reasoning})
        if parsed.content:
            if self.open != "text":
                self._start({"type": "text", "text": ""})
            self._delta({"type": "text_delta", "text": parsed.content})
        for call in parsed.tool_calls:
            block = _tool_use(call)
            self._start({**block, "input": {}})
            self._delta({"type": "input_json_delta", "partial_json": call.arguments})
            self.called = True
        return self.drain()

    def drain(self) -> list[str]:
        """The events made since the last drain."""
        events, self.events = self.events, []
        return events


def _parsed(st: _ChoiceState, text: str, done: bool) -> ParsedOutput:
    if st.parser is None:
        return ParsedOutput(content=text)
    parsed = st.parser.feed(text)
    return parsed + st.parser.finish() if done else parsed


class _MessageStream:
    """One streamed Messages answer: the chat stream's outputs as Anthropic's events."""

    def __init__(self, ctx: _Ctx, rid: str, prompt: _Prompt, parsers: Callable[[], OutputParser] | None, show: bool):
        self.ctx, self.rid, self.prompt, self.parsers = ctx, rid, prompt, parsers
        self.blocks = _BlockStream(show)
        self.last: CompletionOutput | None = None

    def start(self, runner: _StreamRunner) -> str:
        message: dict[str, Any] = {
            "id": self.rid,
            "type": "message",
            "role": "assistant",
            "model": _shown_model(self.ctx, runner.params[0].lora),
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": _usage(self.prompt, runner.latest.get(0), 0),
        }
        return _event("message_start", {"message": message})

    async def events(self, runner: _StreamRunner) -> AsyncIterator[str]:
        yield self.start(runner)
        try:
            async with contextlib.aclosing(runner._items()) as items:
                async for _pi, c, st, _start, _end, done in items:
                    if c.finish_reason == "error":
                        yield _error_event(_failure_message(self.ctx, c))
                        return
                    if not st.started:
                        st.started, st.parser = True, self.parsers() if self.parsers is not None else None
                    for event in self.blocks.feed(_parsed(st, runner._delta_text(0, c, st, done), done)):
                        yield event
                    self.last = c
        except (EngineFailure, EngineDeadError, ValueError) as e:
            yield _error_event(f"generation failed: {e}")
            return
        for event in self.end(runner):
            yield event

    def end(self, runner: _StreamRunner) -> list[str]:
        c = self.last
        if c is None:  # the engine's stream ended without an output: never a finished message
            return [_error_event("generation failed: the engine returned no output")]
        self.blocks.close()
        self.blocks.ping()
        stop_reason, stop_sequence = _stop(c, self.blocks.called)
        delta = {"stop_reason": stop_reason, "stop_sequence": stop_sequence}
        usage = _usage(self.prompt, runner.latest.get(0), len(c.token_ids))
        return [
            *self.blocks.drain(),
            _event("message_delta", {"delta": delta, "usage": usage}),
            _event("message_stop", {}),
        ]


def _error_event(message: str) -> str:
    return f"event: error\ndata: {json.dumps(anthropic_error_body(500, message))}\n\n"


# --------------------------------------------------------------------------- routes


def _error_response(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(anthropic_error_body(status, message), status, headers=headers)


def _validation_message(errors: Sequence[Any], body: Any) -> str:
    """Pydantic's errors as ``path: message`` parts, paths as the client wrote them (field names and
    indices, without the union's branch names); up to three fields. Of a union's errors, those of the
    branch whose type matched explain the problem; the type mismatches of the others are dropped."""
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid" or len(tuple(first.get("loc", ()))) < 2:
        return validation_api_error(errors, body).message  # a body that is not a JSON object
    chosen = [e for e in errors if not str(e.get("type", "")).endswith("_type")] or list(errors)
    by_path: dict[str, list[str]] = {}
    for e in chosen:
        message = "Extra inputs are not permitted" if e.get("type") == "extra_forbidden" else str(e.get("msg"))
        if message not in by_path.setdefault(_client_path(e), []):
            by_path[_client_path(e)].append(message)
    return "; ".join(f"{p}: {' or '.join(m)}" for p, m in list(by_path.items())[:3])


def _client_path(error: Any) -> str:
    """The top-level field, then the field names and indices below it; an unknown key by its name."""
    loc = tuple(error["loc"])[1:]
    # A content block's union tag (its type) follows its index: not a field the client wrote.
    inner = [p for i, p in enumerate(loc[1:-1], 1) if not (isinstance(loc[i - 1], int) and p in _KNOWN_BLOCKS)]
    parts = [str(loc[0])] + [str(p) for p in inner if isinstance(p, int) or p in _FIELD_NAMES]
    last = loc[-1] if len(loc) > 1 else None
    if last is not None and (isinstance(last, int) or last in _FIELD_NAMES or error.get("type") == "extra_forbidden"):
        parts.append(str(last))
    return ".".join(parts)


def _anthropic_route(max_depth: int) -> type[APIRoute]:
    """Routes whose every error (validation, ``APIError``, HTTP) answers in Anthropic's shape; bodies
    are parsed with bounded nesting as on every other route."""

    class AnthropicRoute(json_depth_route(max_depth)):  # type: ignore[misc]
        def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
            handler: Callable[[Request], Coroutine[Any, Any, Response]] = super().get_route_handler()

            async def answer(request: Request) -> Response:
                try:
                    return await handler(request)
                except APIError as e:
                    return _error_response(e.status, e.message, e.headers)
                except RequestValidationError as e:
                    return _error_response(400, _validation_message(e.errors(), e.body))
                except StarletteHTTPException as e:
                    detail = str(e.detail)
                    if e.status_code == 400 and detail == "There was an error parsing the body":
                        detail = "could not parse the JSON body of the request"
                    return _error_response(e.status_code, detail, dict(e.headers or {}))

            return answer

    return AnthropicRoute


def _check(ctx: _Ctx, req: _MessagesFields) -> None:
    _check_model(ctx, req.model)
    _check_ready(ctx)


async def _create(ctx: _Ctx, req: MessagesRequest, raw: Request) -> Response:
    """One Messages request through the chat machinery: prompt, parsers, grammar, sampling, capacity."""
    _check(ctx, req)
    if req.max_tokens < 1:
        raise APIError(400, "max_tokens: must be at least 1 (no cache pre-warming requests)", param="max_tokens")
    budget = req.thinking.budget_tokens if req.thinking is not None and req.thinking.type == "enabled" else None
    if budget is not None and budget >= req.max_tokens:  # as Anthropic: thinking counts toward max_tokens
        raise APIError(400, "thinking.budget_tokens: must be less than max_tokens", param="thinking")
    chat, prefill = _chat_request(req)
    prompt = await asyncio.to_thread(_prompt, ctx, chat, prefill)
    parsers = _output_parsers(ctx, chat, prompt)
    field, grammar = await _request_grammar(ctx, chat, _tool_choice_spec(ctx, chat, parsers))
    params = _sampling_params(ctx, chat, [prompt], req.max_tokens, None, structured=grammar)
    _check_capacity(ctx, chat, [prompt], params)
    rid = f"msg_{uuid.uuid4().hex}"
    show = req.thinking is None or req.thinking.display != "omitted"
    if req.stream:
        runner = await _start_stream(ctx, rid, [prompt], params)
        return _sse(_MessageStream(ctx, rid, prompt, parsers, show).events(runner))
    (out,) = await _run_all(ctx, rid, [prompt], params, raw, field)
    return await _json_response(_message_body, ctx, rid, prompt, out, parsers, show=show, lora=params[0].lora)


def add_anthropic_routes(app: FastAPI, ctx: _Ctx) -> None:
    """``POST /v1/messages`` and ``/v1/messages/count_tokens``; other paths and methods under
    ``/v1/messages`` are Anthropic-shaped 404s and 405s."""
    router = APIRouter(route_class=_anthropic_route(ctx.settings.max_json_depth))

    @router.post(ANTHROPIC_PATH, response_model=None)
    async def messages(req: MessagesRequest, raw: Request) -> Response:
        return await _create(ctx, req, raw)

    @router.post(f"{ANTHROPIC_PATH}/count_tokens")
    async def count_tokens(req: CountTokensRequest) -> dict[str, int]:
        _check(ctx, req)
        return await asyncio.to_thread(_count, ctx, req)

    @router.api_route(ANTHROPIC_PATH, methods=["GET", "PUT", "PATCH", "DELETE"], include_in_schema=False)
    @router.api_route(
        f"{ANTHROPIC_PATH}/count_tokens", methods=["GET", "PUT", "PATCH", "DELETE"], include_in_schema=False
    )
    async def wrong_method(raw: Request) -> Response:
        return _error_response(405, f"{raw.method} is not allowed on {raw.url.path}; use POST", {"allow": "POST"})

    @router.api_route(
        ANTHROPIC_PATH + "/{rest:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"], include_in_schema=False
    )
    async def not_found(raw: Request) -> Response:
        return _error_response(404, f"no route {raw.url.path}")

    app.include_router(router)
