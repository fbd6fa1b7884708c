"""The worker process that hosts an executor, and :class:`WorkerClient`, the engine's handle on it.

The worker runs a :class:`~pypto_serving.runner.ModelRunner` around the executor and answers each
message from :mod:`pypto_serving.messages` in order over a pipe. ``WorkerClient`` can also run the
runner in the engine's own thread (``mode="inproc"``), for debugging and the simplest tests.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import re
import select
import sys
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as mp_wait
from multiprocessing.process import BaseProcess
from typing import Any

import msgspec
import torch

from .config import ServingSettings
from .core_watch import CoreWatch
from .cpu_binding import core_list, engine_cores, on_cores, pin_process
from .devices import device_kind
from .distributed import (
    RANK_LOST_EXIT,
    RANK_REFUSED_EXIT,
    RankGroup,
    RankLayout,
    check_parallel_settings,
    combine_profiles,
    die_with_parent,
    free_port,
    info_mismatch,
    join_group,
    rank_device,
    settings_mismatch,
    step_digest,
)
from .executor import Executor, ExecutorInfo, StepInterrupt
from .heap import freeze_startup_heap
from .memory import profile_memory
from .messages import (
    InitCache,
    InitDone,
    Loaded,
    LoadLora,
    MemoryProfile,
    ProfileMemory,
    ReadLora,
    Shutdown,
    StepCommand,
    StepResult,
    WorkerCommand,
)
from .profiler import ProfileControl, TraceProfiler, phase
from .runner import ModelRunner

__all__ = ["WorkerClient", "WorkerDiedError", "WorkerError", "serve_node"]

logger = logging.getLogger(__name__)

_encoder = msgspec.msgpack.Encoder()
# Profile controls travel in order with the steps (see profiler.py); only the worker's loops know them.
_cmd_decoder = msgspec.msgpack.Decoder(WorkerCommand | ProfileControl)  # type: ignore[arg-type]


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


def worker_cores(settings: ServingSettings) -> list[int] | None:
    """The cores a spawned worker's compute threads are pinned to (``worker_cpu_bind``), or None.

    Only a single-rank worker is pinned (ranks would share the cores); ``auto`` leaves the first cores
    to the engine core and server, and pins nothing when there are fewer cores than threads. A listed
    core the kernel does not let this process use fails when the worker is spawned.
    """
    if settings.worker_cpu_bind == "off" or settings.tensor_parallel_size > 1:
        return None
    if settings.worker_cpu_bind != "auto":
        return core_list(settings.worker_cpu_bind)
    allowed = sorted(os.sched_getaffinity(0))
    # Unset worker_threads: torch's default in the child, the same as here (OMP_NUM_THREADS, else the cores).
    threads = settings.worker_threads or torch.get_num_threads()
    return allowed[-threads:] if threads <= len(allowed) else None


def resolve_cpu_binds(replicas: list[ServingSettings]) -> list[ServingSettings]:
    """Each replica's settings with ``worker_cpu_bind`` and ``engine_cpu_bind`` as this process's cores
    decide them now (``auto`` made a list, or ``off``), so that a process narrowed to the engine's
    cores later still spawns each worker on its own. The engine's ``auto`` keeps every spawned worker's
    cores free; where the environment places OpenMP's threads (``OMP_PLACES`` / ``OMP_PROC_BIND``) they are
    not ours to keep free, and the engine is not pinned."""
    workers = [worker_cores(each) for each in replicas]
    # An in-process worker computes on the engine's own threads: nothing to keep the engine off.
    spawned = [w if each.worker_mode == "process" else None for each, w in zip(replicas, workers, strict=True)]
    owned = [] if _placed_by_environment() else spawned
    engine = engine_cores(replicas[0].engine_cpu_bind, owned)
    return [
        each.with_overrides(worker_cpu_bind=_spec(w), engine_cpu_bind=_spec(engine))
        for each, w in zip(replicas, workers, strict=True)
    ]


def keep_off_workers(settings: ServingSettings) -> ServingSettings:
    """Pin this process (a server or an engine core: ours to place) to ``engine_cpu_bind``'s cores, as
    :func:`resolve_cpu_binds` decides them; returns the resolved settings, which spawn the worker.

    :raises ValueError: a listed core the kernel does not let this process run on.
    """
    settings = resolve_cpu_binds([settings])[0]
    cores = engine_cores(settings.engine_cpu_bind, [])
    if cores is not None:
        pin_process(cores, "engine_cpu_bind")
    return settings


def _placed_by_environment() -> bool:
    """Whether the user exported OpenMP's thread placement, which then wins over worker_cpu_bind's."""
    return bool({"OMP_PLACES", "OMP_PROC_BIND"} & set(os.environ))


def _spec(cores: list[int] | None) -> str:
    return ",".join(map(str, cores)) if cores is not None else "off"


def _places(cores: list[int]) -> str:
    return ",".join(f"{{{c}}}" for c in cores)


#: ``worker_heap_reuse``'s glibc settings: no allocation served by its own mapping, and freed memory
#: returned to the system only past 1 TiB of free heap (never, in practice).
HEAP_REUSE_TUNABLES = "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=1099511627776"


@contextlib.contextmanager
def _worker_environment(settings: ServingSettings) -> Iterator[None]:
    """Environment a spawned worker starts with: OpenMP reads its wait policy and thread places once,
    when the child loads torch, and torch its huge-page switch at its first allocation, so they are set
    around ``Process.start`` (spawn copies the environment then) and restored after. Variables the user
    exported win."""
    env: dict[str, str] = {}
    if settings.worker_omp_wait_policy != "inherit":
        env["OMP_WAIT_POLICY"] = settings.worker_omp_wait_policy.upper()
    if settings.worker_huge_pages:
        # torch's CPU allocator reads it once, at its first allocation in the child.
        env["THP_MEM_ALLOC_ENABLE"] = "1"
    if settings.worker_heap_reuse:
        # The dynamic loader reads it at the child's exec; glibc otherwise maps blocks of 32 MiB and
        # more fresh on every allocation (its largest mmap threshold), so such a buffer faults its
        # pages in on every step. Other C libraries ignore the variable.
        env["GLIBC_TUNABLES"] = HEAP_REUSE_TUNABLES
    cores = None if _placed_by_environment() else worker_cores(settings)
    if cores is not None:
        # One place per core, thread i on place i: no thread migrates, none shares a core with another.
        env["OMP_PLACES"] = _places(cores)
        env["OMP_PROC_BIND"] = "close"
    env = {k: v for k, v in env.items() if k not in os.environ}
    os.environ.update(env)
    try:
        # Spawned from a thread on the worker's cores, the worker starts there even where this process
        # keeps off them (engine_cpu_bind): OpenMP takes its places from the mask it starts with.
        with on_cores(cores, "worker_cpu_bind") if cores is not None else contextlib.nullcontext():
            yield
    finally:
        for key in env:
            os.environ.pop(key, None)


def _placed_cores() -> list[int] | None:
    """The cores OpenMP binds this process's threads to, one per place and thread ``p`` on place ``p``
    (``OMP_PLACES`` of single cores, as :func:`_worker_environment` writes it, with ``close``
    binding); None for any other placement."""
    places = os.environ.get("OMP_PLACES", "")
    if os.environ.get("OMP_PROC_BIND", "").lower() != "close" or not re.fullmatch(r"\{\d+\}(,\{\d+\})*", places):
        return None
    return [int(core) for core in re.findall(r"\d+", places)]


def _pin_threads(settings: ServingSettings) -> None:
    """The worker's thread count (``worker_threads``): a spawned worker's, or this process's for an
    in-process one. OpenMP itself binds a spawned worker's threads to the places the parent chose (the
    initial thread to the first when torch loads, the others when they start)."""
    if settings.worker_threads:
        torch.set_num_threads(settings.worker_threads)


def core_watch(settings: ServingSettings, info: ExecutorInfo) -> CoreWatch | None:
    """The watch that sheds the cores other processes keep busy (``worker_shed_busy_cores``): for a CPU
    worker bound to more than one core, one thread each, whose executor's logits do not depend on
    the thread count (or with ``on``); else None."""
    cores = _placed_cores()
    wanted = settings.worker_shed_busy_cores == "on" or (
        settings.worker_shed_busy_cores == "auto" and info.thread_count_invariant
    )
    if not wanted or cores is None or device_kind(settings.device) != "cpu":
        return None
    return CoreWatch(cores=cores) if len(cores) == torch.get_num_threads() > 1 else None


def parent_logging() -> tuple[int, str | None] | None:
    """This process's logging, for a spawned child to copy: the ``pypto_serving`` logger's effective
    level and the first root handler's format; None where nothing configured logging here (a library
    user's script), so the child's warnings reach stderr as the parent's would, unformatted."""
    root = logging.getLogger()
    if not root.handlers:
        return None
    formatter = root.handlers[0].formatter
    fmt = formatter._fmt if formatter is not None else None
    return logging.getLogger("pypto_serving").getEffectiveLevel(), fmt


