"""AsyncLLM: runs an :class:`EngineCore` in its own thread beside an asyncio event loop.

The engine is not thread-safe and a step can take long (a big prefill, a slow device), so one
background thread owns it exclusively. The event loop talks to it only through a command queue
(add / abort / stop) and gets outputs back through per-request ``asyncio.Queue``s fed with
``loop.call_soon_threadsafe``; HTTP handling therefore never waits on a step.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import threading
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
    ) -> None:
        self.settings = settings
        self.plugins = plugins or PluginManager()
        self.metrics = metrics
        self._factory = engine_factory or (lambda: EngineCore(settings, self.plugins))
        self._cmds: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()  # guards _streams and _pending_adds (both threads touch them)
        self._pending_adds = 0
        self._thread: threading.Thread | None = None
        self._loaded = threading.Event()
        self.engine: EngineCore | None = None
        self.startup_error: BaseException | None = None
        self.failure: str | None = None  # set when the engine thread itself crashed
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
        return self._loaded.is_set() and self.engine is not None

    @property
    def dead_reason(self) -> str | None:
        if self.startup_error is not None:
            return f"the engine failed to start: {self.startup_error}"
        if self.failure is not None:
            return self.failure
        return self.engine.dead_reason if self.engine is not None else None

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
        """Engine waiting queue plus adds not yet handed to the engine (for back-pressure)."""
        with self._lock:
            pending = self._pending_adds
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
            self._pending_adds += 1
        self._cmds.put(_Add(request_id, prompt, params, stream, done))
        await asyncio.wrap_future(done)
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
        try:
            self.engine = self._factory()
        except BaseException as e:  # reported by wait_ready / health; the thread ends
            self.startup_error = e
            logger.error("engine start-up failed: %s", e)
            self._loaded.set()
            return
        self.stats = self.engine.stats()
        self._loaded.set()
        engine = self.engine
        try:
            self._loop(engine)
            self._fail_all("the server is shutting down")  # adds that raced with the stop
        except BaseException as e:  # a bug in the engine: fail every request instead of hanging them
            logger.exception("engine thread crashed")
            self.failure = f"engine thread crashed: {type(e).__name__}: {e}"
            self._fail_all(self.failure)
        finally:
            try:
                engine.shutdown()
            except Exception:
                logger.exception("engine shutdown failed")

    def _loop(self, engine: EngineCore) -> None:
        stopping = False
        while True:
            # Block for the next command only when idle; otherwise take what is queued and step.
            idle = not engine.has_unfinished()
            if stopping and idle:
                return
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
            if engine.has_unfinished():
                self._dispatch(engine.step())
                self.stats = engine.stats()
                if self.metrics is not None:
                    self.metrics.update_engine(self.stats, engine.dead_reason is not None)

    def _handle(self, engine: EngineCore, cmd: _Add | _Abort, stopping: bool) -> None:
        if isinstance(cmd, _Abort):
            engine.abort(cmd.request_id)
            return
        with self._lock:
            self._pending_adds -= 1
        try:
            if stopping:
                raise EngineDeadError("the server is shutting down")
            engine.add_request(cmd.request_id, cmd.prompt, cmd.params)
        except BaseException as e:
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
            if stream is None:
                continue
            # A closed event loop means nobody is listening for this request any more.
            with contextlib.suppress(RuntimeError):
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, out)

    def _fail_all(self, reason: str) -> None:
        with self._lock:
            streams, self._streams = self._streams, {}
        for stream in streams.values():
            with contextlib.suppress(RuntimeError):
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, EngineFailure(reason))
        while True:  # adds that raced with the crash must not wait forever
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, _Add) and not cmd.done.done():
                cmd.done.set_exception(EngineDeadError(reason))
