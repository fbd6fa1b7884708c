"""The embedded ``tiny-qwen3`` (trained by tools/train_tiny.py, shipped as package data): it loads
by name and by path and reproduces transformers' greedy tokens."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers.models.qwen3", reason="transformers with Qwen3 not installed")

from pypto_serving_qwen.plugin import TINY_QWEN3
from tests.plugins.embedded import (
    check_golden,
    check_serve_without_a_model,
    check_shipped_directory,
    engine_greedy,
    tokenize,
    transformers_greedy,
)

NAME = "tiny-qwen3"
# transformers' greedy continuation of "def main():\n" (tools/train_tiny.py --golden).
GOLDEN_PROMPT_IDS: list[int] = [535, 2271, 681, 201]
GOLDEN: list[int] = [
    201,
    535,
    431,
    385,
    65,
    305,
    65,
    305,
    65,
    305,
    65,
    305,
    65,
    305,
    65,
    305,
    65,
    305,
    65,
    305,
    65,
    305,
    65,
    305,
]
# Prompts in the style of the training corpus (its held-out slice is other stdlib files).
PROMPTS = ["import os\nimport sys\n\n", "class Config:\n    def __init__(self", "    for i in range(len("]


def _tokenize(text: str) -> list[int]:
    return tokenize(TINY_QWEN3, text)


def test_the_shipped_directory_is_complete() -> None:
    check_shipped_directory(TINY_QWEN3)


def test_golden_tokens_by_name_and_by_path() -> None:
    check_golden(NAME, TINY_QWEN3, GOLDEN_PROMPT_IDS, GOLDEN)


def test_the_golden_tokens_are_transformers_greedy() -> None:
    assert transformers_greedy(TINY_QWEN3, GOLDEN_PROMPT_IDS, len(GOLDEN)) == GOLDEN


@pytest.mark.requires_plugin("sync_sched")
def test_serve_without_a_model_serves_it(tmp_path: Path) -> None:
    import importlib.util

    if importlib.util.find_spec("pypto_serving_deepseek_mtp") is not None:
        pytest.skip("with the deepseek_mtp plugin installed its model is the default (tested there)")
    check_serve_without_a_model(NAME, tmp_path)


def test_engine_greedy_matches_transformers_on_more_prompts() -> None:
    for text in PROMPTS:
        ids = _tokenize(text)
        assert engine_greedy(NAME, ids, 16) == transformers_greedy(TINY_QWEN3, ids, 16), text
