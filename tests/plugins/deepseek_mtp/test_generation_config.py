"""The DeepSeek executor reports every sampling default of generation_config.json (through the core's
reader), and the engine applies them all, penalties included, to requests that leave them unset."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pypto_serving import LLM, SamplingParams

from .helpers import Checkpoint, alias_checkpoint, plugin_manager

DEFAULTS = {"temperature": 0.0, "min_p": 0.25, "repetition_penalty": 1.8, "presence_penalty": 1.5}


@pytest.fixture
def llm(checkpoints: dict[str, Checkpoint], tmp_path: Path) -> Any:
    path = alias_checkpoint(checkpoints["sliding_only"].path, tmp_path / "with_defaults")
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 5, "top_k": None, **DEFAULTS}))
    llm = LLM(
        model=str(path),
        plugins=plugin_manager(),
        dtype="float32",
        device="cpu",
        worker_mode="inproc",
        block_size=4,
    )
    yield llm
    llm.shutdown()


def test_generation_config_defaults_are_all_applied(llm: Any) -> None:
    assert llm.engine.info.generation_defaults == DEFAULTS
    assert 5 in llm.engine.info.eos_token_ids
    defaults = llm.default_sampling_params()
    assert (defaults.min_p, defaults.repetition_penalty, defaults.presence_penalty) == (0.25, 1.8, 1.5)
    prompt = [7, 8, 9, 7, 8, 9, 7, 8]

    def tokens(params: SamplingParams | None) -> list[int]:
        return list(llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids)

    explicit = SamplingParams(**DEFAULTS)  # the engine's SamplingParams() default max_tokens as well
    assert tokens(None) == tokens(explicit)
    assert tokens(explicit) != tokens(SamplingParams(temperature=0.0))  # the penalties change the output
