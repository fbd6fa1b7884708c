"""Turning an OpenAI request into engine work: the shared app context, the model/readiness/capacity
checks, prompt encoding and validation, chat templating, the SamplingParams mapping, and the mapping
of engine add-time errors to OpenAI errors."""

from __future__ import annotations

import copy
import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..config import ServingSettings, lora_paths
from ..engine import PRIORITY_NEEDS_POLICY, EngineDeadError
from ..lora import LoraError
from ..metrics import ServerMetrics
from ..model_files import sampling_defaults
from ..parsers import OutputParser
from ..parsers.grammar import ToolChoiceError, auto_calls_grammar
from ..request import SamplingParams
from ..structured import GrammarBudget, GrammarBudgetError, GrammarChecker, GrammarCompiler, StructuredSpec
from .async_llm import EngineFailure, EngineRestarting, ServerDraining
from .data_parallel import ServingLLM
from .protocol import (
    APIError,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    JSONDepthError,
    NamedToolChoice,
    TokenizeChatRequest,
    loads_bounded,
)

_SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
    "priority",
)
_PARAM_RE = re.compile(r"^(\w+)=")


@dataclass(slots=True)
class _Prompt:
    """A validated prompt: its token ids, and its text when the client sent text."""

    ids: list[int]
    text: str | None


@dataclass(slots=True)
class _Ctx:
    """What every handler shares: the settings, the engine, the metrics and the served model's name."""

    settings: ServingSettings
    llm: ServingLLM
    metrics: ServerMetrics
    model_name: str
    created: int = field(default_factory=lambda: int(time.time()))
    grammars: GrammarChecker | None = None  # made at the first grammar (_grammar_checker)


def _served_adapters(ctx: _Ctx) -> list[str]:
    """The LoRA adapters served now: the engine's, after run-time loads and unloads (its stats say
    them), or ``lora_modules`` before the engine has said."""
    names = (getattr(ctx.llm, "stats", None) or {}).get("lora_adapters")
    return list(lora_paths(ctx.settings)) if names is None else list(names)


def _lora_of(ctx: _Ctx, model: str | None) -> str | None:
    """The adapter a request's ``model`` names (checked by :func:`_check_model`), None: the base model."""
    return None if model is None or model == ctx.model_name else model


def _check_model(ctx: _Ctx, model: str | None) -> None:
    """The base model's name, a LoRA adapter's (served now), or none; anything else is a 404."""
    if model is not None and model != ctx.model_name and model not in _served_adapters(ctx):
        served = [ctx.model_name, *_served_adapters(ctx)]
        raise APIError(
            404,
            f"the model {model!r} does not exist; this server serves {', '.join(map(repr, served))}",
            param="model",
            code="model_not_found",
        )


def _shown_model(ctx: _Ctx, lora: str | None) -> str:
    """The ``model`` a response names: the request's LoRA adapter, or the base model's name."""
    return ctx.model_name if lora is None else lora


def _check_ready(ctx: _Ctx) -> None:
    if ctx.llm.dead_reason is not None:
        raise APIError(503, f"the engine failed: {ctx.llm.dead_reason}", type="server_error", code="engine_dead")
    if ctx.llm.draining:  # SIGTERM: the requests in flight finish, new ones go elsewhere
        raise APIError(
            503,
            "the server is shutting down",
            type="server_error",
            code="shutting_down",
            headers={"retry-after": "5"},
        )
    if ctx.llm.restarting is not None:
        raise APIError(
            503,
            f"the worker is restarting after a failure ({ctx.llm.restarting}); retry shortly",
            type="server_error",
            code="restarting",
            headers={"retry-after": "5"},
        )
    if not ctx.llm.ready:
        raise APIError(
            503,
            "the model is still loading",
            type="server_error",
            code="loading",
            headers={"retry-after": "5"},
        )


