"""Request bodies of the OpenAI API (plus the vLLM sampling extras), the OpenAI error shape, and the
translation of request-validation errors into OpenAI errors.

The models are strict: JSON types must match (no ``"yes"`` for a bool, no ``true`` for an integer;
floats accept integers), every integer fits in int64, and every string is valid Unicode (a lone UTF-16
surrogate such as ``"\\ud800"`` cannot be tokenized or sent to the worker). Unknown fields are refused,
so a client never silently loses an option it relies on; only ``IGNORED_FIELDS`` are accepted and
ignored, and ``UNSUPPORTED_FIELDS`` are refused with a message saying so unless they hold a value that
asks for nothing (``null``, ``tools: []``, ``tool_choice: "none"``, ``best_of`` = ``n``...); a field a
request model declares (chat's ``tools``, ``tool_choice``, ``parallel_tool_calls``) is its own. Value ranges
are checked once, by ``SamplingParams``; bounds that depend on the model (vocabulary size, context
length) are checked in ``openai_requests``.
"""

from __future__ import annotations

import asyncio
import functools
import json
import re
import sys
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import Annotated, Any, Literal

from fastapi import Request, Response
from fastapi.routing import APIRoute
from pydantic import (
    AfterValidator,
    AllowInfNan,
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

__all__ = [
    "IGNORED_FIELDS",
    "UNSUPPORTED_FIELDS",
    "APIError",
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "DetokenizeRequest",
    "JSONDepthError",
    "JSONSchemaFormat",
    "NamedToolChoice",
    "ResponseFormat",
    "StreamOptions",
    "TokenizeChatRequest",
    "TokenizeCompletionRequest",
    "ToolDefinition",
    "error_body",
    "json_depth_route",
    "loads_bounded",
    "validation_api_error",
]

# Bounds that keep one request from exhausting memory before SamplingParams sees it.
MAX_N = 128
MAX_STOP = 16
MAX_STOP_CHARS = 512
MAX_STOP_TOKEN_IDS = 256
MAX_TOOLS = 128
MAX_CHOICES = 1024
MAX_LOGIT_BIAS = 300  # as SamplingParams allows
MAX_ALLOWED_TOKEN_IDS = 262_144
MAX_BAD_WORDS = 128
# Every integer reaches the worker's msgpack wire and int64 tensors.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

# Accepted and ignored: metadata about the caller or the account that changes nothing we generate.
IGNORED_FIELDS = ("user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key")

# Refused with "X is not supported" unless the value asks for nothing (null always does).
UNSUPPORTED_FIELDS: dict[str, tuple[Any, ...]] = {
    "tools": ([],),
    "tool_choice": ("none",),
    "parallel_tool_calls": (),
    "functions": ([],),
    "function_call": ("none",),
    "suffix": ("",),
    "best_of": (),  # accepted when equal to n: see _is_neutral
    "guided_grammar": (),
    "guided_decoding_backend": (),
    "structured_outputs": (),
    "logits_processors": (),
    "reasoning_effort": (),
    "audio": (),
    "modalities": (["text"],),
    "prediction": (),
    "web_search_options": (),
}


class APIError(Exception):
    """An error the client caused (or a clear server condition) rendered as an OpenAI error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# --------------------------------------------------------------------------- client JSON

# A JSON string literal (escapes included) and a run of anything but brackets, for the depth scan.
_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKETS = re.compile(r"[^\[\]{}]+")
_SQUARE = str.maketrans("{}", "[]")


class JSONDepthError(ValueError):
    """Client JSON nested deeper than the ``max_json_depth`` setting."""

    def __init__(self, max_depth: int) -> None:
        super().__init__(f"nested deeper than max_json_depth={max_depth}")
        self.max_depth = max_depth


def _deeper_than(text: str, max_depth: int) -> bool:
    """Whether valid JSON ``text`` nests arrays and objects more than ``max_depth`` deep. Done on the
    text with C-speed passes (a walk of the decoded value costs a Python step per number of a long
    token-id prompt): strings dropped, then brackets only, then each pass deletes the innermost
    pairs, which lowers every group's depth by one."""
    if text.count("[") + text.count("{") <= max_depth:
        return False
    brackets = _NOT_BRACKETS.sub("", _JSON_STRING.sub("", text)).translate(_SQUARE)
    for _ in range(max_depth):
        brackets = brackets.replace("[]", "")
        if not brackets:
            return False
    return bool(brackets)


def loads_bounded(text: str | bytes, max_depth: int) -> Any:
    """``json.loads`` for client JSON: nesting deeper than ``max_depth`` raises :class:`JSONDepthError`
    rather than reaching code that recurses over the value (templates, schemas, pydantic) or, past
    Python's recursion limit, ``RecursionError`` (a 500) in the decoder itself."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise JSONDepthError(max_depth) from None
    if isinstance(text, bytes):
        text = text.decode(json.detect_encoding(text))
    if _deeper_than(text, max_depth):
        raise JSONDepthError(max_depth)
    return value


def _loads_body(body: bytes, max_depth: int) -> Any:
    """The decoded body. What ``json.loads`` reports as something other than a ``JSONDecodeError``
    (invalid UTF-8, an integer past Python's digit limit) and a too deep body are raised as one, so
    that FastAPI answers them as it answers any malformed body: 400 ``invalid_json``."""
    try:
        return loads_bounded(body, max_depth)
    except json.JSONDecodeError:
        raise  # FastAPI reports it with its position
    except UnicodeDecodeError as e:
        reason = f"the body is not valid UTF-8 ({e.reason} at byte {e.start})"
    except JSONDepthError as e:
        reason = f"the body is {e}"
    except ValueError:  # int("9" * 5000): past Python's integer string conversion limit
        reason = f"the body holds an integer of more than {sys.get_int_max_str_digits()} digits"
    raise json.JSONDecodeError(reason, "", 0) from None


# Bodies larger than this are parsed (decoded, depth-checked) in a worker thread, so the streams and
# /health the event loop serves keep going meanwhile; smaller ones take under a millisecond.
_PARSE_OFF_LOOP_BYTES = 64 * 1024


class _BoundedJSONRequest(Request):
    """A request whose JSON body is parsed by :func:`loads_bounded`."""

    max_depth = 64

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            if len(body) > _PARSE_OFF_LOOP_BYTES:  # tens of ms of parsing: off the event loop
                self._json = await asyncio.to_thread(_loads_body, body, self.max_depth)
            else:
                self._json = _loads_body(body, self.max_depth)
        return self._json


def json_depth_route(max_depth: int) -> type[APIRoute]:
    """A route class whose handlers parse JSON bodies with nesting bounded by ``max_depth``: a deep,
    badly encoded or huge-integer body is a 400 ``invalid_json`` like any malformed one. FastAPI
    parses the body before any dependency runs, so the bound has to sit in the request class."""

    class BoundedRequest(_BoundedJSONRequest):
        pass

    BoundedRequest.max_depth = max_depth

    class BoundedJSONRoute(APIRoute):
        def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
            handler = super().get_route_handler()

            async def bounded(request: Request) -> Response:
                return await handler(BoundedRequest(request.scope, request.receive))

            return bounded

    return BoundedJSONRoute


# --------------------------------------------------------------------------- field types


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _printable(text: str) -> str:
    """``text`` with lone surrogates escaped, safe to put in a UTF-8 response."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


_SURROGATE = "contains an unpaired UTF-16 surrogate; send valid Unicode text"


def _unicode_text(text: str) -> str:
    if not _is_unicode(text):
        raise PydanticCustomError("unpaired_surrogate", _SURROGATE)
    return text


def _unicode_json(value: Any) -> Any:
    """Refuses a JSON value any of whose strings (keys included) holds a lone surrogate. Checked at C
    speed on the value's JSON text (a walk in Python holds the event loop for tens of ms on a body of
    thousands of schema branches); only a value that fails is walked, to name where."""
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        _name_surrogate(value)
    return value


def _name_surrogate(value: Any) -> None:
    """Raises the error naming where in ``value`` a string holds a lone surrogate. Iterative, so deep
    nesting cannot exhaust the stack."""
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        path, item = stack.pop()
        children: list[tuple[str, Any]] = []
        if isinstance(item, str):
            bad = not _is_unicode(item)
        elif isinstance(item, dict):
            bad = any(isinstance(k, str) and not _is_unicode(k) for k in item)
            children = [(f"{path}.{k}" if path else str(k), v) for k, v in item.items()]
        else:
            bad = False
            if isinstance(item, list):
                children = [(f"{path}.{i}" if path else str(i), v) for i, v in enumerate(item)]
        if bad:
            where = f" at {_printable(path)}" if path else ""
            raise PydanticCustomError(
                "unpaired_surrogate",
                "contains an unpaired UTF-16 surrogate{where}; send valid Unicode text",
                {"where": where},
            )
        stack.extend(reversed(children))


Text = Annotated[str, Strict(), AfterValidator(_unicode_text)]
StopString = Annotated[str, Strict(), Field(min_length=1, max_length=MAX_STOP_CHARS), AfterValidator(_unicode_text)]
Int64 = Annotated[int, Strict(), Field(ge=INT64_MIN, le=INT64_MAX)]
TokenId = Annotated[int, Strict(), Field(ge=0, le=INT64_MAX)]
Float = Annotated[float, Strict(), AllowInfNan(False)]
Bool = Annotated[bool, Strict()]
JSONObject = Annotated[dict[str, Any], AfterValidator(_unicode_json)]


# --------------------------------------------------------------------------- request models


class StreamOptions(BaseModel):
    # Nested options are benign (e.g. include_obfuscation): unknown ones are ignored.
    model_config = ConfigDict(extra="ignore")

    include_usage: Bool = False


def _is_neutral(name: str, value: Any, body: Mapping[str, Any]) -> bool:
    """Whether an unsupported field's value asks for nothing this server would do differently."""
    if value is None:
        return True
    if name == "best_of":
        return type(value) is int and value == body.get("n", 1)
    return any(type(value) is type(v) and value == v for v in UNSUPPORTED_FIELDS[name])


@functools.cache
def _defaulted_not_nullable(model: type[BaseModel]) -> frozenset[str]:
    """Fields with a default whose type does not admit None: a null for them means "the default"."""
    return frozenset(
        name
        for name, f in model.model_fields.items()
        if not f.is_required() and f.default is not None and "None" not in str(f.annotation)
    )


class JSONSchemaFormat(BaseModel):
    """``response_format.json_schema``: the schema the output must validate against."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: Annotated[Text, Field(max_length=256)] | None = None
    description: Text | None = None
    # "schema" shadows a BaseModel attribute: the field is json_schema under its JSON name "schema".
    json_schema: JSONObject | None = Field(None, alias="schema")
    strict: Bool | None = None


class ResponseFormat(BaseModel):
    """``response_format``: plain text, any JSON object, or JSON matching a schema."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class _SamplingFields(BaseModel):
    """Fields shared by both endpoints; ``None`` means "the checkpoint's generation default"."""

    model_config = ConfigDict(extra="forbid")

    model: Text | None = Field(None, description="Served model name; omitted = the only model.")
    temperature: Float | None = None
    top_p: Float | None = None
    top_k: Int64 | None = None
    min_p: Float | None = None
    presence_penalty: Float | None = None
    frequency_penalty: Float | None = None
    repetition_penalty: Float | None = None
    seed: Int64 | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP)] | None = None
    n: Annotated[int, Strict(), Field(ge=1, le=MAX_N)] = 1
    stream: Bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: Bool = False
    min_tokens: Int64 = 0
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    skip_special_tokens: Bool = True
    # OpenAI's token-id (as text) -> bias in [-100, 100], checked with the model's vocabulary.
    logit_bias: Annotated[dict[Text, Float], Field(max_length=MAX_LOGIT_BIAS)] | None = None
    allowed_token_ids: Annotated[list[TokenId], Field(min_length=1, max_length=MAX_ALLOWED_TOKEN_IDS)] | None = None
    bad_words: Annotated[list[StopString], Field(max_length=MAX_BAD_WORDS)] | None = None
    include_stop_str_in_output: Bool = False
    prompt_logprobs: Int64 | None = None  # vLLM's: the prompt tokens' logprobs, with this many top ones
    priority: Int64 = 0  # vLLM's: lower is served first, under scheduling_policy "priority" only
    # vLLM's disaggregated serving: {"do_remote_decode": true} to a prefill engine; its answer's params to a
    # decode engine (docs/disaggregated.md).
    kv_transfer_params: JSONObject | None = None
    # Structured output: at most one of these (see openai_requests._structured_spec).
    response_format: ResponseFormat | None = None
    guided_json: JSONObject | Text | None = None
    guided_regex: Text | None = None
    guided_choice: Annotated[list[Text], Field(min_length=1, max_length=MAX_CHOICES)] | None = None
    # IGNORED_FIELDS: typed so that they, too, carry nothing that could not be logged or echoed.
    user: Text | None = None
    metadata: dict[Text, Text] | None = None
    store: Bool | None = None
    service_tier: Text | None = None
    safety_identifier: Text | None = None
    prompt_cache_key: Text | None = None

    @model_validator(mode="before")
    @classmethod
    def _drop_neutral_unsupported(cls, data: Any) -> Any:
        # What remains of UNSUPPORTED_FIELDS is refused by extra="forbid" and named by validation_api_error.
        if not isinstance(data, dict):
            return data
        # OpenAI's schema lets a client send null for a field it leaves at its default (n, stream...).
        data = {k: v for k, v in data.items() if not (v is None and k in _defaulted_not_nullable(cls))}
        if not any(k in UNSUPPORTED_FIELDS for k in data):
            return data
        # A model that declares an unsupported name (chat's tools) keeps its value, neutral or not.
        return {
            k: v
            for k, v in data.items()
            if not (k in UNSUPPORTED_FIELDS and k not in cls.model_fields and _is_neutral(k, v, data))
        }

    @field_validator("stream_options")
    @classmethod
    def _stream_options_need_stream(cls, value: StreamOptions | None, info: ValidationInfo) -> StreamOptions | None:
        # As OpenAI: options of a stream that is not asked for are a client's mistake, not silently dropped.
        # A ``stream`` that failed its own validation is absent here; its error is the one reported.
        if value is not None and info.data.get("stream", True) is not True:
            raise PydanticCustomError("stream_options_without_stream", "allowed only when stream is true")
        return value


