"""The OpenAI-compatible FastAPI app: /v1/completions, /v1/chat/completions, /v1/models, /health,
/metrics and /version, with OpenAI error bodies, Bearer auth, a body-size limit and back-pressure."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, MutableMapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import __version__
from ..config import ServingSettings
from ..engine import EngineDeadError
from ..metrics import CONTENT_TYPE_LATEST, ServerMetrics
from ..request import CompletionOutput, RequestOutput, SamplingParams
from .async_llm import AsyncLLM, EngineFailure
from .protocol import APIError, ChatCompletionRequest, ChatMessage, CompletionRequest, error_body

__all__ = ["build_app", "served_model_name"]

logger = logging.getLogger("pypto_serving.server")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

_SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
)
_PARAM_RE = re.compile(r"^(\w+)=")


def served_model_name(settings: ServingSettings) -> str:
    if settings.served_model_name:
        return settings.served_model_name
    return Path(settings.model).name if settings.model else "default"


# --------------------------------------------------------------------------- ASGI guard


class _Guard:
    """Outermost checks, as plain ASGI so streaming and disconnects pass through untouched:
    the body-size limit (413), Bearer auth (401) and a last-resort 500 that carries an error id."""

    def __init__(self, app: ASGIApp, settings: ServingSettings) -> None:
        self.app = app
        self.limit = settings.max_request_body_bytes
        self.keys = [k.encode() for k in settings.api_key]
        self.open_paths = {"/health"} | (set() if settings.protect_metrics else {"/metrics"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.keys and scope["path"] not in self.open_paths and not self._authorized(scope):
            await _send_json(
                send,
                401,
                error_body("missing or invalid API key", "authentication_error", None, "invalid_api_key"),
                {"www-authenticate": "Bearer"},
            )
            return
        declared = _header(scope, b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.limit):
            await self._too_large(send)
            return
        # Read the body here (bounded) so chunked uploads cannot exceed the limit either, then
        # replay it; later receive() calls go to the server so disconnects still arrive.
        chunks: list[bytes] = []
        size = 0
        more = True
        while more:
            msg = await receive()
            if msg["type"] != "http.request":
                return  # client left before sending its body
            chunks.append(msg.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                await self._too_large(send)
                return
            more = bool(msg.get("more_body", False))
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        started = False

        async def tracked_send(msg: Message) -> None:
            nonlocal started
            if msg["type"] == "http.response.start":
                started = True
            await send(msg)

        try:
            await self.app(scope, replay, tracked_send)
        except Exception:
            error_id = f"err-{uuid.uuid4().hex}"
            logger.exception("internal error %s while serving %s %s", error_id, scope.get("method"), scope["path"])
            if not started:
                await _send_json(
                    send,
                    500,
                    error_body(f"internal server error (error id {error_id})", "server_error", None, "internal_error"),
                    {"x-error-id": error_id},
                )

    def _authorized(self, scope: Scope) -> bool:
        value = _header(scope, b"authorization") or ""
        scheme, _, token = value.partition(" ")
        if scheme.lower() != "bearer" or not token:
            return False
        given = token.strip().encode()
        ok = False
        for key in self.keys:  # compare against every key so timing does not reveal which one matched
            ok |= hmac.compare_digest(given, key)
        return ok

    async def _too_large(self, send: Send) -> None:
        await _send_json(
            send,
            413,
            error_body(
                f"request body is larger than max_request_body_bytes={self.limit}",
                "invalid_request_error",
                None,
                "request_too_large",
            ),
        )


def _header(scope: Scope, name: bytes) -> str | None:
    for k, v in scope.get("headers", []):
        if k.lower() == name:
            return bytes(v).decode("latin-1")
    return None


async def _send_json(send: Send, status: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> None:
    data = json.dumps(body).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    raw += [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": data})


# --------------------------------------------------------------------------- app


@dataclass(slots=True)
class _Prompt:
    ids: list[int]
    text: str | None


@dataclass(slots=True)
class _ChoiceState:
    """What one streamed choice has sent so far (outputs are cumulative snapshots)."""

    text_sent: int = 0
    tokens_sent: int = 0
    started: bool = False
    finished: bool = False


@dataclass(slots=True)
class _Ctx:
    settings: ServingSettings
    llm: AsyncLLM
    metrics: ServerMetrics
    model_name: str
    created: int = field(default_factory=lambda: int(time.time()))


def build_app(llm: AsyncLLM, settings: ServingSettings | None = None, *, manage_engine: bool = True) -> FastAPI:
    """The FastAPI app serving ``llm``. With ``manage_engine`` the app's lifespan starts the engine
    (loading in the background; /health says 503 until ready) and shuts it down on exit."""
    settings = settings or llm.settings
    name = served_model_name(settings)
    metrics = llm.metrics or ServerMetrics(name)
    llm.metrics = metrics
    ctx = _Ctx(settings, llm, metrics, name)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if manage_engine:
            llm.start()
        yield
        if manage_engine:
            # uvicorn has already waited (up to shutdown_timeout) for in-flight responses; abort the rest.
            await asyncio.to_thread(llm.shutdown, max(5.0, settings.shutdown_timeout))

    app = FastAPI(title="pypto-serving", version=__version__, lifespan=lifespan)
    app.state.ctx = ctx
    _add_error_handlers(app)
    _add_routes(app, ctx)
    llm.plugins.add_routes(app)
    app.add_middleware(_Guard, settings=settings)  # type: ignore[arg-type]
    return app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(error_body(exc.message, exc.type, exc.param, exc.code), exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = [str(p) for p in first.get("loc", ())]
        # The top-level field: deeper parts are pydantic's union branch names, not client-facing fields.
        param = loc[1] if len(loc) > 1 and loc[0] == "body" else None
        if first.get("type") == "json_invalid":
            param = None
        msg = "; ".join(
            f"{'.'.join(str(p) for p in e.get('loc', ())[1:]) or 'body'}: {e.get('msg')}" for e in errors[:3]
        )
        return JSONResponse(error_body(msg, "invalid_request_error", param, "invalid_value"), 400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = "not_found" if exc.status_code == 404 else None
        return JSONResponse(
            error_body(str(exc.detail), "invalid_request_error", None, code),
            exc.status_code,
            headers=exc.headers,
        )


def _add_routes(app: FastAPI, ctx: _Ctx) -> None:
    llm = ctx.llm

    @app.get("/health")
    async def health() -> JSONResponse:
        if llm.healthy:
            return JSONResponse({"status": "ok"})
        reason = llm.dead_reason or ("shutting down" if llm.ready else "loading")
        return JSONResponse({"status": "unavailable", "reason": reason}, 503, headers={"retry-after": "5"})

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics_route() -> Response:
        ctx.metrics.update_engine(llm.stats, llm.dead_reason is not None)
        return Response(ctx.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card: dict[str, Any] = {
            "id": ctx.model_name,
            "object": "model",
            "created": ctx.created,
            "owned_by": "pypto-serving",
        }
        if llm.ready and llm.engine is not None:
            card["max_model_len"] = llm.max_model_len
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions", response_model=None)
    async def completions(req: CompletionRequest, raw: Request) -> Response:
        _check_model(ctx, req.model)
        _check_ready(ctx)
        if req.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        if req.logit_bias:
            raise APIError(400, "logit_bias is not supported", param="logit_bias")
        prompts = _completion_prompts(ctx, req.prompt)
        params = [_sampling_params(ctx, req, p, req.max_tokens, req.logprobs) for p in prompts]
        _check_capacity(ctx, len(prompts))
        rid = f"cmpl-{uuid.uuid4().hex}"
        if req.stream:
            source = _merged(ctx, rid, prompts, params)
            first = await _prepare(source)
            return _sse(_StreamRunner(ctx, rid, prompts, params, _with_first(first, source)).completion(req))
        outs = await _run_all(ctx, rid, prompts, params, raw)
        return JSONResponse(_completion_body(ctx, rid, req, prompts, outs))

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(req: ChatCompletionRequest, raw: Request) -> Response:
        _check_model(ctx, req.model)
        _check_ready(ctx)
        if req.logit_bias:
            raise APIError(400, "logit_bias is not supported", param="logit_bias")
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        prompt = _chat_prompt(ctx, req)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        param_name = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        num_logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = _sampling_params(ctx, req, prompt, max_tokens, num_logprobs, max_tokens_param=param_name)
        _check_capacity(ctx, 1)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        if req.stream:
            source = _merged(ctx, rid, [prompt], [params])
            first = await _prepare(source)
            return _sse(_StreamRunner(ctx, rid, [prompt], [params], _with_first(first, source)).chat(req))
        outs = await _run_all(ctx, rid, [prompt], [params], raw)
        return JSONResponse(_chat_body(ctx, rid, req, prompt, outs[0]))


# --------------------------------------------------------------------------- request building


def _check_model(ctx: _Ctx, model: str | None) -> None:
    if model is not None and model != ctx.model_name:
        raise APIError(
            404,
            f"the model {model!r} does not exist; this server serves {ctx.model_name!r}",
            param="model",
            code="model_not_found",
        )


def _check_ready(ctx: _Ctx) -> None:
    if ctx.llm.dead_reason is not None:
        raise APIError(503, f"the engine failed: {ctx.llm.dead_reason}", type="server_error", code="engine_dead")
    if not ctx.llm.ready:
        raise APIError(
            503,
            "the model is still loading",
            type="server_error",
            code="loading",
            headers={"retry-after": "5"},
        )


def _check_capacity(ctx: _Ctx, new: int) -> None:
    if ctx.llm.num_waiting() + new > ctx.settings.max_waiting_requests:
        raise APIError(
            503,
            f"the server is overloaded (more than max_waiting_requests={ctx.settings.max_waiting_requests} "
            "requests waiting); retry later",
            type="server_error",
            code="overloaded",
            headers={"retry-after": "1"},
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


def _message_dict(m: ChatMessage) -> dict[str, Any]:
    d = m.model_dump(exclude_none=True)
    if isinstance(m.content, list):  # text parts joined; other part types have no meaning for a text model
        if any(p.type != "text" for p in m.content):
            raise APIError(400, "only text content parts are supported", param="messages")
        d["content"] = "".join(p.text or "" for p in m.content)
    d.setdefault("content", "")
    return d


def _chat_prompt(ctx: _Ctx, req: ChatCompletionRequest) -> _Prompt:
    tok = ctx.llm.tokenizer
    if tok is None or not tok.chat_template:
        raise APIError(400, "this model has no chat template; use /v1/completions", param="messages")
    messages = [_message_dict(m) for m in req.messages]
    try:
        text = tok.apply_chat_template(
            messages, add_generation_prompt=req.add_generation_prompt, **(req.chat_template_kwargs or {})
        )
    except (ValueError, TypeError) as e:
        raise APIError(400, f"cannot render the chat template: {e}", param="messages") from None
    except Exception as e:  # template errors (jinja undefined, security) are the request's fault too
        raise APIError(400, f"cannot render the chat template: {type(e).__name__}: {e}", param="messages") from None
    return _validate_ids(ctx, tok.encode(text), text, param="messages")


def _sampling_params(
    ctx: _Ctx,
    req: CompletionRequest | ChatCompletionRequest,
    prompt: _Prompt,
    max_tokens: int | None,
    logprobs: int | None,
    *,
    max_tokens_param: str = "max_tokens",
) -> SamplingParams:
    defaults = ctx.llm.engine.info.generation_defaults if ctx.llm.engine is not None else {}
    kw: dict[str, Any] = {k: v for k, v in defaults.items() if k in ("temperature", "top_p", "top_k", "min_p")}
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
            **kw,
        )
    except (ValueError, TypeError) as e:
        m = _PARAM_RE.match(str(e))
        param = m.group(1) if m else None
        if param == "max_tokens":
            param = max_tokens_param
        elif param == "logprobs" and isinstance(req, ChatCompletionRequest):
            param = "top_logprobs"
        raise APIError(400, str(e), param=param) from None
    if params.stop and ctx.llm.tokenizer is None:
        raise APIError(400, "stop strings need a tokenizer.json in the model directory", param="stop")
    if max_tokens is not None and len(prompt.ids) + max_tokens > ctx.llm.max_model_len:
        raise APIError(
            400,
            f"{max_tokens_param}={max_tokens} plus the prompt's {len(prompt.ids)} tokens exceeds the context "
            f"length max_model_len={ctx.llm.max_model_len}",
            param=max_tokens_param,
            code="context_length_exceeded",
        )
    return params


# --------------------------------------------------------------------------- running


async def _collect(ctx: _Ctx, rid: str, prompt: _Prompt, params: SamplingParams) -> RequestOutput:
    last: RequestOutput | None = None
    async for out in ctx.llm.generate(rid, prompt.ids, params):
        last = out
    assert last is not None
    return last


def _engine_error(e: BaseException) -> APIError:
    if isinstance(e, EngineDeadError | EngineFailure):
        return APIError(503, f"the engine is unavailable: {e}", type="server_error", code="engine_dead")
    return APIError(400, str(e), param=_guess_param(str(e)))


def _guess_param(message: str) -> str | None:
    m = _PARAM_RE.match(message)
    if m:
        return m.group(1)
    return "prompt" if "prompt" in message else None


async def _run_all(
    ctx: _Ctx, rid: str, prompts: list[_Prompt], params: list[SamplingParams], raw: Request
) -> list[RequestOutput]:
    """Run every prompt as its own engine request; a client disconnect or any failure aborts them all."""
    ids = [rid if len(prompts) == 1 else f"{rid}-{i}" for i in range(len(prompts))]
    tasks = [asyncio.ensure_future(_collect(ctx, i, p, sp)) for i, p, sp in zip(ids, prompts, params)]
    watcher = asyncio.ensure_future(_watch_disconnect(raw, tasks))
    try:
        outs = await asyncio.gather(*tasks)
    except asyncio.CancelledError:
        raise
    except (ValueError, EngineDeadError, EngineFailure) as e:
        raise _engine_error(e) from None
    finally:
        watcher.cancel()
        for t in tasks:
            t.cancel()  # generate()'s cleanup aborts whatever is unfinished
    for out in outs:
        if any(c.finish_reason == "error" for c in out.outputs):
            reason = ctx.llm.dead_reason or "a step failed for this request"
            raise APIError(500, f"generation failed: {reason}", type="server_error", code="generation_failed")
    return list(outs)


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
    text = tok.decode([token], skip_special_tokens=False)
    return f"token_id:{token}" if "\ufffd" in text else text


def _completion_logprobs(
    ctx: _Ctx, c: CompletionOutput, start: int, end: int, offset: int, echo_ids: list[int] | None = None
) -> dict[str, Any] | None:
    if c.logprobs is None:
        return None
    tokens: list[str] = []
    token_lps: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for t in echo_ids or []:  # prompt tokens: the engine computes no prompt logprobs, so they are null
        s = _token_str(ctx, t)
        tokens.append(s)
        token_lps.append(None)
        tops.append(None)
        offsets.append(offset)
        offset += len(s)
    for t, d in zip(c.token_ids[start:end], c.logprobs[start:end]):
        s = _token_str(ctx, t)
        tokens.append(s)
        token_lps.append(d.get(t))
        tops.append({_token_str(ctx, k): v for k, v in sorted(d.items(), key=lambda kv: -kv[1])})
        offsets.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


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
        for c in out.outputs:
            lp = _completion_logprobs(ctx, c, 0, len(c.token_ids), 0, p.ids if req.echo else None)
            choices.append(
                {
                    "index": pi * req.n + c.index,
                    "text": echo + c.text,
                    "logprobs": lp,
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                }
            )
    return {
        "id": rid,
        "object": "text_completion",
        "created": int(time.time()),
        "model": ctx.model_name,
        "choices": choices,
        "usage": _usage(prompts, outs),
    }


def _chat_body(ctx: _Ctx, rid: str, req: ChatCompletionRequest, prompt: _Prompt, out: RequestOutput) -> dict[str, Any]:
    top_n = req.top_logprobs or 0
    choices = [
        {
            "index": c.index,
            "message": {"role": "assistant", "content": c.text},
            "logprobs": _chat_logprobs(ctx, c, 0, len(c.token_ids), top_n),
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
        }
        for c in out.outputs
    ]
    return {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": ctx.model_name,
        "choices": choices,
        "usage": _usage([prompt], [out]),
    }


# --------------------------------------------------------------------------- streaming


def _sse(gen: AsyncIterator[str]) -> StreamingResponse:
    return StreamingResponse(gen, media_type="text/event-stream", headers={"cache-control": "no-cache"})


def _event(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data)}\n\n"


_DONE = "data: [DONE]\n\n"


async def _merged(
    ctx: _Ctx, rid: str, prompts: list[_Prompt], params: list[SamplingParams]
) -> AsyncGenerator[tuple[int, RequestOutput]]:
    """Outputs of all prompts' requests as they come, tagged with the prompt index. Adds happen
    before the first yield so validation errors surface before any byte is sent."""
    streams = []
    ids = [rid if len(prompts) == 1 else f"{rid}-{i}" for i in range(len(prompts))]
    added: list[str] = []
    try:
        for i, p, sp in zip(ids, prompts, params):
            streams.append(await ctx.llm.add_request(i, p.ids, sp))
            added.append(i)
    except BaseException:
        for i in added:
            ctx.llm.abort(i)
        raise
    merged: asyncio.Queue[tuple[int, RequestOutput | EngineFailure]] = asyncio.Queue()

    async def pump(idx: int) -> None:
        while True:
            item = await streams[idx].queue.get()
            await merged.put((idx, item))
            if isinstance(item, EngineFailure) or item.finished:
                return

    pumps = [asyncio.ensure_future(pump(k)) for k in range(len(streams))]
    done: set[int] = set()
    try:
        while len(done) < len(streams):
            idx, item = await merged.get()
            if isinstance(item, EngineFailure):
                raise item
            if item.finished:
                done.add(idx)
            yield idx, item
    finally:
        for t in pumps:
            t.cancel()
        for k, rid_k in enumerate(ids):
            if k not in done:
                ctx.llm.abort(rid_k)  # disconnect or failure: free the blocks now


async def _prepare(gen: AsyncGenerator[tuple[int, RequestOutput]]) -> tuple[int, RequestOutput] | None:
    """Pull the first item before streaming starts so add-time errors become plain HTTP errors."""
    try:
        return await gen.__anext__()
    except StopAsyncIteration:
        return None
    except (ValueError, EngineDeadError, EngineFailure) as e:
        raise _engine_error(e) from None


def _hold_back(params: SamplingParams) -> int:
    # A stop string may start in text we would already have streamed; keep its length - 1 back.
    return max((len(s) for s in params.stop), default=1) - 1


def _error_event(message: str) -> str:
    return _event(error_body(message, "server_error", None, "generation_failed"))


async def _with_first(
    first: tuple[int, RequestOutput] | None, gen: AsyncGenerator[tuple[int, RequestOutput]]
) -> AsyncGenerator[tuple[int, RequestOutput]]:
    # Close the source explicitly: a disconnect closes only the outermost generator.
    async with contextlib.aclosing(gen):
        if first is not None:
            yield first
            async for item in gen:
                yield item


class _StreamRunner:
    """Turns cumulative outputs into OpenAI SSE chunks (text deltas, logprobs, finish, usage)."""

    def __init__(
        self,
        ctx: _Ctx,
        rid: str,
        prompts: list[_Prompt],
        params: list[SamplingParams],
        source: AsyncGenerator[tuple[int, RequestOutput]],
    ) -> None:
        self.ctx, self.rid, self.prompts, self.params, self.source = ctx, rid, prompts, params, source
        self.created = int(time.time())
        self.finals: dict[int, RequestOutput] = {}

    async def _items(self) -> AsyncGenerator[tuple[int, CompletionOutput, _ChoiceState, int, int, bool]]:
        """(prompt index, choice, state, token start, token end, finished now) for every change."""
        states: dict[tuple[int, int], _ChoiceState] = {}
        async with contextlib.aclosing(self.source):
            async for pi, out in self.source:
                if out.finished:
                    self.finals[pi] = out
                for c in out.outputs:
                    st = states.setdefault((pi, c.index), _ChoiceState())
                    if st.finished:
                        continue
                    done = c.finish_reason is not None
                    yield pi, c, st, st.tokens_sent, len(c.token_ids), done
                    st.tokens_sent = len(c.token_ids)
                    st.finished = done

    def _delta_text(self, pi: int, c: CompletionOutput, st: _ChoiceState, done: bool) -> str:
        upto = len(c.text) if done else max(st.text_sent, len(c.text) - _hold_back(self.params[pi]))
        delta = c.text[st.text_sent : upto]
        st.text_sent = max(st.text_sent, upto)
        return delta

    def _usage_chunk(self, obj: str) -> str:
        outs = [self.finals[i] for i in sorted(self.finals)]
        return _event(
            {
                "id": self.rid,
                "object": obj,
                "created": self.created,
                "model": self.ctx.model_name,
                "choices": [],
                "usage": _usage(self.prompts, outs),
            }
        )

    async def completion(self, req: CompletionRequest) -> AsyncIterator[str]:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        try:
            async with contextlib.aclosing(self._items()) as items:
                async for pi, c, st, start, end, done in items:
                    if c.finish_reason == "error":
                        yield _error_event(f"generation failed: {self.ctx.llm.dead_reason or 'a step failed'}")
                        yield _DONE
                        return
                    prefix = ""
                    echo_ids = None
                    if not st.started:
                        st.started = True
                        if req.echo:
                            prefix = _prompt_text(self.ctx, self.prompts[pi])
                            echo_ids = self.prompts[pi].ids
                    text = prefix + self._delta_text(pi, c, st, done)
                    if not text and not done and echo_ids is None and (c.logprobs is None or start == end):
                        continue
                    choice = {
                        "index": pi * req.n + c.index,
                        "text": text,
                        "logprobs": _completion_logprobs(self.ctx, c, start, end, st.text_sent - len(text), echo_ids),
                        "finish_reason": c.finish_reason,
                        "stop_reason": c.stop_reason if done else None,
                    }
                    yield _event(
                        {
                            "id": self.rid,
                            "object": "text_completion",
                            "created": self.created,
                            "model": self.ctx.model_name,
                            "choices": [choice],
                            **({"usage": None} if include_usage else {}),
                        }
                    )
        except (EngineFailure, EngineDeadError, ValueError) as e:
            yield _error_event(f"generation failed: {e}")
            yield _DONE
            return
        if include_usage:
            yield self._usage_chunk("text_completion")
        yield _DONE

    async def chat(self, req: ChatCompletionRequest) -> AsyncIterator[str]:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        top_n = req.top_logprobs or 0

        def chunk(choice: dict[str, Any]) -> str:
            return _event(
                {
                    "id": self.rid,
                    "object": "chat.completion.chunk",
                    "created": self.created,
                    "model": self.ctx.model_name,
                    "choices": [choice],
                    **({"usage": None} if include_usage else {}),
                }
            )

        try:
            async with contextlib.aclosing(self._items()) as items:
                async for _pi, c, st, start, end, done in items:
                    if c.finish_reason == "error":
                        yield _error_event(f"generation failed: {self.ctx.llm.dead_reason or 'a step failed'}")
                        yield _DONE
                        return
                    if not st.started:
                        st.started = True
                        yield chunk(
                            {
                                "index": c.index,
                                "delta": {"role": "assistant", "content": ""},
                                "logprobs": None,
                                "finish_reason": None,
                            }
                        )
                    text = self._delta_text(0, c, st, done)
                    if not text and not done and (c.logprobs is None or start == end):
                        continue
                    yield chunk(
                        {
                            "index": c.index,
                            "delta": {"content": text} if text else {},
                            "logprobs": _chat_logprobs(self.ctx, c, start, end, top_n),
                            "finish_reason": c.finish_reason,
                            **({"stop_reason": c.stop_reason} if done else {}),
                        }
                    )
        except (EngineFailure, EngineDeadError, ValueError) as e:
            yield _error_event(f"generation failed: {e}")
            yield _DONE
            return
        if include_usage:
            yield self._usage_chunk("chat.completion.chunk")
        yield _DONE