def copy_logging(log: tuple[int, str | None] | None) -> None:
    """Configure a spawned child's logging as :func:`parent_logging` read it in the parent."""
    if log is not None:
        logging.basicConfig(level=log[0], format=log[1] or logging.BASIC_FORMAT)
        logging.getLogger("pypto_serving").setLevel(log[0])


def _worker_main(
    conn: Connection | None,
    factory: Callable[[Any], Executor],
    settings_json: str,
    rank: int = 0,
    kv_link: tuple[Callable[[Any], Any], Connection] | None = None,
    log: tuple[int, str | None] | None = None,
    interrupt: StepInterrupt | None = None,
) -> None:
    """Entry point of a spawned worker process: rank 0 talks to the engine over ``conn``; the other
    tensor-parallel ranks (no ``conn``) follow rank 0's broadcasts. ``log``: the parent's logging
    (:func:`parent_logging`), so the executor's and the core watch's messages show as the engine's do.
    ``interrupt``: the engine's count of arrivals, which ends a command of several forwards early (one
    rank only: ranks reading it at different forwards would part ways in their collectives)."""
    copy_logging(log)
    try:
        settings = ServingSettings.model_validate_json(settings_json)
    except BaseException as e:
        if conn is not None:
            conn.send_bytes(_encoder.encode(Loaded(None, _format_error(e))))
        return
    _pin_threads(settings)
    if settings.tensor_parallel_size > 1:
        _rank_main(conn, factory, settings, rank, kv_link)
        return
    assert conn is not None
    try:
        runner = ModelRunner(factory(settings), settings)
        runner.kv_link, runner.interrupt = kv_link, interrupt
        info = runner.load()
        freeze_startup_heap()
        conn.send_bytes(_encoder.encode(Loaded(info)))
    except BaseException as e:
        conn.send_bytes(_encoder.encode(Loaded(None, _format_error(e))))
        return
    _serve_steps(conn, runner, core_watch(settings, info))
    runner.shutdown()


