"""The engine-core process: an :class:`EngineCore` (scheduler, detokenization, stop strings) that runs
beside the server process instead of in one of its threads, so that stepping never holds the GIL the
HTTP event loop needs.

The server keeps tokenization, HTTP and the per-request queues; the core process owns the engine and
spawns the worker as the engine always does. They talk over one socket pair with msgspec structs
encoded as msgpack: the server sends :data:`CoreCommand` values, the core answers with
:data:`CoreMessage` values, one :class:`CoreOutputs` per engine step carrying every output, add result
and the stats of that step.

The core process is started with ``subprocess`` (a plain child, not a daemonic multiprocessing one,
which could not spawn the worker) and dies with the server: when the socket closes (the server exited
or was killed) it stops its engine, and after a short grace exits regardless.

Supervision stays in the server: the core reports a dead engine (:attr:`CoreOutputs.dead_reason`) and
waits for a :class:`RestartCmd` (a fresh engine in the same process) or a :class:`StopCmd`.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import pickle
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import types
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import msgspec

from ..config import ServingSettings
from ..executor import ExecutorInfo, StepInterrupt
from ..heap import freeze_startup_heap
from ..request import RequestOutput, SamplingParams
from ..worker import keep_off_workers, parent_logging

__all__ = [
    "AbortCmd",
    "AddCmd",
    "AddResult",
    "CoreBeat",
    "CoreCommand",
    "CoreFailed",
    "CoreMessage",
    "CoreOutputs",
    "CoreProcess",
    "CoreReady",
    "CoreStopped",
    "LoraCmd",
    "ProfileCmd",
    "RestartCmd",
    "StopCmd",
    "rebuild_error",
]

logger = logging.getLogger(__name__)

ORPHAN_GRACE = 5.0
"""Seconds a core process whose server is gone may spend stopping its engine before it exits anyway."""


# --------------------------------------------------------------------------- server -> core
class AddCmd(msgspec.Struct, frozen=True, tag=True):
    request_id: str
    prompt: list[int]
    params: SamplingParams


class AbortCmd(msgspec.Struct, frozen=True, tag=True):
    request_id: str


class StopCmd(msgspec.Struct, frozen=True, tag=True):
    """Abort everything, drain, close the engine and exit (also accepted while the engine is dead)."""


class RestartCmd(msgspec.Struct, frozen=True, tag=True):
    """Build a fresh engine (new worker, model reloaded) after the core reported a dead one."""


class ProfileCmd(msgspec.Struct, frozen=True, tag=True):
    """Start the engine's and worker's profiles, or stop them and write their traces (``EngineCore.profile``)."""

    start: bool
    path: str


class LoraCmd(msgspec.Struct, frozen=True, tag=True):
    """Load adapter ``name`` from ``path`` (None: unload it); answered by an :class:`AddResult` under
    ``request_id`` (a token of the server's), whose ``kind`` ``lora<status>`` names a refusal."""

    request_id: str
    name: str
    path: str | None


CoreCommand = AddCmd | AbortCmd | StopCmd | RestartCmd | ProfileCmd | LoraCmd


# --------------------------------------------------------------------------- core -> server
class AddResult(msgspec.Struct, frozen=True):
    """The outcome of one :class:`AddCmd`; ``kind`` names the exception class the server raises."""

    request_id: str
    error: str | None = None
    kind: str = ""  # "value" (ValueError), "dead" (EngineDeadError) or "other" (RuntimeError)


class CoreReady(msgspec.Struct, frozen=True, tag=True):
    info: ExecutorInfo
    max_model_len: int
    stats: dict[str, Any]
    worker_pid: int | None


class CoreFailed(msgspec.Struct, frozen=True, tag=True):
    """The engine could not be built; ``pickled`` is the exception itself when it pickles."""

    error: str
    pickled: bytes = b""


class CoreOutputs(msgspec.Struct, frozen=True, tag=True):
    """Everything one engine step produced; ``dead_reason`` is set on the engine's last message."""

    outputs: list[RequestOutput]
    added: list[AddResult]
    stats: dict[str, Any]
    dead_reason: str | None = None


class CoreStopped(msgspec.Struct, frozen=True, tag=True):
    pass


class CoreBeat(msgspec.Struct, frozen=True, tag=True):
    """Sent every :func:`beat_interval` seconds by a thread of the core, whatever its engine does: the
    server tells a frozen core (no beats) and a step that runs too long (``busy_for``) from a busy one."""

    busy_for: float  # seconds the current engine step has run; 0 when no step runs


CoreMessage = CoreReady | CoreFailed | CoreOutputs | CoreStopped | CoreBeat

_encoder = msgspec.msgpack.Encoder()
_cmd_decoder = msgspec.msgpack.Decoder(CoreCommand)  # type: ignore[arg-type]
_msg_decoder = msgspec.msgpack.Decoder(CoreMessage)  # type: ignore[arg-type]


def beat_interval(settings: ServingSettings) -> float:
    """Seconds between two :class:`CoreBeat`: a quarter of the liveness bound, at most one second."""
    return min(1.0, settings.health_step_timeout / 4)


def rebuild_error(failed: CoreFailed) -> BaseException:
    """The start-up exception the core reported, as the same class when it pickled."""
    if failed.pickled:
        with contextlib.suppress(Exception):
            err = pickle.loads(failed.pickled)
            if isinstance(err, BaseException):
                return err
    return RuntimeError(failed.error)


@dataclass(slots=True)
class _CoreInit:
    """What the core process needs to build engines; pickled because plugins are Python objects."""

    settings_json: str
    plugins: list[Any]  # objects to register, or ("module", name) for plugin modules
    sys_path: list[str]
    log_level: int
    log_format: str | None


# --------------------------------------------------------------------------- server side
class CoreProcess:
    """The server's handle on one engine-core process."""

    def __init__(self, settings: ServingSettings, plugins: Any) -> None:
        parent, child = socket.socketpair()
        code = "import sys; from pypto_serving.server.engine_proc import core_main; core_main(int(sys.argv[1]))"
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", code, str(child.fileno())], pass_fds=[child.fileno()], close_fds=True
            )
        finally:
            child.close()
        self._conn = Connection(parent.detach())
        self._send_lock = threading.Lock()
        self.alive = True
        try:
            self._conn.send_bytes(pickle.dumps(_init_for(settings, plugins)))
        except BaseException:  # an unpicklable plugin, say: no core is left waiting for its start
            self._conn.close()
            self.proc.kill()
            self.proc.wait()
            raise

    @property
    def pid(self) -> int:
        return self.proc.pid

    def send(self, cmd: CoreCommand) -> None:
        """Fire and forget; a core that is gone is noticed by the reader (:meth:`recv` returns None)."""
        data = _encoder.encode(cmd)
        with self._send_lock, contextlib.suppress(OSError):
            self._conn.send_bytes(data)

    def recv(self) -> CoreMessage | None:
        """The next message, or None once the core process is gone (its socket closed)."""
        try:
            raw = self._conn.recv_bytes()
        except (EOFError, OSError):
            self.alive = False
            return None
        msg: CoreMessage = _msg_decoder.decode(raw)
        return msg

    def death_reason(self, what: str) -> str:
        try:
            code = self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            return f"the engine core process stopped answering while {what}"
        return f"the engine core process died (exit code {code}) while {what}"

    def close(self, timeout: float = 10.0) -> None:
        """Ask the core to stop, wait for it, kill it past ``timeout``; never leaves a zombie."""
        self.send(StopCmd())
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            logger.error("the engine core process did not stop within %.0fs; killing it", timeout)
            self.proc.kill()
            self.proc.wait(timeout=5)
        with self._send_lock:
            self._conn.close()
        self.alive = False


