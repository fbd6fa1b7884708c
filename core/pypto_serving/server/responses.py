"""Non-streamed generation and the OpenAI response bodies: running a request's prompts to the end
(aborting them all on a disconnect or failure), usage, logprobs and the completion/chat bodies."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, ParamSpec

import msgspec
from fastapi import Request, Response

from ..engine import EngineDeadError
from ..kv_ledger import TRANSFER_FAILED
from ..parsers import OutputParser, ParsedToolCall
from ..request import CompletionOutput, RequestOutput, SamplingParams
from ..structured import grammar_failed
from .async_llm import EngineFailure
from .openai_requests import _Ctx, _engine_error, _lora_of, _Prompt, _request_ids, _shown_model
from .protocol import APIError, ChatCompletionRequest, CompletionRequest

_P = ParamSpec("_P")


_ENCODE = msgspec.json.Encoder().encode
_PIECE = 256  # list items encoded per msgspec call: a few hundred KB at most, about a millisecond


async def _json_response(build: Callable[_P, dict[str, Any]], *args: _P.args, **kwargs: _P.kwargs) -> Response:
    """The JSON response of ``build(*args, **kwargs)``, built and encoded in a worker thread: a body
    of many logprobs takes seconds to build (a token decode per entry), which on the event loop
    would stall /health and every stream. msgspec encodes several times faster than ``json``, and a
    non-finite float becomes null rather than a 500; it holds the GIL for a whole call, so the body is
    encoded in pieces (:func:`encode_pieces`) and the event loop runs between them."""

    def make() -> Response:
        return Response(b"".join(encode_pieces(build(*args, **kwargs))), media_type="application/json")

    return await asyncio.to_thread(make)


def encode_pieces(value: Any, depth: int = 0) -> Iterator[bytes]:
    """``value`` as JSON, in pieces that each take one short msgspec call: objects near the top are
    opened key by key, lists of objects near the top item by item (a body's choices), and other long
    lists ``_PIECE`` items at a time (logprob entries)."""
    if depth < 5 and isinstance(value, dict):
        yield b"{"
        for i, (key, item) in enumerate(value.items()):
            yield (b"," if i else b"") + _ENCODE(key) + b":"
            yield from encode_pieces(item, depth + 1)
        yield b"}"
    elif depth < 5 and isinstance(value, list) and len(value) > 1:
        yield b"["
        first = next((x for x in value if x is not None), None)
        if depth < 3 and isinstance(first, dict | list):
            for i, item in enumerate(value):
                yield b"," if i else b""
                yield from encode_pieces(item, depth + 1)
        else:
            for start in range(0, len(value), _PIECE):
                yield (b"," if start else b"") + _ENCODE(value[start : start + _PIECE])[1:-1]
        yield b"]"
    else:
        yield _ENCODE(value)


async def _collect(ctx: _Ctx, rid: str, prompt: _Prompt, params: SamplingParams) -> RequestOutput:
    last: RequestOutput | None = None
    async for out in ctx.llm.generate(rid, prompt.ids, params):
        last = out
    assert last is not None
    return last


async def _run_all(
    ctx: _Ctx,
    rid: str,
    prompts: list[_Prompt],
    params: list[SamplingParams],
    raw: Request,
    grammar_param: str | None = None,
) -> list[RequestOutput]:
    """Run every prompt as its own engine request; a client disconnect or any failure aborts them all.
    ``grammar_param``: the field that sent the request's grammar, named by a 400 when it fails."""
    ids = _request_ids(rid, len(prompts))
    tasks = [asyncio.ensure_future(_collect(ctx, i, p, sp)) for i, p, sp in zip(ids, prompts, params)]
    watcher = asyncio.ensure_future(_watch_disconnect(raw, tasks))
    try:
        outs = await asyncio.gather(*tasks)
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise  # the server cancels this handler (shutdown): not ours to swallow
        # The watcher cancelled the work because the client left: an ordinary end, not an error.
        raise APIError(499, "the client closed the request", code="client_closed") from None
    except (ValueError, EngineDeadError, EngineFailure) as e:
        raise _engine_error(e) from None
    finally:
        watcher.cancel()
        for t in tasks:
            t.cancel()  # generate()'s cleanup aborts whatever is unfinished
    for out in outs:
        failed = next((c for c in out.outputs if c.finish_reason == "error"), None)
        if failed is not None:
            raise _failed_choice_error(ctx, failed, grammar_param)
    return list(outs)


def _failed_choice_error(ctx: _Ctx, c: CompletionOutput, grammar_param: str | None = None) -> APIError:
    """A failed choice's answer: a KV transfer from a prefill engine that failed is that upstream's
    failure (502 ``kv_transfer_failed``), a grammar the worker could not follow the client's (400
    ``invalid_grammar`` naming ``grammar_param``), anything else this server's (500 ``generation_failed``)."""
    if c.error is not None and c.error.startswith(TRANSFER_FAILED):
        return APIError(502, _failure_message(ctx, c), type="server_error", code="kv_transfer_failed")
    if grammar_failed(c.error):
        return APIError(400, _failure_message(ctx, c), param=grammar_param, code="invalid_grammar")
    return APIError(500, _failure_message(ctx, c), type="server_error", code="generation_failed")


def _failure_message(ctx: _Ctx, c: CompletionOutput) -> str:
    """What a client is told about a failed choice: the request's own error, else the engine's state.
    Only the error's first line goes out; the traceback tail after it stays in the server log."""
    reason = c.error.partition("\n")[0] if c.error else None
    return f"generation failed: {reason or ctx.llm.dead_reason or ctx.llm.restarting or 'a step failed'}"


async def _watch_disconnect(raw: Request, tasks: Sequence[asyncio.Future[RequestOutput]]) -> None:
    # Non-streamed responses are not cancelled by the server when the client leaves; poll instead.
    with contextlib.suppress(Exception):
        while not all(t.done() for t in tasks):
            if await raw.is_disconnected():
                for t in tasks:
                    t.cancel()
                return
            await asyncio.sleep(0.25)


def _usage(prompts: list[_Prompt], outs: list[RequestOutput]) -> dict[str, Any]:
    prompt_tokens = sum(len(p.ids) for p in prompts)
    completion = sum(len(c.token_ids) for o in outs for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in outs)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def _token_str(ctx: _Ctx, token: int) -> str:
    """A token's text for logprobs. Tokens that are only part of a UTF-8 character decode to U+FFFD,
    which would make different tokens collide as dict keys, so those are named ``token_id:N``."""
    tok = ctx.llm.tokenizer
    if tok is None:
        return f"token_id:{token}"
    text = tok.token_text(token)
    return f"token_id:{token}" if "\ufffd" in text else text


@dataclasses.dataclass(slots=True, frozen=True)
class _LogprobRows:
    """Completion logprobs rows: per token its text, its logprob and its top entries by text. A
    prompt's rows are built once and shared by all of its ``n`` choices (an echo of a long prompt
    with ``n=128`` would otherwise decode and rank it 128 times)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]


def _logprob_rows(ctx: _Ctx, rows: Iterable[tuple[int, list[tuple[int, float]] | None]]) -> _LogprobRows:
    """Rows of ``(token, its ranked entries or None)``."""
    out = _LogprobRows([], [], [])
    for t, ranked in rows:
        out.tokens.append(_token_str(ctx, t))
        out.token_logprobs.append(dict(ranked).get(t) if ranked is not None else None)
        out.top_logprobs.append({_token_str(ctx, k): v for k, v in ranked} if ranked is not None else None)
    return out


def _echo_rows(ctx: _Ctx, ids: list[int], lps: list[dict[int, float] | None] | None, top_n: int) -> _LogprobRows:
    """The echoed prompt's rows (the first prompt token has no logprobs), each with its ``top_n`` (the
    request's ``logprobs``) most likely tokens, as the outputs have."""
    return _logprob_rows(
        ctx, ((t, _top_entries(d, t, top_n) if d is not None else None) for t, d in zip(ids, lps or [None] * len(ids)))
    )


def _completion_logprobs(
    ctx: _Ctx, c: CompletionOutput, span: tuple[int, int, int], echo: _LogprobRows | None
) -> dict[str, Any] | None:
    """OpenAI's completion logprobs of output tokens ``span[0]:span[1]``, text offsets from ``span[2]``;
    with ``echo`` the prompt's rows (:func:`_echo_rows`) come first."""
    if c.logprobs is None:
        return None
    start, end, offset = span
    ranked = (sorted(d.items(), key=lambda kv: -kv[1]) for d in c.logprobs[start:end])
    rows = _logprob_rows(ctx, zip(c.token_ids[start:end], ranked))
    if echo is not None:
        rows = _LogprobRows(
            echo.tokens + rows.tokens,
            echo.token_logprobs + rows.token_logprobs,
            echo.top_logprobs + rows.top_logprobs,
        )
    offsets = list(itertools.accumulate((len(s) for s in rows.tokens[:-1]), initial=offset)) if rows.tokens else []
    return {
        "tokens": rows.tokens,
        "token_logprobs": rows.token_logprobs,
        "top_logprobs": rows.top_logprobs,
        "text_offset": offsets,
    }


def _top_entries(d: dict[int, float], token: int, n: int) -> list[tuple[int, float]]:
    """The token's entry and the ``n`` most likely of ``d``, most likely first."""
    ranked = sorted(d.items(), key=lambda kv: -kv[1])
    keep = ranked[:n]
    if token in d and all(t != token for t, _ in keep):
        keep.append((token, d[token]))
    return sorted(keep, key=lambda kv: -kv[1])


def _vllm_prompt_logprobs(
    ctx: _Ctx, ids: list[int], lps: list[dict[int, float] | None] | None, n: int, computed: int
) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's ``prompt_logprobs``: None for the first prompt token, then per token its entry and the
    ``n`` most likely, each with ``logprob``, ``rank`` (1 = most likely) and ``decoded_token``. The
    engine computed the top ``computed``: a token outside them has rank None."""
    if lps is None:
        return None
    tok = ctx.llm.tokenizer
    out: list[dict[str, dict[str, Any]] | None] = []
    for t, d in zip(ids, lps):
        if d is None:
            out.append(None)
            continue
        ranked = [k for k, _ in sorted(d.items(), key=lambda kv: -kv[1])[:computed]]
        out.append(
            {
                str(k): {
                    "logprob": v,
                    "rank": ranked.index(k) + 1 if k in ranked else None,
                    "decoded_token": tok.token_text(k) if tok is not None else None,
                }
                for k, v in _top_entries(d, t, n)
            }
        )
    return out


def _chat_logprobs(ctx: _Ctx, c: CompletionOutput, start: int, end: int, top_n: int) -> dict[str, Any] | None:
    if c.logprobs is None:
        return None
    content = []
    for t, d in zip(c.token_ids[start:end], c.logprobs[start:end]):
        s = _token_str(ctx, t)
        ranked = sorted(d.items(), key=lambda kv: -kv[1])[:top_n]
        content.append(
            {
                "token": s,
                "logprob": d.get(t, float("-inf")),
                "bytes": list(s.encode()),
                "top_logprobs": [
                    {"token": (ts := _token_str(ctx, k)), "logprob": v, "bytes": list(ts.encode())} for k, v in ranked
                ],
            }
        )
    return {"content": content}


def _prompt_text(ctx: _Ctx, p: _Prompt) -> str:
    if p.text is not None:
        return p.text
    tok = ctx.llm.tokenizer
    return tok.decode(p.ids, skip_special_tokens=False) if tok is not None else ""


def _completion_body(
    ctx: _Ctx, rid: str, req: CompletionRequest, prompts: list[_Prompt], outs: list[RequestOutput]
) -> dict[str, Any]:
    choices = []
    for pi, (p, out) in enumerate(zip(prompts, outs)):
        echo = _prompt_text(ctx, p) if req.echo else ""
        # Built once per prompt: its n choices share them.
        echoed = req.echo and req.logprobs is not None
        rows = _echo_rows(ctx, p.ids, out.prompt_logprobs, req.logprobs or 0) if echoed else None
        vllm_rows = (
            _vllm_prompt_logprobs(ctx, p.ids, out.prompt_logprobs, req.prompt_logprobs, _computed(req))
            if req.prompt_logprobs is not None
            else None
        )
        for c in out.outputs:
            lp = _completion_logprobs(ctx, c, (0, len(c.token_ids), 0), rows)
            choice = {
                "index": pi * req.n + c.index,
                "text": echo + c.text,
                "logprobs": lp,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
            if req.prompt_logprobs is not None:
                choice["prompt_logprobs"] = vllm_rows
            choices.append(choice)
    body = {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": _shown_model(ctx, _lora_of(ctx, req.model)),
        "choices": choices,
        "usage": _usage(prompts, outs),
    }
    return _with_kv_transfer(body, outs)


def _with_kv_transfer(body: dict[str, Any], outs: list[RequestOutput]) -> dict[str, Any]:
    """A prefill engine's answer carries what the decode engine's request needs (vLLM's field)."""
    params = outs[0].kv_transfer_params if len(outs) == 1 else None
    if params is not None:
        body["kv_transfer_params"] = params
    return body


def _computed(req: CompletionRequest | ChatCompletionRequest) -> int:
    """How many top prompt logprobs the engine computed for ``req`` (see ``_prompt_logprobs``)."""
    echo = isinstance(req, CompletionRequest) and req.echo and req.logprobs is not None
    return max(req.prompt_logprobs or 0, int(req.logprobs or 0) if echo else 0)


def _tool_call(call: ParsedToolCall) -> dict[str, Any]:
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }


def _chat_finish_reason(c: CompletionOutput, called: bool) -> str | None:
    """OpenAI's ``tool_calls`` when the model stopped after calling tools; otherwise the engine's reason."""
    return "tool_calls" if called and c.finish_reason == "stop" else c.finish_reason


def _chat_message(c: CompletionOutput, parsers: Callable[[], OutputParser] | None) -> tuple[dict[str, Any], bool]:
    """A choice's ``message`` and whether it calls tools."""
    if parsers is None:
        return {"role": "assistant", "content": c.text}, False
    parser = parsers()
    parsed = parser.parse(c.text)
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content or (None if parsed.tool_calls else "")}
    if parser.reasoning is not None:
        message["reasoning_content"] = parsed.reasoning or None
    if parsed.tool_calls:
        message["tool_calls"] = [_tool_call(t) for t in parsed.tool_calls]
    return message, bool(parsed.tool_calls)


def _chat_choice(
    ctx: _Ctx, c: CompletionOutput, top_n: int, parsers: Callable[[], OutputParser] | None
) -> dict[str, Any]:
    message, called = _chat_message(c, parsers)
    return {
        "index": c.index,
        "message": message,
        "logprobs": _chat_logprobs(ctx, c, 0, len(c.token_ids), top_n),
        "finish_reason": _chat_finish_reason(c, called),
        "stop_reason": c.stop_reason,
    }


def _chat_body(
    ctx: _Ctx,
    rid: str,
    req: ChatCompletionRequest,
    prompt: _Prompt,
    out: RequestOutput,
    parsers: Callable[[], OutputParser] | None = None,
) -> dict[str, Any]:
    top_n = req.top_logprobs or 0
    body = {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": _shown_model(ctx, _lora_of(ctx, req.model)),
        "choices": [_chat_choice(ctx, c, top_n, parsers) for c in out.outputs],
        "usage": _usage([prompt], [out]),
    }
    if req.prompt_logprobs is not None:
        body["prompt_logprobs"] = _vllm_prompt_logprobs(
            ctx, prompt.ids, out.prompt_logprobs, req.prompt_logprobs, req.prompt_logprobs
        )
    return _with_kv_transfer(body, [out])