class _Readable:
    """Whether a pipe end has a message (or its peer has closed it): ``Connection.poll`` with one
    ``select.poll`` registered once. The standard library's builds and registers a selector on every
    call: 3 us warm, about 30 in a CPU worker where the step's output projection has just streamed
    its weights through the caches, where this takes a few; the engine and the worker ask once a
    step each."""

    __slots__ = ("_conn", "_poll")

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._poll = select.poll() if hasattr(select, "poll") else None
        if self._poll is not None:
            self._poll.register(conn.fileno(), select.POLLIN)  # hang-ups and errors are always reported

    def __call__(self, timeout: float) -> bool:
        """``timeout``: seconds to wait (0: do not wait)."""
        if self._poll is None:
            return self._conn.poll(timeout)
        return bool(self._poll.poll(timeout * 1000))


def _serve_steps(conn: Connection, runner: ModelRunner, watch: CoreWatch | None = None) -> None:
    """Answer the engine's commands in order until a Shutdown or the end of the pipe.

    A step runs in two parts (:meth:`ModelRunner.launch`, :meth:`ModelRunner.finish`). Between
    them, the next command is taken if it is already in the pipe (the async strategy sends step N+1
    before step N's result is back) and the host work of it that needs nothing of step N is staged
    (:meth:`ModelRunner.stage`), so on an accelerator it runs while step N's device work does. The
    results are those of the plain order: staging refuses what could differ. ``watch``, where the
    worker is pinned to CPU cores, sheds those other processes keep busy, between steps."""
    early: WorkerCommand | ProfileControl | msgspec.DecodeError | None = None
    readable = _Readable(conn)
    profiler = TraceProfiler(lambda: getattr(runner.executor, "model", None))
    while True:
        if isinstance(early, msgspec.DecodeError):
            raise early  # a malformed command fails where the plain order would, after the reply before it
        msg = early if early is not None else _receive(conn)
        early = None
        if msg is None or isinstance(msg, Shutdown):
            return
        if isinstance(msg, InitCache | ProfileMemory | LoadLora):
            conn.send_bytes(_encoder.encode(_lifecycle(runner, msg)))
            continue
        if isinstance(msg, ProfileControl):
            profiler.control(msg)
            continue
        if isinstance(msg, ReadLora):  # read in the background while the steps go on; not answered
            runner.lora_reads.start(msg.key, msg.path)
            continue
        if watch is not None:
            watch.poll()
        with phase("launch"):
            launched = runner.launch(msg)
        if readable(0):
            early = _receive_early(conn)
            if isinstance(early, StepCommand):
                runner.stage(early)
        with phase("finish"):
            result = runner.finish(launched)
        conn.send_bytes(_encoder.encode(result))


