"""Shared fixtures: the fake executor plugin, an engine factory that always shuts down, and the
``requires_plugin(name)`` marker."""

from __future__ import annotations

import importlib.util
import os
import re
from collections.abc import Callable, Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest

# The tests compare float32 runs with float32 references (transformers, brute-force enumerations);
# on a CPU with AVX512-BF16 or AMX `dtype = "auto"` runs a float32 checkpoint in bfloat16
# (pypto_kernels.auto_dtype), so the suite, and the servers and workers it starts, run float32 unless a
# test names a dtype (the tests of auto's choice pass dtype="auto" and stand in for the CPU's flags).
os.environ.setdefault("PYPTO_SERVING_DTYPE", "float32")

# Plugin entry-point names and the module each one lives in (either installed counts).
_PLUGIN_MODULES = {
    "sync_sched": "pypto_serving_sync_sched",
    "async_sched": "pypto_serving_async_sched",
    "qwen": "pypto_serving_qwen",
    "deepseek_mtp": "pypto_serving_deepseek_mtp",
}


def plugin_installed(name: str) -> bool:
    """True when an entry point ``name`` of group ``pypto_serving`` or the module behind it exists."""
    if any(ep.name == name for ep in metadata.entry_points(group="pypto_serving")):
        return True
    module = _PLUGIN_MODULES.get(name, name)
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread() -> Iterator[None]:
    """The test models are tiny: intra-op threads only add OpenMP wake-up stalls (measured tens of ms
    per op on a busy 2-core runner). Worker processes spawned meanwhile read OMP_NUM_THREADS."""
    import os

    import torch

    threads, env = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"
    yield
    torch.set_num_threads(threads)
    if env is None:
        os.environ.pop("OMP_NUM_THREADS", None)
    else:
        os.environ["OMP_NUM_THREADS"] = env


# The plugins whose test directory a `*-sync` tox env owns (it runs them with that plugin and sync).
_SINGLE_PLUGIN_DIRS = ("qwen", "deepseek_mtp")
# Skip reasons that mean "a distribution the `all` env has is missing here".
_MISSING_DIST = re.compile(r"pypto_serving_|plugin \w+ not installed|schemathesis|pypto-serving-")


def _required_plugins(item: pytest.Item) -> list[str]:
    return [str(a) for m in item.iter_markers(name="requires_plugin") for a in m.args]


def _about(item: pytest.Item, word: str) -> bool:
    """The test is about ``word`` (a strategy): its id names it or it requires a plugin named so."""
    return word in item.nodeid.lower() or any(word in p for p in _required_plugins(item))


