"""Forwarding one request to a replica and relaying its answer, byte for byte, as it arrives.

* The request body is read whole (bounded by ``max_request_body_bytes``: a larger one is a 413) so
  that it can be routed by its content and sent again to another replica.
* A replica that fails before its answer starts (refused or reset connection, a timeout, a pool with
  no free connection, or a ``503`` from a replica that is shutting down) costs nothing the client
  saw: the request goes to another replica, at most ``max_retries`` times. A replica that cannot
  be reached is marked unhealthy at once.
* Once the answer started, its status and headers are the replica's (plus ``x-pypto-replica``) and
  its body is relayed chunk by chunk. A Server-Sent Events stream is cut only at event boundaries,
  so when the replica breaks off mid-stream the client gets a whole error event and ``data: [DONE]``
  after the last whole event, never a half event or a hang; any other body is cut off (the client
  sees a short body against its ``content-length``).
* A client that goes away closes the replica's connection, which aborts the request there.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.types import Message, Receive, Scope, Send

from .config import RouterSettings
from .metrics import RouterMetrics
from .replicas import Replica
from .routing import RequestProfile, Router, request_profile

__all__ = ["Forwarder", "error_response", "read_body"]

logger = logging.getLogger("pypto_serving.router")

# Headers that describe one connection, not the message (RFC 9110 section 7.6.1), and those httpx sets.
_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)
_SSE_BREAK = b"\n\n"
_GENERATING = ("/v1/completions", "/v1/chat/completions")  # the routes a prefill/decode pair splits
_MAX_PENDING = 1 << 20  # an SSE "event" this long without a boundary is relayed as it is


def error_response(status: int, message: str, code: str, headers: Mapping[str, str] | None = None) -> JSONResponse:
    """An OpenAI-style error body."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = {"error": {"message": message, "type": kind, "param": None, "code": code}}
    return JSONResponse(body, status, headers=dict(headers or {}))


def _sse_error(message: str) -> bytes:
    event = {"error": {"message": message, "type": "server_error", "param": None, "code": "replica_failed"}}
    return b"data: " + json.dumps(event).encode() + b"\n\ndata: [DONE]\n\n"