def _receive(conn: Connection) -> WorkerCommand | ProfileControl | None:
    """The next command; None once the engine is gone (the pipe closed)."""
    try:
        msg: WorkerCommand | ProfileControl = _cmd_decoder.decode(conn.recv_bytes())
    except (EOFError, OSError):
        return None
    return msg


def _receive_early(conn: Connection) -> WorkerCommand | ProfileControl | msgspec.DecodeError:
    """The command waiting in the pipe, taken while a step is in flight: a closed pipe reads as a
    Shutdown and a malformed command as its error, both acted on after the step's reply."""
    try:
        msg = _receive(conn)
    except msgspec.DecodeError as e:
        return e
    return Shutdown() if msg is None else msg


def _lifecycle(runner: ModelRunner, msg: InitCache | ProfileMemory | LoadLora) -> InitDone | MemoryProfile:
    """Run a cache-planning or adapter-loading command; a failure is reported, not raised (the
    engine decides). A refused adapter (ValueError) is reported by its message alone: it is the
    client's answer."""
    try:
        if isinstance(msg, ProfileMemory):
            return profile_memory(runner, msg.num_tokens)
        if isinstance(msg, LoadLora):
            runner.install_lora(msg)
        else:
            runner.init_kv_cache(msg.num_blocks)
        return InitDone(True)
    except BaseException as e:
        if isinstance(msg, ProfileMemory):
            return MemoryProfile(ok=False, error=_format_error(e))
        refused = isinstance(msg, LoadLora) and isinstance(e, ValueError)
        return InitDone(False, f"ValueError: {e}" if refused else _format_error(e))


def _format_error(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}\n{''.join(traceback.format_exception(e)[-3:])}".strip()


class _GroupSetupError(RuntimeError):
    """The ranks cannot serve together; every rank reaches the same message."""


def _rank_main(
    conn: Connection | None,
    factory: Callable[[Any], Executor],
    settings: ServingSettings,
    rank: int,
    kv_link: tuple[Callable[[Any], Any], Connection] | None = None,
) -> None:
    """A tensor-parallel rank: join the group, load in agreement with the other ranks, then run rank
    0's commands until a Shutdown. A failed collective (a peer died or hung) ends the process with
    :data:`RANK_LOST_EXIT`, so the engine restarts the whole group. ``kv_link``: this rank's KV
    connector and its own pipe to the engine (disaggregated serving: each rank moves its shard)."""
    die_with_parent()
    layout = RankLayout.of(settings)
    own = settings.model_copy(update={"device": rank_device(settings.device, layout.local_index(rank))})
    try:
        group = join_group(own, rank)
        runner = _load_ranks(group, factory, own)
        runner.kv_link, runner.kv_rank = kv_link, rank
    except BaseException as e:
        why = str(e) if isinstance(e, _GroupSetupError) else f"rank {rank} could not join the group: {_format_error(e)}"
        _report(rank, why)
        if conn is not None:
            conn.send_bytes(_encoder.encode(Loaded(None, why)))
        os._exit(RANK_REFUSED_EXIT if isinstance(e, _GroupSetupError) else RANK_LOST_EXIT)
    if conn is not None:
        conn.send_bytes(_encoder.encode(Loaded(runner.info)))
    try:
        _serve_ranks(conn, group, runner, own)
    except Exception as e:
        _report(rank, f"the tensor-parallel group failed: {type(e).__name__}: {e}")
        os._exit(RANK_LOST_EXIT)
    runner.shutdown()
    group.close()


