"""OpenAI's Responses API: ``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``.

A request is translated into a chat-completions request and served by the chat machinery itself: the
chat template renders the conversation (``instructions`` as the system turn, function calls and their
outputs as assistant tool calls and tool messages, reasoning items as ``reasoning_content``), the tool
and reasoning parsers read the output, ``text.format`` becomes ``response_format`` (the same grammars)
and ``tool_choice`` the same constrained calls. What differs is the shape of what goes out: output
items (reasoning, message, function_call) and, streamed, typed events with sequence numbers.

Responses are kept (``store``, true by default as OpenAI) in a store bounded in entries, age and bytes
(least recently used evicted first), so ``previous_response_id`` continues a conversation and
``GET``/``DELETE`` find it while it is kept."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import msgspec
from fastapi import Body, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..engine import EngineDeadError
from ..parsers import OutputParser, ParsedOutput, ParsedToolCall
from ..request import RequestOutput, SamplingParams
from ..structured import grammar_failed
from .async_llm import EngineFailure
from .openai_requests import (
    _chat_prompt,
    _check_capacity,
    _check_model,
    _check_ready,
    _check_tool_choice,
    _Ctx,
    _output_parsers,
    _Prompt,
    _request_grammar,
    _sampling_params,
    _shown_model,
    _tool_choice_spec,
)
from .protocol import (
    MAX_TOOLS,
    APIError,
    Bool,
    ChatCompletionRequest,
    Float,
    Int64,
    JSONObject,
    StreamOptions,
    Text,
)
from .responses import _failure_message, _run_all, _usage
from .streaming import _sse, _start_stream, _StreamRunner

__all__ = ["ResponseStore", "ResponsesRequest", "add_responses_routes"]

MAX_ITEMS = 4096  # input items of one request
_ENCODE = msgspec.json.Encoder().encode

# Request fields of OpenAI's API this server does not serve, and the values that ask for nothing (null
# always does): any other value is a 400 naming the field, never accepted and ignored.
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "background": (False,),
    "include": ([],),
    "reasoning": ({},),  # a dict of nulls asks for nothing too (_is_neutral)
    "top_logprobs": (0,),
    "truncation": ("disabled",),
    "conversation": (),
    "prompt": (),
    "max_tool_calls": (),
    "context_management": (),
    "moderation": (),
    "image": (),
    "prompt_cache_retention": (),
    "prompt_cache_options": (),
    "access_programs": (),
    "background_options": (),
}
# Chat's names of the fields a response request sets, as the client wrote them.
_RENAMED = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens",
    "response_format": "text.format",
}
_RENAMED_WORDS = re.compile(r"\b(max_completion_tokens|response_format)\b")
_MESSAGE_PATH = re.compile(r"\bmessages\.(\d+)")  # chat's path of a message (instructions and items as rendered)


# --------------------------------------------------------------------------- request models


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class TextFormat(_Strict):
    """``text.format``: plain text, any JSON object, or JSON valid against ``schema``."""

    type: Literal["text", "json_object", "json_schema"]
    name: Annotated[Text, Field(max_length=256)] | None = None
    description: Text | None = None
    json_schema: JSONObject | None = Field(None, alias="schema")
    strict: Bool | None = None


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: None = None  # any value asks for something a served model cannot be told


class FunctionTool(_Strict):
    type: Literal["function"]
    name: Annotated[Text, Field(min_length=1, max_length=256)]
    description: Text | None = None
    parameters: JSONObject | None = None
    strict: Bool | None = None


class MessageItem(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Text | list[JSONObject]
    id: Text | None = None
    status: Text | None = None
    phase: Text | None = None


class FunctionCallItem(_Strict):
    type: Literal["function_call"]
    call_id: Annotated[Text, Field(min_length=1, max_length=256)]
    name: Annotated[Text, Field(min_length=1, max_length=256)]
    arguments: Text
    id: Text | None = None
    status: Text | None = None


class FunctionCallOutputItem(_Strict):
    type: Literal["function_call_output"]
    call_id: Annotated[Text, Field(min_length=1, max_length=256)]
    output: Text | list[JSONObject]
    id: Text | None = None
    status: Text | None = None


class ReasoningItem(_Strict):
    type: Literal["reasoning"]
    id: Text | None = None
    summary: list[JSONObject] = Field(default_factory=list)
    content: list[JSONObject] | None = None
    encrypted_content: None = None  # this server never hands out encrypted reasoning to take back
    status: Text | None = None


_ITEMS: dict[str, type[BaseModel]] = {
    "message": MessageItem,
    "function_call": FunctionCallItem,
    "function_call_output": FunctionCallOutputItem,
    "reasoning": ReasoningItem,
}


class ResponsesRequest(_Strict):
    """``POST /v1/responses``. Items and tools arrive as objects and are checked by their ``type``
    (:func:`_parse_item`, :func:`_tools`), so an unsupported kind is named as such."""

    model: Text | None = None
    input: Text | Annotated[list[JSONObject], Field(min_length=1, max_length=MAX_ITEMS)]
    instructions: Text | None = None
    tools: Annotated[list[JSONObject], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | JSONObject | None = None
    parallel_tool_calls: Bool | None = None
    text: TextConfig | None = None
    max_output_tokens: Int64 | None = None
    temperature: Float | None = None
    top_p: Float | None = None
    store: Bool = True
    previous_response_id: Text | None = None
    stream: Bool = False
    stream_options: StreamOptions | None = None
    priority: Int64 = 0  # vLLM's, as chat's: lower is served first under scheduling_policy "priority"
    # Accepted and echoed or ignored: metadata about the caller that changes nothing generated.
    metadata: (
        Annotated[
            dict[Annotated[Text, Field(max_length=64)], Annotated[Text, Field(max_length=512)]], Field(max_length=16)
        ]
        | None
    ) = None
    user: Text | None = None
    safety_identifier: Text | None = None
    prompt_cache_key: Text | None = None
    service_tier: Text | None = None


# Names that may appear in an error's location; anything else there is pydantic's name of a union branch.
_MODELS: tuple[type[BaseModel], ...] = (ResponsesRequest, TextConfig, TextFormat, FunctionTool, *_ITEMS.values())
_FIELD_NAMES = frozenset({"schema"}.union(*(m.model_fields for m in _MODELS)))


def _is_neutral(name: str, value: Any) -> bool:
    if value is None:
        return True
    if name == "reasoning" and isinstance(value, dict):
        return all(v is None for v in value.values())
    return any(type(value) is type(v) and value == v for v in UNSUPPORTED[name])


def _parse_request(body: Any) -> ResponsesRequest:
    """The request, or a 400 naming the field: unsupported fields first, then the model's checks."""
    if not isinstance(body, dict):
        # FastAPI hands over the raw bytes of a body sent without content-type: application/json.
        how = " sent with content-type: application/json" if isinstance(body, bytes | bytearray) else ""
        raise APIError(400, f"the request body must be a JSON object{how}", code="invalid_json")
    for name, value in body.items():
        if name in UNSUPPORTED and not _is_neutral(name, value):
            raise APIError(400, f"{name} is not supported by this server", param=name, code="unsupported_parameter")
    fields = {k: v for k, v in body.items() if k not in UNSUPPORTED}
    # OpenAI's schema lets a client send null for any field it leaves at its default.
    fields = {k: v for k, v in fields.items() if v is not None}
    req: ResponsesRequest = _validated(ResponsesRequest, fields, "")
    return req