class CompletionRequest(_SamplingFields):
    prompt: Text | list[Text] | list[TokenId] | list[list[TokenId]]
    max_tokens: Int64 | None = 16
    logprobs: Int64 | None = None
    echo: Bool = False


class ContentPart(BaseModel):
    # Part types other than text are refused when the prompt is built; their other keys do not matter.
    model_config = ConfigDict(extra="ignore")

    type: Text
    text: Text | None = None


class ChatMessage(BaseModel):
    # Extra keys pass through to the chat template, which may read any of them; their strings are checked.
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Text | list[ContentPart] | None = None
    name: Text | None = None
    tool_calls: list[JSONObject] | None = None
    tool_call_id: Text | None = None
    reasoning_content: Text | None = None

    @model_validator(mode="after")
    def _extra_keys_are_unicode(self) -> ChatMessage:
        if self.model_extra:
            _unicode_json(self.model_extra)
        return self


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: Annotated[Text, Field(min_length=1, max_length=256)]
    description: Text | None = None
    parameters: JSONObject | None = None
    strict: Bool | None = None


class ToolDefinition(BaseModel):
    """One entry of ``tools``: a function the model may call, handed to the chat template as a dict."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: Text


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: Int64 | None = None
    max_completion_tokens: Int64 | None = None
    logprobs: Bool = False
    top_logprobs: Int64 | None = None
    add_generation_prompt: Bool = True
    chat_template_kwargs: JSONObject | None = None
    tools: Annotated[list[ToolDefinition], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: Bool | None = None


class TokenizeCompletionRequest(BaseModel):
    """vLLM's ``/tokenize`` body for a text prompt."""

    model_config = ConfigDict(extra="forbid")

    model: Text | None = None
    prompt: Text
    add_special_tokens: Bool = True
    return_token_strs: Bool = False


