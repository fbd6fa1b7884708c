"""The OpenAI-compatible FastAPI app: /v1/completions, /v1/chat/completions, /v1/models, /health,
/metrics, /version and vLLM's /tokenize and /detokenize, with OpenAI error bodies, Bearer auth, a
body-size limit and back-pressure; and Anthropic's /v1/messages (``anthropic.py``).
This module assembles the app (lifespan, error handlers, routes); the work is in its siblings."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Annotated, Any

from fastapi import Body, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import __version__
from ..config import ServingSettings
from ..heap import freeze_startup_heap
from ..metrics import CONTENT_TYPE_LATEST, ServerMetrics
from .anthropic import add_anthropic_routes
from .dashboard import add_dashboard_routes, start_sampler
from .data_parallel import ServingLLM
from .guard import _Guard
from .lora_admin import add_lora_routes
from .openai_requests import (
    _chat_prompt,
    _check_capacity,
    _check_model,
    _check_ready,
    _check_tool_choice,
    _completion_prompts,
    _Ctx,
    _output_parsers,
    _render_chat,
    _request_grammar,
    _sampling_params,
    _served_adapters,
    _tool_choice_spec,
)
from .profiling import add_profile_routes
from .protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    error_body,
    json_depth_route,
    validation_api_error,
)
from .responses import _chat_body, _completion_body, _json_response, _run_all
from .responses_api import add_responses_routes
from .streaming import _sse, _start_stream
from .timeline import add_timeline_route, timeline_store

__all__ = ["build_app", "served_model_name"]


def served_model_name(settings: ServingSettings) -> str:
    if settings.served_model_name:
        return settings.served_model_name
    return Path(settings.model).name if settings.model else "default"


def build_app(llm: ServingLLM, settings: ServingSettings | None = None, *, manage_engine: bool = True) -> FastAPI:
    """The FastAPI app serving ``llm``. With ``manage_engine`` the app's lifespan starts the engine
    (loading in the background; /health says 503 until ready) and shuts it down on exit."""
    settings = settings or llm.settings
    # A misspelt parser name fails here, at start-up, not on the first request with tools.
    llm.plugins.select_tool_parser(settings.tool_call_parser, "")
    llm.plugins.select_reasoning_parser(settings.reasoning_parser, "")
    name = served_model_name(settings)
    metrics = llm.metrics or ServerMetrics(name)
    llm.metrics = metrics
    timelines = timeline_store(settings, name)
    metrics.on_finished = timelines.add
    ctx = _Ctx(settings, llm, metrics, name)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if manage_engine:
            llm.start()
        freeze_startup_heap()
        app.state.sampler = start_sampler(ctx)
        yield
        sampler, app.state.sampler = app.state.sampler, None
        await asyncio.to_thread(sampler.stop)
        if manage_engine:
            # uvicorn has already waited (up to shutdown_timeout) for in-flight responses; abort the rest.
            await asyncio.to_thread(llm.shutdown, max(5.0, settings.shutdown_timeout))
        await asyncio.to_thread(timelines.shutdown)  # sends the spans still batched

    app = FastAPI(title="pypto-serving", version=__version__, lifespan=lifespan)
    app.state.ctx = ctx
    _add_error_handlers(app)
    _add_routes(app, ctx)
    add_timeline_route(app, timelines)
    add_profile_routes(app, ctx)
    add_lora_routes(app, ctx)
    llm.plugins.add_routes(app)
    app.add_middleware(_Guard, settings=settings)  # type: ignore[arg-type]
    return app


def _add_error_handlers(app: FastAPI) -> None:
    # Routes added from here on parse JSON bodies with bounded nesting (a too deep body is a 400, never
    # a RecursionError); set here, before any route exists, as it is how bad bodies become errors.
    app.router.route_class = json_depth_route(app.state.ctx.settings.max_json_depth)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(error_body(exc.message, exc.type, exc.param, exc.code), exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        e = validation_api_error(exc.errors(), exc.body)
        return JSONResponse(error_body(e.message, e.type, e.param, e.code), e.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = "not_found" if exc.status_code == 404 else None
        detail = str(exc.detail)
        if exc.status_code == 400 and detail == "There was an error parsing the body":  # FastAPI's own
            code, detail = "invalid_json", "could not parse the JSON body of the request"
        return JSONResponse(
            error_body(detail, "invalid_request_error", None, code),
            exc.status_code,
            headers=exc.headers,
        )


def _add_routes(app: FastAPI, ctx: _Ctx) -> None:
    _add_info_routes(app, ctx)
    _add_generation_routes(app, ctx)
    add_responses_routes(app, ctx)
    _add_tokenizer_routes(app, ctx)
    add_anthropic_routes(app, ctx)  # /v1/messages: Anthropic's Messages API on the chat machinery
    add_dashboard_routes(app, ctx)


def _add_info_routes(app: FastAPI, ctx: _Ctx) -> None:
    """/health, /version, /metrics and /v1/models: cheap reads that never touch the engine thread."""
    llm = ctx.llm

    @app.get("/health")
    async def health() -> JSONResponse:
        stalled = llm.stalled if llm.healthy else None
        if llm.healthy and stalled is None:
            return JSONResponse({"status": "ok"})
        if stalled is not None:  # up, but frozen: a step past health_step_timeout, or a silent core
            body = {"status": "stalled", "reason": stalled}
        elif llm.restarting is not None and llm.dead_reason is None:
            body = {"status": "restarting", "reason": llm.restarting}
        else:
            body = {"status": "unavailable", "reason": llm.dead_reason or ("shutting down" if llm.ready else "loading")}
        return JSONResponse(body, 503, headers={"retry-after": "5"})

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics_route() -> Response:
        ctx.metrics.update_engine(llm.stats, llm.dead_reason is not None)
        return Response(ctx.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/metrics/json")
    async def metrics_json() -> dict[str, Any]:
        ctx.metrics.update_engine(llm.stats, llm.dead_reason is not None)
        return {"time": time.time(), **ctx.metrics.render_json()}

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
        # Each LoRA adapter is a model of its own whose parent is the base model, as vLLM lists them
        # (without its directory: the server's file layout is not the client's business).
        adapters = [{**card, "id": name, "parent": ctx.model_name} for name in _served_adapters(ctx)]
        return {"object": "list", "data": [card, *adapters]}


def _add_generation_routes(app: FastAPI, ctx: _Ctx) -> None:
    """/v1/completions and /v1/chat/completions: validate, add to the engine, stream or collect."""

    @app.post("/v1/completions", response_model=None)
    async def completions(req: CompletionRequest, raw: Request) -> Response:
        _check_model(ctx, req.model)
        _check_ready(ctx)
        # The grammar compiles once per request, on the grammar checker's threads, within its budget;
        # first, so a grammar over it is refused before a thousand prompts are tokenized.
        field, grammar = await _request_grammar(ctx, req)
        # Tokenization runs off the event loop, so a long prompt never stalls other clients' streams.
        prompts = await asyncio.to_thread(_completion_prompts, ctx, req.prompt)
        params = _sampling_params(ctx, req, prompts, req.max_tokens, req.logprobs, structured=grammar)
        _check_capacity(ctx, req, prompts, params)
        rid = f"cmpl-{uuid.uuid4().hex}"
        if req.stream:
            return _sse((await _start_stream(ctx, rid, prompts, params)).completion(req))
        outs = await _run_all(ctx, rid, prompts, params, raw, field)
        return await _json_response(_completion_body, ctx, rid, req, prompts, outs)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(req: ChatCompletionRequest, raw: Request) -> Response:
        _check_model(ctx, req.model)
        _check_ready(ctx)
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        _check_tool_choice(req)
        prompt = await asyncio.to_thread(_chat_prompt, ctx, req)
        parsers = _output_parsers(ctx, req, prompt)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        param_name = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        num_logprobs = (req.top_logprobs or 0) if req.logprobs else None
        field, grammar = await _request_grammar(ctx, req, _tool_choice_spec(ctx, req, parsers))
        params = _sampling_params(
            ctx, req, [prompt], max_tokens, num_logprobs, max_tokens_param=param_name, structured=grammar
        )
        _check_capacity(ctx, req, [prompt], params)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        if req.stream:
            return _sse((await _start_stream(ctx, rid, [prompt], params)).chat(req, parsers))
        outs = await _run_all(ctx, rid, [prompt], params, raw, field)
        return await _json_response(_chat_body, ctx, rid, req, prompt, outs[0], parsers)


def _add_tokenizer_routes(app: FastAPI, ctx: _Ctx) -> None:
    """vLLM's /tokenize (a text prompt, or chat messages rendered as a chat request renders them) and
    /detokenize: tokenizer work only, run off the event loop."""

    @app.post("/tokenize")
    async def tokenize(body: Annotated[dict[str, Any], Body()]) -> dict[str, Any]:
        # The body's kind decides the model, so errors speak of that one (a union would report both).
        kind = TokenizeChatRequest if "messages" in body else TokenizeCompletionRequest
        try:
            req = kind.model_validate(body)
        except ValidationError as e:
            raise RequestValidationError(
                [{**err, "loc": ("body", *err["loc"])} for err in e.errors()], body=body
            ) from None
        _check_model(ctx, req.model)
        _check_ready(ctx)
        return await asyncio.to_thread(_tokenize, ctx, req)

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> dict[str, Any]:
        _check_model(ctx, req.model)
        _check_ready(ctx)
        tok = _need_tokenizer(ctx, "tokens")
        if any(t >= ctx.llm.vocab_size for t in req.tokens):
            raise APIError(400, f"tokens must be token ids in [0, {ctx.llm.vocab_size})", param="tokens")
        return {"prompt": await asyncio.to_thread(tok.decode, req.tokens, False)}


def _need_tokenizer(ctx: _Ctx, param: str) -> Any:
    tok = ctx.llm.tokenizer
    if tok is None:
        raise APIError(400, "this model directory has no tokenizer.json", param=param)
    return tok


def _tokenize(ctx: _Ctx, req: TokenizeCompletionRequest | TokenizeChatRequest) -> dict[str, Any]:
    if isinstance(req, TokenizeChatRequest):
        tok = _need_tokenizer(ctx, "messages")
        ids = tok.encode(_render_chat(ctx, req), add_special_tokens=req.add_special_tokens)
    else:
        tok = _need_tokenizer(ctx, "prompt")
        ids = tok.encode(req.prompt, add_special_tokens=req.add_special_tokens)
    strs = [tok.token_text(t) for t in ids] if req.return_token_strs else None
    return {"count": len(ids), "max_model_len": ctx.llm.max_model_len, "tokens": ids, "token_strs": strs}