def _check_capacity(
    ctx: _Ctx, req: CompletionRequest | ChatCompletionRequest, prompts: list[_Prompt], params: list[SamplingParams]
) -> None:
    """Back-pressure counted in sequences: every prompt's every choice waits as its own sequence. A
    request that alone needs more than the waiting limit can never be admitted, so it is the client's
    error (400), not a reason to retry (503); so is one whose response may outgrow max_response_bytes."""
    num_prompts, n = len(prompts), req.n
    limit = ctx.settings.max_waiting_requests
    new = num_prompts * n
    if new > limit:
        raise APIError(
            400,
            f"this request needs {new} sequences ({num_prompts} prompt(s) x n={n}) but at most "
            f"max_waiting_requests={limit} may wait; lower n or send fewer prompts per request",
            param="n" if n > 1 else "prompt",
            code="too_many_sequences",
        )
    _check_response_size(ctx, req, prompts, params)
    if ctx.llm.num_waiting() + new > limit:
        raise APIError(
            503,
            f"the server is overloaded (more than max_waiting_requests={limit} sequences waiting); retry later",
            type="server_error",
            code="overloaded",
            headers={"retry-after": "1"},
        )


# What a response body spends (bytes, as encoded), measured on bodies of a real 151k-token BPE
# (tests/core/server/test_response_size.py checks the estimate against built bodies).
_CHOICE_BYTES = 400  # a choice's fixed fields
_TEXT_BYTES = 6  # one generated or echoed token's text
_LOGPROB_BYTES = {False: (48, 32), True: (96, 72)}  # chat?: (per token, per top entry) of ``logprobs``
_PROMPT_LOGPROB_BYTES = 80  # one entry of vLLM's ``prompt_logprobs``: id, logprob, rank, decoded token


def _response_parts(
    ctx: _Ctx, req: CompletionRequest | ChatCompletionRequest, prompts: list[_Prompt], params: list[SamplingParams]
) -> dict[str, int]:
    """The response's estimated size in bytes, by the field that asks for it, before anything runs:
    every choice is assumed to use its whole ``max_tokens`` (without one, the rest of the context).
    Completions show the echoed prompt's text and logprobs, and repeat prompt logprobs per choice."""
    chat = isinstance(req, ChatCompletionRequest)
    echo = isinstance(req, CompletionRequest) and req.echo
    token_bytes, top_bytes = _LOGPROB_BYTES[chat]
    parts = {"max_tokens": 0, "logprobs": 0, "prompt_logprobs": 0}
    for prompt, sp in zip(prompts, params):
        out = sp.max_tokens if sp.max_tokens is not None else ctx.llm.max_model_len - len(prompt.ids)
        shown = out + (len(prompt.ids) if echo else 0)
        parts["max_tokens"] += sp.n * (_CHOICE_BYTES + shown * _TEXT_BYTES)
        if sp.logprobs is not None:
            tops = sp.logprobs + (0 if chat else 1)  # completions' tops also hold the chosen token
            parts["logprobs"] += sp.n * shown * (token_bytes + tops * top_bytes)
        if req.prompt_logprobs is not None:
            copies = 1 if chat else sp.n
            parts["prompt_logprobs"] += copies * len(prompt.ids) * (req.prompt_logprobs + 1) * _PROMPT_LOGPROB_BYTES
    return parts


def _check_response_size(
    ctx: _Ctx, req: CompletionRequest | ChatCompletionRequest, prompts: list[_Prompt], params: list[SamplingParams]
) -> None:
    """A request may not ask for a response over ``max_response_bytes``: a few KB asking for n=128
    choices with 20 logprobs per prompt token answer hundreds of MB, which the server would build,
    hold and send whole. Refused before it is queued, naming the field that asks for the most."""
    parts = _response_parts(ctx, req, prompts, params)
    total, limit = sum(parts.values()), ctx.settings.max_response_bytes
    if total <= limit:
        return
    param = max(parts, key=lambda k: parts[k])
    if isinstance(req, ChatCompletionRequest):
        names = {"logprobs": "top_logprobs"}
        if req.max_completion_tokens is not None:
            names["max_tokens"] = "max_completion_tokens"
        param = names.get(param, param)
    raise APIError(
        400,
        f"this request may answer about {total / 2**20:.1f} MiB ({len(prompts)} prompt(s), n={req.n}, mostly "
        f"{param}) but a response may be at most max_response_bytes={limit}; lower {param} or n",
        param=param,
        code="response_too_large",
    )


