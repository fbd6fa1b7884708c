"""AsyncLLM: runs an :class:`EngineCore` beside an asyncio event loop, in its own process or thread.

The engine is not thread-safe and a step can take long (a big prefill, a slow device), so one owner
drives it exclusively. With ``engine_mode = "process"`` (the default) that owner is the engine-core
process of :mod:`.engine_proc`, so scheduling and detokenization never contend with the event loop
for the GIL; one background thread of this process reads its outputs. With ``engine_mode = "thread"``
a background thread of this process owns the engine. Either way the event loop hands over commands
(add / abort / stop) and gets outputs back through per-request ``asyncio.Queue``s fed with
``loop.call_soon_threadsafe``; HTTP handling therefore never waits on a step.

The background thread also keeps the engine alive: a worker (or core process) that dies (busy or
idle, noticed within half a second) or a step that raises fails the requests in flight, and the
engine is replaced by a fresh one (new worker, model reloaded), at most ``max_worker_restarts`` times
per ``worker_restart_window`` seconds. Past that budget it gives up and calls ``on_fatal`` so the
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
import uuid
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from ..config import ServingSettings
from ..engine import EngineCore, EngineDeadError
from ..executor import ExecutorInfo
from ..lora import LoraError
from ..metrics import ServerMetrics
from ..plugins import PluginManager
from ..request import CompletionOutput, RequestOutput, SamplingParams
from ..tokenizer import Tokenizer, load_tokenizer
from .engine_proc import (
    AbortCmd,
    AddCmd,
    AddResult,
    CoreBeat,
    CoreCommand,
    CoreFailed,
    CoreOutputs,
    CoreProcess,
    CoreReady,
    CoreStopped,
    LoraCmd,
    ProfileCmd,
    RestartCmd,
    StopCmd,
    rebuild_error,
)

__all__ = ["AsyncLLM", "CoreView", "EngineFailure", "EngineRestarting", "ServerDraining"]

logger = logging.getLogger(__name__)


class EngineFailure(RuntimeError):
    """Put on a request's queue when the server ends it (shutdown); the handler turns it into an error."""


class ServerDraining(EngineDeadError):
    """A request refused because the server is shutting down (SIGTERM): it never ran, and another
    server can take it (503 ``shutting_down`` with ``Retry-After``), unlike a dead engine."""


class EngineRestarting(EngineDeadError):
    """A request refused because the engine is being replaced: it never ran, so a retry is safe
    (503 ``restarting`` with ``Retry-After``), unlike a request that failed while running (500)."""


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput | EngineFailure]
    n: int = 1  # choices of the request, for the failed output that ends it when the engine dies


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


@dataclass(slots=True)
class _Profile:
    start: bool
    path: str


@dataclass(slots=True)
class _Lora:
    name: str
    path: str | None  # None: unload
    done: concurrent.futures.Future[None]


_Command = _Add | _Abort | _Stop | _Profile | _Lora


@dataclass(slots=True)
class CoreView:
    """What the server process keeps of an engine that runs in the engine-core process."""

    info: ExecutorInfo
    max_model_len: int
    tokenizer: Tokenizer | None
    pid: int  # the engine-core process
    worker_pid: int | None  # its worker process (None with worker_mode = "inproc")


