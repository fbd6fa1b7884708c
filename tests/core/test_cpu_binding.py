"""``engine_cpu_bind``: the serve command's server and engine-core processes on the cores the pinned
workers leave (``worker_cpu_bind``), decided once in the server so that a narrowed process still
spawns each worker on its own cores."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from pypto_serving import ServingSettings
from pypto_serving.cpu_binding import engine_cores
from pypto_serving.server.data_parallel import replica_settings
from pypto_serving.worker import resolve_cpu_binds

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def eight_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    for name in ("OMP_PLACES", "OMP_PROC_BIND"):
        monkeypatch.delenv(name, raising=False)


def test_engine_cores_are_what_the_pinned_workers_leave(eight_cores: None) -> None:
    assert engine_cores("auto", [[4, 5, 6, 7]]) == [0, 1, 2, 3]
    assert engine_cores("auto", [[2, 3], [6, 7]]) == [0, 1, 4, 5]
    assert engine_cores("auto", [[4, 5], None]) is None  # a worker anywhere: no core is free of it
    assert engine_cores("auto", []) is None
    assert engine_cores("auto", [list(range(8))]) is None  # nothing left
    assert engine_cores("auto", [list(range(1, 8))]) is None  # one core: the server and core would share it
    assert engine_cores("auto", [list(range(2, 8))]) == [0, 1]
    assert engine_cores("off", [[4]]) is None
    assert engine_cores("1-2,5", [None]) == [1, 2, 5]


def _binds(settings: list[ServingSettings]) -> list[tuple[str, str]]:
    return [(s.worker_cpu_bind, s.engine_cpu_bind) for s in settings]


def test_the_server_resolves_every_auto_choice_once(eight_cores: None, monkeypatch: pytest.MonkeyPatch) -> None:
    base = ServingSettings(device="cpu", worker_threads=4)
    assert _binds(replica_settings(base, 1)) == [("4,5,6,7", "0,1,2,3")]
    assert _binds(resolve_cpu_binds(replica_settings(base, 1))) == [("4,5,6,7", "0,1,2,3")]  # stays as decided
    assert _binds(replica_settings(base.with_overrides(worker_threads=2), 3)) == [
        ("2,3", "0,1"),
        ("4,5", "0,1"),
        ("6,7", "0,1"),
    ]
    assert _binds(replica_settings(base.with_overrides(worker_threads=8), 1)) == [("0,1,2,3,4,5,6,7", "off")]
    assert _binds(replica_settings(base.with_overrides(worker_threads=7), 1)) == [("1,2,3,4,5,6,7", "off")]
    assert _binds(replica_settings(base.with_overrides(worker_threads=3), 3)) == [("off", "off")] * 3
    assert _binds(replica_settings(base.with_overrides(worker_mode="inproc"), 1)) == [("4,5,6,7", "off")]
    assert _binds(replica_settings(base.with_overrides(engine_cpu_bind="off"), 1)) == [("4,5,6,7", "off")]
    assert _binds(replica_settings(base.with_overrides(engine_cpu_bind="1"), 1)) == [("4,5,6,7", "1")]
    assert _binds(replica_settings(base.with_overrides(worker_cpu_bind="off"), 1)) == [("off", "off")]
    assert _binds(replica_settings(base.with_overrides(tensor_parallel_size=2), 1)) == [("off", "off")]
    monkeypatch.setenv("OMP_PLACES", "{0},{1}")  # the environment places the worker's threads: not ours
    assert _binds(replica_settings(base, 1)) == [("4,5,6,7", "off")]
    with pytest.raises(ValueError, match="engine_cpu_bind"):
        ServingSettings(engine_cpu_bind="first")


_PIN_SCRIPT = """
import json, os, subprocess, sys, threading, time
from pypto_serving.cpu_binding import on_cores, pin_process

def masks():
    return sorted({{tuple(sorted(os.sched_getaffinity(int(t)))) for t in os.listdir("/proc/self/task")}})

first, last = {first}, {last}
threading.Thread(target=time.sleep, args=(30,), daemon=True).start()
out = {{"before": masks()}}
pin_process([first], "engine_cpu_bind")
out["pinned"] = masks()
try:
    pin_process([first, last + 1000], "engine_cpu_bind")
except ValueError as e:
    out["refused"] = str(e)
out["after_refusal"] = masks()
child = [sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"]
with on_cores([last], "worker_cpu_bind"):
    out["spawned_on"] = subprocess.run(child, capture_output=True, text=True, check=True).stdout.strip()
out["after_spawn"] = masks()
out["later_thread"] = []
t = threading.Thread(target=lambda: out["later_thread"].extend(sorted(os.sched_getaffinity(0))))
t.start(); t.join()
print(json.dumps(out))
"""


def test_a_pinned_process_keeps_every_thread_there_and_spawns_a_worker_on_its_cores() -> None:
    """In a child process (pinning this one would pin the test run): every thread moves, threads
    started later inherit the mask, a core the kernel refuses moves nothing, and a process spawned
    under ``on_cores`` starts on the worker's cores while the spawning thread returns to its own."""
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        pytest.skip("needs two cores")
    first, last = allowed[0], allowed[-1]
    script = textwrap.dedent(_PIN_SCRIPT).format(first=first, last=last)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stderr
    out: dict[str, Any] = json.loads(run.stdout.splitlines()[-1])
    assert out["before"] == [allowed]
    assert out["pinned"] == [[first]]
    assert out["refused"] == f"engine_cpu_bind names cores this process may not run on: [{last + 1000}]"
    assert out["after_refusal"] == [[first]]
    assert out["spawned_on"] == f"[{last}]"
    assert out["after_spawn"] == [[first]]
    assert out["later_thread"] == [first]
