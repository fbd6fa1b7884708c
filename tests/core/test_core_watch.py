"""A pinned CPU worker sheds the cores other processes keep busy, and takes them back
(``pypto_serving.core_watch``, ``worker_shed_busy_cores``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from pypto_serving.core_watch import next_shed

TWO_CORES = sorted(os.sched_getaffinity(0))[:2]
needs_two_cores = pytest.mark.skipif(len(TWO_CORES) < 2, reason="needs two cores to shed one")


@pytest.mark.parametrize(
    ("others", "shed", "want"),
    [
        ({0: 0.05, 1: 0.0}, set(), set()),  # our own engine's share stays under the bar
        ({0: 0.55, 1: 0.0}, set(), {0}),  # a busy neighbour on core 0
        ({0: 0.30, 1: 0.0}, {0}, {0}),  # shed, and others still use more than the resume bar
        ({0: 0.10, 1: 0.0}, {0}, set()),  # the neighbour left
        ({0: 0.30, 1: 0.0}, set(), set()),  # between the bars a kept core stays kept
        ({0: 0.90, 1: 0.70}, set(), set()),  # both busy: no free core to move to, nothing changes
        ({0: 0.55, 1: 0.55}, set(), set()),  # two workers on the same cores stay where they are
        ({0: 0.95, 1: 0.60}, {0}, {0}),  # a neighbour beside us on the kept core too: still nothing
        ({0: 0.0, 1: 0.9, 2: 0.6, 3: 0.2}, {3}, {1, 2, 3}),
    ],
)
def test_next_shed(others: dict[int, float], shed: set[int], want: set[int]) -> None:
    assert next_shed(others, frozenset(shed), shed_above=0.4, resume_below=0.15) == want


@contextmanager
def _busy_loop_on(core: int) -> Iterator[None]:
    """A CPU-bound process pinned to ``core``."""
    code = f"import os\nos.sched_setaffinity(0, {{{core}}})\nwhile True: pass"
    proc = subprocess.Popen([sys.executable, "-c", code])
    try:
        yield
    finally:
        proc.kill()
        proc.wait(10)


_WATCHED = textwrap.dedent(
    """
    import json, os, sys, threading, time, torch
    from pypto_serving.core_watch import CoreWatch, _own_per_core, read_own_threads

    # A neighbour on the core a command names, at 100 % from then on: its ticks added to this
    # process's own in the cores' busy time, so the watch sees exactly that share whatever else runs.
    neighbour = {"core": None, "ticks": {}, "since": time.monotonic(), "own": {}, "threads": {}}
    hz = os.sysconf("SC_CLK_TCK")

    def read_busy():
        now = time.monotonic()
        if neighbour["core"] is not None:
            core = neighbour["core"]
            neighbour["ticks"][core] = neighbour["ticks"].get(core, 0.0) + (now - neighbour["since"]) * hz
        neighbour["since"] = now
        threads = read_own_threads()
        for cpu, ticks in _own_per_core(threads, neighbour["threads"]).items():  # as the watch counts them
            neighbour["own"][cpu] = neighbour["own"].get(cpu, 0) + ticks
        neighbour["threads"] = threads
        cores = set(neighbour["own"]) | set(neighbour["ticks"])
        return {c: neighbour["own"].get(c, 0) + neighbour["ticks"].get(c, 0.0) for c in cores}

    watch = CoreWatch(cores=json.loads(sys.argv[1]), interval=0.2, read_busy=read_busy)
    x = torch.randn(1 << 20)
    for line in sys.stdin:
        seconds, core = json.loads(line)
        read_busy()  # the old neighbour's time up to now
        neighbour["core"] = core
        end = time.monotonic() + seconds
        while time.monotonic() < end:  # steps: a parallel region each, then the poll between them
            x.mul_(1.0)
            watch.poll()
        masks = {t: sorted(os.sched_getaffinity(int(t))) for t in os.listdir("/proc/self/task")}
        me = str(threading.get_native_id())
        print(json.dumps({"kept": watch.kept(), "threads": torch.get_num_threads(), "master": masks[me],
                          "masks": sorted(m for t, m in masks.items() if t != me)}), flush=True)
    """
)


@needs_two_cores
def test_a_busy_core_is_shed_and_taken_back() -> None:
    """In a process bound like a spawned worker (OMP_PLACES one core per place, close), a neighbour
    busy on the first core moves the computation onto the second, one thread (OpenMP's team really
    re-pinned); once it ends, both cores and the original binding come back. The neighbour's time is
    added to the cores' busy time the watch reads, so other load on the machine cannot move the result."""
    first, second = TWO_CORES
    env = dict(os.environ, OMP_PLACES=f"{{{first}}},{{{second}}}", OMP_PROC_BIND="close", OMP_NUM_THREADS="2")
    proc = subprocess.Popen(
        [sys.executable, "-c", _WATCHED, json.dumps(TWO_CORES)],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )

    def run(seconds: float, neighbour: int | None) -> dict[str, Any]:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(json.dumps([seconds, neighbour]) + "\n")
        proc.stdin.flush()
        return dict(json.loads(proc.stdout.readline()))

    try:
        quiet = run(0.7, None)
        assert quiet["kept"] == TWO_CORES and quiet["threads"] == 2 and quiet["master"] == [first]
        busy = run(0.7, first)
        assert busy["kept"] == [second] and busy["threads"] == 1 and busy["master"] == [second]
        back = run(0.7, None)
        assert back["kept"] == TWO_CORES and back["threads"] == 2 and back["master"] == [first]
        assert [second] in back["masks"]  # the team's second thread is on its own core again
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(10)


