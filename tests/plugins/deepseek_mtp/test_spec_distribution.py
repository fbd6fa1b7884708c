"""Speculation at temperature > 0 leaves the output distribution unchanged, checked on the embedded
tiny DeepSeek-V4 at temperature 0.7, top-p 0.9 with a presence penalty: the first 3 tokens of
``SEEDS`` seeded requests with MTP k = 2 against those of ``SEEDS`` other seeds without speculation.

Sampled MTP drafts are verified by rejection sampling (the penalty is conditioned on each row's
drafts, so these requests take that path), whose tokens equal the plain sampler's only in
distribution, not seed by seed. Test: for the 2nd and the 3rd token separately, a two-sample
chi-square over the tokens with at least 10 draws in both runs together (the rest pooled), below
``df + 6 * sqrt(2 df)`` (about 1e-5 tail probability under the null; the seeds are fixed, so the
outcome is deterministic).

Statistical power: with ``SEEDS = 1024`` per run, moving 8 % of the mass between two tokens of about
10 % each gives a noncentrality of about ``10 * SEEDS * 0.08**2 = 65``; with the 8 (3rd token) to
21 (2nd token) degrees of freedom seen here the statistic then exceeds the threshold with
probability about 99 % and 93 %. :func:`test_the_comparison_detects_a_shifted_distribution` shows the
statistic flagging a real change of the sampling law at this sample size. A 2 % shift
needs tens of thousands of samples: that power lives in ``tests/core/test_rejection.py``, where the
same verification (:func:`pypto_serving.spec_decode.verify_sampled` on drafts drawn by
:class:`~pypto_serving.spec_decode.DraftSampler`) is checked against exact enumeration with 40,000
seeds. The verifier must also accept drafts here, or the comparison would say nothing about
verification."""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import pytest

pytest.importorskip("transformers.models.deepseek_v4", reason="transformers with DeepSeek-V4 not installed")
pytestmark = pytest.mark.requires_plugin("sync_sched")

from pypto_serving import LLM, SamplingParams  # noqa: E402
from pypto_serving_deepseek_mtp.plugin import TINY_DEEPSEEK_V4  # noqa: E402
from tests.plugins.embedded import tokenize  # noqa: E402

SEEDS = 1024
# Rejection-sampled requests verify no drafts within k + 2 outputs of max_tokens (the runner's cap
# that keeps async equal to sync): 6 lets the first two decode steps verify both drafts.
MAX_TOKENS = 6


def _first_tokens(spec: dict[str, Any] | None, first_seed: int) -> tuple[list[list[int]], dict[str, Any]]:
    prompt = tokenize(TINY_DEEPSEEK_V4, "class Config:\n    def __init__(self")
    params = [
        SamplingParams(temperature=0.7, top_p=0.9, presence_penalty=0.5, seed=s, max_tokens=MAX_TOKENS, ignore_eos=True)
        for s in range(first_seed, first_seed + SEEDS)
    ]
    with LLM(
        model=str(TINY_DEEPSEEK_V4),
        device="cpu",
        dtype="float32",
        worker_mode="inproc",
        scheduler="sync",
        max_num_seqs=256,
        speculative_config=spec,
    ) as llm:
        outs = llm.generate([prompt] * SEEDS, params, use_tqdm=False)
        assert llm.engine is not None
        stats = llm.engine.stats()
    return [list(o.outputs[0].token_ids) for o in outs], stats


def two_sample_chi_square(a: Counter[int], b: Counter[int]) -> tuple[float, int]:
    """Pearson's homogeneity statistic of two equal-size samples; cells under 10 draws pooled."""
    stat, df, pool_a, pool_b = 0.0, -1, 0, 0
    for t in set(a) | set(b):
        if a[t] + b[t] < 10:
            pool_a, pool_b = pool_a + a[t], pool_b + b[t]
            continue
        stat += (a[t] - b[t]) ** 2 / (a[t] + b[t])
        df += 1
    if pool_a + pool_b:
        stat += (pool_a - pool_b) ** 2 / (pool_a + pool_b)
        df += 1
    return stat, df


def test_mtp_keeps_the_sampled_distribution() -> None:
    plain, _ = _first_tokens(None, 0)
    spec, stats = _first_tokens({"method": "mtp", "num_speculative_tokens": 2, "policy": "fixed"}, SEEDS)
    assert len({tuple(t) for t in plain}) > 50  # really sampled: many different prefixes
    for pos in (1, 2):
        stat, df = two_sample_chi_square(Counter(t[pos] for t in plain), Counter(t[pos] for t in spec))
        assert df >= 3 and stat < df + 6 * math.sqrt(2 * df), (pos, stat, df)
    assert 0 < stats["spec_accepted"] < stats["spec_drafted"]


def test_the_comparison_detects_a_shifted_distribution() -> None:
    """The same statistic flags a real change of the sampling law: top-p 0.9 against top-p 0.6 (as
    a verifier that processed the target differently from the sampler would)."""

    def tokens(top_p: float, first_seed: int) -> Counter[int]:
        prompt = tokenize(TINY_DEEPSEEK_V4, "class Config:\n    def __init__(self")
        params = [
            SamplingParams(temperature=0.7, top_p=top_p, seed=s, max_tokens=2, ignore_eos=True)
            for s in range(first_seed, first_seed + SEEDS // 2)
        ]
        with LLM(
            model=str(TINY_DEEPSEEK_V4), device="cpu", dtype="float32", worker_mode="inproc", max_num_seqs=256
        ) as llm:
            outs = llm.generate([prompt] * len(params), params, use_tqdm=False)
        return Counter(o.outputs[0].token_ids[1] for o in outs)

    stat, df = two_sample_chi_square(tokens(0.9, 0), tokens(0.6, SEEDS))
    assert stat > df + 6 * math.sqrt(2 * df), (stat, df)