def _completion_prompts(ctx: _Ctx, prompt: str | list[str] | list[int] | list[list[int]]) -> list[_Prompt]:
    items: list[str | list[int]]
    if isinstance(prompt, str):
        items = [prompt]
    elif prompt and all(isinstance(p, int) for p in prompt):
        items = [list(prompt)]  # type: ignore[arg-type]
    else:
        items = list(prompt)  # type: ignore[arg-type]
    if not items:
        raise APIError(400, "prompt is empty", param="prompt")
    return [_encode(ctx, p) for p in items]


def _encode(ctx: _Ctx, prompt: str | list[int]) -> _Prompt:
    tok = ctx.llm.tokenizer
    if isinstance(prompt, str):
        if tok is None:
            raise APIError(
                400,
                "text prompts need a tokenizer.json in the model directory; send token ids",
                param="prompt",
            )
        ids, text = tok.encode(prompt), prompt
    else:
        ids, text = list(prompt), None
    return _validate_ids(ctx, ids, text)


def _validate_ids(ctx: _Ctx, ids: list[int], text: str | None, param: str = "prompt") -> _Prompt:
    if not ids:
        raise APIError(400, "the prompt is empty", param=param)
    vocab = ctx.llm.vocab_size
    if any(t < 0 or t >= vocab for t in ids):
        raise APIError(400, f"prompt token ids must be in [0, {vocab})", param=param)
    if len(ids) >= ctx.llm.max_model_len:
        raise APIError(
            400,
            f"the prompt has {len(ids)} tokens; the context length max_model_len is {ctx.llm.max_model_len} "
            "and at least one token must be generated",
            param=param,
            code="context_length_exceeded",
        )
    return _Prompt(ids, text)


def _message_dict(m: ChatMessage, where: str, max_depth: int) -> dict[str, Any]:
    """Message ``where`` (``messages.I``) as the chat template reads it."""
    d = m.model_dump(exclude_none=True)
    if isinstance(m.content, list):  # text parts joined; other part types have no meaning for a text model
        if any(p.type != "text" for p in m.content):
            raise APIError(400, "only text content parts are supported", param="messages")
        d["content"] = "".join(p.text or "" for p in m.content)
    d.setdefault("content", "")
    if m.tool_calls:
        d["tool_calls"] = [
            _template_tool_call(c, f"{where}.tool_calls.{j}", max_depth) for j, c in enumerate(m.tool_calls)
        ]
    return d


def _template_tool_call(call: dict[str, Any], where: str, max_depth: int) -> dict[str, Any]:
    """An assistant message's tool call as chat templates read it: OpenAI sends ``arguments`` as JSON
    text, and templates (Qwen's, DeepSeek's) write a dict with ``tojson``, so a JSON object is decoded.
    The text is the client's JSON too: nested past ``max_depth`` it is a 400 (the template's ``tojson``
    and the decoder itself would recurse over it)."""
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = loads_bounded(function["arguments"], max_depth)
    except JSONDepthError as e:
        raise APIError(400, f"{where}.function.arguments is {e}", param="messages", code="invalid_value") from None
    except ValueError:  # not JSON (JSONDecodeError), or an integer past Python's digit limit
        return call
    if not isinstance(arguments, dict):
        return call
    return {**call, "function": {**function, "arguments": arguments}}


# apply_chat_template's own arguments, and what it passes the template itself: chat_template_kwargs
# cannot set them (Python would refuse the call with its own words).
_TEMPLATE_ARGUMENTS = ("messages", "add_generation_prompt", "bos_token", "eos_token", "self")


def _check_template_kwargs(kwargs: dict[str, Any]) -> None:
    taken = [k for k in _TEMPLATE_ARGUMENTS if k in kwargs]
    if taken:
        raise APIError(
            400,
            f"chat_template_kwargs cannot set {', '.join(taken)}: the server passes them to the template "
            "(messages and add_generation_prompt are fields of the request)",
            param="chat_template_kwargs",
            code="invalid_value",
        )


