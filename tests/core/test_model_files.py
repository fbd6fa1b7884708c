"""The one generation_config.json reader every executor uses, and the sampling-defaults filter the
engine and the server share."""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path

import pytest

from pypto_serving import SamplingParams, read_generation_config
from pypto_serving.model_files import GENERATION_CONFIG_KEYS, sampling_defaults


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
