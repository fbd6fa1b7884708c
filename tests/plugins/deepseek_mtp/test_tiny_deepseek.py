"""The embedded ``tiny-deepseek-v4`` (trained by tools/train_tiny.py, shipped as package data): it
loads by name and by path, reproduces transformers' greedy tokens, its trained MTP layer drafts
tokens that are accepted, and speculation with k = 1..3 never changes the output."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers.models.deepseek_v4", reason="transformers with DeepSeek-V4 not installed")

from pypto_serving_deepseek_mtp.plugin import TINY_DEEPSEEK_V4
from tests.plugins.embedded import (
    check_golden,
    check_serve_without_a_model,
    check_shipped_directory,
    engine_greedy,
    tokenize,
    transformers_greedy,
)

NAME = "tiny-deepseek-v4"
# transformers' greedy continuation of "def main():\n" (tools/train_tiny.py --golden).
GOLDEN_PROMPT_IDS: list[int] = [535, 2271, 681, 201]
GOLDEN: list[int] = [
    201,
    535,
    431,
    385,
    65,
    380,
    10,
    380,
    14,
    550,
    14,
    550,
    14,
    550,
    14,
    1013,
    830,
    291,
    280,
    439,
    1094,
    337,
    803,
    369,
]
# Prompts in the style of the training corpus (its held-out slice is other stdlib files).
PROMPTS = ["import os\nimport sys\n\n", "class Config:\n    def __init__(self", "    for i in range(len("]


def _tokenize(text: str) -> list[int]:
    return tokenize(TINY_DEEPSEEK_V4, text)


def test_the_shipped_directory_is_complete_with_its_mtp_layer() -> None:
    from safetensors import safe_open

    check_shipped_directory(TINY_DEEPSEEK_V4)
    with safe_open(str(TINY_DEEPSEEK_V4 / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert {"mtp.0.e_proj.weight", "mtp.0.h_proj.weight", "mtp.0.attn.wq_a.weight"} <= keys


def test_golden_tokens_by_name_and_by_path() -> None:
    check_golden(NAME, TINY_DEEPSEEK_V4, GOLDEN_PROMPT_IDS, GOLDEN)


def test_the_golden_tokens_are_transformers_greedy() -> None:
    assert transformers_greedy(TINY_DEEPSEEK_V4, GOLDEN_PROMPT_IDS, len(GOLDEN)) == GOLDEN


@pytest.mark.parametrize(
    "scheduler",
    [
        pytest.param("sync", marks=pytest.mark.requires_plugin("sync_sched")),
        pytest.param("async", marks=pytest.mark.requires_plugin("async_sched")),
    ],
)
def test_mtp_speculation_equals_no_speculation_and_its_drafts_are_accepted(scheduler: str) -> None:
    from pypto_serving import LLM, SamplingParams

    prompts = [_tokenize(p) for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outputs: dict[int, list[list[int]]] = {}
    accepted: dict[int, float] = {}
    for k in (0, 1, 2, 3):
        spec = {"method": "mtp", "num_speculative_tokens": k} if k else None
        with LLM(NAME, device="cpu", scheduler=scheduler, speculative_config=spec) as llm:
            outs = llm.generate(prompts, params, use_tqdm=False)
            stats: dict[str, Any] = llm.engine.stats() if llm.engine is not None else {}
        outputs[k] = [list(o.outputs[0].token_ids) for o in outs]
        accepted[k] = stats["spec_accepted"] / max(1, stats["spec_drafted"])
    for k in (1, 2, 3):
        assert outputs[k] == outputs[0], f"k={k} changed the greedy output"
    # A trained MTP head: a fair share of its drafts are right (on random weights it is ~0%).
    assert accepted[1] > 0.3, accepted


@pytest.mark.requires_plugin("sync_sched")
def test_mtp_speculation_in_bfloat16_equals_no_speculation() -> None:
    """The same invariant in bfloat16, which ``dtype = "auto"`` picks for this float32 checkpoint on a
    CPU with AVX512-BF16 or AMX; the drafts ran."""
    from pypto_serving import LLM, SamplingParams

    prompts = [_tokenize(p) for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outputs, drafted = [], 0
    for spec in (None, {"method": "mtp", "num_speculative_tokens": 2}):
        with LLM(NAME, device="cpu", dtype="bfloat16", worker_mode="inproc", speculative_config=spec) as llm:
            outs = llm.generate(prompts, params, use_tqdm=False)
            drafted += llm.engine.stats()["spec_drafted"] if llm.engine is not None else 0
        outputs.append([list(o.outputs[0].token_ids) for o in outs])
    assert outputs[1] == outputs[0] and drafted > 0


@pytest.mark.requires_plugin("sync_sched")
def test_serve_without_a_model_serves_it(tmp_path: Path) -> None:
    check_serve_without_a_model(NAME, tmp_path)


def test_engine_greedy_matches_transformers_on_more_prompts() -> None:
    for text in PROMPTS:
        ids = _tokenize(text)
        assert engine_greedy(NAME, ids, 16) == transformers_greedy(TINY_DEEPSEEK_V4, ids, 16), text