def _validated(model: type[Any], data: Any, where: str) -> Any:
    """``model`` validated from ``data`` (at ``where`` in the body), errors as one 400."""
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise _validation_error(e, where) from None


def _validation_error(e: ValidationError, where: str) -> APIError:
    errors = e.errors()
    # A union reports one error per branch: one whose type matched explains best, else the deepest.
    field_errors = [x for x in errors if x["loc"][:1] == errors[0]["loc"][:1]]
    matched = [x for x in field_errors if not x["type"].endswith("_type")]
    err = matched[0] if matched else max(field_errors, key=lambda x: len(x["loc"]))
    # Union branch names (``str``, ``list[...]``) are pydantic's, not the client's.
    loc, last = err["loc"], []
    if err["type"] == "extra_forbidden":  # the unknown name itself is the client's
        loc, last = loc[:-1], [str(loc[-1])]
    path = [str(p) for p in loc if isinstance(p, int) or p in _FIELD_NAMES] + last
    full = ".".join(filter(None, [where, *path]))
    param = full.split(".")[0] or None
    if err["type"] == "extra_forbidden":
        return APIError(400, f"unknown field '{full}'", param=param, code="unknown_parameter")
    return APIError(400, f"{full}: {err['msg']}" if full else err["msg"], param=param, code="invalid_value")