@needs_two_cores
def test_another_process_on_a_core_reads_as_its_share() -> None:
    """``/proc/stat`` less this process's threads: a busy loop pinned to a core is most of that core."""
    from pypto_serving.core_watch import read_core_busy

    first = TWO_CORES[0]
    with _busy_loop_on(first):
        time.sleep(0.3)
        before, start = read_core_busy()[first], time.monotonic()
        time.sleep(0.5)
        ticks, span = read_core_busy()[first] - before, (time.monotonic() - start) * os.sysconf("SC_CLK_TCK")
    assert ticks / span > 0.6  # this test sleeps: what ran there was the loop (and any other load)


def _machine_is_quiet() -> bool:
    """Whether no core of this process's was more than a fifth busy over a quarter second."""
    from pypto_serving.core_watch import read_core_busy

    before = read_core_busy()
    time.sleep(0.25)
    after, span = read_core_busy(), 0.25 * os.sysconf("SC_CLK_TCK")
    return all((after[c] - before[c]) / span < 0.2 for c in TWO_CORES)


@contextmanager
def _third_party_share(core: int, worker: int) -> Iterator[list[float]]:
    """The share of ``core`` that processes other than this one and ``worker`` used while the block
    ran, at least (the yielded list holds it afterwards): the core's busy time less the worker's
    threads' time there (pinned, so exact) and less all of this process's time wherever it ran."""
    from pypto_serving.core_watch import _own_per_core, read_core_busy, read_own_threads

    share: list[float] = []
    busy, threads, start, mine = read_core_busy()[core], read_own_threads(worker), time.monotonic(), os.times()
    yield share
    worker_there = _own_per_core(read_own_threads(worker), threads).get(core, 0)
    after = os.times()
    hz = os.sysconf("SC_CLK_TCK")
    ours = (after.user + after.system - mine.user - mine.system) * hz
    span = (time.monotonic() - start) * hz
    share.append((read_core_busy()[core] - busy - worker_there - ours) / span)