def _report(rank: int, why: str) -> None:
    print(f"pypto-serving worker rank {rank}: {why}", file=sys.stderr, flush=True)


def _load_ranks(group: RankGroup, factory: Callable[[Any], Executor], settings: ServingSettings) -> ModelRunner:
    """Load the executor on every rank; refuse ranks whose settings or loaded models differ."""
    problem = settings_mismatch(group, settings)
    if problem is not None:
        raise _GroupSetupError(problem)
    runner = None
    try:
        runner = ModelRunner(factory(settings), settings)
        payload = b"\x01" + _encoder.encode(runner.load())
    except BaseException as e:
        payload = b"\x00" + _format_error(e).encode()
    outcomes = group.all_gather_bytes(payload, setup=True)
    failed = [f"rank {r}: {o[1:].decode()}" for r, o in enumerate(outcomes) if o[:1] == b"\x00"]
    if failed or runner is None:
        raise _GroupSetupError("the executor failed to load on " + "; ".join(failed))
    problem = info_mismatch([msgspec.msgpack.decode(o[1:], type=ExecutorInfo) for o in outcomes])
    if problem is not None:
        raise _GroupSetupError(problem)
    return runner


def _serve_ranks(conn: Connection | None, group: RankGroup, runner: ModelRunner, settings: ServingSettings) -> None:
    """Rank 0 reads each command from the engine and broadcasts its bytes; every rank runs it in the
    same order; rank 0 answers. While the engine is idle rank 0 broadcasts an empty heartbeat, so
    the other ranks' wait never reaches the collectives' timeout."""
    heartbeat = min(5.0, settings.step_timeout / 4)
    profiler = TraceProfiler(lambda: getattr(runner.executor, "model", None))
    while True:
        raw = _next_command(conn, group, heartbeat)
        if not raw:
            continue
        msg = _cmd_decoder.decode(raw)
        if isinstance(msg, Shutdown):
            return
        if isinstance(msg, ProfileControl):  # rank 0's process is profiled, the others run on
            if conn is not None:
                profiler.control(msg)
            continue
        if isinstance(msg, ReadLora):  # every rank reads; not answered
            runner.lora_reads.start(msg.key, msg.path)
            continue
        reply, fatal = _run_on_ranks(group, runner, settings, msg)
        if conn is not None:
            conn.send_bytes(_encoder.encode(reply))
        if fatal is not None:
            raise _GroupSetupError(fatal)


def _next_command(conn: Connection | None, group: RankGroup, heartbeat: float) -> bytes:
    if conn is None:
        return group.broadcast_bytes()
    if not conn.poll(heartbeat):
        return group.broadcast_bytes(b"")
    try:
        raw = conn.recv_bytes()
    except (EOFError, OSError):  # the engine is gone: the ranks shut down with it
        raw = _encoder.encode(Shutdown())
    return group.broadcast_bytes(raw)


def _run_on_ranks(
    group: RankGroup, runner: ModelRunner, settings: ServingSettings, msg: WorkerCommand
) -> tuple[StepResult | InitDone | MemoryProfile, str | None]:
    """Run one command on this rank and combine the ranks' answers (rank 0's reply, and why the
    group must stop when the ranks' sampled tokens differ)."""
    if isinstance(msg, ProfileMemory):
        mine = _lifecycle(runner, msg)
        every = [msgspec.msgpack.decode(r, type=MemoryProfile) for r in group.all_gather_bytes(_encoder.encode(mine))]
        per_host = RankLayout.of(settings).per_node if runner.device.type == "cpu" else 1
        return combine_profiles(every, settings.gpu_memory_utilization or 1.0, per_host), None
    if isinstance(msg, InitCache | LoadLora):
        done = _lifecycle(runner, msg)
        dones = [msgspec.msgpack.decode(r, type=InitDone) for r in group.all_gather_bytes(_encoder.encode(done))]
        bad = [f"rank {r}: {d.error}" for r, d in enumerate(dones) if not d.ok]
        return (InitDone(False, "; ".join(bad)) if bad else InitDone(True)), None
    assert isinstance(msg, StepCommand)
    result = runner.step(msg)
    digests = group.all_gather_digest(step_digest(result))
    differ = [r for r, d in enumerate(digests) if d != digests[0]]
    if not differ:
        return result, None
    result.error = (
        f"tensor-parallel rank(s) {differ} sampled other tokens than rank 0 in step {msg.step_id}: "
        "the ranks' states diverged, so the worker group stops and restarts"
    )
    return result, result.error