def _render_chat(ctx: _Ctx, req: ChatCompletionRequest | TokenizeChatRequest) -> str:
    """The request's messages (and tools) rendered by the checkpoint's chat template."""
    tok = ctx.llm.tokenizer
    if tok is None or not tok.can_chat:
        raise APIError(400, "this model has no chat template; use /v1/completions", param="messages")
    depth = ctx.settings.max_json_depth
    messages = [_message_dict(m, f"messages.{i}", depth) for i, m in enumerate(req.messages)]
    kwargs = dict(req.chat_template_kwargs or {})
    _check_template_kwargs(kwargs)
    if req.tools:  # transformers' convention: the template reads the tool list as ``tools``
        kwargs["tools"] = [t.model_dump(exclude_none=True) for t in req.tools]
        # A template that reads them gets the tool choice and the parallel-calls switch as sent
        # (chat_template_kwargs may override); the checkpoints' own templates ignore them.
        choice = getattr(req, "tool_choice", None)
        if choice is not None:
            kwargs.setdefault("tool_choice", choice if isinstance(choice, str) else choice.model_dump())
        parallel = getattr(req, "parallel_tool_calls", None)
        if parallel is not None:
            kwargs.setdefault("parallel_tool_calls", parallel)
    try:
        return tok.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt, **kwargs)
    except (ValueError, TypeError) as e:
        raise APIError(400, f"cannot render the chat template: {e}", param="messages") from None
    except Exception as e:  # template errors (jinja undefined, security) are the request's fault too
        raise APIError(400, f"cannot render the chat template: {type(e).__name__}: {e}", param="messages") from None


def _chat_prompt(ctx: _Ctx, req: ChatCompletionRequest) -> _Prompt:
    text = _render_chat(ctx, req)
    tok = ctx.llm.tokenizer
    assert tok is not None
    return _validate_ids(ctx, tok.encode(text), text, param="messages")


def _check_tool_choice(req: ChatCompletionRequest) -> None:
    """As OpenAI: a tool choice other than ``none`` without tools (none or ``[]``) is a 400, ``auto``
    included, rather than a choice silently dropped."""
    choice = req.tool_choice
    if choice is None or choice == "none" or req.tools:
        return
    what = f"'{choice}'" if isinstance(choice, str) else "naming a function"
    message = f"tool_choice {what} needs tools; send tools or drop tool_choice"
    raise APIError(400, message, param="tool_choice", code="invalid_value")


def _forced_calls(req: ChatCompletionRequest) -> tuple[list[str], bool] | None:
    """The functions a forced tool choice allows and whether several calls may follow each other;
    None unless ``tool_choice`` is ``required`` or names a function."""
    choice = req.tool_choice
    if isinstance(choice, NamedToolChoice):
        return [choice.function.name], False
    if choice == "required":
        return [t.function.name for t in req.tools or ()], req.parallel_tool_calls is not False
    return None


def _tool_choice_spec(
    ctx: _Ctx, req: ChatCompletionRequest, parsers: Callable[[], OutputParser] | None
) -> StructuredSpec | None:
    """The grammar that keeps ``tool_choice: "required"`` or a named function: the output is only calls
    (after any reasoning), in the tool parser's syntax, with arguments valid against the parameters."""
    forced = _forced_calls(req)
    if forced is None:
        return _auto_calls_spec(ctx, req, parsers)
    parser = parsers() if parsers is not None else None
    if parser is None or parser.tools is None:
        raise APIError(400, "tool_choice needs a tool-call parser; tool_call_parser is 'none'", param="tool_choice")
    names, parallel = forced
    try:
        rules = [parser.tools.call_grammar(names, parallel=parallel)]
        if parser.reasoning is not None:
            rules.append(parser.reasoning.grammar_rules())
    except ValueError as e:
        raise APIError(400, f"tool_choice: {e}", param="tool_choice") from None
    start = "start: reasoning tool_calls" if parser.reasoning is not None else "start: tool_calls"
    spec = StructuredSpec("lark", "\n".join([start, *rules]))
    if ctx.llm.tokenizer is None:
        raise APIError(400, "tool_choice needs a tokenizer.json in the model directory", param="tool_choice")
    return spec  # checked with the request's other fields (_request_grammar)