@needs_two_cores
def test_the_spawned_worker_sheds_a_busy_core(make_llm: Callable[..., Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """``worker_shed_busy_cores`` reaches the spawned worker pinned to two cores: beside a busy loop on
    its first core its compute thread moves to the second; with 'auto' and the fake executor (which
    does not promise logits independent of the thread count) it stays put. Real load decides here, so
    on a machine already busy (another test run beside this one) the test is skipped."""
    from pypto_serving import SamplingParams

    if not _machine_is_quiet():
        pytest.skip("other processes keep this machine's cores busy: which core the worker keeps is theirs to decide")
    for name in ("OMP_PLACES", "OMP_PROC_BIND"):
        monkeypatch.delenv(name, raising=False)
    first, second = TWO_CORES
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    for shed in (True, False):
        llm = make_llm(
            worker_mode="process",
            worker_cpu_bind=f"{first},{second}",
            worker_threads=2,
            worker_shed_busy_cores="on" if shed else "auto",
        )
        pid = llm.engine.worker._proc.pid
        with _busy_loop_on(first), _third_party_share(second, pid) as third_party:
            # Shed within a few half-second windows; left alone for three of them when off.
            deadline = time.monotonic() + (8 if shed else 1.6)
            while time.monotonic() < deadline:
                llm.generate([[1, 2, 3]], params, use_tqdm=False)
                if os.sched_getaffinity(pid) == {second}:
                    break
        kept = os.sched_getaffinity(pid)
        llm.shutdown()
        if shed and kept != {second} and third_party[0] > 0.15:
            # A window in which both cores are busy sheds nothing (test_next_shed), rightly.
            pytest.skip(f"another process used {third_party[0]:.0%} of the second core meanwhile")
        assert kept == ({second} if shed else {first})


@pytest.mark.parametrize(
    ("setting", "invariant", "places", "device", "watched"),
    [
        ("auto", True, "{0},{1}", "cpu", True),
        ("auto", False, "{0},{1}", "cpu", False),  # the executor does not promise the same logits
        ("on", False, "{0},{1}", "cpu", True),
        ("off", True, "{0},{1}", "cpu", False),
        ("auto", True, "{0}", "cpu", False),  # one core: nothing to shed
        ("auto", True, "{0:2}", "cpu", False),  # the user's places of several cores each
        ("auto", True, None, "cpu", False),  # not pinned (worker_cpu_bind = "off")
        ("auto", True, "{0},{1}", "cuda", False),
    ],
)
def test_which_workers_watch_their_cores(
    monkeypatch: pytest.MonkeyPatch, setting: str, invariant: bool, places: str | None, device: str, watched: bool
) -> None:
    import torch

    from pypto_serving import ExecutorInfo
    from pypto_serving.config import ServingSettings
    from pypto_serving.worker import core_watch

    if places is None:
        monkeypatch.delenv("OMP_PLACES", raising=False)
    else:
        monkeypatch.setenv("OMP_PLACES", places)
    monkeypatch.setenv("OMP_PROC_BIND", "close")
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1 if places == "{0}" else 2)
    info = ExecutorInfo(cache_groups=[], vocab_size=8, max_model_len=8, thread_count_invariant=invariant)
    watch = core_watch(ServingSettings(worker_shed_busy_cores=setting, device=device), info)
    assert (watch is not None) == watched
    if watch is not None:
        assert watch.cores == [0, 1]


def test_a_failed_re_pinning_leaves_every_core_and_stops_watching(monkeypatch: pytest.MonkeyPatch) -> None:
    """A team thread that cannot be re-pinned (gone, or its core taken from the cpuset) never fails a
    step: the watch puts every core back, says so, and stops."""
    import torch

    from pypto_serving import core_watch

    ticks = {"now": 0.0}
    busy = {0: 0.0, 1: 0.0}

    def read_busy() -> dict[int, int]:
        return {c: int(v) for c, v in busy.items()}

    calls: list[tuple[int, set[int]]] = []

    def refuse(tid: int, mask: set[int]) -> None:
        calls.append((tid, set(mask)))
        raise OSError(3, "No such process")

    monkeypatch.setattr(core_watch.os, "sched_setaffinity", refuse)
    threads = torch.get_num_threads()
    watch = core_watch.CoreWatch(
        cores=[0, 1],
        clock=lambda: ticks["now"],
        read_busy=read_busy,
        read_own=lambda: {},
        _team=[101, 102],  # the team's thread ids as found (no such threads: the re-pinning fails)
        _tick_seconds=0.01,
    )
    watch.poll()
    ticks["now"], busy[0] = 1.0, 90.0  # others ran 90 of the second's 100 ticks on core 0
    watch.poll()
    assert calls and watch.kept() == [0, 1] and torch.get_num_threads() == threads
    ticks["now"], busy[0] = 2.0, 180.0
    before = len(calls)
    watch.poll()
    assert len(calls) == before  # stopped watching


def test_an_unreadable_proc_stops_watching_without_failing_the_step() -> None:
    from pypto_serving.core_watch import CoreWatch

    def unreadable() -> dict[int, int]:
        raise FileNotFoundError(2, "No such file or directory", "/proc/stat")

    watch = CoreWatch(cores=[0, 1], read_busy=unreadable)
    watch.poll()  # no exception: the step goes on
    assert watch.kept() == [0, 1]