class TokenizeChatRequest(BaseModel):
    """vLLM's ``/tokenize`` body for chat messages, rendered as ``/v1/chat/completions`` renders them."""

    model_config = ConfigDict(extra="forbid")

    model: Text | None = None
    messages: list[ChatMessage] = Field(..., min_length=1)
    add_generation_prompt: Bool = True
    add_special_tokens: Bool = False
    chat_template_kwargs: JSONObject | None = None
    tools: Annotated[list[ToolDefinition], Field(max_length=MAX_TOOLS)] | None = None
    return_token_strs: Bool = False


class DetokenizeRequest(BaseModel):
    """vLLM's ``/detokenize`` body."""

    model_config = ConfigDict(extra="forbid")

    model: Text | None = None
    tokens: list[TokenId]


def _field_names(*models: type[BaseModel]) -> frozenset[str]:
    return frozenset(name for m in models for name in m.model_fields)


# Names that may appear in an error's location; anything else there is pydantic's name of a union branch.
_FIELD_NAMES = _field_names(
    CompletionRequest,
    ChatCompletionRequest,
    ChatMessage,
    ContentPart,
    StreamOptions,
    ToolDefinition,
    FunctionDefinition,
    NamedToolChoice,
    ResponseFormat,
    JSONSchemaFormat,
    TokenizeCompletionRequest,
    TokenizeChatRequest,
    DetokenizeRequest,
)


