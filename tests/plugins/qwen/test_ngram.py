"""n-gram (prompt-lookup) speculation on the embedded tiny Qwen3: a prompt whose continuation repeats
it gets drafts accepted, and the greedy output equals decoding without speculation, sync and async."""

from __future__ import annotations

from typing import Any

import pytest

from pypto_serving import LLM, SamplingParams
from pypto_serving_qwen.plugin import TINY_QWEN3
from tests.conftest import plugin_installed
from tests.plugins.embedded import tokenize

pytestmark = pytest.mark.requires_plugin("sync_sched")

CODE = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\n"


def _generate(
    scheduler: str, spec: dict[str, Any] | None, dtype: str = "float32"
) -> tuple[list[list[int]], dict[str, Any]]:
    prompts = [tokenize(TINY_QWEN3, CODE * 3), tokenize(TINY_QWEN3, "import os\n" * 4)]
    with LLM(
        model=str(TINY_QWEN3),
        device="cpu",
        dtype=dtype,
        worker_mode="inproc",
        scheduler=scheduler,
        speculative_config=spec,
    ) as llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)
        assert llm.engine is not None
        stats = llm.engine.stats()
    return [list(o.outputs[0].token_ids) for o in outs], stats


@pytest.mark.parametrize("scheduler", ["sync", "async"])
def test_ngram_drafts_are_accepted_and_change_nothing(scheduler: str) -> None:
    if scheduler == "async" and not plugin_installed("async_sched"):
        pytest.skip("plugin async_sched not installed")
    plain, _ = _generate(scheduler, None)
    spec, stats = _generate(scheduler, {"method": "ngram", "num_speculative_tokens": 3, "policy": "fixed"})
    assert spec == plain
    assert stats["spec_accepted"] > 0 and stats["spec_method"] == "ngram"


def test_ngram_in_bfloat16_changes_nothing() -> None:
    """The same invariant in bfloat16, which ``dtype = "auto"`` picks for this float32 checkpoint on a
    CPU with AVX512-BF16 or AMX (there: packed bfloat16 products, a float32 cache read in place)."""
    plain, _ = _generate("sync", None, "bfloat16")
    spec, stats = _generate("sync", {"method": "ngram", "num_speculative_tokens": 3, "policy": "fixed"}, "bfloat16")
    assert spec == plain
    assert stats["spec_accepted"] > 0 and stats["spec_method"] == "ngram"