def _parse_item(raw: dict[str, Any], where: str) -> BaseModel:
    kind = raw.get("type", "message")
    model = _ITEMS.get(kind) if isinstance(kind, str) else None
    if model is None:
        raise APIError(
            400,
            f"{where}: input items of type {kind!r} are not supported by this server (message, function_call, "
            "function_call_output and reasoning are)",
            param="input",
            code="unsupported_parameter",
        )
    return _validated(model, {k: v for k, v in raw.items() if v is not None}, where)  # type: ignore[no-any-return]


def _tools(req: ResponsesRequest) -> list[FunctionTool]:
    tools = []
    for i, raw in enumerate(req.tools or ()):
        if raw.get("type") != "function":
            raise APIError(
                400,
                f"tools.{i}: tools of type {raw.get('type')!r} are not supported by this server (function tools are)",
                param="tools",
                code="unsupported_parameter",
            )
        tools.append(_validated(FunctionTool, {k: v for k, v in raw.items() if v is not None}, f"tools.{i}"))
    return tools


def _tool_choice(req: ResponsesRequest) -> str | dict[str, Any] | None:
    """Chat's ``tool_choice`` of the request's: a named function ``{"type": "function", "name": N}``
    becomes ``{"type": "function", "function": {"name": N}}``; other kinds are a 400."""
    choice = req.tool_choice
    if choice is None or isinstance(choice, str):
        return choice
    name = choice.get("name")
    if choice.get("type") != "function" or set(choice) != {"type", "name"} or not isinstance(name, str):
        raise APIError(
            400,
            f"tool_choice {choice.get('type')!r} is not supported by this server (none, auto, required, or "
            '{"type": "function", "name": ...} are)',
            param="tool_choice",
            code="unsupported_parameter",
        )
    return {"type": "function", "function": {"name": name}}


# --------------------------------------------------------------------------- items -> chat messages


def _texts(parts: str | list[dict[str, Any]], kinds: tuple[str, ...], where: str) -> str:
    """The text of a content list (parts joined), refusing parts that are not text."""
    if isinstance(parts, str):
        return parts
    out = []
    for j, part in enumerate(parts):
        kind, text = part.get("type"), part.get("text")
        if kind not in kinds:
            raise APIError(
                400,
                f"{where}.{j}: content of type {kind!r} is not supported by this server (text only: "
                f"{', '.join(kinds)})",
                param="input",
                code="unsupported_parameter",
            )
        if not isinstance(text, str):
            raise APIError(400, f"{where}.{j}.text: must be a string", param="input", code="invalid_value")
        out.append(text)
    return "".join(out)


@dataclass(slots=True)
class _Messages:
    """Chat messages being built from items: function calls join the assistant turn before them,
    and reasoning waits for the assistant turn it belongs to."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    reasoning: str | None = None

    def assistant(self, *, new: bool) -> dict[str, Any]:
        last = self.messages[-1] if self.messages else None
        if new or last is None or last["role"] != "assistant" or self.reasoning is not None:
            last = {"role": "assistant", "content": ""}
            self.messages.append(last)
        if self.reasoning is not None:
            last["reasoning_content"], self.reasoning = self.reasoning, None
        return last

    def add(self, item: BaseModel, where: str) -> None:
        if isinstance(item, MessageItem):
            # Either kind of text part in any role, as the SDK's input message types allow.
            text = _texts(item.content, ("input_text", "output_text"), f"{where}.content")
            if item.role == "assistant":
                self.assistant(new=True)["content"] = text
            else:
                self.messages.append({"role": item.role, "content": text})
        elif isinstance(item, FunctionCallItem):
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            self.assistant(new=False).setdefault("tool_calls", []).append(call)
        elif isinstance(item, FunctionCallOutputItem):
            text = _texts(item.output, ("input_text",), f"{where}.output")
            self.messages.append({"role": "tool", "tool_call_id": item.call_id, "content": text})
        elif isinstance(item, ReasoningItem):
            parts = item.content if item.content is not None else item.summary
            kinds = ("reasoning_text",) if item.content is not None else ("summary_text",)
            self.reasoning = (self.reasoning or "") + _texts(parts, kinds, f"{where}.content")

    def done(self) -> list[dict[str, Any]]:
        if self.reasoning is not None:  # reasoning last: the assistant turn it belongs to has no text
            self.assistant(new=True)
        return self.messages


def _input_items(req: ResponsesRequest) -> list[dict[str, Any]]:
    if isinstance(req.input, str):
        return [{"type": "message", "role": "user", "content": req.input}]
    return list(req.input)


def _chat_messages(instructions: str | None, items: list[dict[str, Any]], first_new: int) -> list[dict[str, Any]]:
    """The conversation as chat messages: ``instructions`` as the system turn, then every item.
    Items from ``first_new`` on are the request's own (errors name them ``input.I``)."""
    built = _Messages()
    if instructions is not None:
        built.messages.append({"role": "system", "content": instructions})
    for i, raw in enumerate(items):
        where = f"input.{i - first_new}" if i >= first_new else f"previous_response_id's item {i}"
        built.add(_parse_item(raw, where), where)
    return built.done()