def serve_node(factory: Callable[[Any], Executor], settings: ServingSettings) -> int:
    """Run this node's ranks of a multi-node tensor-parallel worker (``pypto-serving worker``) until
    node 0's engine shuts them down (0). A group that fails (a rank died, or node 0 restarted its
    worker) is joined again by fresh ranks, at most ``max_worker_restarts`` times per
    ``worker_restart_window``; past that: 1. Ranks refused at start-up (their settings or model
    differ from node 0's): 2, at once."""
    check_parallel_settings(settings, engine=False)
    ctx = mp.get_context("spawn")
    payload = settings.model_dump_json()
    restarts: deque[float] = deque()
    while True:
        procs = [_rank_process(ctx, factory, payload, r) for r in RankLayout.of(settings).local_ranks]
        with _worker_environment(settings):
            for p in procs:
                p.start()
        codes = _wait_ranks(procs)
        if not any(codes):
            return 0
        if RANK_REFUSED_EXIT in codes:
            logger.error("node 0's group refused this node's ranks (see the error above)")
            return 2
        now = time.monotonic()
        while restarts and now - restarts[0] > settings.worker_restart_window:
            restarts.popleft()
        if len(restarts) >= settings.max_worker_restarts:
            logger.error("ranks exited with %s; no restart left (max_worker_restarts)", codes)
            return 1
        restarts.append(now)
        logger.warning("ranks exited with %s: starting them again to rejoin node 0's group", codes)


def _rank_process(
    ctx: Any,
    factory: Callable[[Any], Executor],
    payload: str,
    rank: int,
    kv_link: tuple[Callable[[Any], Any], Connection] | None = None,
) -> BaseProcess:
    """A rank after rank 0: no pipe for commands, it follows rank 0's broadcasts (its KV connector,
    if any, has its own pipe to the engine)."""
    proc: BaseProcess = ctx.Process(
        target=_worker_main,
        args=(None, factory, payload, rank, kv_link, parent_logging()),
        daemon=True,
        name=f"pypto-worker-rank{rank}",
    )
    return proc