# --------------------------------------------------------------------------- validation errors


def validation_api_error(errors: Sequence[Any], body: Any) -> APIError:
    """The OpenAI error for FastAPI's request-validation ``errors`` of a request ``body``: ``param`` is
    the top-level field the client sent, and the message names fields the way the client wrote them."""
    unknown = next((e for e in errors if e.get("type") == "extra_forbidden"), None)
    if unknown is not None:
        return _unknown_field_error(str(unknown["loc"][-1]))
    first = errors[0] if errors else {}
    loc = tuple(first.get("loc", ()))
    if first.get("type") == "json_invalid":
        return _json_error(first, body)
    if len(loc) < 2:
        if first.get("type") == "string_unicode" and isinstance(first.get("input"), str):
            return _unknown_field_error(first["input"])  # a key with a lone surrogate: never a field of ours
        return _body_error(first)
    same_field = [e for e in errors if tuple(e.get("loc", ()))[1:2] == loc[1:2]]
    return APIError(400, _field_message(same_field), param=_printable(str(loc[1])), code="invalid_value")


def _unknown_field_error(name: str) -> APIError:
    shown = _printable(name)
    if name not in UNSUPPORTED_FIELDS:
        return APIError(400, f"unknown field '{shown}'", param=shown, code="unknown_parameter")
    hint = " (only best_of equal to n is accepted)" if name == "best_of" else ""
    return APIError(400, f"{name} is not supported by this server{hint}", param=name, code="unsupported_parameter")