def _response_format(req: ResponsesRequest) -> dict[str, Any] | None:
    fmt = req.text.format if req.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.json_schema is None:
        raise APIError(400, "text.format json_schema needs schema", param="text.format")
    spec = {"name": fmt.name, "schema": fmt.json_schema, "strict": fmt.strict, "description": fmt.description}
    return {"type": "json_schema", "json_schema": {k: v for k, v in spec.items() if v is not None}}


def _chat_request(req: ResponsesRequest, items: list[dict[str, Any]], first_new: int) -> ChatCompletionRequest:
    tools = _tools(req)
    chat: dict[str, Any] = {
        "model": req.model,
        "messages": _chat_messages(req.instructions, items, first_new),
        "max_completion_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "stream": req.stream,
        "response_format": _response_format(req),
        "tools": [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)} for t in tools]
        or None,
        "tool_choice": _tool_choice(req),
        "parallel_tool_calls": req.parallel_tool_calls,
        "priority": req.priority,
    }
    return _validated(ChatCompletionRequest, {k: v for k, v in chat.items() if v is not None}, "input")  # type: ignore[no-any-return]


@contextlib.contextmanager
def _in_responses_terms() -> Iterator[None]:
    """Errors of the chat machinery, naming the fields as a response request calls them."""
    try:
        yield
    except APIError as e:
        e.param = _RENAMED.get(e.param or "", e.param)
        e.message = _RENAMED_WORDS.sub(lambda m: _RENAMED[m.group(1)], e.message)
        e.message = _MESSAGE_PATH.sub(r"the rendered conversation's message \1", e.message)
        raise


# --------------------------------------------------------------------------- the store


@dataclass(slots=True)
class _Entry:
    body: dict[str, Any]
    items: list[dict[str, Any]]  # the conversation's input items (those of previous responses first)
    size: int


class ResponseStore:
    """Stored responses, bounded in number (``max_entries``), age (``max_age`` seconds) and encoded
    bytes (``max_bytes``); past a bound the least recently used go first, and a response larger than
    ``max_bytes`` alone is not kept. Touched only on the event loop, so it needs no lock."""

    def __init__(
        self, max_entries: int, max_age: float, max_bytes: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.max_entries, self.max_age, self.max_bytes, self.clock = max_entries, max_age, max_bytes, clock
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # least recently used first
        self._ages: OrderedDict[str, float] = OrderedDict()  # oldest first: expiry stops at the first young one
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, rid: str, body: dict[str, Any], items: list[dict[str, Any]]) -> bool:
        """Keep ``body`` and its input ``items``; whether it was kept."""
        size = len(_ENCODE([body, items]))
        self.delete(rid)
        self._expire()
        if self.max_entries == 0 or size > self.max_bytes:
            return False
        self._entries[rid], self._ages[rid] = _Entry(body, items, size), self.clock()
        self.bytes += size
        while len(self._entries) > self.max_entries or self.bytes > self.max_bytes:
            self._drop(next(iter(self._entries)))
        return True

    def get(self, rid: str) -> _Entry | None:
        self._expire()
        entry = self._entries.get(rid)
        if entry is not None:
            self._entries.move_to_end(rid)
        return entry

    def delete(self, rid: str) -> bool:
        if rid not in self._entries:
            return False
        self._drop(rid)
        return True

    def _drop(self, rid: str) -> None:
        self.bytes -= self._entries.pop(rid).size
        del self._ages[rid]

    def _expire(self) -> None:
        cutoff = self.clock() - self.max_age
        while self._ages and next(iter(self._ages.values())) < cutoff:
            self._drop(next(iter(self._ages)))


