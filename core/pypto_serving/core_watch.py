"""Which of a pinned CPU worker's cores it computes on, when other processes share them.

An OpenMP parallel region ends when its slowest thread does, so one compute thread that shares its
core with a busy process slows every region of a step: a concurrency-1 decode step of the small
Qwen3 shape on two cores took 1.9-2.3x as long beside a busy loop, where one thread on the free core
alone took 1.06x (``docs/benchmarks.md``). Pinned threads make it worse in one way (the kernel
cannot move our thread off the shared core) and better in another (nothing migrates when the cores
are quiet), so the worker stays pinned and steps aside instead:

* Every ``interval`` seconds, :class:`CoreWatch` reads how much of each of its cores other processes
  used: ``/proc/stat``'s busy time of the core (steal included: a hypervisor's other guests count)
  less the time this process's threads ran there.
* :func:`next_shed` turns those shares into the set of shed cores: a core others used for more than
  ``shed_above`` of the window is shed; a shed core is taken back once others use less than
  ``resume_below`` of it (the gap keeps a core from flapping); a window in which every core is busy
  changes nothing (no core is free to move to).
* The worker then runs one thread per kept core. OpenMP's team thread ``p`` was bound to ``cores[p]``
  by ``OMP_PLACES`` when it started, and a team of ``k`` threads is made of the threads of places
  ``0..k-1``; so thread ``p`` is re-pinned to the ``p``-th kept core and the thread count lowered to
  ``k``. Taking every core back restores the original binding.

Results do not depend on the thread count on the executors' CPU paths (their logits are bitwise
equal at one and two threads, tested), so shedding changes the time of a step, not its tokens.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

__all__ = ["CoreWatch", "next_shed"]

log = logging.getLogger(__name__)


def next_shed(
    others: dict[int, float], shed: frozenset[int], *, shed_above: float, resume_below: float
) -> frozenset[int]:
    """The cores to shed after a window in which other processes used ``others[core]`` of each core.

    A kept core others used more than ``shed_above`` of is shed; a shed core is taken back once they
    use less than ``resume_below`` of it. A window in which every core is that busy changes nothing:
    moving the work helps only where a core is free, and two workers sharing the same cores would
    otherwise shed and take back cores in step with each other.

    :param others: per pinned core, the fraction of the window (0..1) other processes ran on it.
    :param shed: the cores shed now (never all of them).
    :param shed_above: a kept core others used more than this is shed.
    :param resume_below: a shed core others used less than this is taken back.
    :return: the new shed set, never every core.
    """
    new = {c for c, share in others.items() if share > shed_above or (c in shed and share >= resume_below)}
    return shed if len(new) == len(others) else frozenset(new)


def _clock_ticks() -> int:
    return os.sysconf("SC_CLK_TCK")


def read_core_busy() -> dict[int, int]:
    """Busy clock ticks per CPU since boot (``/proc/stat``: everything but idle and iowait)."""
    busy: dict[int, int] = {}
    with open("/proc/stat") as f:
        for line in f:
            if not (line.startswith("cpu") and line[3].isdigit()):
                continue
            name, *values = line.split()
            ticks = [int(v) for v in values]
            busy[int(name[3:])] = sum(ticks) - ticks[3] - (ticks[4] if len(ticks) > 4 else 0)
    return busy


def read_own_threads(pid: int | None = None) -> dict[int, tuple[int, int]]:
    """Per thread of this process (of process ``pid`` if given): the CPU it last ran on and the clock
    ticks it has run (``/proc/<pid>/task/*/stat``); a pinned thread runs on one CPU only, so its CPU
    is exact."""
    proc = "self" if pid is None else str(pid)
    own: dict[int, tuple[int, int]] = {}
    for tid in os.listdir(f"/proc/{proc}/task"):
        try:
            with open(f"/proc/{proc}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended between the listing and the read
            continue
        # After the name comes the state, field 3 of proc(5), so field n is fields[n - 3].
        own[int(tid)] = (int(fields[39 - 3]), int(fields[14 - 3]) + int(fields[15 - 3]))
    return own


def _own_per_core(now: dict[int, tuple[int, int]], before: dict[int, tuple[int, int]]) -> dict[int, int]:
    """Ticks this process ran per CPU between two reads, each thread's on the CPU it is on now (a
    re-pinned thread's earlier time stays where it was spent)."""
    per_core: dict[int, int] = {}
    for tid, (cpu, ticks) in now.items():
        per_core[cpu] = per_core.get(cpu, 0) + ticks - before.get(tid, (cpu, 0))[1]
    return per_core


@dataclass(slots=True)
class CoreWatch:
    """Sheds the cores of ``cores`` that other processes keep busy, and takes them back (module doc).

    :param cores: the worker's cores in ``OMP_PLACES`` order (place ``p`` is ``cores[p]``).
    :param interval: seconds between two reads; :meth:`poll` between steps does nothing sooner.
    """

    cores: list[int]
    interval: float = 0.5
    shed_above: float = 0.4
    resume_below: float = 0.15
    clock: Callable[[], float] = time.monotonic
    read_busy: Callable[[], dict[int, int]] = read_core_busy
    read_own: Callable[[], dict[int, tuple[int, int]]] = read_own_threads
    shed: frozenset[int] = frozenset()
    _team: list[int] | None = None
    _last: tuple[float, dict[int, int], dict[int, tuple[int, int]]] | None = None
    _tick_seconds: float = field(default_factory=lambda: 1.0 / _clock_ticks())
    _disabled: bool = False

    def poll(self) -> None:
        """Between steps: read the cores' use if ``interval`` has passed, and shed or take back cores."""
        now = self.clock()
        if self._disabled or (self._last is not None and now - self._last[0] < self.interval):
            return
        try:
            busy, own = self.read_busy(), self.read_own()
        except (OSError, ValueError, IndexError) as e:  # no procfs, or one laid out otherwise
            self._disabled = True
            log.warning("reading the cores' use failed (%s): busy cores are not shed", e)
            return
        last, self._last = self._last, (now, busy, own)
        if last is None:
            return
        span = (now - last[0]) / self._tick_seconds
        mine = _own_per_core(own, last[2])
        others = {c: max(0, busy.get(c, 0) - last[1].get(c, 0) - mine.get(c, 0)) / span for c in self.cores}
        shed = next_shed(others, self.shed, shed_above=self.shed_above, resume_below=self.resume_below)
        if shed != self.shed:
            self._apply(shed, others)

    def kept(self) -> list[int]:
        """The cores computed on now, in place order."""
        return [c for c in self.cores if c not in self.shed]

    def _apply(self, shed: frozenset[int], others: dict[int, float]) -> None:
        team = self._team if self._team is not None else self._find_team()
        if team is None:
            self._disabled = True
            log.warning("worker threads not found one per core of %s: busy cores are not shed", self.cores)
            return
        self._team = team
        try:
            self._pin(team, [c for c in self.cores if c not in shed])
        except OSError as e:  # a thread gone, or a core taken from this process's cpuset meanwhile
            self._disabled = True
            log.warning("re-pinning the worker threads failed (%s): busy cores are no longer shed", e)
            with contextlib.suppress(OSError):
                self._pin(team, self.cores)
            self.shed = frozenset()
            return
        self.shed = shed
        kept = self.kept()
        log.info(
            "worker computes on cores %s (others used %s)",
            kept,
            ", ".join(f"core {c}: {others[c]:.0%}" for c in self.cores),
        )

    def _pin(self, team: list[int], kept: list[int]) -> None:
        """Team thread ``p`` onto ``kept[p]`` (the others back on their own places), ``len(kept)`` threads."""
        for p, tid in enumerate(team):
            os.sched_setaffinity(tid, {kept[p] if p < len(kept) else self.cores[p]})
        torch.set_num_threads(len(kept))

    def _find_team(self) -> list[int] | None:
        """The thread ids of OpenMP's team, place order: this thread (the master, place 0) and, for
        every later place, the one thread pinned to that core alone; None unless each is found once."""
        # OpenMP starts its threads at the first parallel region that wants them; an executor whose
        # ops are all too small to split may not have run one yet. A fill of a few grains per thread does.
        torch.zeros(len(self.cores) << 16)
        pinned: dict[int, list[int]] = {}
        for name in os.listdir("/proc/self/task"):
            tid = int(name)
            try:
                mask = os.sched_getaffinity(tid)
            except OSError:
                continue
            if len(mask) == 1:
                pinned.setdefault(next(iter(mask)), []).append(tid)
        team = [threading.get_native_id()]
        for core in self.cores[1:]:
            found = pinned.get(core, [])
            if len(found) != 1:
                return None
            team.append(found[0])
        return team
