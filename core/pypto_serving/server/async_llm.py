"""AsyncLLM: runs an :class:`EngineCore` in its own thread beside an asyncio event loop.

The engine is not thread-safe and a step can take long (a big prefill, a slow device), so one
background thread owns it exclusively. The event loop talks to it only through a command queue
(add / abort / stop) and gets outputs back through per-request ``asyncio.Queue``s fed with
``loop.call_soon_threadsafe``; HTTP handling therefore never waits on a step.

The thread also keeps the engine alive: a worker that dies (busy or idle, noticed within half a
second) or a step that raises fails the requests in flight, and the thread replaces the engine with
a fresh one (new worker, model reloaded), at most ``max_worker_restarts`` times per
``worker_restart_window`` seconds. Past that budget it gives up and calls ``on_fatal`` so the
process can exit non-zero for its supervisor.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from ..config import ServingSettings
from ..engine import EngineCore, EngineDeadError
from ..metrics import ServerMetrics
from ..plugins import PluginManager
from ..request import RequestOutput, SamplingParams
from ..tokenizer import Tokenizer

__all__ = ["AsyncLLM", "EngineFailure"]

logger = logging.getLogger(__name__)


class EngineFailure(RuntimeError):
    """Put on a request's queue when the engine thread failed; the handler turns it into an error."""


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | EngineFailure]


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    stream: _Stream
    done: concurrent.futures.Future[None]

    @property
    def num_seqs(self) -> int:
        return self.params.n


@dataclass(slots=True)
class _Abort:
    request_id: str


@dataclass(slots=True)
class _Stop:
    pass


_Command = _Add | _Abort | _Stop


