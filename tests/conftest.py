"""Shared fixtures: the fake executor plugin, an engine factory that always shuts down, and the
``requires_plugin(name)`` marker."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterator
from importlib import metadata
from typing import Any

import pytest

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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``PYPTO_TESTS_ONLY=<word>`` (tox's ``*-async`` envs set ``async``) keeps only the tests about
    that strategy: those whose id names it (a file, a test or a parameter) or that require a plugin
    named with it. Everything else runs unchanged in the matching ``*-sync`` env and in ``all``, so a
    plugin-combination env runs what depends on its combination, not the whole suite again."""
    import os

    only = os.environ.get("PYPTO_TESTS_ONLY", "").lower()
    if not only:
        return
    keep, drop = [], []
    for item in items:
        plugins = [str(a) for m in item.iter_markers(name="requires_plugin") for a in m.args]
        about = only in item.nodeid.lower() or any(only in p for p in plugins)
        (keep if about else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


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
