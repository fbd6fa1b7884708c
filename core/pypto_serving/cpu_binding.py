"""Which cores the serving processes run on: a CPU worker's compute threads on cores of their own
(``worker_cpu_bind``), the ``serve`` command's server and engine-core processes on the others
(``engine_cpu_bind``), so that neither preempts the other's threads.

Linux keeps an affinity mask per thread, and a child process starts with the mask of the thread that
spawned it. So a serving process keeps off the worker's cores by narrowing every one of its threads
(:func:`pin_process`), and it spawns a worker from a thread moved onto the worker's cores for the
moment of the spawn (:func:`on_cores`): the worker's OpenMP runtime takes its places from the mask it
starts with. Both ask the kernel whether the cores may be used, which is the one authority on it (a
narrowed process may still move a thread onto any core its cgroup allows).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Collection, Iterator, Sequence

__all__ = ["MIN_ENGINE_CORES", "core_list", "engine_cores", "on_cores", "pin_process"]

logger = logging.getLogger(__name__)

#: Cores ``engine_cpu_bind = "auto"`` needs left to pin the server and engine cores: on one they
#: wait on each other, and on a busy machine the engine core then notices a dead worker late (a
#: request sent 50 ms after an idle worker's kill ran a step on it in a test beside another job).
MIN_ENGINE_CORES = 2


def core_list(spec: str) -> list[int]:
    """``'0-3,6'`` -> ``[0, 1, 2, 3, 6]``."""
    cores: list[int] = []
    for part in spec.split(","):
        first, _, last = part.partition("-")
        cores.extend(range(int(first), int(last or first) + 1))
    return cores


def engine_cores(spec: str, workers: Sequence[Sequence[int] | None]) -> list[int] | None:
    """The cores ``engine_cpu_bind = spec`` gives the server and engine-core processes, or None.

    ``auto``: the cores this process may use that none of ``workers`` (each worker's pinned cores,
    None for one that is not pinned) takes; None where a worker is not pinned (its threads may run
    anywhere) or fewer than :data:`MIN_ENGINE_CORES` are left. ``off``: None. A list: those cores.
    """
    if spec == "off":
        return None
    if spec != "auto":
        return core_list(spec)
    if not workers or any(w is None for w in workers):
        return None
    taken = {core for w in workers for core in w or ()}
    rest = sorted(set(os.sched_getaffinity(0)) - taken)
    return rest if len(rest) >= MIN_ENGINE_CORES else None


@contextlib.contextmanager
def on_cores(cores: Collection[int], setting: str) -> Iterator[None]:
    """The calling thread on ``cores`` meanwhile (a process it spawns then starts there), then back on
    the cores it had.

    :param setting: the setting that named the cores, for the error.
    :raises ValueError: a core the kernel does not let this process run on.
    """
    before = os.sched_getaffinity(0)
    _move(0, cores, setting, before)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def pin_process(cores: Collection[int], setting: str) -> None:
    """Every thread of this process on ``cores``; threads started later inherit the mask.

    :raises ValueError: a core the kernel does not let this process run on (nothing moved).
    """
    with on_cores(cores, setting):
        pass
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(tid), cores)
    logger.info("%s: this process (pid %d) runs on cores %s", setting, os.getpid(), ",".join(map(str, cores)))


def _move(tid: int, cores: Collection[int], setting: str, before: Collection[int]) -> None:
    # The kernel keeps the cores of a mask it may use and refuses only a mask with none of them, so
    # the mask read back is what says whether every core was usable.
    try:
        os.sched_setaffinity(tid, cores)
        got = os.sched_getaffinity(tid)
    except (OSError, ValueError, OverflowError):  # a number past any CPU set Python can build
        got = set()
    if got != set(cores):
        os.sched_setaffinity(tid, before)
        outside = sorted(set(cores) - got)
        raise ValueError(f"{setting} names cores this process may not run on: {outside}")
