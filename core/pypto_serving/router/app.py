"""The router's ASGI app: the OpenAI API forwarded to replicas, its own /health and /metrics, and the
admin routes under /router (Bearer ``admin_token``).

Routes:

* ``/v1/...`` (any method; ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models`` and every
  other one), ``/tokenize``, ``/detokenize``, ``/version``: routed and forwarded (see ``proxy.py``);
* ``GET /health``: 200 while at least one replica takes requests, else 503;
* ``GET /metrics``: Prometheus text (``pypto_router_*``);
* ``GET /router/replicas``: each replica's state; ``POST /router/replicas/{name}/drain`` and
  ``.../undrain``: a drained replica gets no new request and finishes those it has;
* ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (``admin_token``): to every
  replica (see ``lora.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from functools import partial

from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .config import RouterSettings
from .lora import LORA_PATHS, LoraBroadcast
from .metrics import RouterMetrics
from .proxy import Forwarder, error_response, read_body
from .replicas import Replica, launch, make_replica, poll_health, poll_once, stop
from .routing import Router

__all__ = ["RouterState", "build_router_app"]

logger = logging.getLogger("pypto_serving.router")

# An admin action on the router's state and the replica named in the path ("" for none).
_Action = Callable[["RouterState", str], Response]
_METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"]


class RouterState:
    """The router's replicas, routing state and metrics; what the app's routes share."""

    def __init__(self, settings: RouterSettings) -> None:
        self.settings = settings
        self.replicas = {c.name or c.url: make_replica(c, settings) for c in settings.replicas}
        self.router = Router(settings, {name: r.load for name, r in self.replicas.items()})
        self.metrics = RouterMetrics()
        self.forwarder = Forwarder(settings, self.router, self.replicas, self.metrics)
        self.lora = LoraBroadcast(self.replicas)
        self._poller: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Launch the replicas that have a command, poll every replica once, then keep polling."""
        replicas = list(self.replicas.values())
        for replica in replicas:
            if replica.config.command:
                launch(replica, self.settings)
        await asyncio.gather(*(poll_once(r, self.settings, self.lora.sync) for r in replicas))
        self._poller = asyncio.create_task(poll_health(replicas, self.settings, self.lora.sync))

    async def stop(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
        for replica in self.replicas.values():
            await replica.client.aclose()
            await replica.health_client.aclose()
        launched = [r for r in self.replicas.values() if r.process is not None]
        # Stopped side by side: each may take its whole drain.
        await asyncio.gather(*(asyncio.to_thread(stop, r, self.settings.stop_timeout) for r in launched))


def build_router_app(settings: RouterSettings) -> Starlette:
    """The router app; its lifespan launches, polls and stops the replicas."""
    state = RouterState(settings)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        try:
            await state.start()
        except BaseException:
            await state.stop()  # the replicas launched before the failure
            raise
        try:
            yield
        finally:
            await state.stop()

    routes = [
        Route("/health", partial(_health, state), methods=["GET"]),
        Route("/metrics", partial(_metrics, state), methods=["GET"]),
        Route("/router/replicas", partial(_admin, state, _list), methods=["GET"]),
        Route("/router/replicas/{name}/drain", partial(_admin, state, _drain), methods=["POST"]),
        Route("/router/replicas/{name}/undrain", partial(_admin, state, _undrain), methods=["POST"]),
        *(Route(p, partial(_lora, state), methods=["POST"]) for p in LORA_PATHS),
        *(Route(p, partial(_api, state), methods=_METHODS) for p in ("/tokenize", "/detokenize", "/version")),
        Route("/v1/{rest:path}", partial(_api, state), methods=_METHODS),
    ]
    handlers = {404: _not_found, 405: _not_allowed, Exception: _internal_error}
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers=handlers)
    app.state.router = state
    return app


async def _not_found(request: Request, exc: Exception) -> Response:
    return error_response(404, f"no route {request.url.path} on the router", "not_found")


async def _not_allowed(request: Request, exc: Exception) -> Response:
    return error_response(405, f"{request.method} is not allowed on {request.url.path}", "method_not_allowed")


async def _internal_error(request: Request, exc: Exception) -> Response:
    error_id = f"err-{uuid.uuid4().hex}"
    logger.error("internal error %s on %s %s", error_id, request.method, request.url.path, exc_info=exc)
    return error_response(500, f"internal router error (error id {error_id})", "internal_error")


async def _health(state: RouterState, request: Request) -> Response:
    routable = [r.name for r in state.replicas.values() if r.load.routable]
    if routable:
        return JSONResponse({"status": "ok", "replicas": routable})
    return JSONResponse({"status": "unavailable", "reason": "no replica is healthy and undrained"}, 503)


async def _metrics(state: RouterState, request: Request) -> Response:
    body = state.metrics.render(r.load for r in state.replicas.values())
    return Response(body, media_type=CONTENT_TYPE_LATEST)


def _bearer_ok(request: Request, keys: list[str]) -> bool:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token:
        return False
    ok = False
    for key in keys:  # every key compared, so timing does not say which one matched
        ok |= hmac.compare_digest(token.encode("latin-1"), key.encode())
    return ok


async def _api(state: RouterState, request: Request) -> Response:
    keys = state.settings.api_key
    if keys and not _bearer_ok(request, keys):
        return error_response(401, "missing or invalid API key", "invalid_api_key", {"www-authenticate": "Bearer"})
    return await state.forwarder.handle(request)


def _refuse_admin(state: RouterState, request: Request) -> Response | None:
    token = state.settings.admin_token
    if token is None:
        return error_response(403, "the admin routes are off: set admin_token", "admin_disabled")
    if not _bearer_ok(request, [token]):
        return error_response(
            401, "missing or invalid admin token", "invalid_admin_token", {"www-authenticate": "Bearer"}
        )
    return None


async def _lora(state: RouterState, request: Request) -> Response:
    if (refused := _refuse_admin(state, request)) is not None:
        return refused
    limit = state.settings.max_request_body_bytes
    body = await read_body(request, limit)
    if body is None:
        return error_response(413, f"request body is larger than max_request_body_bytes={limit}", "request_too_large")
    return await state.lora.handle(request.url.path, body)


async def _admin(state: RouterState, action: _Action, request: Request) -> Response:
    if (refused := _refuse_admin(state, request)) is not None:
        return refused
    name = str(request.path_params.get("name", ""))
    if name and name not in state.replicas:
        return error_response(404, f"no replica named {name!r}", "unknown_replica")
    return action(state, name)


def _list(state: RouterState, name: str) -> Response:
    return JSONResponse({"replicas": [r.describe() for r in state.replicas.values()]})


def _drain(state: RouterState, name: str) -> Response:
    replica: Replica = state.replicas[name]
    replica.load.drained = True
    logger.info("replica %s drained (%d request(s) in flight)", name, replica.load.in_flight)
    return JSONResponse(replica.describe())


def _undrain(state: RouterState, name: str) -> Response:
    replica: Replica = state.replicas[name]
    replica.load.drained = False
    logger.info("replica %s undrained", name)
    return JSONResponse(replica.describe())