def _json_error(error: Mapping[str, Any], body: Any) -> APIError:
    loc = tuple(error.get("loc", ()))
    pos = loc[1] if len(loc) > 1 and isinstance(loc[1], int) else None
    reason = str(error.get("ctx", {}).get("error", "invalid JSON"))
    if body == "":  # _loads_body's errors: they have no position (FastAPI never parses an empty body)
        where = reason
    elif isinstance(body, str) and pos is not None:
        where = str(json.JSONDecodeError(reason, body, pos))  # adds "line L column C (char N)"
    else:
        where = reason if pos is None else f"{reason} (char {pos})"
    return APIError(400, f"could not parse the JSON body of the request: {where}", code="invalid_json")


def _body_error(error: Mapping[str, Any]) -> APIError:
    value = error.get("input")
    if error.get("type") == "missing":
        message = "the request body is empty (or null); send a JSON object"
    elif isinstance(value, bytes | bytearray):
        message = "the request body must be a JSON object sent with content-type: application/json"
    else:
        message = f"the request body must be a JSON object, not {_json_type(value)}"
    return APIError(400, message, code="invalid_json")


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    return "null" if value is None else type(value).__name__


def _field_message(errors: Sequence[Any]) -> str:
    """One field's errors as ``path: message`` parts. A union reports one error per branch: a branch
    whose type matched and whose value failed explains the problem best; when every branch failed on
    the type, the deepest ones say what was expected where."""
    chosen = [e for e in errors if not str(e.get("type", "")).endswith("_type")]
    if not chosen:
        deepest = max(len(_client_path(e)) for e in errors)
        chosen = [e for e in errors if len(_client_path(e)) == deepest]
    by_path: dict[str, list[str]] = {}
    for e in chosen:
        messages = by_path.setdefault(".".join(_client_path(e)), [])
        # A length-constrained string meets the surrogate before our validator does.
        msg = _SURROGATE if e.get("type") == "string_unicode" else str(e.get("msg"))
        if msg not in messages:
            messages.append(msg)
    parts = [f"{path}: {_either(msgs)}" for path, msgs in list(by_path.items())[:3]]
    return "; ".join(parts)


def _client_path(error: Mapping[str, Any]) -> list[str]:
    """The error's location as the client wrote it: field names and list indices, without the
    ``body`` prefix and without pydantic's union branch names."""
    loc = tuple(error.get("loc", ()))[1:]
    return [str(loc[0])] + [str(p) for p in loc[1:] if isinstance(p, int) or p in _FIELD_NAMES]


def _either(messages: list[str]) -> str:
    prefix = "Input should be "
    rest = [m.removeprefix(prefix) for m in messages[1:]]
    return " or ".join([messages[0], *rest])
