"""How ``async_scheduling`` / ``scheduler`` pick the strategy."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("pypto_serving_async_sched")
pytest.importorskip("pypto_serving_sync_sched")

from pypto_serving import SamplingParams
from pypto_serving.config import SettingsError
from pypto_serving.plugins import PluginError
from pypto_serving_async_sched import AsyncStrategy
from pypto_serving_sync_sched import SyncStrategy
from tests.fakes import FakeExecutor

from .helpers import make_llm


def _strategy(**kw: Any) -> tuple[str, type]:
    llm = make_llm("auto", **kw)
    try:
        out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 3
        return llm.engine.scheduler_name, type(llm.engine.strategy)
    finally:
        llm.shutdown()


@pytest.mark.parametrize(
    "async_scheduling,pipelining,expected",
    [
        (None, True, ("async", AsyncStrategy)),
        (None, False, ("sync", SyncStrategy)),
        (False, True, ("sync", SyncStrategy)),
        (False, False, ("sync", SyncStrategy)),
        (True, True, ("async", AsyncStrategy)),
    ],
)
def test_selection(async_scheduling: bool | None, pipelining: bool, expected: tuple[str, type]) -> None:
    assert _strategy(async_scheduling=async_scheduling, options={"pipelining": pipelining}) == expected


def test_async_requested_without_pipelining_is_a_startup_error() -> None:
    with pytest.raises(PluginError, match=r"pipelines steps.*cannot.*async_scheduling = false"):
        make_llm("auto", async_scheduling=True, options={"pipelining": False})
    with pytest.raises(PluginError, match="pipelines steps"):
        make_llm("async", options={"pipelining": False})


def test_contradicting_settings_are_rejected() -> None:
    with pytest.raises(SettingsError, match="contradicts"):
        make_llm("sync", async_scheduling=True)


@pytest.mark.parametrize(
    ("loaded", "pipelining", "expected"),
    [
        ("sync_sched", True, ("sync", SyncStrategy)),
        ("sync_sched", False, ("sync", SyncStrategy)),
        ("async_sched", True, ("async", AsyncStrategy)),
        ("sync_sched,async_sched", True, ("async", AsyncStrategy)),
        ("sync_sched,async_sched", False, ("sync", SyncStrategy)),
    ],
)
def test_auto_picks_by_what_is_installed(
    monkeypatch: pytest.MonkeyPatch, loaded: str, pipelining: bool, expected: tuple[str, type]
) -> None:
    """The built-in strategies are found like any plugin: ``auto`` chooses by their ``pipelined``
    flag among those loaded, so with only the sync plugin a pipelining executor still runs."""
    monkeypatch.setenv("PYPTO_SERVING_PLUGINS", loaded)
    assert _strategy(options={"pipelining": pipelining}) == expected


def test_auto_with_only_a_pipelined_strategy_on_an_executor_that_cannot_pipeline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PYPTO_SERVING_PLUGINS", "async_sched")
    with pytest.raises(PluginError, match=r"the executor cannot pipeline: it needs a non-pipelined strategy") as e:
        make_llm("auto", options={"pipelining": False})
    assert "installed schedulers: async (pipelined)" in str(e.value)
    assert "PYPTO_SERVING_PLUGINS leaves out the installed plugins" in str(e.value)


def test_async_scheduling_true_with_only_a_non_pipelined_strategy_fails_before_loading(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PYPTO_SERVING_PLUGINS", "sync_sched")

    def never_loaded(self: FakeExecutor) -> None:
        raise AssertionError("the executor was loaded")

    monkeypatch.setattr(FakeExecutor, "load", never_loaded)
    with pytest.raises(PluginError, match=r"async_scheduling=True asks for a pipelined strategy and none is installed"):
        make_llm("auto", async_scheduling=True)
