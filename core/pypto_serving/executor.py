"""The executor contract, the step messages, and the worker process that hosts an executor.

The engine (scheduler side) owns request state and block accounting; the worker owns tensors.
They talk through small msgspec structs: a :class:`StepCommand` per step and a :class:`StepResult`
back. No activation ever crosses the pipe.
"""

from __future__ import annotations

import abc
import contextlib
import logging
import multiprocessing as mp
import os
import sys
import threading
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import torch

__all__ = [
    "BatchInput",
    "CacheGroupSpec",
    "Executor",
    "ExecutorInfo",
    "NewRequestData",
    "ScheduledEntry",
    "StepCommand",
    "StepResult",
    "WorkerClient",
    "WorkerDiedError",
    "WorkerError",
]

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------- the contract


@dataclass(frozen=True, slots=True)
class CacheGroupSpec:
    """One kind of paged state. A block holds ``block_size`` entries; an entry covers
    ``tokens_per_entry`` sequence tokens (1 for plain KV, the compression rate for compressed KV)."""

    name: str
    block_size: int
    bytes_per_block: int
    tokens_per_entry: int = 1
    prefix_caching: bool = True
    no_prefix_caching_reason: str = ""

    @property
    def tokens_per_block(self) -> int:
        return self.block_size * self.tokens_per_entry


@dataclass(slots=True)
class ExecutorInfo:
    """What an executor tells the engine after loading."""

    cache_groups: list[CacheGroupSpec]
    vocab_size: int
    max_model_len: int
    eos_token_ids: list[int] = field(default_factory=list)
    architecture: str = ""
    supports_pipelining: bool = True  # can run under the async (depth-2) strategy
    uniform_batches: bool = False  # kernels need each step all-prefill or all-decode
    max_draft_tokens: int = 0  # drafting depth it can verify per step (0: no speculation)
    prefill_barrier: bool = False  # first decode after a terminal prefill waits for its result
    generation_defaults: dict[str, Any] = field(default_factory=dict)  # from generation_config.json


@dataclass(slots=True)
class BatchInput:
    """One step's flat token batch, on the executor's device.

    ``T`` tokens of ``R`` requests laid end to end; request ``r`` owns rows
    ``query_start_loc[r]:query_start_loc[r+1]`` and, after this step, has ``seq_lens[r]`` tokens in
    its cache. ``block_tables[g]`` is ``[R, max_blocks]`` (padded with 0) and ``slot_mapping[g]`` the
    cache slot of each token for groups whose entries are single tokens. ``logits_indices`` are the
    rows whose logits the sampler needs, grouped per request in order.
    """

    request_ids: list[str]
    input_ids: torch.Tensor
    positions: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: dict[str, torch.Tensor]
    slot_mapping: dict[str, torch.Tensor]
    logits_indices: torch.Tensor
    query_lens: list[int]
    seq_lens_list: list[int]
    num_logits: list[int]  # logits rows per request (0, 1 or 1 + drafts)
    is_prefill: list[bool]


class Executor(abc.ABC):
    """A model runner plugged in by an executor plugin. Lives in the worker process.

    Lifecycle: ``load()`` -> ``init_kv_cache()`` -> ``execute()`` per step -> ``shutdown()``.
    """

    @abc.abstractmethod
    def load(self) -> ExecutorInfo:
        """Load weights, decide the device and return what the engine needs to plan caches."""

    @abc.abstractmethod
    def init_kv_cache(self, num_blocks: dict[str, int]) -> None:
        """Allocate the paged cache tensors: ``num_blocks[group]`` blocks for each cache group."""

    @abc.abstractmethod
    def execute(self, batch: BatchInput) -> torch.Tensor:
        """Run one forward over the flat batch, writing KV into the paged caches, and return
        float logits ``[len(batch.logits_indices), vocab]`` for the requested rows."""

    def propose_drafts(self, batch: BatchInput, accepted: list[list[int]]) -> list[list[int]]:
        """Draft tokens for each request's next step after ``accepted`` tokens were committed this
        step (empty list where a request sampled nothing). Executors without drafting return []s."""
        return [[] for _ in batch.request_ids]

    def release(self, request_ids: list[str]) -> None:  # noqa: B027 - optional hook
        """Forget per-request state of finished, aborted or preempted requests."""

    def shutdown(self) -> None:  # noqa: B027 - optional hook
        """Free device memory."""


# --------------------------------------------------------------------------- messages


