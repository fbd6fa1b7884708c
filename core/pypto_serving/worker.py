"""The worker process that hosts an executor, and :class:`WorkerClient`, the engine's handle on it.

The worker runs a :class:`~pypto_serving.runner.ModelRunner` around the executor and answers each
message from :mod:`pypto_serving.messages` in order over a pipe. ``WorkerClient`` can also run the
runner in the engine's own thread (``mode="inproc"``), for debugging and the simplest tests.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import sys
import traceback
from collections import deque
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import torch

from .config import ServingSettings
from .executor import Executor
from .memory import profile_memory
from .messages import (
    InitCache,
    InitDone,
    Loaded,
    MemoryProfile,
    ProfileMemory,
    Shutdown,
    StepCommand,
    StepResult,
    WorkerCommand,
)
from .runner import ModelRunner

__all__ = ["WorkerClient", "WorkerDiedError", "WorkerError"]

_encoder = msgspec.msgpack.Encoder()
_cmd_decoder = msgspec.msgpack.Decoder(WorkerCommand)  # type: ignore[arg-type]


class WorkerError(RuntimeError):
    """The worker failed a step or could not start."""


class WorkerDiedError(WorkerError):
    """The worker process is gone or stopped answering."""


# Exit code of a spawned child that tried to start a worker while importing the main script: the
# script creates an LLM at import time, outside ``if __name__ == "__main__":``.
_UNGUARDED_MAIN_EXIT = 86
_UNGUARDED_MAIN_HELP = (
    "the worker process could not start because the script that creates the LLM has no "
    "'if __name__ == \"__main__\":' guard: the worker is spawned and imports the main script again, "
    "which must not create an LLM or start a server at import time. Put that code under "
    "'if __name__ == \"__main__\":' (or use worker_mode='inproc')"
)


def _refuse_spawn_while_bootstrapping() -> None:
    """In a spawned child that is still importing the parent's main script, creating a worker would
    recurse; multiprocessing raises an opaque RuntimeError there. Exit with a code the parent
    recognises instead, after saying why on stderr."""
    if getattr(mp.current_process(), "_inheriting", False):  # set by spawn while the child prepares
        print(f"pypto-serving: error: {_UNGUARDED_MAIN_HELP}", file=sys.stderr, flush=True)
        os._exit(_UNGUARDED_MAIN_EXIT)


@contextlib.contextmanager
def _worker_environment(settings: ServingSettings) -> Iterator[None]:
    """Environment a spawned worker starts with: OpenMP reads its wait policy once, when the child
    loads torch, so it is set around ``Process.start`` (spawn copies the environment then) and
    restored after. A policy the user exported wins."""
    policy = settings.worker_omp_wait_policy
    if policy == "inherit" or "OMP_WAIT_POLICY" in os.environ:
        yield
        return
    os.environ["OMP_WAIT_POLICY"] = policy.upper()
    try:
        yield
    finally:
        os.environ.pop("OMP_WAIT_POLICY", None)


def _worker_main(conn: Connection, factory: Callable[[Any], Executor], settings_json: str) -> None:
    """Entry point of the spawned worker process."""
    try:
        settings = ServingSettings.model_validate_json(settings_json)
        if settings.worker_threads:
            torch.set_num_threads(settings.worker_threads)
        runner = ModelRunner(factory(settings), settings)
        info = runner.load()
        conn.send_bytes(_encoder.encode(Loaded(info)))
    except BaseException as e:
        conn.send_bytes(_encoder.encode(Loaded(None, _format_error(e))))
        return
    while True:
        try:
            msg = _cmd_decoder.decode(conn.recv_bytes())
        except (EOFError, OSError):
            break
        if isinstance(msg, Shutdown):
            break
        if isinstance(msg, InitCache | ProfileMemory):
            conn.send_bytes(_encoder.encode(_lifecycle(runner, msg)))
            continue
        conn.send_bytes(_encoder.encode(runner.step(msg)))
    runner.shutdown()


def _lifecycle(runner: ModelRunner, msg: InitCache | ProfileMemory) -> InitDone | MemoryProfile:
    """Run a cache-planning command; a failure is reported, not raised (the engine decides)."""
    try:
        if isinstance(msg, ProfileMemory):
            return profile_memory(runner, msg.num_tokens)
        runner.init_kv_cache(msg.num_blocks)
        return InitDone(True)
    except BaseException as e:
        if isinstance(msg, ProfileMemory):
            return MemoryProfile(ok=False, error=_format_error(e))
        return InitDone(False, _format_error(e))


def _format_error(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}\n{''.join(traceback.format_exception(e)[-3:])}".strip()


class WorkerClient:
    """Engine-side handle of the worker: ``submit`` steps, ``get_result`` them in order.

    ``mode="process"`` spawns a process and talks over a pipe; ``mode="inproc"`` runs the executor
    in this thread at ``submit`` time (for debugging and the simplest tests).
    """

    def __init__(
        self,
        factory: Callable[[Any], Executor],
        settings: Any,
        *,
        mode: str = "process",
        timeout: float = 600.0,
    ) -> None:
        self.mode = mode
        self.timeout = timeout
        self._pending: deque[StepResult] = deque()
        self._in_flight = 0
        self.dead_reason: str | None = None
        if mode == "inproc":
            self._runner: ModelRunner | None = ModelRunner(factory(settings), settings)
            self.info = self._runner.load()
            self._proc = None
            return
        self._runner = None
        _refuse_spawn_while_bootstrapping()
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(
            target=_worker_main,
            args=(child, factory, settings.model_dump_json()),
            daemon=True,
            name="pypto-worker",
        )
        with _worker_environment(settings):
            self._proc.start()
        child.close()
        try:
            raw = self._recv(timeout=max(timeout, 600.0), what="loading the model")
        except WorkerDiedError:
            if self._proc.exitcode == _UNGUARDED_MAIN_EXIT:
                raise WorkerError(_UNGUARDED_MAIN_HELP) from None
            raise
        loaded = msgspec.msgpack.decode(raw, type=Loaded)
        if loaded.error is not None or loaded.info is None:
            self.close()
            raise WorkerError(f"the executor failed to load: {loaded.error}")
        self.info = loaded.info

    def init_kv_cache(self, num_blocks: dict[str, int]) -> None:
        if self._runner is not None:
            self._runner.init_kv_cache(num_blocks)
            return
        self._conn.send_bytes(_encoder.encode(InitCache(num_blocks)))
        done = msgspec.msgpack.decode(self._recv(self.timeout, "allocating the KV cache"), type=InitDone)
        if not done.ok:
            raise WorkerError(f"the executor failed to allocate its KV cache: {done.error}")

    def profile_memory(self, num_tokens: int) -> MemoryProfile:
        """Device memory and the peak of a ``num_tokens`` forward (see :mod:`pypto_serving.memory`)."""
        if self._runner is not None:
            profile = _lifecycle(self._runner, ProfileMemory(num_tokens))
        else:
            self._conn.send_bytes(_encoder.encode(ProfileMemory(num_tokens)))
            raw = self._recv(self.timeout, "profiling memory")
            profile = msgspec.msgpack.decode(raw, type=MemoryProfile)
        assert isinstance(profile, MemoryProfile)
        if not profile.ok:
            raise WorkerError(f"the worker could not profile memory: {profile.error}")
        return profile

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def submit(self, cmd: StepCommand) -> None:
        if self.dead_reason is not None:
            raise WorkerDiedError(self.dead_reason)
        self._in_flight += 1
        if self._runner is not None:
            self._pending.append(self._runner.step(cmd))
            return
        try:
            self._conn.send_bytes(_encoder.encode(cmd))
        except (BrokenPipeError, OSError) as e:
            self._in_flight -= 1
            self._die(f"the worker process is gone ({e})")

    def get_result(self) -> StepResult:
        """The oldest submitted step's result; raises :class:`WorkerDiedError` if the worker dies
        or exceeds ``step_timeout``."""
        if self._in_flight == 0:
            raise RuntimeError("get_result() without a submitted step")
        self._in_flight -= 1
        if self._runner is not None:
            return self._pending.popleft()
        return msgspec.msgpack.decode(self._recv(self.timeout, "running a step"), type=StepResult)

    def _recv(self, timeout: float, what: str) -> bytes:
        if self.dead_reason is not None:
            raise WorkerDiedError(self.dead_reason)
        assert self._proc is not None
        waited = 0.0
        while not self._conn.poll(min(0.5, timeout - waited)):
            waited += 0.5
            if not self._proc.is_alive():
                self._proc.join(timeout=1)  # reap it, so the exit code is known
                self._die(f"the worker process died (exit code {self._proc.exitcode}) while {what}")
            if waited >= timeout:
                self._die(f"the worker did not answer within {timeout:.0f}s while {what} (step_timeout)")
        try:
            return self._conn.recv_bytes()
        except (EOFError, OSError):
            self._proc.join(timeout=1)
            self._die(f"the worker process died (exit code {self._proc.exitcode}) while {what}")
            raise  # unreachable

    def _die(self, reason: str) -> None:
        self.dead_reason = reason
        self._in_flight = 0
        if self._proc is not None:
            if self._proc.is_alive():
                self._proc.kill()
            self._proc.join(timeout=5)  # no zombie left behind
        raise WorkerDiedError(reason)

    def check_alive(self) -> str | None:
        """Why the worker is gone, or None while it runs. Cheap (a non-blocking ``waitpid``), so
        the engine calls it while idle to notice a dead worker before the next request needs it."""
        if self.dead_reason is not None:
            return self.dead_reason
        if self._proc is None or self._proc.is_alive():
            return None
        self._proc.join(timeout=1)
        self.dead_reason = f"the worker process died (exit code {self._proc.exitcode}) while idle"
        self._in_flight = 0
        return self.dead_reason

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def close(self) -> None:
        if self._runner is not None:
            self._runner.shutdown()
            self._runner = None
            return
        if self._proc is None:
            return
        if self._proc.is_alive():
            with contextlib.suppress(OSError):  # it may be exiting already
                self._conn.send_bytes(_encoder.encode(Shutdown()))
            self._proc.join(timeout=10)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join(timeout=5)
        self._conn.close()
        self._proc = None