def _auto_calls_spec(
    ctx: _Ctx, req: ChatCompletionRequest, parsers: Callable[[], OutputParser] | None
) -> StructuredSpec | None:
    """Under ``tool_choice: auto``, the grammar that keeps what the request asks of the calls the model
    may make: a ``strict`` tool's arguments valid against its parameters, and with
    ``parallel_tool_calls: false`` at most one call (after free text, and any reasoning). None when
    it asks neither, or a structured-output field already constrains the output. A tool parser that
    cannot express it is a 400: the fields are never accepted and ignored."""
    tools = req.tools or []
    strict = any(t.function.strict for t in tools)
    if req.tool_choice not in (None, "auto") or not tools or (not strict and req.parallel_tool_calls is not False):
        return None
    parser = parsers() if parsers is not None else None
    if parser is None or parser.tools is None or _structured_spec(ctx, req) is not None:
        return None
    param = "tools" if strict else "parallel_tool_calls"
    tags = getattr(parser.tools, "tags", ())
    try:
        if not tags:
            raise ToolChoiceError(f"the tool-call parser {type(parser.tools).__name__} cannot constrain tool calls")
        names = [t.function.name for t in tools]
        calls = parser.tools.call_grammar(names, parallel=req.parallel_tool_calls is not False, opened=tags[0][0])
        rules = [auto_calls_grammar(calls, tags[0][0])]
        if parser.reasoning is not None:
            rules.append(parser.reasoning.grammar_rules())
    except (ValueError, TypeError) as e:
        what = "strict tools" if strict else "parallel_tool_calls false"
        raise APIError(400, f"{what} under tool_choice 'auto': {e}", param=param) from None
    start = "start: reasoning answer" if parser.reasoning is not None else "start: answer"
    if ctx.llm.tokenizer is None:
        raise APIError(400, f"{param} needs a tokenizer.json in the model directory", param=param)
    return StructuredSpec("lark", "\n".join([start, *rules]))


def _output_parsers(ctx: _Ctx, req: ChatCompletionRequest, prompt: _Prompt) -> Callable[[], OutputParser] | None:
    """A factory of one choice's output parser (reasoning, tool calls), or None when the response is
    plain text. Tool calls are parsed when the request sends tools and does not say tool_choice 'none'."""
    settings, plugins = ctx.settings, ctx.llm.plugins
    arch = ctx.llm.engine.info.architecture if ctx.llm.engine is not None else ""
    reasoning = plugins.select_reasoning_parser(settings.reasoning_parser, arch)
    tools_spec = None
    if req.tools and req.tool_choice != "none":
        tools_spec = plugins.select_tool_parser(settings.tool_call_parser, arch)
        if tools_spec is None and settings.tool_call_parser == "auto":
            raise APIError(
                400,
                f"no installed tool-call parser serves this model's architecture {arch!r}; set tool_call_parser "
                f"(installed: {plugins.tool_parsers.installed()}) or send tool_choice 'none'",
                param="tools",
            )
    if reasoning is None and tools_spec is None:
        return None
    tools = [t.model_dump(exclude_none=True) for t in req.tools or ()]
    prompt_text = prompt.text or ""
    max_calls = 1 if req.parallel_tool_calls is False else None

    def make() -> OutputParser:
        return OutputParser(
            reasoning.factory(prompt_text) if reasoning is not None else None,
            tools_spec.factory(tools) if tools_spec is not None else None,
            max_calls=max_calls,
        )

    return make