def _init_for(settings: ServingSettings, plugins: Any) -> _CoreInit:
    extra: list[Any] = []
    for info in plugins.plugins:
        if info.distribution != "(in-process)":
            continue
        obj = plugins.pm.get_plugin(info.name)
        extra.append(("module", obj.__name__) if isinstance(obj, types.ModuleType) else obj)
    logged = parent_logging()
    return _CoreInit(
        settings_json=settings.model_dump_json(),
        plugins=extra,
        sys_path=list(sys.path),
        log_level=logging.getLogger("pypto_serving").getEffectiveLevel(),
        log_format=logged[1] if logged is not None else None,
    )


# --------------------------------------------------------------------------- core side
def core_main(fd: int) -> None:
    """Entry point of the engine-core process; ``fd`` is its end of the socket pair."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the server's to handle
    conn = Connection(fd)
    try:
        init: _CoreInit = pickle.loads(conn.recv_bytes())
    except (EOFError, OSError):
        return
    sys.path[:] = init.sys_path
    logging.basicConfig(level=init.log_level, format=init.log_format or logging.BASIC_FORMAT)
    logging.getLogger("pypto_serving").setLevel(init.log_level)
    from ..plugins import PluginManager

    extra = [importlib.import_module(p[1]) if isinstance(p, tuple) else p for p in init.plugins]
    settings = ServingSettings.model_validate_json(init.settings_json)
    _CoreLoop(conn, settings, PluginManager(extra_plugins=extra)).run()
    # The engine and its worker are closed: skip the interpreter's teardown (torch's takes seconds).
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class _CoreLoop:
    """Runs engines one after the other in the core process; commands come from a reader thread."""

    def __init__(self, conn: Connection, settings: ServingSettings, plugins: Any) -> None:
        self.conn, self.settings, self.plugins = conn, settings, plugins
        self.cmds: queue.SimpleQueue[CoreCommand | None] = queue.SimpleQueue()  # None: the server is gone
        self.held: deque[CoreCommand | None] = deque()  # commands kept while no engine runs
        self.live: set[str] = set()
        self.step_started: float | None = None  # monotonic start of the engine step now running
        self.interrupt: StepInterrupt | None = None  # the running engine's (EngineCore.step_interrupt)
        self._send_lock = threading.Lock()  # the beat thread sends too
        threading.Thread(target=self._read, name="pypto-core-reader", daemon=True).start()
        threading.Thread(target=self._beat, name="pypto-core-beat", daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                raw = self.conn.recv_bytes()
            except (EOFError, OSError):
                break
            self.cmds.put(_cmd_decoder.decode(raw))
            interrupt = self.interrupt
            if interrupt is not None:  # commands of several forwards scheduled before it end after their current one
                interrupt.arrive()
        self.cmds.put(None)
        # Nobody reads the outputs any more: stop the engine (and its worker) if that is quick, and
        # exit regardless after the grace period (a step that hangs must not keep the process alive).
        timer = threading.Timer(ORPHAN_GRACE, os._exit, (1,))
        timer.daemon = True
        timer.start()

    def _send(self, msg: CoreMessage) -> None:
        data = _encoder.encode(msg)
        with self._send_lock, contextlib.suppress(OSError):  # the server is gone; the reader ends the process
            self.conn.send_bytes(data)

    def _beat(self) -> None:
        """Tell the server this process lives and how long the current step has run (see CoreBeat)."""
        interval = beat_interval(self.settings)
        while True:
            time.sleep(interval)
            started = self.step_started
            self._send(CoreBeat(0.0 if started is None else time.monotonic() - started))

    def run(self) -> None:
        engine = self._build()
        while True:
            if engine is None:
                if not self._wait_for_restart():
                    break
                engine = self._build()
                continue
            reason = self._loop(engine)
            self.interrupt = None
            _close(engine)
            if reason is None:
                break
            engine = None
        self._refuse_held("the server is shutting down")
        self._send(CoreStopped())

    def _build(self) -> Any:
        from ..engine import EngineCore

        try:
            # Placed first: the worker EngineCore spawns starts from the settings this resolves.
            self.settings = keep_off_workers(self.settings)
            engine = EngineCore(self.settings, self.plugins)
        except BaseException as e:  # reported to the server, which decides what follows
            try:
                pickled = pickle.dumps(e)
            except Exception:
                pickled = b""
            self._send(CoreFailed(f"{type(e).__name__}: {e}" if str(e) else type(e).__name__, pickled))
            return None
        freeze_startup_heap()
        self.interrupt = engine.step_interrupt
        self._send(CoreReady(engine.info, engine.max_model_len, engine.stats(), engine.worker.pid))
        return engine

    def _wait_for_restart(self) -> bool:
        """Keep adds and aborts for the next engine; True on a restart, False on a stop."""
        while True:
            cmd = self.cmds.get()
            if isinstance(cmd, RestartCmd):
                return True
            if cmd is None or isinstance(cmd, StopCmd):
                return False
            self.held.append(cmd)

    def _commands(self, block: bool) -> Iterator[CoreCommand | None]:
        if self.held:
            block = False
        while self.held:
            yield self.held.popleft()
        try:
            cmd = self._get(block)
        except queue.Empty:
            return
        while True:
            yield cmd
            try:
                cmd = self._get(False)
            except queue.Empty:
                return

    def _get(self, block: bool) -> CoreCommand | None:
        """The next command (``queue.Empty`` where none comes within half a second, or none is queued
        when not ``block``); the arrivals counted so far are taken before the read
        (``StepInterrupt.take``), so one queued after it ends the commands scheduled before it."""
        interrupt = self.interrupt
        if interrupt is not None:
            interrupt.take()
        return self.cmds.get(timeout=0.5) if block else self.cmds.get_nowait()

    def _loop(self, engine: Any) -> str | None:
        """Commands and steps until a stop (None) or the engine's death (the reason)."""
        stopping = False
        while True:
            idle = not engine.has_unfinished()
            if stopping and idle:
                return None
            added: list[AddResult] = []
            outputs: list[RequestOutput] = []
            for cmd in self._commands(block=idle):
                if cmd is None or isinstance(cmd, StopCmd):
                    stopping = True
                    for rid in self.live:
                        engine.abort(rid)
                elif isinstance(cmd, AbortCmd):
                    engine.abort(cmd.request_id)
                elif isinstance(cmd, ProfileCmd):
                    engine.profile(cmd.start, cmd.path)
                elif isinstance(cmd, AddCmd):
                    added.append(self._add(engine, cmd, stopping, outputs))
                elif isinstance(cmd, LoraCmd):
                    added.append(self._lora(engine, cmd))
            stepped = engine.has_unfinished()
            self.step_started = time.monotonic() if stepped else None
            outputs += engine.step() if stepped else engine.check_worker()
            self.step_started = None
            for out in outputs:
                if out.finished:
                    self.live.discard(out.request_id)
            if stepped or added or outputs or engine.dead_reason is not None:
                self._send(CoreOutputs(outputs, added, engine.stats(), engine.dead_reason))
            if engine.dead_reason is not None:
                self.live.clear()
                return str(engine.dead_reason)

    def _add(self, engine: Any, cmd: AddCmd, stopping: bool, outputs: list[RequestOutput]) -> AddResult:
        """Add one request; a worker that died since the last poll refuses it (the server answers 503
        ``restarting``) instead of taking it into a step that would fail on a broken pipe."""
        from ..engine import EngineDeadError
        from ..lora import LoraError

        try:
            if stopping:
                raise EngineDeadError("the server is shutting down")
            outputs += engine.check_worker()  # one non-blocking waitpid; fails the live requests if dead
            engine.add_request(cmd.request_id, cmd.prompt, cmd.params)
        except LoraError as e:  # an adapter not served: 404 as the server's own model check says
            return AddResult(cmd.request_id, str(e), f"lora{e.status}")
        except Exception as e:  # this request's fault (or a bug it triggered): it alone fails
            kind = "value" if isinstance(e, ValueError) else "dead" if isinstance(e, EngineDeadError) else "other"
            return AddResult(cmd.request_id, str(e) if kind != "other" else f"{type(e).__name__}: {e}", kind)
        self.live.add(cmd.request_id)
        return AddResult(cmd.request_id)

    def _emit(self, engine: Any, outputs: list[RequestOutput]) -> None:
        """The outputs of steps run while an adapter loads (the loop's own steps send theirs)."""
        for out in outputs:
            if out.finished:
                self.live.discard(out.request_id)
        if outputs:
            self._send(CoreOutputs(outputs, [], engine.stats(), None))

    def _lora(self, engine: Any, cmd: LoraCmd) -> AddResult:
        """Load or unload an adapter; the adapters served then are what a restarted engine loads."""
        from ..engine import EngineDeadError
        from ..lora import LoraError

        try:
            if cmd.path is None:
                engine.unload_lora(cmd.name)
            else:
                engine.load_lora(cmd.name, cmd.path, on_outputs=lambda outs: self._emit(engine, outs))
        except LoraError as e:
            return AddResult(cmd.request_id, str(e), f"lora{e.status}")
        except EngineDeadError as e:
            return AddResult(cmd.request_id, str(e), "dead")
        except Exception as e:  # a bug it triggered: reported, the engine goes on
            return AddResult(cmd.request_id, f"{type(e).__name__}: {e}", "other")
        self.settings = self.settings.with_overrides(
            lora_modules=engine.loras.entries(), enable_lora=engine.loras.enabled
        )
        return AddResult(cmd.request_id)

    def _refuse_held(self, reason: str) -> None:
        """Answer the adds that will never reach an engine (they raced with a stop)."""
        pending = [*self.held]
        while True:
            try:
                pending.append(self.cmds.get_nowait())
            except queue.Empty:
                break
        added = [AddResult(c.request_id, reason, "dead") for c in pending if isinstance(c, AddCmd)]
        if added:
            self._send(CoreOutputs([], added, {}, None))


def _close(engine: Any) -> None:
    try:
        engine.shutdown()
    except Exception:
        logger.exception("engine shutdown failed")