@dataclass(slots=True)
class _PendingAdd:
    done: concurrent.futures.Future[None]
    num_seqs: int


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
        # Called with a request id when its stream ends (finished, failed, aborted), from the engine
        # thread or the event loop: a router above (data parallelism) releases its accounting.
        self.on_finished: Callable[[str], None] | None = None
        # An engine factory is an object of this process, so it runs the engine in a thread here.
        self.process_mode = self.settings.engine_mode == "process" and engine_factory is None
        self._factory = engine_factory or (lambda: EngineCore(self.settings, self.plugins))
        self._cmds: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()  # guards _streams and _pending_seqs (both threads touch them)
        self._pending_seqs = 0
        self._thread: threading.Thread | None = None
        self._loaded = threading.Event()
        self.engine: EngineCore | CoreView | None = None
        self._core: CoreProcess | None = None  # process mode: the core that takes commands, if any
        self._adds: dict[str, _PendingAdd] = {}  # process mode: adds the core has not answered
        self._held: list[CoreCommand] = []  # process mode: commands kept while no core runs
        self.startup_error: BaseException | None = None
        self.failure: str | None = None  # set when the engine is down for good
        self.restarting: str | None = None  # why the engine is being replaced, while it is
        self.num_restarts = 0
        self._restart_times: deque[float] = deque()
        self.stats: dict[str, Any] = {}  # snapshot refreshed by the engine thread after each step
        self._stopping = False
        self._draining = False  # SIGTERM: finishing the requests in flight, refusing new ones
        # Liveness for /health (monotonic times of this process): when the running step began (None:
        # no step), and in process mode when the core last said anything (it beats while it lives).
        self._busy_since: float | None = None
        self._heard_at: float | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        if self._thread is not None:
            return
        target = self._run_process if self.process_mode else self._run
        self._thread = threading.Thread(target=target, name="pypto-engine", daemon=True)
        self._thread.start()

    def wait_ready(self, timeout: float | None = None) -> EngineCore | CoreView:
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
        return self.ready and self.dead_reason is None and not self._stopping and not self._draining

    @property
    def draining(self) -> bool:
        return self._draining or self._stopping

    def drain(self) -> None:
        """SIGTERM: from now on /health says 503 and new requests are refused; those in flight go on."""
        self._draining = True

    def has_open_requests(self) -> bool:
        with self._lock:
            return bool(self._streams) or self._pending_seqs > 0

    @property
    def stalled(self) -> str | None:
        """Why an engine that looks up is frozen: a step running past ``health_step_timeout``, or (process
        mode) an engine-core process silent that long (stopped, deadlocked); None otherwise. /health says
        503 then, long before ``step_timeout`` declares the worker hung."""
        if not self.ready:
            return None
        bound, now = self.settings.health_step_timeout, time.monotonic()
        busy, heard = self._busy_since, self._heard_at
        if busy is not None and now - busy > bound:
            return f"an engine step has run for {now - busy:.1f}s (health_step_timeout={bound:g}s)"
        if self.process_mode and heard is not None and now - heard > bound:
            return f"the engine core process has not answered for {now - heard:.1f}s (health_step_timeout={bound:g}s)"
        return None

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
        if self.process_mode:
            self._send(StopCmd())
        else:
            self._queue(_Stop())
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.error("the engine thread did not stop within %.0fs", timeout)
            core = self._core
            if core is not None:
                core.proc.kill()  # a core that does not drain in time must not outlive the server
        self._thread = None

    def fail_streams(self, reason: str) -> int:
        """End every open request now with ``reason`` (on the event loop: no wait for a step) and
        abort them in the engine. Used when the shutdown grace period runs out. Returns the count."""
        with self._lock:
            streams, self._streams = self._streams, {}
        for rid, stream in streams.items():
            _put(stream, EngineFailure(reason))
            self.abort(rid)
            if self.on_finished is not None:
                self.on_finished(rid)
        return len(streams)

    # ------------------------------------------------------------------ requests (event-loop side)
    async def add_request(self, request_id: str, prompt: list[int], params: SamplingParams) -> _Stream:
        """Hand a request to the engine; raises what ``EngineCore.add_request`` raises (ValueError...)."""
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        if self.draining:
            raise ServerDraining("the server is shutting down")
        if self.process_mode:
            return await self._add_to_core(request_id, prompt, params)
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue(), params.n)
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        with self._lock:
            self._pending_seqs += params.n
        self._queue(_Add(request_id, prompt, params, stream, done))
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
        if self.process_mode:
            self._send(AbortCmd(request_id))
        else:
            self._queue(_Abort(request_id))

    def profile(self, start: bool, path: str) -> None:
        """Start the engine's and worker's profiles, or stop them and write their Chrome traces to
        ``<path>.engine.json`` and ``<path>.worker.json`` (fire and forget: the files tell when done)."""
        if self.process_mode:
            self._send(ProfileCmd(start, path))
        else:
            self._queue(_Profile(start, path))

    async def load_lora(self, name: str, path: str) -> None:
        """Serve the PEFT adapter directory ``path`` as ``name`` (``EngineCore.load_lora``); raises
        LoraError when refused, EngineDeadError when the engine is down."""
        await self._lora(name, path)

    async def unload_lora(self, name: str) -> None:
        """Stop serving adapter ``name`` (``EngineCore.unload_lora``); LoraError (404) if not served."""
        await self._lora(name, None)

    async def _lora(self, name: str, path: str | None) -> None:
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        if self.process_mode:
            token = f"lora-{uuid.uuid4().hex}"
            with self._lock:
                self._adds[token] = _PendingAdd(done, 0)
            self._send(LoraCmd(token, name, path))
        else:
            self._queue(_Lora(name, path, done))
        await asyncio.wrap_future(done)

    def _queue(self, cmd: _Command) -> None:
        """Hand ``cmd`` to the engine thread and count it as an arrival (``EngineCore.step_interrupt``):
        the worker's commands of several forwards scheduled before it end after their current
        forward, so ``cmd`` waits one forward rather than a command."""
        self._cmds.put(cmd)
        engine = self.engine
        interrupt = engine.step_interrupt if isinstance(engine, EngineCore) else None
        if interrupt is not None:
            interrupt.arrive()

    def generate(self, request_id: str, prompt: list[int], params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Cumulative outputs until finished. Leaving early (cancellation, disconnect) aborts the request."""
        return stream_outputs(lambda: self.add_request(request_id, prompt, params), lambda: self.abort(request_id))

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

    def _take_restart(self, reason: str) -> bool:
        """Count one restart within the budget (True), or give up past it (False, ``on_fatal``)."""
        window, budget = self.settings.worker_restart_window, self.settings.max_worker_restarts
        now = time.monotonic()
        while self._restart_times and now - self._restart_times[0] > window:
            self._restart_times.popleft()
        if len(self._restart_times) >= budget:
            self._give_up(f"{reason}; no restart left (max_worker_restarts={budget} per {window:.0f}s)")
            return False
        self._restart_times.append(now)
        self.num_restarts += 1
        self.restarting = reason
        if self.metrics is not None:
            self.metrics.observe_restart()
        logger.warning("restarting the worker (restart %d): %s", self.num_restarts, reason)
        return True

    def _restart(self, reason: str) -> EngineCore | None:
        """A fresh engine within the restart budget, or None (and ``on_fatal``) past it."""
        while not self._stopping:
            if not self._take_restart(reason):
                return None
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
        self._fail_adds(reason)
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
            cmd = self._next_command(engine, idle)
            while cmd is not None:
                if isinstance(cmd, _Stop):
                    stopping = True
                    for rid in list(self._streams):
                        engine.abort(rid)
                else:
                    self._handle(engine, cmd, stopping)
                cmd = self._next_command(engine, False)
            if engine.has_unfinished():
                self._busy_since = time.monotonic()
                outputs = engine.step()
                self._busy_since = None
            else:
                outputs = engine.check_worker()
            if engine.dead_reason is not None:
                self.restarting = engine.dead_reason  # set first: the handlers of these outputs name it
            # Stats before the outputs: a client answered by them may send its next request at once,
            # and back-pressure must not count the finished request's sequences as still waiting.
            self.stats = engine.stats()
            self._dispatch(outputs)
            if self.metrics is not None:
                self.metrics.update_engine(self.stats, False)
            if engine.dead_reason is not None:
                return engine.dead_reason

    def _next_command(self, engine: EngineCore, block: bool) -> _Command | None:
        """The next queued command (waiting up to half a second for one where ``block``), or None. The
        arrivals counted so far are taken before the read (``StepInterrupt.take``): one queued after
        it ends the commands scheduled before it."""
        interrupt = engine.step_interrupt
        if interrupt is not None:
            interrupt.take()
        try:
            return self._cmds.get(timeout=0.5) if block else self._cmds.get_nowait()
        except queue.Empty:
            return None

    def _handle(self, engine: EngineCore, cmd: _Add | _Abort | _Profile | _Lora, stopping: bool) -> None:
        if isinstance(cmd, _Abort):
            engine.abort(cmd.request_id)
            return
        if isinstance(cmd, _Profile):
            engine.profile(cmd.start, cmd.path)
            return
        if isinstance(cmd, _Lora):
            self._handle_lora(engine, cmd)
            return
        with self._lock:
            self._pending_seqs -= cmd.num_seqs
        if not cmd.done.set_running_or_notify_cancel():
            return  # the client left before the engine saw the request
        try:
            if stopping:
                raise ServerDraining("the server is shutting down")
            # A worker killed since the last poll refuses the request (503 restarting) rather than
            # taking it into a step that fails on a broken pipe (500).
            self._dispatch(engine.check_worker())
            if engine.dead_reason is not None:
                self.restarting = engine.dead_reason
                raise EngineRestarting(_restarting_message(engine.dead_reason))
            engine.add_request(cmd.request_id, cmd.prompt, cmd.params)
        except Exception as e:  # this request's fault (or a bug it triggered): it alone fails
            cmd.done.set_exception(e)
            return
        with self._lock:
            self._streams[cmd.request_id] = cmd.stream
        self.stats = engine.stats()  # so back-pressure sees the new waiting request at once
        cmd.done.set_result(None)

    def _handle_lora(self, engine: EngineCore, cmd: _Lora) -> None:
        """Load or unload an adapter; the adapters served then are what a restarted engine loads."""
        if not cmd.done.set_running_or_notify_cancel():
            return
        try:
            if cmd.path is None:
                engine.unload_lora(cmd.name)
            else:
                engine.load_lora(cmd.name, cmd.path, on_outputs=self._dispatch)
        except Exception as e:
            cmd.done.set_exception(e)
            return
        self.settings = self.settings.with_overrides(
            lora_modules=engine.loras.entries(), enable_lora=engine.loras.enabled
        )
        self.stats = engine.stats()  # before the answer: /v1/models and the model check read it
        cmd.done.set_result(None)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            with self._lock:
                stream = self._streams.pop(out.request_id, None) if out.finished else self._streams.get(out.request_id)
            if self.metrics is not None:  # a finished output is observed as one, tokens included
                (self.metrics.observe_finished if out.finished else self.metrics.observe_output)(out)
            if out.finished and self.on_finished is not None:  # before the stream sees the end
                self.on_finished(out.request_id)
            if stream is not None:
                _put(stream, out)

    def _fail_streams_from_thread(self, reason: str) -> None:
        """Fail the requests in flight; an add the engine has not answered yet (process mode) waits
        for the next engine, as a queued add does in thread mode. A request cut by the engine's death
        ends as one the engine failed itself (``finish_reason`` "error": 500 ``generation_failed``, or
        an error event), whether the worker or the engine-core process died; one cut by a stop gets
        the shutdown's error."""
        with self._lock:
            streams = {rid: s for rid, s in self._streams.items() if rid not in self._adds}
            self._streams = {rid: s for rid, s in self._streams.items() if rid in self._adds}
        for rid, stream in streams.items():
            if self.on_finished is not None:
                self.on_finished(rid)
            _put(stream, EngineFailure(reason) if self._stopping else _failed_output(rid, stream.n, reason))

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

    # ------------------------------------------------------------------ process mode (event-loop side)
    async def _add_to_core(self, request_id: str, prompt: list[int], params: SamplingParams) -> _Stream:
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue(), params.n)
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        try:
            cmd = AddCmd(request_id, prompt, params)
            _cmd_check.encode(cmd)
        except (OverflowError, TypeError, ValueError, UnicodeError, msgspec.EncodeError) as e:
            raise ValueError(f"the request cannot be sent to the engine core: {e}") from None
        with self._lock:
            # Registered before the core sees the add, so its first output always finds the queue.
            if request_id in self._streams or request_id in self._adds:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._streams[request_id] = stream
            self._adds[request_id] = _PendingAdd(done, params.n)
            self._pending_seqs += params.n
        self._send(cmd)
        try:
            await asyncio.wrap_future(done)
        except asyncio.CancelledError:
            self.abort(request_id)  # the client left: this abort follows the add on the same pipe
            raise
        return stream

    def _send(self, cmd: CoreCommand) -> None:
        """To the running core, or kept for the next one while a dead core is being replaced."""
        with self._lock:
            core = self._core
            if core is None:
                self._held.append(cmd)
                return
            core.send(cmd)

    # ------------------------------------------------------------------ process mode (reader thread)
    def _run_process(self) -> None:
        core = self._first_core()
        while core is not None:
            try:
                reason = self._pump(core)
            except Exception as e:  # a bug in this thread's own code: treat it like a dead engine
                logger.exception("engine output thread failed")
                reason = f"engine output thread failed: {type(e).__name__}: {e}"
                core.proc.kill()
                core.alive = False
            if reason is not None and not core.alive:
                self._detach_core(reason)
            self._fail_streams_from_thread(reason or "the server is shutting down")
            if reason is None or self._stopping:
                self._detach_core("the server is shutting down")
                self._fail_adds("the server is shutting down")
                core.close()
                return
            core = self._restart_core(core, reason)

    def _first_core(self) -> CoreProcess | None:
        try:
            core = CoreProcess(self.settings, self.plugins)
        except Exception as e:  # no process to start, or plugins that cannot be handed over
            logger.error("engine start-up failed: %s", e)
            self.startup_error = e
            self._loaded.set()
            return None
        error = self._await_ready(core, "starting")
        if error is not None:
            core.close()
            self.startup_error = error
            logger.error("engine start-up failed: %s", error)
            self._loaded.set()
            return None
        self._attach_core(core)
        self._loaded.set()
        return core

    def _await_ready(self, core: CoreProcess, what: str) -> BaseException | None:
        """Wait for the core's engine; sets ``engine`` and ``stats``; the error otherwise."""
        try:
            model = self.settings.model  # the tokenizer loads while the core does
            tokenizer = load_tokenizer(self.settings.tokenizer or model, self.plugins.chat_encoder(model))
        except Exception as e:  # the engine would fail on it too; this is the clearer report
            return e
        while True:
            msg = core.recv()
            if msg is None:
                return EngineDeadError(core.death_reason(what))
            if isinstance(msg, CoreFailed):
                return rebuild_error(msg)
            if isinstance(msg, CoreReady):
                self.engine = CoreView(msg.info, msg.max_model_len, tokenizer, core.pid, msg.worker_pid)
                self.stats = msg.stats
                return None
            self._heard_at = time.monotonic()
            if isinstance(msg, CoreOutputs):
                self._apply(msg)  # answers to adds the core refuses

    def _pump(self, core: CoreProcess) -> str | None:
        """Dispatch the core's outputs until it stops (None) or its engine or itself dies (the reason)."""
        while True:
            msg = core.recv()
            if msg is None:
                reason = core.death_reason("serving")
                if not self._stopping:
                    self.restarting = reason  # before the failures, whose handlers name it
                return reason
            self._heard_at = time.monotonic()
            if isinstance(msg, CoreBeat):
                self._busy_since = self._heard_at - msg.busy_for if msg.busy_for > 0 else None
                continue
            if isinstance(msg, CoreStopped):
                return None
            if isinstance(msg, CoreOutputs):
                self._busy_since = None  # a step ended; the next beat tells of the one after
                if msg.dead_reason is not None:
                    self.restarting = msg.dead_reason  # set first: the handlers of these outputs name it
                self._apply(msg)
                if msg.dead_reason is not None:
                    return msg.dead_reason

    def _apply(self, msg: CoreOutputs) -> None:
        if msg.stats:  # first: an adapter's load is answered once the stats name it
            self.stats = msg.stats
            if self.metrics is not None:
                self.metrics.update_engine(self.stats, False)
        for added in msg.added:
            self._settle(added)
        self._dispatch(msg.outputs)

    def _settle(self, added: AddResult) -> None:
        with self._lock:
            pending = self._adds.pop(added.request_id, None)
            if pending is None:
                return
            self._pending_seqs -= pending.num_seqs
            if added.error is not None:
                self._streams.pop(added.request_id, None)
        with contextlib.suppress(concurrent.futures.InvalidStateError):  # cancelled: the client left
            if added.error is None:
                pending.done.set_result(None)
            else:
                pending.done.set_exception(self._add_error(added))

    def _add_error(self, added: AddResult) -> Exception:
        """The exception ``EngineCore.add_request`` raised in the core, as the class the handlers
        expect; a dead engine that is being replaced (not stopping, restarts left) is EngineRestarting."""
        if added.kind == "dead" and not self._stopping and self.failure is None:
            return EngineRestarting(_restarting_message(added.error or "the engine failed"))
        return _add_error(added)

    def _restart_core(self, core: CoreProcess, reason: str) -> CoreProcess | None:
        """The same core with a fresh engine, or a fresh core if it died, within the restart budget."""
        while not self._stopping:
            if not self._take_restart(reason):
                self._detach_core(reason)
                core.close()
                return None
            if core.alive:
                core.send(RestartCmd())
            else:
                core.close()
                try:
                    core = CoreProcess(self.settings, self.plugins)
                except Exception as e:
                    reason = f"restarting the engine core failed: {type(e).__name__}: {e}"
                    continue
            error = self._await_ready(core, "restarting")
            if error is not None:
                reason = f"restarting the worker failed: {type(error).__name__}: {error}"
                logger.error("%s", reason)
                continue
            self._attach_core(core)
            self.restarting = None
            logger.info("the worker is back (restart %d)", self.num_restarts)
            return core
        self._detach_core("the server is shutting down")
        self._fail_adds("the server is shutting down")
        core.close()
        return None

    def _attach_core(self, core: CoreProcess) -> None:
        with self._lock:
            self._core, held, self._held = core, self._held, []
            for cmd in held:
                core.send(cmd)
            if self._stopping:
                core.send(StopCmd())

    def _detach_core(self, reason: str) -> None:
        """A core process that is gone took the adds it had not answered with it: they fail."""
        with self._lock:
            self._core = None
        self._fail_adds(reason, sent_only=True)

    def _fail_adds(self, reason: str, *, sent_only: bool = False) -> None:
        with self._lock:
            held = {c.request_id for c in self._held if isinstance(c, AddCmd | LoraCmd)} if sent_only else set()
            failed = [rid for rid in self._adds if rid not in held]
            if not sent_only:
                self._held = []
        for rid in failed:
            self._settle(AddResult(rid, reason, "dead"))


