"""The ASGI guard wrapped around the whole app: body-size limit, Bearer (or x-api-key) auth, last-resort
500, access log. Its errors take the shape of the API the path belongs to (Anthropic's on /v1/messages)."""

from __future__ import annotations

import hmac
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any
from urllib.parse import unquote_to_bytes

from ..config import ServingSettings
from .anthropic import ANTHROPIC_PATH, anthropic_error_body
from .protocol import error_body

logger = logging.getLogger("pypto_serving.server")
# One line per HTTP request at info; its own name so deployments can route or silence it.
access_logger = logging.getLogger("pypto_serving.access")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class _Exchange:
    """One HTTP request's response as its client sees it: the status sent, whether the body ended,
    and the ``x-request-id`` header added to the response start. Everything the guard and the app
    send goes through :meth:`send`, so the access line reports what was actually sent."""

    def __init__(self, send: Send, request_id: str) -> None:
        self._send = send
        self.request_id = request_id
        self.status: int | None = None
        self.complete = False
        self.failed = False

    async def send(self, msg: Message) -> None:
        if msg["type"] == "http.response.start":
            self.status = int(msg["status"])
            msg = {**msg, "headers": [*msg.get("headers", []), (b"x-request-id", self.request_id.encode())]}
        elif msg["type"] == "http.response.body" and not msg.get("more_body", False):
            self.complete = True
        await self._send(msg)

    def log(self, scope: Scope, seconds: float) -> None:
        """The one access line of this request (never headers, keys or bodies)."""
        status = 499 if self.status is None else self.status  # 499: the client closed before any response
        note = ""
        if self.failed and self.status is not None:
            note = " (failed mid-response)"
        elif not self.complete:
            note = " (client closed)"
        access_logger.info(
            "%s %s %d %.1fms %s%s",
            scope.get("method"),
            _printable(scope["path"]),
            status,
            seconds * 1000,
            self.request_id,
            note,
        )


