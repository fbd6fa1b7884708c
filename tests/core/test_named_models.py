"""Named models: plugins register model directories by name; ``--model NAME`` and "no model at all"
resolve to them wherever a model directory is accepted."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pypto_serving import ModelSpec, PluginError, PluginManager, SamplingParams, ServingSettings, hookimpl
from pypto_serving.cli import main
from pypto_serving.config import SettingsError
from pypto_serving.plugins import require_model
from tests.fakes import FakePlugin, reference_tokens


@pytest.fixture(autouse=True)
def only_test_plugins(monkeypatch: pytest.MonkeyPatch) -> None:
    """No installed entry point takes part: the named models are the ones these tests register."""
    for name in list(os.environ):
        if name.startswith("PYPTO_SERVING_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("PYPTO_SERVING_PLUGINS", "sync_sched")  # the strategy, but no installed named models


def _model_dir(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"architectures": ["FakeForCausalLM"]}))
    return path


@pytest.fixture
def models(tmp_path: Path) -> Callable[..., PluginManager]:
    """``models(**{name: priority})`` -> a plugin manager whose test plugin ships those named models."""

    def make(**priorities: int) -> PluginManager:
        specs = [
            ModelSpec(name, str(_model_dir(tmp_path / f"dir-{name}")), f"the {name} model", priority)
            for name, priority in priorities.items()
        ]

        class ShipsModels:
            @staticmethod
            @hookimpl
            def pypto_serving_register_models() -> list[ModelSpec]:
                return specs

        return PluginManager(extra_plugins=[FakePlugin, ShipsModels])

    return make


def test_a_name_resolves_to_its_directory_and_is_the_served_name(models: Callable[..., PluginManager]) -> None:
    pm = models(tiny=0, other=5)
    resolved = pm.resolve_model(ServingSettings(model="tiny"))
    assert resolved.model is not None and Path(resolved.model).name == "dir-tiny"
    assert resolved.served_model_name == "tiny"
    assert resolved.source_of("model") == "named model tiny"
    kept = pm.resolve_model(ServingSettings(model="tiny", served_model_name="mine"))
    assert kept.served_model_name == "mine"


def test_no_model_picks_the_highest_priority_then_the_first_name(
    models: Callable[..., PluginManager], caplog: Any
) -> None:
    caplog.set_level(logging.INFO, logger="pypto_serving.plugins")
    resolved = models(a=1, b=3, c=3).resolve_model(ServingSettings())
    assert resolved.served_model_name == "b" and resolved.model is not None and resolved.model.endswith("dir-b")
    assert any("default named model b" in r.getMessage() for r in caplog.records)


def test_what_is_not_a_registered_name_is_left_alone(
    models: Callable[..., PluginManager], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pm = models(tiny=0)
    settings = ServingSettings(model=str(tmp_path))
    assert pm.resolve_model(settings) is settings
    # A directory named like a registered model wins over the name.
    monkeypatch.chdir(tmp_path)
    _model_dir(tmp_path / "tiny")
    assert pm.resolve_model(ServingSettings(model="tiny")).model == "tiny"
    # An explicit executor may run without any model: no default is forced on it.
    settings = ServingSettings(executor="fake")
    assert pm.resolve_model(settings) is settings


@pytest.mark.parametrize(
    ("model", "hint"),
    [
        ("tiny-qwen", "did you mean 'tiny-qwen3'? "),
        ("tiny-deepseek", "did you mean 'tiny-deepseek-v4'? "),
        ("/no/such/dir", ""),  # nothing close: the list of names only
    ],
)
def test_a_model_that_is_neither_a_directory_nor_a_name_names_the_closest_one(
    models: Callable[..., PluginManager], model: str, hint: str
) -> None:
    pm = models(**{"tiny-qwen3": 0, "tiny-deepseek-v4": 1})
    expected = (
        f"model {model!r} does not exist: it is neither a directory nor a named model; {hint}"
        "'pypto-serving models' lists the named models (tiny-deepseek-v4, tiny-qwen3)"
    )
    with pytest.raises(SettingsError) as e:
        pm.resolve_model(ServingSettings(model=model))
    assert str(e.value) == expected


def test_a_mistyped_model_fails_the_command_in_one_line(
    models: Callable[..., PluginManager], monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    pm = models(**{"tiny-qwen3": 0})
    monkeypatch.setattr("pypto_serving.cli.PluginManager", lambda: pm)
    assert main(["generate", "--model", "tiny-qwen", "Hello"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("pypto-serving: error: model 'tiny-qwen' does not exist: it is neither") and "\n" not in err
    assert "did you mean 'tiny-qwen3'?" in err and "'pypto-serving models'" in err


def test_without_named_models_a_command_says_what_it_needs(models: Callable[..., PluginManager]) -> None:
    with pytest.raises(SettingsError, match=r"serve needs a model: .*installed named models: none"):
        require_model(models(), ServingSettings(), "serve")
    assert require_model(models(x=0), ServingSettings(), "serve").served_model_name == "x"


def test_a_name_registered_twice_names_both_plugins(tmp_path: Path) -> None:
    class One:
        @staticmethod
        @hookimpl
        def pypto_serving_register_models() -> list[ModelSpec]:
            return [ModelSpec("same", str(tmp_path))]

    class Two(One):
        pass

    with pytest.raises(PluginError, match=r"model 'same' is registered twice: by plugin 'Two' .* and by plugin 'One'"):
        PluginManager(extra_plugins=[One, Two])


@pytest.mark.requires_plugin("sync_sched")
def test_llm_serves_a_named_model_and_the_default_one(models: Callable[..., PluginManager]) -> None:
    from pypto_serving import LLM

    pm = models(tiny=0)
    sp = SamplingParams(temperature=0, max_tokens=4)
    for model in ("tiny", None):
        with LLM(model, plugins=pm, worker_mode="inproc", scheduler="sync") as llm:
            assert llm.settings.served_model_name == "tiny"
            out = llm.generate([[1, 2, 3]], sp, use_tqdm=False)
        assert out[0].outputs[0].token_ids == reference_tokens([1, 2, 3], 4)[0]


def test_the_models_command_lists_names_defaults_and_plugins(
    models: Callable[..., PluginManager], monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    pm = models(small=0, big=2)
    monkeypatch.setattr("pypto_serving.cli.PluginManager", lambda: pm)
    assert main(["models", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [(m["name"], m["default"], m["description"]) for m in listed] == [
        ("big", "yes", "the big model"),
        ("small", "", "the small model"),
    ]
    assert main(["models"]) == 0
    assert capsys.readouterr().out.splitlines()[0].split() == ["model", "default", "plugin", "description", "path"]
    assert main(["plugins", "--json"]) == 0