class NewRequestData(msgspec.Struct, frozen=True):
    """Sent once when a request (re)enters the worker: sampling state and token history."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # non-empty when resuming after preemption
    sampling: dict[str, Any]
    seed: int


class ScheduledEntry(msgspec.Struct, frozen=True):
    """What to compute for one request in one step.

    ``token_ids`` are the known input tokens. When ``use_last_sampled`` is true the single input
    token is the worker's own last sampled token for this request (async scheduling), never a
    placeholder value. ``num_draft`` draft tokens from the worker's draft cache follow it.
    ``start_pos`` is the request's computed-token count at schedule time; ``rejected_seen`` is how
    many rejected draft positions the scheduler had reclaimed by then, so the worker can correct
    positions for rejections the scheduler had not yet seen.
    """

    request_id: str
    token_ids: list[int]
    use_last_sampled: bool
    num_draft: int
    start_pos: int
    rejected_seen: int
    block_ids: dict[str, list[int]]
    sample: bool


class StepCommand(msgspec.Struct, frozen=True, tag=True):
    step_id: int
    new_requests: list[NewRequestData]
    entries: list[ScheduledEntry]
    finished_ids: list[str]


class StepResult(msgspec.Struct):
    step_id: int
    sampled: dict[str, list[int]] = {}
    logprobs: dict[str, list[dict[int, float]]] = {}
    request_errors: dict[str, str] = {}
    error: str | None = None
    num_drafted: int = 0
    num_verify_steps: int = 0  # request-steps that verified at least one draft
    num_accepted_per_pos: list[int] = []
    execute_seconds: float = 0.0


class _Init(msgspec.Struct, frozen=True, tag=True):
    num_blocks: dict[str, int]


class _InitDone(msgspec.Struct, frozen=True):
    ok: bool
    error: str | None = None


class _Loaded(msgspec.Struct, frozen=True):
    info: bytes | None  # msgpack of ExecutorInfo fields
    error: str | None = None


class _Shutdown(msgspec.Struct, frozen=True, tag=True):
    pass


_Msg = StepCommand | _Init | _Shutdown
_encoder = msgspec.msgpack.Encoder()
_cmd_decoder = msgspec.msgpack.Decoder(_Msg)  # type: ignore[arg-type]


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


def _encode_info(info: ExecutorInfo) -> bytes:
    return _encoder.encode(info)


def _decode_info(data: bytes) -> ExecutorInfo:
    return msgspec.msgpack.decode(data, type=ExecutorInfo)


# --------------------------------------------------------------------------- worker side


def _worker_main(conn: Connection, factory: Callable[[Any], Executor], settings_json: str) -> None:
    """Entry point of the spawned worker process."""
    from .config import ServingSettings
    from .runner import ModelRunner

    try:
        settings = ServingSettings.model_validate_json(settings_json)
        if settings.worker_threads:
            torch.set_num_threads(settings.worker_threads)
        runner = ModelRunner(factory(settings), settings)
        info = runner.load()
        conn.send_bytes(_encoder.encode(_Loaded(_encode_info(info))))
    except BaseException as e:
        conn.send_bytes(_encoder.encode(_Loaded(None, _format_error(e))))
        return
    while True:
        try:
            msg = _cmd_decoder.decode(conn.recv_bytes())
        except (EOFError, OSError):
            break
        if isinstance(msg, _Shutdown):
            break
        if isinstance(msg, _Init):
            try:
                runner.init_kv_cache(msg.num_blocks)
                conn.send_bytes(_encoder.encode(_InitDone(True)))
            except BaseException as e:
                conn.send_bytes(_encoder.encode(_InitDone(False, _format_error(e))))
            continue
        conn.send_bytes(_encoder.encode(runner.step(msg)))
    runner.shutdown()


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
        self._lock = threading.Lock()
        self.dead_reason: str | None = None
        if mode == "inproc":
            from .runner import ModelRunner

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
        self._proc.start()
        child.close()
        try:
            raw = self._recv(timeout=max(timeout, 600.0), what="loading the model")
        except WorkerDiedError:
            if self._proc.exitcode == _UNGUARDED_MAIN_EXIT:
                raise WorkerError(_UNGUARDED_MAIN_HELP) from None
            raise
        loaded = msgspec.msgpack.decode(raw, type=_Loaded)
        if loaded.error is not None or loaded.info is None:
            self.close()
            raise WorkerError(f"the executor failed to load: {loaded.error}")
        self.info = _decode_info(loaded.info)

    def init_kv_cache(self, num_blocks: dict[str, int]) -> None:
        if self._runner is not None:
            self._runner.init_kv_cache(num_blocks)
            return
        self._conn.send_bytes(_encoder.encode(_Init(num_blocks)))
        done = msgspec.msgpack.decode(self._recv(self.timeout, "allocating the KV cache"), type=_InitDone)
        if not done.ok:
            raise WorkerError(f"the executor failed to allocate its KV cache: {done.error}")

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
                self._conn.send_bytes(_encoder.encode(_Shutdown()))
            self._proc.join(timeout=10)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join(timeout=5)
        self._conn.close()
        self._proc = None
