"""The ASGI guard wrapped around the whole app: body-size limit, Bearer auth, last-resort 500."""

from __future__ import annotations

import hmac
import json
import logging
import uuid
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from ..config import ServingSettings
from .protocol import error_body

logger = logging.getLogger("pypto_serving.server")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


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