def _wait_ranks(procs: list[BaseProcess]) -> list[int]:
    """Wait for every rank to exit; once one fails, end the others (their group is gone)."""
    while any(p.is_alive() for p in procs):
        mp_wait([p.sentinel for p in procs if p.is_alive()], timeout=1.0)
        if any(p.exitcode not in (None, 0) for p in procs):
            for p in procs:
                if p.is_alive():
                    p.kill()
    for p in procs:
        p.join()
    return [p.exitcode or 0 for p in procs]


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
        kv_factory: Callable[[Any], Any] | None = None,
    ) -> None:
        """``kv_factory``: the KV connector's factory (disaggregated serving); every rank of the worker
        then runs one beside its caches and :attr:`kv_conns` (one pipe per rank, rank 0 first) carry
        their messages (:mod:`pypto_serving.kv_ledger`)."""
        self.mode = mode
        self.kv_conns: list[Connection] = []
        self.timeout = timeout
        self._pending: deque[StepResult] = deque()
        self._in_flight = 0
        self.dead_reason: str | None = None
        if getattr(settings, "tensor_parallel_size", 1) > 1 or getattr(settings, "nnodes", 1) > 1:
            check_parallel_settings(settings, engine=True)
        self._ranks: list[BaseProcess] = []  # tensor parallel: this node's ranks after rank 0
        self._parallel = getattr(settings, "tensor_parallel_size", 1) > 1
        self.interrupt: StepInterrupt | None = None  # ends a command of several forwards (not with ranks)
        # The in-process worker's profiler (a spawned one has its own); the engine's then stays off.
        self._profiler = TraceProfiler(lambda: getattr(getattr(self._runner, "executor", None), "model", None))
        self._proc: BaseProcess | None = None
        self._runner: ModelRunner | None = None
        if mode == "inproc":
            self._start_inproc(factory, settings, kv_factory)
            return
        _refuse_spawn_while_bootstrapping()
        self._start(factory, settings, kv_factory)
        try:
            raw = self._recv(timeout=max(timeout, 600.0), what="loading the model")
        except WorkerDiedError:
            if self._proc is not None and self._proc.exitcode == _UNGUARDED_MAIN_EXIT:
                raise WorkerError(_UNGUARDED_MAIN_HELP) from None
            raise
        loaded = msgspec.msgpack.decode(raw, type=Loaded)
        if loaded.error is not None or loaded.info is None:
            self.close()
            raise WorkerError(f"the executor failed to load: {loaded.error}")
        self.info = loaded.info

    def _start_inproc(
        self, factory: Callable[[Any], Executor], settings: Any, kv_factory: Callable[[Any], Any] | None
    ) -> None:
        """The executor in this process, run at ``submit`` time."""
        _pin_threads(settings)  # the in-process worker's torch ops are this process's
        runner = self._runner = ModelRunner(factory(settings), settings)
        self.interrupt = StepInterrupt()
        runner.interrupt = StepInterrupt(self.interrupt.word)  # its own seen, the same count
        if kv_factory is not None:
            kv_conn, child = mp.Pipe()
            self.kv_conns = [kv_conn]
            runner.kv_link = (kv_factory, child)
        self.info = runner.load()

    def _start(
        self, factory: Callable[[Any], Executor], settings: Any, kv_factory: Callable[[Any], Any] | None
    ) -> None:
        """Spawn the worker: rank 0 on the pipe, and with tensor parallelism this node's other ranks.
        One node without a ``master_port`` meets on a free port."""
        tp = settings.tensor_parallel_size > 1
        if tp and settings.master_port == 0:
            settings = settings.with_overrides(master_port=free_port(settings.master_addr))
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._readable = _Readable(self._conn)
        payload = settings.model_dump_json()
        local = list(RankLayout.of(settings).local_ranks) if tp else [0]
        kv_links = [self._kv_link(ctx, kv_factory) for _ in local]
        self.interrupt = None if tp else StepInterrupt.shared(ctx)
        proc: BaseProcess = ctx.Process(
            target=_worker_main,
            args=(child, factory, payload, 0, kv_links[0], parent_logging(), self.interrupt),
            daemon=True,
            name="pypto-worker",
        )
        self._proc = proc
        self._ranks = [_rank_process(ctx, factory, payload, r, link) for r, link in zip(local[1:], kv_links[1:])]
        with _worker_environment(settings):
            for p in (proc, *self._ranks):
                p.start()
        child.close()
        for link in kv_links:
            if link is not None:
                link[1].close()

    def _kv_link(
        self, ctx: Any, kv_factory: Callable[[Any], Any] | None
    ) -> tuple[Callable[[Any], Any], Connection] | None:
        """A rank's KV connector and the child end of its pipe (the engine keeps the other end)."""
        if kv_factory is None:
            return None
        conn, child = ctx.Pipe()
        self.kv_conns.append(conn)
        return kv_factory, child

    def profile(self, msg: ProfileControl) -> None:
        """Start or stop the worker's profile, in order with the steps submitted (nothing answers)."""
        if self._runner is not None:
            self._profiler.control(msg)
        elif self.dead_reason is None:
            with contextlib.suppress(BrokenPipeError, OSError):  # a dead worker is noticed by the steps
                self._conn.send_bytes(_encoder.encode(msg))

    def init_kv_cache(self, num_blocks: dict[str, int]) -> None:
        if self._runner is not None:
            self._runner.init_kv_cache(num_blocks)
            return
        self._conn.send_bytes(_encoder.encode(InitCache(num_blocks)))
        done = msgspec.msgpack.decode(self._recv(self.timeout, "allocating the KV cache"), type=InitDone)
        if not done.ok:
            raise WorkerError(f"the executor failed to allocate its KV cache: {done.error}")

    def read_lora(self, cmd: ReadLora) -> None:
        """Start the worker's background read of an adapter, in order with the steps (not answered:
        a step result lists it in ``loras_read`` once read)."""
        if self._runner is not None:
            self._runner.lora_reads.start(cmd.key, cmd.path)
        elif self.dead_reason is None:
            with contextlib.suppress(BrokenPipeError, OSError):  # a dead worker is noticed by the steps
                self._conn.send_bytes(_encoder.encode(cmd))

    def install_lora(self, cmd: LoadLora) -> InitDone:
        """Install an adapter between steps (none may be in flight); the answer says whether it did."""
        if self._in_flight:
            raise RuntimeError("install_lora() while steps are in flight")
        if self._runner is not None:
            done = _lifecycle(self._runner, cmd)
        else:
            self._conn.send_bytes(_encoder.encode(cmd))
            done = msgspec.msgpack.decode(self._recv(self.timeout, "loading a LoRA adapter"), type=InitDone)
        assert isinstance(done, InitDone)
        return done

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
        if self.interrupt is not None:
            cmd = msgspec.structs.replace(cmd, arrivals_seen=self.interrupt.seen)
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
        while not self._readable(min(0.5, timeout - waited)):
            waited += 0.5
            reason = self._exit_reason(what)
            if reason is not None:
                self._die(reason)
            if waited >= timeout:
                self._die(f"the worker did not answer within {timeout:.0f}s while {what} (step_timeout)")
        try:
            return self._conn.recv_bytes()
        except (EOFError, OSError):
            self._proc.join(timeout=1)
            self._die(self._exit_reason(what) or f"the worker process closed its pipe while {what}")
            raise  # unreachable

    def _exit_reason(self, what: str) -> str | None:
        """Why the worker cannot answer when one of its processes has exited, else None. With tensor
        parallelism it names the rank that died rather than one that only saw a peer go."""
        assert self._proc is not None
        procs = [self._proc, *self._ranks]
        dead = [(r, p) for r, p in enumerate(procs) if not p.is_alive()]
        if not dead:
            return None
        for _, p in dead:
            p.join(timeout=1)  # reap it, so the exit code is known
        rank, proc = next(((r, p) for r, p in dead if p.exitcode != RANK_LOST_EXIT), dead[0])
        if not self._parallel:
            return f"the worker process died (exit code {proc.exitcode}) while {what}"
        if proc.exitcode == RANK_LOST_EXIT:
            return (
                f"the tensor-parallel group lost a rank while {what}: rank {rank}'s collectives failed "
                "(a rank on another node died, stopped answering, or the ranks diverged)"
            )
        return f"tensor-parallel rank {rank} of the worker died (exit code {proc.exitcode}) while {what}"

    def _die(self, reason: str) -> None:
        self.dead_reason = reason
        self._in_flight = 0
        self._kill_all()
        raise WorkerDiedError(reason)

    def _kill_all(self) -> None:
        """Kill every process of the worker that still runs and reap them all (no zombie left)."""
        procs = [p for p in (self._proc, *self._ranks) if p is not None]
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=5)

    def check_alive(self) -> str | None:
        """Why the worker is gone, or None while it runs. Cheap (a non-blocking ``waitpid`` per
        process), so the engine calls it while idle to notice a dead worker before the next request."""
        if self.dead_reason is not None:
            return self.dead_reason
        if self._proc is None:
            return None
        reason = self._exit_reason("idle")
        if reason is None:
            return None
        self.dead_reason = reason
        self._in_flight = 0
        self._kill_all()
        return reason

    @property
    def pids(self) -> list[int]:
        """The pids of this node's worker processes, rank 0 first."""
        return [p.pid for p in (self._proc, *self._ranks) if p is not None and p.pid is not None]

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
        for p in (self._proc, *self._ranks):  # rank 0 passes the Shutdown on to the other ranks
            p.join(timeout=10)
        self._kill_all()
        self._conn.close()
        self._proc = None
        self._ranks = []