async def stream_outputs(
    add: Callable[[], Awaitable[_Stream]], abort: Callable[[], None]
) -> AsyncIterator[RequestOutput]:
    """Add a request when iteration starts (``add``), then yield its cumulative outputs until the
    finished one; an engine failure is raised, and leaving early calls ``abort``."""
    stream = await add()
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
            abort()


def _put(stream: _Stream, item: RequestOutput | EngineFailure) -> None:
    # A closed event loop means nobody is listening for this request any more.
    with contextlib.suppress(RuntimeError):
        stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)


def _close(engine: EngineCore) -> None:
    try:
        engine.shutdown()
    except Exception:
        logger.exception("engine shutdown failed")


def _restarting_message(reason: str) -> str:
    return f"the worker is restarting after a failure ({reason}); retry shortly"


def _failed_output(request_id: str, n: int, reason: str) -> RequestOutput:
    """The last output of a request whose engine died: every choice failed with ``reason``."""
    choices = [CompletionOutput(i, [], finish_reason="error", error=reason) for i in range(n)]
    return RequestOutput(request_id, None, [], choices, finished=True)


def _add_error(added: AddResult) -> Exception:
    """The exception ``EngineCore.add_request`` raised in the core, as the class the handlers expect."""
    message = added.error or ""
    if added.kind.startswith("lora"):
        return LoraError(int(added.kind[4:]), message)
    if added.kind == "value":
        return ValueError(message)
    if added.kind == "dead":
        return EngineDeadError(message)
    return RuntimeError(message)


_cmd_check = msgspec.msgpack.Encoder()