# --------------------------------------------------------------------------- output items and events

_DELTA = {"message": "response.output_text.delta", "reasoning": "response.reasoning_text.delta"}
_DONE = {"message": "response.output_text.done", "reasoning": "response.reasoning_text.done"}
_PART = {"message": "output_text", "reasoning": "reasoning_text"}


def _part(kind: str, text: str) -> dict[str, Any]:
    if kind == "message":
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"type": "reasoning_text", "text": text}


class _Output:
    """A response's output items as parsed text arrives, and the stream events that build them: a
    reasoning or message item stays open while text of its kind follows; a function call is whole."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None
        self.text = ""
        self.reasoning = ""  # all reasoning text, for usage

    def feed(self, parsed: ParsedOutput) -> list[dict[str, Any]]:
        events = []
        if parsed.reasoning:
            events += self._text("reasoning", parsed.reasoning)
            self.reasoning += parsed.reasoning
        if parsed.content:
            events += self._text("message", parsed.content)
        for call in parsed.tool_calls:
            events += self._close("completed") + self._call(call)
        return events

    def finish(self, status: str) -> list[dict[str, Any]]:
        """Close the open item; a response with no output at all gets an empty message."""
        events = self._open("message") if not self.items else []
        return events + self._close(status)

    def _where(self) -> dict[str, Any]:
        assert self.open is not None
        return {"item_id": self.open["id"], "output_index": len(self.items) - 1}

    def _text(self, kind: str, delta: str) -> list[dict[str, Any]]:
        events = []
        if self.open is None or self.open["type"] != kind:
            events = self._close("completed") + self._open(kind)
        self.text += delta
        event = {"type": _DELTA[kind], **self._where(), "content_index": 0, "delta": delta}
        return [*events, {**event, "logprobs": []} if kind == "message" else event]

    def _open(self, kind: str) -> list[dict[str, Any]]:
        if kind == "message":
            item = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "content": []}
        else:
            item = {"id": f"rs_{uuid.uuid4().hex}", "type": "reasoning", "summary": [], "content": []}
        item["status"] = "in_progress"
        self.items.append(item)
        self.open, self.text = item, ""
        added = {"type": "response.output_item.added", "output_index": len(self.items) - 1, "item": dict(item)}
        part = {"type": "response.content_part.added", **self._where(), "content_index": 0, "part": _part(kind, "")}
        return [added, part]

    def _close(self, status: str) -> list[dict[str, Any]]:
        if self.open is None:
            return []
        kind, where, part = self.open["type"], self._where(), _part(self.open["type"], self.text)
        self.open.update(content=[part], status=status)
        done = {"type": _DONE[kind], **where, "content_index": 0, "text": self.text}
        events = [
            {**done, "logprobs": []} if kind == "message" else done,
            {"type": "response.content_part.done", **where, "content_index": 0, "part": part},
            {"type": "response.output_item.done", "output_index": where["output_index"], "item": self.open},
        ]
        self.open = None
        return events

    def _call(self, call: ParsedToolCall) -> list[dict[str, Any]]:
        item = {
            "id": f"fc_{uuid.uuid4().hex}",
            "type": "function_call",
            "call_id": f"call_{uuid.uuid4().hex[:24]}",
            "name": call.name,
            "arguments": "",
            "status": "in_progress",
        }
        self.items.append(item)
        where = {"item_id": item["id"], "output_index": len(self.items) - 1}
        added = {"type": "response.output_item.added", "output_index": where["output_index"], "item": dict(item)}
        item.update(arguments=call.arguments, status="completed")
        return [
            added,
            {"type": "response.function_call_arguments.delta", **where, "delta": call.arguments},
            {"type": "response.function_call_arguments.done", **where, "arguments": call.arguments},
            {"type": "response.output_item.done", "output_index": where["output_index"], "item": item},
        ]


# --------------------------------------------------------------------------- bodies


@dataclass(slots=True)
class _Plan:
    """A request ready to run: its chat form, prompt, parsers and sampling parameters, and the
    conversation's input items (a previous response's first)."""

    rid: str
    req: ResponsesRequest
    chat: ChatCompletionRequest
    prompt: _Prompt
    parsers: Callable[[], OutputParser] | None
    params: list[SamplingParams]
    items: list[dict[str, Any]]
    grammar_param: str | None = None  # the field that sent the grammar, in this API's terms
    created: int = field(default_factory=lambda: int(time.time()))


def _body(
    ctx: _Ctx, plan: _Plan, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None
) -> dict[str, Any]:
    req = plan.req
    fmt = req.text.format.model_dump(by_alias=True, exclude_none=True) if req.text and req.text.format else None
    return {
        "id": plan.rid,
        "object": "response",
        "created_at": plan.created,
        "status": status,
        "background": False,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "model": _shown_model(ctx, plan.params[0].lora),
        "output": output,
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id,
        "reasoning": {"effort": None, "summary": None},
        "store": req.store,
        "temperature": req.temperature,
        "text": {"format": fmt or {"type": "text"}},
        "tool_choice": req.tool_choice or "auto",
        "tools": [t.model_dump(exclude_none=True) for t in _tools(req)],
        "top_p": req.top_p,
        "truncation": "disabled",
        "usage": usage,
        "user": req.user,
        "metadata": req.metadata or {},
    }


def _status(out: RequestOutput) -> str:
    return "incomplete" if out.outputs[0].finish_reason == "length" else "completed"


def _response_usage(ctx: _Ctx, plan: _Plan, out: RequestOutput, output: _Output) -> dict[str, Any]:
    usage = _usage([plan.prompt], [out])
    tok = ctx.llm.tokenizer
    # The parser hands back text: its tokens are counted again (close to, not always, the sampled ones).
    reasoning = len(tok.encode(output.reasoning)) if tok is not None and output.reasoning else 0
    return {
        "input_tokens": usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]},
        "output_tokens": usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": min(reasoning, usage["completion_tokens"])},
        "total_tokens": usage["total_tokens"],
    }


def _final_body(ctx: _Ctx, plan: _Plan, out: RequestOutput) -> dict[str, Any]:
    output = _Output()
    text = out.outputs[0].text
    output.feed(plan.parsers().parse(text) if plan.parsers is not None else ParsedOutput(content=text))
    status = _status(out)
    output.finish(status)
    return _body(ctx, plan, status, output.items, _response_usage(ctx, plan, out, output))


def _remember(store: ResponseStore, plan: _Plan, body: dict[str, Any]) -> None:
    if plan.req.store:
        store.put(plan.rid, body, plan.items)


# --------------------------------------------------------------------------- streaming


def _sse_event(event: dict[str, Any]) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"


async def _events(ctx: _Ctx, store: ResponseStore, plan: _Plan, runner: _StreamRunner) -> AsyncIterator[str]:
    """The response's SSE events, numbered by ``sequence_number`` from 0."""
    seq = 0
    async for event in _typed_events(ctx, store, plan, runner):
        yield _sse_event({**event, "sequence_number": seq})
        seq += 1