@dataclass(slots=True)
class Forwarder:
    """Routes and forwards requests for the app (one per router)."""

    settings: RouterSettings
    router: Router
    replicas: dict[str, Replica]
    metrics: RouterMetrics
    _drains: set[asyncio.Future[None]] = field(default_factory=set)  # streamed prefills still being read

    async def handle(self, request: Request) -> Response:
        try:
            body = await read_body(request, self.settings.max_request_body_bytes)
        except ClientDisconnect:
            return Response(status_code=499)
        if body is None:
            limit = self.settings.max_request_body_bytes
            return error_response(
                413, f"request body is larger than max_request_body_bytes={limit}", "request_too_large"
            )
        header = self.settings.session_header
        session = request.headers.get(header) if header else None
        profile = request_profile(_json_or_none(body, request), session or None, self.settings)
        # Watched from here on: a client that leaves before the answer starts (a long non-streamed
        # generation) cancels the forwarding, which closes the replica's connection and aborts it there.
        watch = asyncio.ensure_future(_disconnected(request.receive))
        forward = asyncio.ensure_future(self._send(request, body, profile))
        try:
            await asyncio.wait({forward, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not forward.done():
                forward.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await forward
        if forward.cancelled():
            return Response(status_code=499)  # nobody is left to read it
        if forward.exception() is not None:
            watch.cancel()
        response = forward.result()
        if isinstance(response, _Relay) and not watch.done():
            response.watch = watch  # the relay keeps watching
        else:
            watch.cancel()
        return response

    async def _send(self, request: Request, body: bytes, profile: RequestProfile) -> Response:
        tried: list[str] = []
        failure: str | None = None
        excluded = self._role_names("prefill")  # prefill replicas answer only the first half of a pair
        if excluded and request.method == "POST" and request.url.path in _GENERATING:
            prefilled = await self._prefill(request, body, profile)
            if isinstance(prefilled, Response):
                return prefilled
            body, excluded = prefilled, excluded + self._role_names("both")
        while len(tried) <= self.settings.max_retries:
            choice = self.router.choose(profile, exclude=[*excluded, *tried])
            if choice is None:
                break
            if tried:
                self.metrics.retries.inc()
            else:
                self.metrics.routed(choice)
            replica = self.replicas[choice.replica]
            tried.append(replica.name)
            last = len(tried) > self.settings.max_retries
            outcome = await self._attempt(replica, request, body, profile, last_try=last)
            if isinstance(outcome, Response):
                return outcome
            failure = outcome
        if failure is None:
            self.metrics.unrouted.inc()
            return error_response(
                503, "no replica is available (none healthy and undrained)", "no_replica", {"retry-after": "1"}
            )
        return error_response(502, f"no replica could serve the request: {failure}", "replica_failed")

    async def _attempt(
        self, replica: Replica, request: Request, body: bytes, profile: RequestProfile, *, last_try: bool
    ) -> Response | str:
        """The relayed answer of ``replica``, or why it failed before answering."""
        self.router.started(replica.name, profile)
        self.metrics.requests.labels(replica.name).inc()
        outgoing = replica.client.build_request(
            request.method,
            request.url.path,
            params=httpx.QueryParams(request.url.query),
            headers=_forward_headers(request, replica),
            content=body,
        )
        try:
            upstream = await replica.client.send(outgoing, stream=True)
        except asyncio.CancelledError:
            self.router.finished(replica.name, profile)
            raise
        except (httpx.HTTPError, OSError) as e:
            self.router.finished(replica.name, profile)
            self.metrics.failures.labels(replica.name, "connect").inc()
            reason = f"replica {replica.name}: {type(e).__name__}: {e}".rstrip(": ")
            if not isinstance(e, httpx.PoolTimeout):  # a full pool is load, not a sick replica
                replica.mark_down(reason)
            logger.warning("%s %s failed before any byte: %s", request.method, request.url.path, reason)
            return reason
        if upstream.status_code == 503 and not last_try and self._another(replica, profile):
            await upstream.aclose()
            self.router.finished(replica.name, profile)
            return f"replica {replica.name} answered 503"
        release = _once(lambda: self.router.finished(replica.name, profile))
        return _Relay(upstream, replica, release, self.metrics)

    def _role_names(self, role: str) -> list[str]:
        return [name for name, r in self.replicas.items() if r.config.role == role]

    async def _prefill(self, request: Request, body: bytes, profile: RequestProfile) -> bytes | Response:
        """The first half of a disaggregated pair: the prompt to a prefill replica (one output token, not
        streamed); returns the body for a decode replica, with the prefill's ``kv_transfer_params``."""
        data = _json_or_none(body, request)
        if not isinstance(data, dict):
            return body  # not JSON: a decode replica answers the 400
        choice = self.router.choose(profile, exclude=self._role_names("decode") + self._role_names("both"))
        if choice is None:
            return error_response(503, "no prefill replica is available", "no_replica", {"retry-after": "1"})
        replica = self.replicas[choice.replica]
        first = {k: v for k, v in data.items() if k not in ("stream", "stream_options", "max_completion_tokens")}
        first.update(max_tokens=1, kv_transfer_params={"do_remote_decode": True})
        self.router.started(replica.name, profile)
        self.metrics.requests.labels(replica.name).inc()
        if replica.config.stream_kv:
            return await self._prefill_streamed(request, data, first, replica, profile)
        try:
            answer = await replica.client.post(
                request.url.path, content=json.dumps(first).encode(), headers=_forward_headers(request, replica)
            )
        except (httpx.HTTPError, OSError) as e:
            replica.mark_down(f"replica {replica.name}: {type(e).__name__}: {e}")
            return error_response(
                502, f"prefill replica {replica.name} failed: {type(e).__name__}: {e}", "replica_failed"
            )
        finally:
            self.router.finished(replica.name, profile)
        if answer.status_code != 200:
            return Response(answer.content, answer.status_code, media_type=answer.headers.get("content-type"))
        try:
            params = answer.json().get("kv_transfer_params")
        except (ValueError, AttributeError):
            params = None
        if not isinstance(params, dict):
            message = (
                f"prefill replica {replica.name} returned no kv_transfer_params (is it served with --kv-role prefill?)"
            )
            return error_response(502, message, "replica_failed")
        return json.dumps({**data, "kv_transfer_params": params}).encode()

    async def _prefill_streamed(
        self, request: Request, data: dict[str, Any], first: dict[str, Any], replica: Replica, profile: RequestProfile
    ) -> bytes | Response:
        """``stream_kv``: the prefill request streamed; its first event carries the offer, and the decode
        body goes out at once while a task reads the rest of the prefill's stream (its load counted
        until then)."""
        first.update(stream=True, kv_transfer_params={"do_remote_decode": True, "stream_kv": True})
        outgoing = replica.client.build_request(
            "POST", request.url.path, content=json.dumps(first).encode(), headers=_forward_headers(request, replica)
        )
        try:
            answer = await replica.client.send(outgoing, stream=True)
        except (httpx.HTTPError, OSError) as e:
            self.router.finished(replica.name, profile)
            replica.mark_down(f"replica {replica.name}: {type(e).__name__}: {e}")
            return error_response(
                502, f"prefill replica {replica.name} failed: {type(e).__name__}: {e}", "replica_failed"
            )
        lines = answer.aiter_lines()
        params = await _first_offer(lines) if answer.status_code == 200 else None
        if params is None:
            content = await answer.aread() if answer.status_code != 200 else b""
            await answer.aclose()
            self.router.finished(replica.name, profile)
            if answer.status_code != 200:
                return Response(content, answer.status_code, media_type=answer.headers.get("content-type"))
            message = (
                f"prefill replica {replica.name} streamed no kv_transfer_params (is it served with --kv-role prefill?)"
            )
            return error_response(502, message, "replica_failed")
        task = asyncio.ensure_future(_drain(answer, lines, lambda: self.router.finished(replica.name, profile)))
        self._drains.add(task)
        task.add_done_callback(self._drains.discard)
        return json.dumps({**data, "kv_transfer_params": params}).encode()

    def _another(self, replica: Replica, profile: RequestProfile) -> bool:
        return any(r.routable and r.name != replica.name for r in self.router.replicas.values())


def _once(fn: Callable[[], None]) -> Callable[[], None]:
    done = False

    def call() -> None:
        nonlocal done
        if not done:
            done = True
            fn()

    return call


async def read_body(request: Request, limit: int) -> bytes | None:
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > limit):
        return None
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


def _json_or_none(body: bytes, request: Request) -> Any:
    """The parsed body when it is JSON, for routing only: the replica validates it (and answers 4xx)."""
    if not body or request.method != "POST":
        return None
    try:
        return json.loads(body)
    except (ValueError, RecursionError):  # not JSON, or nested past the parser's depth
        return None


def _forward_headers(request: Request, replica: Replica) -> list[tuple[str, str]]:
    headers = [(k, v) for k, v in request.headers.items() if k not in _HOP]
    if replica.config.api_key is not None:
        headers = [(k, v) for k, v in headers if k != "authorization"]
        headers.append(("authorization", f"Bearer {replica.config.api_key}"))
    return headers


async def _first_offer(lines: AsyncIterator[str]) -> dict[str, Any] | None:
    """The ``kv_transfer_params`` of a streamed prefill answer's first event that has them; None when
    the stream ends (or breaks) without."""
    with contextlib.suppress(httpx.HTTPError, OSError, ValueError):
        async for line in lines:
            if line.startswith("data: ") and line != "data: [DONE]":
                params = json.loads(line[len("data: ") :]).get("kv_transfer_params")
                if isinstance(params, dict):
                    return params
    return None


async def _drain(answer: httpx.Response, lines: AsyncIterator[str], release: Callable[[], None]) -> None:
    """Read a streamed prefill answer to its end (the replica's request finishes), then count it done."""
    try:
        with contextlib.suppress(httpx.HTTPError, OSError):
            async for _ in lines:
                pass
    finally:
        await answer.aclose()
        release()


class _Relay(Response):
    """The replica's answer relayed to the client; ends the replica's request when the client leaves."""

    def __init__(self, upstream: httpx.Response, replica: Replica, release: Callable[[], None], metrics: RouterMetrics):
        self.upstream = upstream
        self.watch: asyncio.Future[None] | None = None  # the client's disconnect, when already watched
        self.replica = replica.name
        self.mark_down = replica.mark_down
        self.release = release
        self.metrics = metrics
        self.status_code = upstream.status_code
        self.background = None
        self.sse = upstream.headers.get("content-type", "").startswith("text/event-stream")
        raw = [
            (k.lower(), v)
            for k, v in upstream.headers.raw
            if k.lower().decode("latin-1") not in _HOP - {"content-length"}
        ]
        self.raw_headers = [*raw, (b"x-pypto-replica", replica.name.encode())]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        pump = asyncio.ensure_future(self._pump(send))
        watch = self.watch or asyncio.ensure_future(_disconnected(receive))
        try:
            await asyncio.wait({pump, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (pump, watch):
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await pump
            self.release()
            await self.upstream.aclose()
        if pump.done() and not pump.cancelled() and (error := pump.exception()) is not None:
            raise error

    async def _pump(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        pending = b""
        try:
            async for chunk in self.upstream.aiter_raw():
                if not self.sse:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                    continue
                pending += chunk
                end = pending.rfind(_SSE_BREAK)
                cut = len(pending) if len(pending) > _MAX_PENDING else end + len(_SSE_BREAK) if end >= 0 else 0
                if cut:
                    await send({"type": "http.response.body", "body": pending[:cut], "more_body": True})
                    pending = pending[cut:]
        except httpx.HTTPError as e:
            await self._broken(send, e)
            return
        self.release()
        await send({"type": "http.response.body", "body": pending, "more_body": False})

    async def _broken(self, send: Send, error: Exception) -> None:
        self.metrics.failures.labels(self.replica, "response").inc()
        message = f"replica {self.replica} failed mid-response: {type(error).__name__}: {error}".rstrip(": ")
        logger.warning("%s", message)
        self.release()
        self.mark_down(message)  # new requests avoid it until a poll finds it healthy again
        if not self.sse:
            raise ConnectionAbortedError(message)  # uvicorn closes the connection: the body is visibly short
        await send({"type": "http.response.body", "body": _sse_error(message), "more_body": False})


async def _disconnected(receive: Callable[[], Awaitable[Message]]) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
