"""Plugin loading and name resolution: unknown names, duplicates, PYPTO_SERVING_PLUGINS, auto."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pypto_serving import ExecutorSpec, PluginError, PluginManager, SamplingParams, hookimpl, hookspecs
from pypto_serving.engine import read_architecture
from tests.fakes import FakePlugin, make_fake_executor, reference_tokens

NO_ENTRY_POINTS = "core_only_nonexistent"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("PYPTO_SERVING_"):
            monkeypatch.delenv(name)


@pytest.fixture
def core_only(monkeypatch: pytest.MonkeyPatch) -> PluginManager:
    """Only built-ins and the fake plugin: no entry point is loaded."""
    monkeypatch.setenv("PYPTO_SERVING_PLUGINS", NO_ENTRY_POINTS)
    return PluginManager(extra_plugins=[FakePlugin])


@pytest.fixture
def model_dir(tmp_path: Path) -> Callable[[str], Path]:
    def make(arch: str) -> Path:
        d = tmp_path / arch
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"architectures": [arch]}))
        return d

    return make


def test_core_only_loads_no_entry_points(core_only: PluginManager) -> None:
    assert [p.name for p in core_only.plugins] == ["core", "FakePlugin"]
    assert set(core_only.executors.specs) == {"fake"}
    assert set(core_only.schedulers.specs) == set()
    assert set(core_only.spec_policies.specs) == {"none", "greedy", "fixed", "adaptive"}


def test_unknown_executor_lists_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    pm = PluginManager(load_entry_points=False, extra_plugins=[FakePlugin])
    with pytest.raises(PluginError, match=r"unknown executor 'mine'; installed executors: fake$"):
        pm.select_executor("mine", None)


@pytest.mark.parametrize(("kind", "name"), [("executor", "qwen"), ("scheduler", "sync"), ("scheduler", "async")])
def test_missing_name_lists_installed_and_left_out_plugins(core_only: PluginManager, kind: str, name: str) -> None:
    """The core knows no plugin by name, so it guesses no distribution to install: it says what is
    installed and which installed plugins PYPTO_SERVING_PLUGINS left out."""
    select = core_only.select_executor if kind == "executor" else core_only.select_scheduler
    args = (name, None) if kind == "executor" else (name,)
    with pytest.raises(PluginError) as e:
        select(*args)  # type: ignore[operator]
    msg = str(e.value)
    assert f"unknown {kind} {name!r}; installed {kind}s: " in msg
    assert "pip install" not in msg
    if core_only.excluded:
        assert f"PYPTO_SERVING_PLUGINS leaves out the installed plugins {', '.join(core_only.excluded)}" in msg


def test_unknown_scheduler_without_hint(core_only: PluginManager) -> None:
    with pytest.raises(PluginError, match="installed schedulers: none") as e:
        core_only.select_scheduler("fancy")
    assert "pip install" not in str(e.value)


def test_engine_refuses_missing_scheduler_before_loading(core_only: PluginManager) -> None:
    from pypto_serving import LLM

    with pytest.raises(PluginError, match="unknown scheduler 'sync'"):
        LLM(executor="fake", plugins=core_only, worker_mode="inproc", scheduler="sync")
    with pytest.raises(PluginError, match="no scheduling strategy is installed"):
        LLM(executor="fake", plugins=core_only, worker_mode="inproc")
    with pytest.raises(PluginError, match="unknown executor 'qwen'"):
        LLM(executor="qwen", plugins=core_only, worker_mode="inproc")


class PluginA:
    @staticmethod
    @hookimpl
    def pypto_serving_register_executors() -> list[ExecutorSpec]:
        return [ExecutorSpec("dup", make_fake_executor)]


class PluginB:
    @staticmethod
    @hookimpl
    def pypto_serving_register_executors() -> list[ExecutorSpec]:
        return [ExecutorSpec("dup", make_fake_executor)]


def test_duplicate_name_names_both_plugins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYPTO_SERVING_PLUGINS", NO_ENTRY_POINTS)
    with pytest.raises(PluginError) as e:
        PluginManager(extra_plugins=[PluginA, PluginB])
    msg = str(e.value)
    assert "executor 'dup' is registered twice" in msg
    assert "'PluginA'" in msg and "'PluginB'" in msg


@pytest.mark.requires_plugin("sync_sched", "async_sched")
def test_plugins_env_restricts_loading(monkeypatch: pytest.MonkeyPatch) -> None:
    everything = PluginManager()
    assert {"sync", "async"} <= set(everything.schedulers.specs)
    monkeypatch.setenv("PYPTO_SERVING_PLUGINS", "sync_sched")
    pm = PluginManager()
    assert [p.name for p in pm.plugins] == ["core", "sync_sched"]
    assert set(pm.schedulers.specs) == {"sync"}
    with pytest.raises(PluginError, match=r"PYPTO_SERVING_PLUGINS leaves out the installed plugins .*async_sched"):
        pm.select_scheduler("async")
    monkeypatch.setenv("PYPTO_SERVING_PLUGINS", " sync_sched , async_sched ")
    assert set(PluginManager().schedulers.specs) == {"sync", "async"}


def test_auto_picks_by_architecture(core_only: PluginManager, model_dir: Callable[[str], Path]) -> None:
    d = model_dir("FakeForCausalLM")
    assert read_architecture(str(d)) == "FakeForCausalLM"
    assert core_only.select_executor("auto", read_architecture(str(d))).name == "fake"


@pytest.mark.requires_plugin("sync_sched")
def test_auto_end_to_end(fake_pm: PluginManager, model_dir: Callable[[str], Path]) -> None:
    from pypto_serving import LLM

    with LLM(str(model_dir("FakeForCausalLM")), plugins=fake_pm, worker_mode="inproc", scheduler="sync") as llm:
        out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert out[0].outputs[0].token_ids == reference_tokens([1, 2, 3], 4)[0]


def test_auto_unknown_architecture(core_only: PluginManager) -> None:
    with pytest.raises(PluginError) as e:
        core_only.select_executor("auto", "MysteryForCausalLM")
    msg = str(e.value)
    assert "no installed executor serves the architecture 'MysteryForCausalLM'" in msg
    assert "FakeForCausalLM" in msg and "pip install" not in msg


@pytest.mark.parametrize("arch", ["Qwen3ForCausalLM", "DeepseekV4ForCausalLM"])
def test_auto_architecture_of_a_left_out_plugin(core_only: PluginManager, arch: str) -> None:
    with pytest.raises(PluginError) as e:
        core_only.select_executor("auto", arch)
    msg = str(e.value)
    assert f"no installed executor serves the architecture {arch!r}; installed executors serve: FakeForCausalLM" in msg
    assert "pip install" not in msg
    if core_only.excluded:
        assert re.search(r"PYPTO_SERVING_PLUGINS leaves out the installed plugins \w", msg), msg


def test_auto_needs_a_model(core_only: PluginManager) -> None:
    with pytest.raises(PluginError, match="needs a model directory"):
        core_only.select_executor("auto", None)


def test_read_architecture_errors(tmp_path: Path) -> None:
    from pypto_serving import SettingsError

    assert read_architecture(None) is None
    with pytest.raises(SettingsError, match="does not exist"):
        read_architecture(str(tmp_path / "missing"))
    with pytest.raises(SettingsError, match=r"no config\.json"):
        read_architecture(str(tmp_path))


def test_configure_hook_can_refuse(core_only: PluginManager) -> None:
    from pypto_serving import ServingSettings

    class Refuser:
        @staticmethod
        @hookimpl
        def pypto_serving_configure(settings: Any) -> None:
            if settings.max_num_seqs > 4:
                raise ValueError("max_num_seqs must be <= 4 for Refuser")

    pm = PluginManager(load_entry_points=False, extra_plugins=[FakePlugin, Refuser])
    pm.configure(ServingSettings(max_num_seqs=4))
    with pytest.raises(ValueError, match="max_num_seqs"):
        pm.configure(ServingSettings(max_num_seqs=8))


def _named_builtins(doc: str) -> set[str] | None:
    """The names a hook spec's docstring says the core registers (None: it names none)."""
    found = re.search(r"The core registers (.*?) through this hook", " ".join(doc.split()))
    return None if found is None else set(re.findall(r"``(\w+)``", found.group(1)))


def test_hookspec_docstrings_name_what_the_core_registers() -> None:
    """Every ``register`` hook spec that names the core's built-ins names exactly what the core
    plugin returns from that hook, and every such hook the core implements names its built-ins."""
    pm = PluginManager()
    checked = 0
    for name, spec in vars(hookspecs).items():
        if not name.startswith("pypto_serving_register_"):
            continue
        impls = getattr(pm.pm.hook, name).get_hookimpls()
        registered = {d.name for impl in impls if impl.plugin_name == "core" for d in impl.function()}
        named = _named_builtins(spec.__doc__ or "")
        if named is None and not registered:
            continue
        assert named == registered, f"{name}: the docstring names {sorted(named or [])}, the core {sorted(registered)}"
        checked += 1
    assert checked >= 3  # spec policies, tool parsers, reasoning parsers