async def _typed_events(
    ctx: _Ctx, store: ResponseStore, plan: _Plan, runner: _StreamRunner
) -> AsyncIterator[dict[str, Any]]:
    shell = _body(ctx, plan, "in_progress", [], None)
    yield {"type": "response.created", "response": shell}
    yield {"type": "response.in_progress", "response": shell}
    output, parser = _Output(), plan.parsers() if plan.parsers is not None else None
    try:
        async with contextlib.aclosing(runner._items()) as items:
            async for _pi, c, st, _start, _end, done in items:
                if c.finish_reason == "error":
                    for event in _failure(ctx, plan, output, _failure_message(ctx, c), grammar_failed(c.error)):
                        yield event
                    return
                text = runner._delta_text(0, c, st, done)
                parsed = (parser.feed(text) + (parser.finish() if done else ParsedOutput())) if parser else None
                for event in output.feed(parsed if parsed is not None else ParsedOutput(content=text)):
                    yield event
    except (EngineFailure, EngineDeadError, ValueError) as e:
        for event in _failure(ctx, plan, output, f"generation failed: {e}"):
            yield event
        return
    final = runner.finals[0]
    status = _status(final)
    for event in output.finish(status):
        yield event
    body = _body(ctx, plan, status, output.items, _response_usage(ctx, plan, final, output))
    _remember(store, plan, body)
    yield {"type": f"response.{status}", "response": body}


