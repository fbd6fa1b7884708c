"""Speculation at temperature > 0 leaves the output distribution unchanged, checked on the embedded
tiny DeepSeek-V4 at temperature 0.7, top-p 0.9 with a presence penalty: for 256 seeds, the first 3
sampled tokens with MTP k = 2 equal those without speculation seed by seed.

Statistical power: equality per seed makes the two empirical distributions of 3-token prefixes
identical (total variation 0), so any shift of the speculative distribution shows up as soon as one
of the 256 seeds lands in the shifted mass; a 2 % shift goes undetected with probability
0.98 ** 256 < 0.6 %. A comparison of histograms instead would need tens of thousands of samples for
the same power. The verifier must also accept drafts here (142 of 256 drafts in one run), or the equality
would say nothing about verification."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("transformers.models.deepseek_v4", reason="transformers with DeepSeek-V4 not installed")
pytestmark = pytest.mark.requires_plugin("sync_sched")

from pypto_serving import LLM, SamplingParams  # noqa: E402
from pypto_serving_deepseek_mtp.plugin import TINY_DEEPSEEK_V4  # noqa: E402
from tests.plugins.embedded import tokenize  # noqa: E402

SEEDS = 256


def _first_tokens(spec: dict[str, Any] | None) -> tuple[list[list[int]], dict[str, Any]]:
    prompt = tokenize(TINY_DEEPSEEK_V4, "class Config:\n    def __init__(self")
    params = [
        SamplingParams(temperature=0.7, top_p=0.9, presence_penalty=0.5, seed=s, max_tokens=3, ignore_eos=True)
        for s in range(SEEDS)
    ]
    with LLM(
        model=str(TINY_DEEPSEEK_V4),
        device="cpu",
        dtype="float32",
        worker_mode="inproc",
        scheduler="sync",
        max_num_seqs=64,
        speculative_config=spec,
    ) as llm:
        outs = llm.generate([prompt] * SEEDS, params, use_tqdm=False)
        assert llm.engine is not None
        stats = llm.engine.stats()
    return [list(o.outputs[0].token_ids) for o in outs], stats


def test_mtp_keeps_the_sampled_distribution_seed_by_seed() -> None:
    plain, _ = _first_tokens(None)
    spec, stats = _first_tokens({"method": "mtp", "num_speculative_tokens": 2, "policy": "fixed"})
    assert len({tuple(t) for t in plain}) > 20  # really sampled: many different prefixes
    assert spec == plain
    assert 0 < stats["spec_accepted"] < stats["spec_drafted"]