class AsyncLLM:
    """Owns the engine thread. ``start()`` loads the engine in the background; ``ready`` tells when done."""

    def __init__(
        self,
        settings: ServingSettings,
        plugins: PluginManager | None = None,
        *,
        metrics: ServerMetrics | None = None,
        engine_factory: Callable[[], EngineCore] | None = None,
        on_fatal: Callable[[str], None] | None = None,
    ) -> None:
        self.plugins = plugins or PluginManager()
        self.settings = self.plugins.resolve_model(settings)
        self.metrics = metrics
        self.on_fatal = on_fatal  # called from the engine thread once restarts are exhausted
        self._factory = engine_factory or (lambda: EngineCore(self.settings, self.plugins))
        self._cmds: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()  # guards _streams and _pending_seqs (both threads touch them)
        self._pending_seqs = 0
        self._thread: threading.Thread | None = None
        self._loaded = threading.Event()
        self.engine: EngineCore | None = None
        self.startup_error: BaseException | None = None
        self.failure: str | None = None  # set when the engine is down for good
        self.restarting: str | None = None  # why the engine is being replaced, while it is
        self.num_restarts = 0
        self._restart_times: deque[float] = deque()
        self.stats: dict[str, Any] = {}  # snapshot refreshed by the engine thread after each step
        self._stopping = False

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="pypto-engine", daemon=True)
        self._thread.start()

    def wait_ready(self, timeout: float | None = None) -> EngineCore:
        """Block until loaded; re-raise the start-up error (bad plugin, missing weights...)."""
        self.start()
        if not self._loaded.wait(timeout):
            raise TimeoutError("the engine did not load in time")
        if self.startup_error is not None:
            raise self.startup_error
        assert self.engine is not None
        return self.engine

    @property
    def ready(self) -> bool:
        return self._loaded.is_set() and self.engine is not None and self.restarting is None

    @property
    def dead_reason(self) -> str | None:
        """Why the engine is down for good (start-up failed or restarts exhausted); None otherwise."""
        if self.startup_error is not None:
            return f"the engine failed to start: {self.startup_error}"
        return self.failure

    @property
    def healthy(self) -> bool:
        return self.ready and self.dead_reason is None and not self._stopping

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.engine.tokenizer if self.engine is not None else None

    @property
    def max_model_len(self) -> int:
        assert self.engine is not None
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        assert self.engine is not None
        return self.engine.info.vocab_size

    def num_waiting(self) -> int:
        """Sequences in the engine's waiting queue plus those of adds not yet handed to it."""
        with self._lock:
            pending = self._pending_seqs
        return int(self.stats.get("num_waiting", 0)) + pending

    def shutdown(self, timeout: float = 30.0) -> None:
        """Abort whatever is still running, stop the thread and close the worker."""
        self._stopping = True
        if self._thread is None:
            return
        self._cmds.put(_Stop())
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.error("the engine thread did not stop within %.0fs", timeout)
        self._thread = None

    def fail_streams(self, reason: str) -> int:
        """End every open request now with ``reason`` (on the event loop: no wait for a step) and
        abort them in the engine. Used when the shutdown grace period runs out. Returns the count."""
        with self._lock:
            streams, self._streams = self._streams, {}
        for rid, stream in streams.items():
            _put(stream, EngineFailure(reason))
            self._cmds.put(_Abort(rid))
        return len(streams)

    # ------------------------------------------------------------------ requests (event-loop side)
    async def add_request(self, request_id: str, prompt: list[int], params: SamplingParams) -> _Stream:
        """Hand a request to the engine; raises what ``EngineCore.add_request`` raises (ValueError...)."""
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        if self._stopping:
            raise EngineDeadError("the server is shutting down")
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        with self._lock:
            self._pending_seqs += params.n
        self._cmds.put(_Add(request_id, prompt, params, stream, done))
        try:
            await asyncio.wrap_future(done)
        except asyncio.CancelledError:
            # The client left while the add was queued or being handled: the engine thread skips
            # an add it has not started, and this abort (queued after it) frees one it has.
            self.abort(request_id)
            raise
        return stream

    def abort(self, request_id: str) -> None:
        """Thread-safe, fire and forget; the request's final output (finish_reason 'abort') follows."""
        self._cmds.put(_Abort(request_id))

    async def generate(
        self, request_id: str, prompt: list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        """Cumulative outputs until finished. Leaving early (cancellation, disconnect) aborts the request."""
        stream = await self.add_request(request_id, prompt, params)
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, EngineFailure):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    # ------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        engine = self._first_engine()
        while engine is not None:
            try:
                reason = self._loop(engine)
            except Exception as e:  # a bug in this thread's own code: treat it like a dead engine
                logger.exception("engine thread failed")
                reason = f"engine thread failed: {type(e).__name__}: {e}"
            self._fail_streams_from_thread(reason or "the server is shutting down")
            _close(engine)
            if reason is None or self._stopping:
                self._fail_queued("the server is shutting down")
                return
            engine = self._restart(reason)

    def _first_engine(self) -> EngineCore | None:
        try:
            self.engine = self._factory()
        except BaseException as e:  # reported by wait_ready / health; the thread ends
            self.startup_error = e
            logger.error("engine start-up failed: %s", e)
            self._loaded.set()
            return None
        self.stats = self.engine.stats()
        self._loaded.set()
        return self.engine

    def _restart(self, reason: str) -> EngineCore | None:
        """A fresh engine within the restart budget, or None (and ``on_fatal``) past it."""
        window, budget = self.settings.worker_restart_window, self.settings.max_worker_restarts
        while not self._stopping:
            now = time.monotonic()
            while self._restart_times and now - self._restart_times[0] > window:
                self._restart_times.popleft()
            if len(self._restart_times) >= budget:
                self._give_up(f"{reason}; no restart left (max_worker_restarts={budget} per {window:.0f}s)")
                return None
            self._restart_times.append(now)
            self.num_restarts += 1
            self.restarting = reason
            if self.metrics is not None:
                self.metrics.observe_restart()
            logger.warning("restarting the worker (restart %d): %s", self.num_restarts, reason)
            try:
                engine = self._factory()
            except Exception as e:
                reason = f"restarting the worker failed: {type(e).__name__}: {e}"
                logger.error("%s", reason)
                continue
            self.engine, self.restarting = engine, None
            self.stats = engine.stats()
            logger.info("the worker is back (restart %d)", self.num_restarts)
            return engine
        return None

    def _give_up(self, reason: str) -> None:
        logger.error("the engine is down for good: %s", reason)
        self.failure, self.restarting = reason, None
        self._fail_queued(reason)
        if self.metrics is not None:
            self.metrics.update_engine(self.stats, True)
        if self.on_fatal is not None:
            self.on_fatal(reason)

    def _loop(self, engine: EngineCore) -> str | None:
        """Run commands and steps until a stop (None) or the engine's death (the reason)."""
        stopping = False
        while True:
            # Block for the next command only when idle; otherwise take what is queued and step.
            idle = not engine.has_unfinished()
            if stopping and idle:
                return None
            try:
                cmd: _Command | None = self._cmds.get(timeout=0.5) if idle else self._cmds.get_nowait()
            except queue.Empty:
                cmd = None
            while cmd is not None:
                if isinstance(cmd, _Stop):
                    stopping = True
                    for rid in list(self._streams):
                        engine.abort(rid)
                else:
                    self._handle(engine, cmd, stopping)
                try:
                    cmd = self._cmds.get_nowait()
                except queue.Empty:
                    cmd = None
            outputs = engine.step() if engine.has_unfinished() else engine.check_worker()
            if engine.dead_reason is not None:
                self.restarting = engine.dead_reason  # set first: the handlers of these outputs name it
            self._dispatch(outputs)
            self.stats = engine.stats()
            if self.metrics is not None:
                self.metrics.update_engine(self.stats, False)
            if engine.dead_reason is not None:
                return engine.dead_reason

    def _handle(self, engine: EngineCore, cmd: _Add | _Abort, stopping: bool) -> None:
        if isinstance(cmd, _Abort):
            engine.abort(cmd.request_id)
            return
        with self._lock:
            self._pending_seqs -= cmd.num_seqs
        if not cmd.done.set_running_or_notify_cancel():
            return  # the client left before the engine saw the request
        try:
            if stopping:
                raise EngineDeadError("the server is shutting down")
            engine.add_request(cmd.request_id, cmd.prompt, cmd.params)
        except Exception as e:  # this request's fault (or a bug it triggered): it alone fails
            cmd.done.set_exception(e)
            return
        with self._lock:
            self._streams[cmd.request_id] = cmd.stream
        self.stats = engine.stats()  # so back-pressure sees the new waiting request at once
        cmd.done.set_result(None)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            with self._lock:
                stream = self._streams.pop(out.request_id, None) if out.finished else self._streams.get(out.request_id)
            if out.finished and self.metrics is not None:
                self.metrics.observe_finished(out)
            if stream is not None:
                _put(stream, out)

    def _fail_streams_from_thread(self, reason: str) -> None:
        with self._lock:
            streams, self._streams = self._streams, {}
        for stream in streams.values():
            _put(stream, EngineFailure(reason))

    def _fail_queued(self, reason: str) -> None:
        """Fail the adds still queued (they raced with a stop or a final failure)."""
        while True:
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, _Add):
                with self._lock:
                    self._pending_seqs -= cmd.num_seqs
                if cmd.done.set_running_or_notify_cancel():
                    cmd.done.set_exception(EngineDeadError(reason))


def _put(stream: _Stream, item: RequestOutput | EngineFailure) -> None:
    # A closed event loop means nobody is listening for this request any more.
    with contextlib.suppress(RuntimeError):
        stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)


def _close(engine: EngineCore) -> None:
    try:
        engine.shutdown()
    except Exception:
        logger.exception("engine shutdown failed")