def _failure(ctx: _Ctx, plan: _Plan, output: _Output, message: str, grammar: bool = False) -> list[dict[str, Any]]:
    """An ``error`` event, then ``response.failed`` with what was generated before the failure; a
    grammar that failed in the worker is the client's (``invalid_grammar`` naming its field, as the
    non-streamed 400 does)."""
    body = _body(ctx, plan, "failed", output.items, None)
    code, param = ("invalid_grammar", plan.grammar_param) if grammar else ("generation_failed", None)
    body["error"] = {"code": "invalid_grammar" if grammar else "server_error", "message": message}
    return [
        {"type": "error", "code": code, "message": message, "param": param},
        {"type": "response.failed", "response": body},
    ]


# --------------------------------------------------------------------------- routes


async def _plan(ctx: _Ctx, store: ResponseStore, body: Any) -> _Plan:
    """Check the request and put it through the chat machinery, errors in the Responses API's words."""
    req = _parse_request(body)
    _check_model(ctx, req.model)
    _check_ready(ctx)
    history: list[dict[str, Any]] = []
    if req.previous_response_id is not None:
        prev = store.get(req.previous_response_id)
        if prev is None:
            raise APIError(
                400,
                f"previous response {req.previous_response_id!r} is not stored (never stored, deleted, or "
                "evicted from the bounded store)",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        history = prev.items + prev.body["output"]
    items = history + _input_items(req)
    with _in_responses_terms():
        chat = _chat_request(req, items, len(history))
        _check_tool_choice(chat)
        prompt = await asyncio.to_thread(_chat_prompt, ctx, chat)
        parsers = _output_parsers(ctx, chat, prompt)
        grammar_field, grammar = await _request_grammar(ctx, chat, _tool_choice_spec(ctx, chat, parsers))
        max_tokens = chat.max_completion_tokens
        params = _sampling_params(
            ctx, chat, [prompt], max_tokens, None, max_tokens_param="max_completion_tokens", structured=grammar
        )
        _check_capacity(ctx, chat, [prompt], params)
    grammar_param = _RENAMED.get(grammar_field, grammar_field) if grammar_field else None
    return _Plan(f"resp_{uuid.uuid4().hex}", req, chat, prompt, parsers, params, items, grammar_param)


async def _create(ctx: _Ctx, store: ResponseStore, body: Any, raw: Request) -> Response:
    plan = await _plan(ctx, store, body)
    if plan.req.stream:
        runner = await _start_stream(ctx, plan.rid, [plan.prompt], plan.params)
        return _sse(_events(ctx, store, plan, runner))
    outs = await _run_all(ctx, plan.rid, [plan.prompt], plan.params, raw, plan.grammar_param)
    built = await asyncio.to_thread(_final_body, ctx, plan, outs[0])
    _remember(store, plan, built)
    return Response(_ENCODE(built), media_type="application/json")


def _not_found(rid: str) -> APIError:
    return APIError(404, f"no stored response with id {rid!r}", param="response_id", code="not_found")


def _no_query(raw: Request) -> None:
    if raw.query_params:
        name = next(iter(raw.query_params))
        raise APIError(400, f"query parameter {name} is not supported by this server", param=name)


def add_responses_routes(app: FastAPI, ctx: _Ctx) -> ResponseStore:
    """Adds the Responses API's routes to ``app``; returns their store (also ``app.state.response_store``)."""
    s = ctx.settings
    store = ResponseStore(s.response_store_max_entries, s.response_store_max_age, s.response_store_max_bytes)
    app.state.response_store = store

    @app.post("/v1/responses", response_model=None)
    async def create(body: Annotated[Any, Body()], raw: Request) -> Response:
        return await _create(ctx, store, body, raw)

    @app.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str, raw: Request) -> JSONResponse:
        _no_query(raw)
        entry = store.get(response_id)
        if entry is None:
            raise _not_found(response_id)
        return JSONResponse(entry.body)

    @app.delete("/v1/responses/{response_id}")
    async def delete(response_id: str, raw: Request) -> JSONResponse:
        _no_query(raw)
        if not store.delete(response_id):
            raise _not_found(response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    return store