def _sampling_params(
    ctx: _Ctx,
    req: CompletionRequest | ChatCompletionRequest,
    prompts: list[_Prompt],
    max_tokens: int | None,
    logprobs: int | None,
    *,
    max_tokens_param: str = "max_tokens",
    structured: StructuredSpec | None = None,
) -> list[SamplingParams]:
    """Each prompt's sampling parameters, under the request's checked grammar ``structured``
    (:func:`_request_grammar`). Built once: they differ only in the prompt length checked against
    the context, so a thousand prompts cost one mapping, not a thousand."""
    defaults = ctx.llm.engine.info.generation_defaults if ctx.llm.engine is not None else {}
    kw: dict[str, Any] = sampling_defaults(defaults)
    for name in _SAMPLING_FIELDS:
        value = getattr(req, name)
        if value is not None:
            kw[name] = value
    stop = req.stop if req.stop is not None else []
    try:
        params = SamplingParams(
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            stop=[stop] if isinstance(stop, str) else list(stop),
            stop_token_ids=list(req.stop_token_ids or []),
            ignore_eos=req.ignore_eos,
            n=req.n,
            logprobs=logprobs,
            skip_special_tokens=req.skip_special_tokens,
            structured=structured,
            lora=_lora_of(ctx, req.model),
            kv_transfer_params=req.kv_transfer_params,
            **_token_fields(ctx, req),
            **kw,
        )
    except (ValueError, TypeError) as e:
        raise _sampling_error(str(e), isinstance(req, ChatCompletionRequest), max_tokens_param) from None
    _check_model_bounds(ctx, req)
    try:
        params.check_vocab(ctx.llm.vocab_size)
    except ValueError as e:
        raise _sampling_error(str(e), isinstance(req, ChatCompletionRequest), max_tokens_param) from None
    if params.stop and ctx.llm.tokenizer is None:
        raise APIError(400, "stop strings need a tokenizer.json in the model directory", param="stop")
    _check_context(ctx, prompts, max_tokens, max_tokens_param, req.kv_transfer_params is not None)
    return [params, *(copy.copy(params) for _ in prompts[1:])]


def _check_context(
    ctx: _Ctx, prompts: list[_Prompt], max_tokens: int | None, max_tokens_param: str, transfers: bool = False
) -> None:
    """400 ``context_length_exceeded`` when a prompt plus ``max_tokens`` does not fit the context; 400 for
    ``kv_transfer_params`` (``transfers``) over several prompts: one transfer belongs to one prompt."""
    if transfers and len(prompts) > 1:
        raise APIError(
            400, "kv_transfer_params applies to one prompt; send one request per prompt", param="kv_transfer_params"
        )
    if max_tokens is None:
        return
    for prompt in prompts:
        if len(prompt.ids) + max_tokens > ctx.llm.max_model_len:
            raise APIError(
                400,
                f"{max_tokens_param}={max_tokens} plus the prompt's {len(prompt.ids)} tokens exceeds the context "
                f"length max_model_len={ctx.llm.max_model_len}",
                param=max_tokens_param,
                code="context_length_exceeded",
            )


def _token_fields(ctx: _Ctx, req: CompletionRequest | ChatCompletionRequest) -> dict[str, Any]:
    """The fields that name tokens: logit_bias (OpenAI's keys are token ids as text), allowed tokens,
    bad words (each word as it starts the text and after a space), and whether stop strings stay in."""
    bias: dict[int, float] = {}
    for key, value in (req.logit_bias or {}).items():
        if not key.isdigit():
            raise APIError(400, f"logit_bias keys must be token ids, not {key!r}", param="logit_bias")
        bias[int(key)] = value
    words: list[list[int]] = []
    if req.bad_words:
        tok = ctx.llm.tokenizer
        if tok is None:
            raise APIError(400, "bad_words need a tokenizer.json in the model directory", param="bad_words")
        for word in req.bad_words:
            for variant in dict.fromkeys((word, " " + word.lstrip())):
                ids = tok.encode(variant, add_special_tokens=False)
                if ids and ids not in words:
                    words.append(ids)
    return {
        "logit_bias": bias,
        "allowed_token_ids": req.allowed_token_ids,
        "bad_words_token_ids": words,
        "include_stop_str_in_output": req.include_stop_str_in_output,
        "prompt_logprobs": _prompt_logprobs(req),
    }