class _Guard:
    """Outermost checks, as plain ASGI so streaming and disconnects pass through untouched:
    the body-size limit (413), Bearer auth (401), a last-resort 500 that carries an error id, and
    the access log: one line per HTTP request, under an id the app finds in ``request.state``."""

    def __init__(self, app: ASGIApp, settings: ServingSettings) -> None:
        self.app = app
        self.limit = settings.max_request_body_bytes
        self.keys = [k.encode() for k in settings.api_key]
        self.admin_keys = [k.encode() for k in settings.admin_api_key]
        self.open_paths = {"/health"} | (set() if settings.protect_metrics else {"/metrics", "/metrics/json"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        # An id an outer layer already assigned is kept, so every log line of the request agrees.
        state = scope.setdefault("state", {})
        state.setdefault("request_id", f"req-{uuid.uuid4().hex}")
        exchange = _Exchange(send, str(state["request_id"]))
        started_at = time.perf_counter()
        try:
            await self._guarded(scope, receive, exchange)
        finally:  # also when the server cancels the request: every request gets its line
            exchange.log(scope, time.perf_counter() - started_at)

    async def _guarded(self, scope: Scope, receive: Receive, exchange: _Exchange) -> None:
        send = exchange.send
        if scope["path"] in ADMIN_PATHS:
            if not self._admitted(scope):
                return await self._refuse_admin(send)
        elif self.keys and scope["path"] not in self.open_paths and not self._authorized(scope):
            if scope["path"] == "/dashboard":  # a browser: a form that stores the key in the cookie
                await _send_login_page(send)
                return
            await _send_json(
                send,
                401,
                _error(scope, 401, "missing or invalid API key", "authentication_error", "invalid_api_key"),
                {"www-authenticate": "Bearer"},
            )
            return
        body = await self._read_body(scope, receive, send)
        if body is None:
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        try:
            await self.app(scope, replay, send)
        except Exception:
            # Only a response already started is cut short; the complete 500 below is an ordinary answer.
            exchange.failed = exchange.status is not None
            error_id = f"err-{uuid.uuid4().hex}"
            logger.exception("internal error %s while serving %s %s", error_id, scope.get("method"), scope["path"])
            if exchange.status is None:
                message = f"internal server error (error id {error_id})"
                await _send_json(
                    send, 500, _error(scope, 500, message, "server_error", "internal_error"), {"x-error-id": error_id}
                )

    async def _read_body(self, scope: Scope, receive: Receive, send: Send) -> bytes | None:
        """The whole request body, or None when a response (413) went out or the client left.

        Read here (bounded) so chunked uploads cannot exceed the limit either; the app gets it replayed."""
        declared = _header(scope, b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.limit):
            await self._too_large(scope, send)
            return None
        chunks: list[bytes] = []
        size = 0
        more = True
        while more:
            msg = await receive()
            if msg["type"] != "http.request":
                return None  # client left before sending its body
            chunks.append(msg.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                await self._too_large(scope, send)
                return None
            more = bool(msg.get("more_body", False))
        return b"".join(chunks)

    def _admitted(self, scope: Scope) -> bool:
        return bool(self.admin_keys) and self._authorized(scope, self.admin_keys)

    async def _refuse_admin(self, send: Send) -> None:
        if self.admin_keys:
            body = error_body("missing or invalid admin key", "authentication_error", None, "invalid_api_key")
            await _send_json(send, 401, body, {"www-authenticate": "Bearer"})
        else:
            body = error_body("admin routes are off: set admin_api_key", "permission_error", None, "admin_disabled")
            await _send_json(send, 403, body)

    def _authorized(self, scope: Scope, keys: list[bytes] | None = None) -> bool:
        """A Bearer token, or (as Anthropic's clients send it) an ``x-api-key`` header, that is one of
        ``keys`` (default: the API keys)."""
        value = _header(scope, b"authorization") or ""
        scheme, _, token = value.partition(" ")
        bearer = token if scheme.lower() == "bearer" and token else None
        tokens = [t for t in (bearer, _header(scope, b"x-api-key")) if t]
        if not value and str(scope["path"]).startswith("/dashboard"):
            # A page a browser navigates to cannot send a header: the dashboard's routes (read-only)
            # also take the key from the cookie its login form sets.
            tokens.append(_cookie(scope, DASHBOARD_COOKIE) or "")
        return any(self._is_key(t, keys) for t in tokens if t)

    def _is_key(self, token: str, keys: list[bytes] | None) -> bool:
        # The raw bytes, never stripped: str.strip() also drops \xa0 and \x85, so a blank token would
        # match an empty key and "key\xa0" the key itself (empty keys are refused at start-up too).
        given = token.encode("latin-1")
        ok = False
        # Compared against every key, so timing does not reveal which one matched.
        for key in self.keys if keys is None else keys:
            ok |= hmac.compare_digest(given, key)
        return ok

    async def _too_large(self, scope: Scope, send: Send) -> None:
        message = f"request body is larger than max_request_body_bytes={self.limit}"
        await _send_json(send, 413, _error(scope, 413, message, "invalid_request_error", "request_too_large"))


def _error(scope: Scope, status: int, message: str, type: str, code: str) -> dict[str, Any]:
    """The guard's error body in the shape of the API the path belongs to (Anthropic's or OpenAI's)."""
    path = str(scope["path"])
    if path == ANTHROPIC_PATH or path.startswith(ANTHROPIC_PATH + "/"):
        return anthropic_error_body(status, message)
    return error_body(message, type, None, code)


def _printable(text: str) -> str:
    """``text`` with control characters escaped, so a crafted path cannot forge log lines."""
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)


# Routes that take only the admin key (admin_api_key), never the API key.
ADMIN_PATHS = frozenset({"/start_profile", "/stop_profile", "/v1/load_lora_adapter", "/v1/unload_lora_adapter"})
DASHBOARD_COOKIE = "pypto_serving_key"
_LOGIN_PAGE = b"""<!doctype html><html><head><meta charset="utf-8"><title>pypto-serving dashboard</title></head>
<body><form id="f"><label>API key <input id="k" type="password" autofocus></label> <button>Open</button></form>
<script>document.getElementById("f").onsubmit = (e) => { e.preventDefault();
document.cookie = "pypto_serving_key=" + encodeURIComponent(document.getElementById("k").value)
  + "; path=/; SameSite=Strict"; location.reload(); };</script></body></html>"""


async def _send_login_page(send: Send) -> None:
    headers = [(b"content-type", b"text/html; charset=utf-8"), (b"content-length", str(len(_LOGIN_PAGE)).encode())]
    await send({"type": "http.response.start", "status": 401, "headers": [*headers, (b"cache-control", b"no-store")]})
    await send({"type": "http.response.body", "body": _LOGIN_PAGE})


def _cookie(scope: Scope, name: str) -> str | None:
    """The value of cookie ``name``, URL-decoded to its bytes (as latin-1 text, like a header's)."""
    for part in (_header(scope, b"cookie") or "").split(";"):
        key, _, value = part.strip().partition("=")
        if key == name:
            return unquote_to_bytes(value).decode("latin-1")
    return None


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
