"""The HTTP transport under the app: uvicorn with our connection limits and shutdown behaviour.

Two things uvicorn does not do by itself:

* **Stalled connections.** uvicorn closes idle keep-alive connections, but a client that sends half
  its headers (or half its body) and stops holds a connection and a task forever. :func:`timed_h11`
  gives each request a deadline for its headers (``http_header_timeout``, counted from the first
  byte or from the connection) and for its body (``http_body_timeout``); past it the connection gets
  ``408`` and is closed.
* **Shutdown.** uvicorn stops accepting at once, so a health probe during the drain gets a refused
  connection; :class:`ServingServer` keeps accepting while requests are in flight and answers 503.
  After ``shutdown_timeout`` uvicorn cancels the handlers still running, which cuts
  streams without an error event and logs a traceback per stream. :class:`ServingServer` instead
  ends every open request itself when the grace period runs out (streams get an error event and
  ``[DONE]``), and gives uvicorn a few more seconds to flush them.
"""

from __future__ import annotations

import asyncio
import logging
import math
import socket
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from ..config import ServingSettings
from ..graceful import ReturningServer
from .data_parallel import ServingLLM

__all__ = ["ServingServer", "timed_h11", "uvicorn_config"]

logger = logging.getLogger("pypto_serving.server")

# Seconds uvicorn waits after our own cut for the ended streams to flush before it cancels them.
_FLUSH_GRACE = 5
_LINGER_S = 2.0  # after a 408, how long input is drained before the socket closes
_TIMEOUT_RESPONSE = b"HTTP/1.1 408 Request Timeout\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"


class _TimedH11(H11Protocol):
    """uvicorn's h11 protocol with a deadline for each request's headers and body (the class
    attributes, set by :func:`timed_h11`); past it the connection gets 408 and is closed."""

    header_timeout = 10.0
    body_timeout = 30.0
    _deadline: asyncio.TimerHandle | None = None
    _phase = ""
    _lingering = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm("headers", self.header_timeout)

    def data_received(self, data: bytes) -> None:
        if self._lingering:
            return  # after a 408: input is read only so that closing sends no reset
        super().data_received(data)
        state = self.conn.their_state
        if state is h11.IDLE:
            self._arm("headers", self.header_timeout)  # a new request began (or keeps coming in slowly)
        elif state is h11.SEND_BODY:
            self._arm("body", self.body_timeout)
        else:  # the whole request is in (DONE), or the connection is closing
            self._disarm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self, phase: str, seconds: float) -> None:
        if self._phase == phase:
            return  # a deadline counts from the phase's start, not from the latest byte
        self._disarm()
        self._phase = phase
        self._deadline = self.loop.call_later(seconds, self._expire)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline, self._phase = None, ""

    def _expire(self) -> None:
        phase = self._phase
        self._deadline, self._phase = None, ""
        if self.transport.is_closing():
            return
        if phase == "headers" and self.cycle is not None and not self.cycle.response_complete:
            return  # a pipelined request waits behind a response still being produced
        logger.info("closing a connection from %s: request %s not received in time", self.client, phase)
        self.transport.write(_TIMEOUT_RESPONSE)
        self._linger()

    def _linger(self) -> None:
        """Sends the 408 and a FIN, then reads and drops what the client still sends until it
        closes (or ``_LINGER_S``): closing a socket with unread input sends a reset, which can
        reach the client before the 408 and discard it."""
        self._lingering = True
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(_LINGER_S, self.transport.close)


def timed_h11(header_timeout: float, body_timeout: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a per-request deadline for the headers and for the body."""
    return type("TimedH11", (_TimedH11,), {"header_timeout": header_timeout, "body_timeout": body_timeout})


def uvicorn_config(app: Any, settings: ServingSettings) -> uvicorn.Config:
    """uvicorn settings from ours: timeouts, connection limit, log level."""
    return uvicorn.Config(
        app,
        log_level=settings.log_level,
        http=timed_h11(settings.http_header_timeout, settings.http_body_timeout),
        timeout_keep_alive=max(1, math.ceil(settings.http_keep_alive_timeout)),
        limit_concurrency=settings.http_max_connections,
        # Our cut comes at shutdown_timeout; uvicorn's own cancellation only backs it up.
        timeout_graceful_shutdown=math.ceil(settings.shutdown_timeout) + _FLUSH_GRACE,
        access_log=False,  # the guard logs one access line per request
    )


class ServingServer(ReturningServer):
    """uvicorn that drains like a serving engine should.

    uvicorn re-raises SIGTERM/SIGINT after its graceful shutdown, which makes the process die by the
    signal (exit -15); a drained shutdown is a success, so the signals are handled here: refuse new
    requests (503, /health too), let in-flight responses finish for ``shutdown_timeout`` seconds,
    stop accepting, end the rest with an error (streams get an error event and ``[DONE]``) and
    return normally.
    """

    def __init__(self, config: uvicorn.Config, llm: ServingLLM, shutdown_timeout: float) -> None:
        super().__init__(config)
        self.llm = llm
        self.shutdown_timeout = shutdown_timeout

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        loop = asyncio.get_running_loop()
        cut = loop.call_later(self.shutdown_timeout, self._end_open_requests)
        try:
            await self._drain(loop.time() + self.shutdown_timeout)
            await super().shutdown(sockets)
        finally:
            cut.cancel()

    async def _drain(self, deadline: float) -> None:
        """Keep accepting while the requests in flight finish, answering /health and new requests
        with 503 ``shutting down`` (a load balancer's probe sees the drain instead of a refused
        connection); uvicorn stops accepting once none is left, or at the deadline."""
        self.llm.drain()
        loop = asyncio.get_running_loop()
        while self.llm.has_open_requests() and loop.time() < deadline and not self.force_exit:
            await asyncio.sleep(0.05)

    def _end_open_requests(self) -> None:
        n = self.llm.fail_streams(f"the server is shutting down (shutdown_timeout={self.shutdown_timeout:g}s expired)")
        if n:
            logger.warning("shutdown_timeout expired: ended %d request(s) still running", n)
