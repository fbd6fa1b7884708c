"""The one generation_config.json reader every executor uses, the sampling-defaults filter the
engine and the server share, and the context-length bound config.json sets (a longer max_model_len
is refused unless allow_long_max_model_len)."""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path

import pytest

from pypto_serving import SamplingParams, ServingSettings, read_generation_config
from pypto_serving.config import SettingsError
from pypto_serving.model_files import (
    GENERATION_CONFIG_KEYS,
    check_max_model_len,
    checkpoint_max_len,
    sampling_defaults,
)


def _write(tmp_path: Path, data: object) -> Path:
    (tmp_path / "generation_config.json").write_text(json.dumps(data))
    return tmp_path


def test_every_sampling_default_is_read(tmp_path: Path) -> None:
    every = {
        "temperature": 0.6,
        "top_p": 0.95,
        "top_k": 20,
        "min_p": 0.05,
        "repetition_penalty": 1.1,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.25,
    }
    _write(tmp_path, {"eos_token_id": [3, 4], "do_sample": True, "max_length": 99, **every})
    eos, defaults = read_generation_config(tmp_path)
    assert eos == [3, 4] and defaults == every
    assert SamplingParams(**defaults).min_p == 0.05  # every key is a SamplingParams field


def test_keys_are_sampling_params_fields() -> None:
    assert set(GENERATION_CONFIG_KEYS) <= {f.name for f in fields(SamplingParams)}


def test_unset_values_and_a_missing_file(tmp_path: Path) -> None:
    assert read_generation_config(tmp_path) == ([], {})
    _write(tmp_path, {"eos_token_id": 7, "temperature": None, "top_k": 5})
    assert read_generation_config(tmp_path) == ([7], {"top_k": 5})


@pytest.mark.parametrize(
    ("content", "match"),
    [("{not json", "not valid JSON"), ("[1, 2]", "JSON object"), ('{"eos_token_id": "x"}', "eos_token_id")],
)
def test_a_bad_file_is_named(tmp_path: Path, content: str, match: str) -> None:
    (tmp_path / "generation_config.json").write_text(content)
    with pytest.raises(ValueError, match=match) as info:
        read_generation_config(tmp_path)
    assert "generation_config.json" in str(info.value)


def test_sampling_defaults_keeps_only_set_sampling_keys() -> None:
    given = {"temperature": 0.7, "min_p": None, "repetition_penalty": 1.2, "custom": 1, "max_tokens": 5}
    assert sampling_defaults(given) == {"temperature": 0.7, "repetition_penalty": 1.2}


def _config(tmp_path: Path, **values: object) -> Path:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["FakeForCausalLM"], **values}))
    return tmp_path


@pytest.mark.parametrize(
    ("values", "limit"),
    [
        ({"max_position_embeddings": 2048}, 2048),
        ({}, None),  # the file does not say: nothing to check against
        # YaRN stretches the original positions by its factor (Qwen3's documented 4 x 32768).
        (
            {
                "max_position_embeddings": 40960,
                "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768},
            },
            131072,
        ),
        ({"max_position_embeddings": 4096, "rope_scaling": {"type": "linear", "factor": 2}}, 8192),
        (  # transformers 5's name for it
            {
                "max_position_embeddings": 256,
                "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
            },
            256,
        ),
        ({"max_position_embeddings": 256, "rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, 512),
        # llama3 scaling already states the stretched length in max_position_embeddings.
        ({"max_position_embeddings": 131072, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, 131072),
        ({"text_config": {"max_position_embeddings": 1024}}, 1024),  # multimodal configs nest it
    ],
)
def test_the_checkpoint_limit_comes_from_config_json(tmp_path: Path, values: dict[str, object], limit: int) -> None:
    assert checkpoint_max_len(_config(tmp_path, **values)) == limit


def test_a_max_model_len_beyond_the_checkpoint_is_refused_unless_allowed(tmp_path: Path) -> None:
    model = str(_config(tmp_path, max_position_embeddings=2048))
    with pytest.raises(SettingsError) as e:
        check_max_model_len(ServingSettings(model=model, max_model_len=100000))
    assert str(e.value).startswith("max_model_len=100000 is longer than the model's 2048 positions")
    assert "allow_long_max_model_len=true" in str(e.value)
    check_max_model_len(ServingSettings(model=model, max_model_len=2048))
    check_max_model_len(ServingSettings(model=model, max_model_len=100000, allow_long_max_model_len=True))
    check_max_model_len(ServingSettings(model=model))


@pytest.mark.requires_plugin("sync_sched")
def test_the_engine_refuses_it_before_loading(tmp_path: Path) -> None:
    from pypto_serving import LLM, PluginManager
    from tests.fakes import FakePlugin

    model = str(_config(tmp_path, max_position_embeddings=2048))
    pm = PluginManager(extra_plugins=[FakePlugin])
    with pytest.raises(SettingsError, match=r"max_model_len=100000 is longer than the model's 2048 positions"):
        LLM(model, plugins=pm, worker_mode="inproc", scheduler="sync", max_model_len=100000)
    # Allowed explicitly, the engine starts and serves.
    options = {"max_model_len": 100000}
    with LLM(
        model,
        plugins=pm,
        worker_mode="inproc",
        scheduler="sync",
        max_model_len=100000,
        allow_long_max_model_len=True,
        executor_options=options,
        num_kv_blocks=64,
    ) as llm:
        out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2