def _single_env_plugin(item: pytest.Item) -> str | None:
    """The plugin whose `*-sync` env runs ``item`` (None: only `all` does, or an `*-async` env).

    Tests under ``tests/plugins/<plugin>/`` that are not about the async strategy and require no
    other plugin than their own and ``sync_sched`` run there; the `*-sync` env checks that none of
    them skips for a missing distribution (:func:`pytest_runtest_logreport`), so `all` can leave them
    out without losing one."""
    parts = item.path.relative_to(Path(__file__).parent).parts
    if len(parts) < 3 or parts[0] != "plugins" or parts[1] not in _SINGLE_PLUGIN_DIRS:
        return None
    if _about(item, "async") or not set(_required_plugins(item)) <= {parts[1], "sync_sched"}:
        return None
    return parts[1]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``PYPTO_TESTS_SCOPE`` makes each tox env run what depends on its combination, not the whole
    suite again: ``async`` (the ``*-async`` envs) keeps the tests about the async strategy (their id
    names it, or they require a plugin named with it); ``multi`` (the ``all`` env) leaves out the
    tests a ``*-sync`` env owns (:func:`_single_env_plugin`); ``sync`` and unset keep everything."""
    scope = os.environ.get("PYPTO_TESTS_SCOPE", "").lower()
    if scope == "async":
        keep = [item for item in items if _about(item, "async")]
    elif scope == "multi":
        keep = [item for item in items if _single_env_plugin(item) is None]
    else:
        return
    drop = [item for item in items if item not in set(keep)]
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


class _SyncEnvGuard:
    """``PYPTO_TESTS_SCOPE=sync`` (the ``*-sync`` envs): fail the run when a test this env owns
    (:func:`_single_env_plugin`) skips for a missing distribution. ``all`` leaves those tests out,
    so one would run nowhere; marked ``requires_plugin(<name>)``, ``all`` runs it."""

    def __init__(self) -> None:
        self.owned: set[str] = set()
        self.lost: list[str] = []

    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        self.owned = {item.nodeid for item in items if _single_env_plugin(item) is not None}

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        parts = Path(report.fspath).parts
        owned_dir = next((p for p in _SINGLE_PLUGIN_DIRS if "plugins" in parts and p in parts), None)
        if report.skipped and owned_dir and plugin_installed(owned_dir) and _missing_dist(report):
            self.lost.append(f"{report.nodeid}: {_skip_reason(report)}")

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.skipped and report.nodeid in self.owned and _missing_dist(report):
            self.lost.append(f"{report.nodeid}: {_skip_reason(report)}")

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if self.lost:
            lines = "\n  ".join(self.lost)
            print(f"\nERROR: tests this env owns skipped for a missing distribution:\n  {lines}")
            print("Mark each with pytest.mark.requires_plugin(<plugin>) so that the `all` env runs it.")
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("PYPTO_TESTS_SCOPE", "").lower() == "sync":
        config.pluginmanager.register(_SyncEnvGuard(), "pypto-sync-env-guard")


def _skip_reason(report: pytest.CollectReport | pytest.TestReport) -> str:
    longrepr = report.longrepr
    return str(longrepr[2]) if isinstance(longrepr, tuple) else str(longrepr)


def _missing_dist(report: pytest.CollectReport | pytest.TestReport) -> bool:
    return bool(_MISSING_DIST.search(_skip_reason(report)))


def pytest_runtest_setup(item: pytest.Item) -> None:
    for mark in item.iter_markers(name="requires_plugin"):
        for name in mark.args:
            if not plugin_installed(name):
                pytest.skip(f"plugin {name} not installed")


@pytest.fixture
def fake_pm() -> Any:
    """A PluginManager with the deterministic fake executor registered through the real hook."""
    from pypto_serving import PluginManager
    from tests.fakes import FakePlugin

    return PluginManager(extra_plugins=[FakePlugin])


@pytest.fixture
def make_llm(fake_pm: Any) -> Iterator[Callable[..., Any]]:
    """``make_llm(**settings)`` builds an ``LLM`` on the fake executor (in-process, sync scheduling
    unless overridden); every engine built is shut down at teardown."""
    pytest.importorskip("pypto_serving_sync_sched")
    from pypto_serving import LLM

    built: list[Any] = []

    def factory(**kw: Any) -> Any:
        kw.setdefault("executor", "fake")
        kw.setdefault("worker_mode", "inproc")
        kw.setdefault("scheduler", "sync")
        plugins = kw.pop("plugins", fake_pm)
        llm = LLM(plugins=plugins, **kw)
        built.append(llm)
        return llm

    yield factory
    for llm in built:
        llm.shutdown()


@pytest.fixture
def cpu_flags(monkeypatch: pytest.MonkeyPatch) -> Callable[..., None]:
    """Stand in for this CPU's feature flags and vendor: ``cpu_flags("avx512_bf16")`` makes
    ``dtype="auto"`` treat the CPU as one with bfloat16 instructions, ``cpu_flags()`` as one with
    none; ``vendor`` (an Intel CPU unless given) decides the float32 packing rule on AVX-512."""
    import pypto_kernels.device as device

    def use(*flags: str, vendor: str = "GenuineIntel") -> None:
        monkeypatch.setattr(device, "cpu_flags", lambda: frozenset(flags))
        monkeypatch.setattr(device, "cpu_vendor", lambda: vendor)

    return use