def _prompt_logprobs(req: CompletionRequest | ChatCompletionRequest) -> int | None:
    """How many top logprobs the engine computes per prompt token: vLLM's ``prompt_logprobs``, and
    completions' ``echo`` with ``logprobs`` (the echoed prompt is scored); None: none are computed."""
    asked = req.prompt_logprobs
    if asked is not None and req.stream:
        raise APIError(400, "prompt_logprobs is not supported with stream=true", param="prompt_logprobs")
    if isinstance(req, CompletionRequest) and req.echo and req.logprobs is not None:
        return max(asked or 0, req.logprobs)
    return asked


async def _request_grammar(
    ctx: _Ctx, req: CompletionRequest | ChatCompletionRequest, forced: StructuredSpec | None = None
) -> tuple[str | None, StructuredSpec | None]:
    """The request's one grammar and the field that sent it (None, None: it has none), checked once
    for the whole request before it is queued, on the grammar checker's threads (never on the event
    loop, :class:`GrammarChecker`): every grammar error is a 400 with llguidance's reason, a grammar
    over the budget a 400 naming the setting. The field is what a 400 names should the grammar fail
    in the worker past this check."""
    asked = _grammar(ctx, req, forced)
    if asked is None:
        return None, None
    param, spec = asked
    try:
        await _grammar_checker(ctx).check_async(spec)
    except GrammarBudgetError as e:
        raise APIError(400, f"{param}: {e}", param=param, code="grammar_too_complex") from None
    except ValueError as e:
        raise APIError(400, f"{param}: {e}", param=param, code="invalid_grammar") from None
    return param, spec


def _grammar_checker(ctx: _Ctx) -> GrammarChecker:
    """The app's grammar checker, over the tokenizer the worker reads (made at the first grammar)."""
    if ctx.grammars is None:
        settings = ctx.settings
        budget = GrammarBudget(settings.grammar_compile_timeout, settings.grammar_max_bytes)
        ctx.grammars = GrammarChecker(GrammarCompiler(settings.tokenizer or settings.model), budget)
    return ctx.grammars


def warm_grammars(ctx: _Ctx) -> None:
    """Makes the grammar checker and its tokenizer before the server takes requests (see
    :meth:`GrammarChecker.warm`); a model without a ``tokenizer.json`` has no grammars to check."""
    if ctx.llm.tokenizer is not None:
        _grammar_checker(ctx).warm()


def _grammar(
    ctx: _Ctx, req: CompletionRequest | ChatCompletionRequest, forced: StructuredSpec | None
) -> tuple[str, StructuredSpec] | None:
    """The request's one grammar and the field that asks for it: a structured-output field's, or a
    forced tool choice's."""
    structured = _structured_spec(ctx, req)
    if forced is not None and structured is not None:
        raise APIError(
            400,
            "tool_choice 'required' or a named function already constrains the output; "
            "drop the structured-output field",
            param="tool_choice",
        )
    return structured or (("tool_choice", forced) if forced is not None else None)


def _structured_spec(ctx: _Ctx, req: CompletionRequest | ChatCompletionRequest) -> tuple[str, StructuredSpec] | None:
    """The grammar the request asks its output to match and the field that asks (checked by
    :func:`_request_grammar`, so that a bad schema, regex or choice list is a 400 naming the field)."""
    asked: list[tuple[str, StructuredSpec]] = []
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        asked.append(("response_format", StructuredSpec("json_object")))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.json_schema is None:
            raise APIError(400, "response_format json_schema needs json_schema.schema", param="response_format")
        asked.append(("response_format", StructuredSpec("json", json.dumps(fmt.json_schema.json_schema))))
    if req.guided_json is not None:
        source = req.guided_json if isinstance(req.guided_json, str) else json.dumps(req.guided_json)
        if isinstance(req.guided_json, str):
            _check_schema_text_depth(ctx, source)
        asked.append(("guided_json", StructuredSpec("json", source)))
    if req.guided_regex is not None:
        asked.append(("guided_regex", StructuredSpec("regex", req.guided_regex)))
    if req.guided_choice is not None:
        asked.append(("guided_choice", StructuredSpec("choice", json.dumps(req.guided_choice))))
    if not asked:
        return None
    param, spec = asked[0]
    if len(asked) > 1:
        names = ", ".join(name for name, _ in asked)
        raise APIError(
            400,
            f"send at most one of response_format, guided_json, guided_regex, guided_choice (got {names})",
            param=asked[1][0],
        )
    if ctx.llm.tokenizer is None:
        raise APIError(400, f"{param} needs a tokenizer.json in the model directory", param=param)
    return param, spec


