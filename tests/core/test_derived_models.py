"""Named models written at first use: ``ModelSpec.prepare`` runs when the name is resolved, and
``write_model_dir`` writes a derived model directory once, atomically, under the user's cache."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest

from pypto_serving import ModelSpec, PluginManager, ServingSettings, hookimpl
from pypto_serving.model_files import model_cache_dir, write_model_dir
from tests.fakes import FakePlugin


@pytest.fixture(autouse=True)
def only_test_plugins(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("PYPTO_SERVING_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("PYPTO_SERVING_PLUGINS", "sync_sched")


def _write(calls: list[Path]) -> Callable[[Path], None]:
    def write(d: Path) -> None:
        calls.append(d)
        (d / "config.json").write_text(json.dumps({"architectures": ["FakeForCausalLM"]}))

    return write


def test_write_model_dir_writes_once_atomically_and_replaces_a_stale_copy(tmp_path: Path) -> None:
    calls: list[Path] = []
    dest = tmp_path / "cache" / "m"
    assert write_model_dir(dest, "k1", _write(calls)) == dest and (dest / "config.json").is_file()
    write_model_dir(dest, "k1", _write(calls))
    assert len(calls) == 1 and calls[0] != dest  # written elsewhere, then renamed into place
    write_model_dir(dest, "k2", _write(calls))
    assert len(calls) == 2 and (dest / "config.json").is_file()

    def fail(d: Path) -> None:
        (d / "half").write_text("x")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        write_model_dir(tmp_path / "cache" / "other", "k", fail)
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["m"]  # nothing half-written left


def test_the_cache_is_under_xdg_cache_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert model_cache_dir() == tmp_path / "pypto-serving" / "models"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert model_cache_dir() == Path.home() / ".cache" / "pypto-serving" / "models"


def test_a_named_model_is_prepared_when_its_name_resolves(tmp_path: Path) -> None:
    calls: list[Path] = []
    dest = tmp_path / "derived"
    spec = ModelSpec(
        "derived", str(dest), "written at first use", prepare=lambda: write_model_dir(dest, "k", _write(calls))
    )

    class ShipsModels:
        @staticmethod
        @hookimpl
        def pypto_serving_register_models() -> list[ModelSpec]:
            return [spec]

    pm = PluginManager(extra_plugins=[FakePlugin, ShipsModels])
    assert not dest.exists()  # registering writes nothing
    for _ in range(2):
        resolved = pm.resolve_model(ServingSettings(model="derived"))
        assert resolved.model == str(dest) and (dest / "config.json").is_file()
    assert len(calls) == 1