def _check_schema_text_depth(ctx: _Ctx, text: str) -> None:
    """A schema sent as JSON text is client JSON too: nested past ``max_json_depth`` it is a 400 (the
    body's own depth check saw only a string). Text that is not JSON is left to the grammar check."""
    try:
        loads_bounded(text, ctx.settings.max_json_depth)
    except JSONDepthError as e:
        raise APIError(400, f"guided_json is {e}", param="guided_json", code="invalid_value") from None
    except ValueError:
        return


def _sampling_error(message: str, chat: bool, max_tokens_param: str) -> APIError:
    """A ``SamplingParams`` error in the client's words: chat's ``max_completion_tokens`` and
    ``top_logprobs`` are ``max_tokens`` and ``logprobs`` to the engine."""
    if max_tokens_param != "max_tokens":
        message = re.sub(r"\bmax_tokens\b", max_tokens_param, message)
    if chat and message.startswith("logprobs="):
        message = "top_" + message
    m = _PARAM_RE.match(message)
    return APIError(400, message, param=m.group(1) if m else None)


def _check_model_bounds(ctx: _Ctx, req: CompletionRequest | ChatCompletionRequest) -> None:
    """The bounds that depend on the served model and settings, which the request models cannot know."""
    vocab, max_len = ctx.llm.vocab_size, ctx.llm.max_model_len
    if req.priority and ctx.settings.scheduling_policy != "priority":
        raise APIError(400, PRIORITY_NEEDS_POLICY.format(req.priority), param="priority")
    if req.top_k is not None and req.top_k > vocab:
        raise APIError(
            400,
            f"top_k={req.top_k} is invalid: must be -1, 0 (off) or at most the vocabulary size {vocab}",
            param="top_k",
        )
    if any(t >= vocab for t in req.stop_token_ids or ()):
        raise APIError(400, f"stop_token_ids must be token ids in [0, {vocab})", param="stop_token_ids")
    if req.min_tokens > max_len:
        raise APIError(
            400,
            f"min_tokens={req.min_tokens} is invalid: must be at most the context length max_model_len={max_len}",
            param="min_tokens",
        )


def _request_ids(rid: str, n: int) -> list[str]:
    """The engine request ids of a response's ``n`` prompts: ``rid`` itself for one, ``rid-i`` for several."""
    return [rid if n == 1 else f"{rid}-{i}" for i in range(n)]


def _engine_error(e: BaseException) -> APIError:
    if isinstance(e, EngineRestarting):  # refused before it ran: retrying is safe
        return APIError(503, str(e), type="server_error", code="restarting", headers={"retry-after": "5"})
    if isinstance(e, ServerDraining):  # SIGTERM arrived while the request was being prepared
        return APIError(503, str(e), type="server_error", code="shutting_down", headers={"retry-after": "5"})
    if isinstance(e, EngineDeadError | EngineFailure):
        return APIError(503, f"the engine is unavailable: {e}", type="server_error", code="engine_dead")
    if isinstance(e, LoraError):  # an adapter unloaded after the model check
        return APIError(e.status, str(e), param="model", code="model_not_found" if e.status == 404 else None)
    return APIError(400, str(e), param=_guess_param(str(e)))


def _guess_param(message: str) -> str | None:
    m = _PARAM_RE.match(message)
    if m:
        return m.group(1)
    return "prompt" if "prompt" in message else None
