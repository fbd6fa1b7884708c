"""Speculation at temperature > 0 leaves the output distribution unchanged: the embedded tiny
DeepSeek-V4 at temperature 0.7, top-p 0.9 with a presence penalty, speculating with MTP k = 2 for
every request (policy ``fixed``: the default policy would stop drafting for most of a batch of 512),
against the exact law.

The reference is exact rather than a second sample: transformers' DeepSeek-V4 gives the logits after
the prompt and after each sampled prefix, processed as the sampler does (the presence penalty on the
tokens output so far, then temperature and top-p: :func:`processed_probs`). Sampled MTP drafts are
verified by rejection sampling (the penalty is conditioned on each row's drafts, so these requests
take that path; the requests carry no seed of their own, since a user seed takes sample-and-compare,
and draw theirs from the engine's ``seed``); its tokens follow the target law only in distribution.

Test: a chi-square goodness of fit of the first three output tokens (the prefill's draw, then the two
positions the first decode step verifies with both drafts), each against its exact conditional law
given the tokens before it, with cells of expected count under ``MIN_EXPECTED`` pooled per prefix;
rejected above the 1 - ``ALPHA`` quantile of the chi-square law (the seeds are fixed, so the outcome
is deterministic; ``ALPHA = 0.01`` trades a 1 % chance that a change of the draws trips a correct
verifier for the power below).

Power, computed from the exact law at the sample drawn (:func:`shifted_power`): the alternative
moves 2 points of probability (TV distance 0.02) from the most likely token to the second most
likely at every prefix of every tested position, the hardest single 2-point move to see (between the
largest cells). Its noncentrality is ``sum n_prefix * 0.02**2 * (1/p1 + 1/p2)`` over the test's
cells; with ``SEEDS = 2048`` requests after the prompt ``"class "`` it is about 38 over 18 degrees
of freedom, so with the threshold at about 35 the test rejects such a shift with probability about
0.95 (computed by seeded Monte Carlo of the noncentral chi-square; the test asserts at least 0.9).
The statistic under the exact law stays well below the threshold (about 14 on the seeds of an
earlier version). :func:`test_the_check_rejects_a_two_point_shift` applies it to the same sample
against the 2-point-shifted law (about 47: rejected), so the power is not only on paper. Runtime:
about 100 s of CPU for the 2048 speculating requests (3 decode steps each at batch 512, every one
verified by rejection sampling) plus a second for the reference.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import pytest
import torch

pytest.importorskip("transformers.models.deepseek_v4", reason="transformers with DeepSeek-V4 not installed")
pytestmark = pytest.mark.requires_plugin("sync_sched")

from pypto_serving import LLM, SamplingParams  # noqa: E402
from pypto_serving.sampler import RowParams  # noqa: E402
from pypto_serving.spec_decode import processed_probs  # noqa: E402
from pypto_serving_deepseek_mtp.plugin import TINY_DEEPSEEK_V4  # noqa: E402
from tests.plugins.embedded import tokenize  # noqa: E402

SEEDS = 2048
ALPHA = 1e-2
SHIFT = 0.02
PROMPT = "class "
POSITIONS = (0, 1, 2)  # output positions tested: the prefill's draw, then the two the first decode verifies
TEMPERATURE, TOP_P, PRESENCE = 0.7, 0.9, 0.5
# Rejection-sampled requests verify no drafts within k + 2 outputs of max_tokens (the runner's cap
# that keeps async equal to sync): 6 lets the first decode step verify both drafts.
MAX_TOKENS = 6
MIN_EXPECTED = 20.0

Law = dict[tuple[int, ...], dict[int, float]]  # output prefix -> exact law of the next token


@pytest.fixture(scope="module")
def sample() -> tuple[list[tuple[int, ...]], dict[str, Any]]:
    """The first 3 output tokens of ``SEEDS`` requests, speculating, and the engine's stats."""
    prompt = tokenize(TINY_DEEPSEEK_V4, PROMPT)
    params = [
        SamplingParams(
            temperature=TEMPERATURE,
            top_p=TOP_P,
            presence_penalty=PRESENCE,
            max_tokens=MAX_TOKENS,
            ignore_eos=True,
        )
        for _ in range(SEEDS)
    ]
    with LLM(
        model=str(TINY_DEEPSEEK_V4),
        device="cpu",
        dtype="float32",
        worker_mode="inproc",
        scheduler="sync",
        max_num_seqs=512,
        max_num_batched_tokens=4096,
        seed=0,  # the requests' seeds come from the engine's: a user seed would take sample-and-compare
        speculative_config={"method": "mtp", "num_speculative_tokens": 2, "policy": "fixed"},
    ) as llm:
        outs = llm.generate([prompt] * SEEDS, params, use_tqdm=False)
        assert llm.engine is not None
        stats = llm.engine.stats()
    return [tuple(o.outputs[0].token_ids[:3]) for o in outs], stats


@pytest.fixture(scope="module")
def law(sample: tuple[list[tuple[int, ...]], dict[str, Any]]) -> Law:
    """The exact next-token law after every prefix (of 1 and 2 output tokens) the sample holds."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(TINY_DEEPSEEK_V4), dtype=torch.float32).eval()
    prompt = tokenize(TINY_DEEPSEEK_V4, PROMPT)
    prefixes = sorted({t[:n] for t in sample[0] for n in POSITIONS})
    out: Law = {}
    row = RowParams(temperature=TEMPERATURE, seed=0, draw_index=0, top_p=TOP_P)
    for n in POSITIONS:
        group = [p for p in prefixes if len(p) == n]
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + list(p) for p in group])).logits[:, -1].float()
        for i, p in enumerate(group):
            if p:
                logits[i, list(set(p))] -= PRESENCE  # the presence penalty of the tokens output so far
        probs = processed_probs(logits, [row] * len(group))
        for i, p in enumerate(group):
            kept = probs[i].nonzero().flatten().tolist()
            out[p] = {t: float(probs[i, t]) for t in kept}
    return out


def _cells(law: Law, prefix_counts: Counter[tuple[int, ...]]) -> list[tuple[tuple[int, ...], list[set[int]]]]:
    """Per prefix, its cells: single tokens expected at least ``MIN_EXPECTED`` times, the rest pooled."""
    cells = []
    for prefix, n in prefix_counts.items():
        big = {t for t, p in law[prefix].items() if n * p >= MIN_EXPECTED}
        rest = set(law[prefix]) - big
        groups = [{t} for t in sorted(big)] + ([rest] if n * sum(law[prefix][t] for t in rest) > 0 else [])
        if len(groups) > 1:
            cells.append((prefix, groups))
    return cells


def chi_square(tokens: list[tuple[int, ...]], law: Law) -> tuple[float, int]:
    """Goodness of fit of ``POSITIONS`` to their exact conditional laws: statistic, degrees of freedom.
    A token outside a prefix's support (impossible under the law) counts as infinitely unlikely."""
    stat, df = 0.0, 0
    for pos in POSITIONS:
        counts = Counter(t[:pos] for t in tokens)
        seen = Counter(t[: pos + 1] for t in tokens)
        for prefix, groups in _cells(law, counts):
            n = counts[prefix]
            for g in groups:
                expected = n * sum(law[prefix].get(t, 0.0) for t in g)
                observed = sum(seen[(*prefix, t)] for t in g)
                stat += (observed - expected) ** 2 / expected
            df += len(groups) - 1
            outside = sum(c for k, c in seen.items() if k[:pos] == prefix and k[pos] not in law[prefix])
            if outside:
                stat = math.inf
    return stat, df


def shifted(law: Law) -> Law:
    """``law`` with ``SHIFT`` of probability moved from the most likely token to the second, per prefix."""
    out: Law = {}
    for prefix, p in law.items():
        q = dict(p)
        top = sorted(q, key=q.__getitem__, reverse=True)
        if len(top) > 1:
            move = min(SHIFT, q[top[0]])
            q[top[0]] -= move
            q[top[1]] += move
        out[prefix] = q
    return out


def critical(df: int, alpha: float = ALPHA, draws: int = 400_000) -> float:
    """The 1 - alpha quantile of the chi-square law with ``df`` degrees of freedom (seeded Monte Carlo)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(draws, df, generator=gen, dtype=torch.float64).square().sum(1)
    return float(x.kthvalue(int(draws * (1 - alpha))).values)


def shifted_power(tokens: list[tuple[int, ...]], law: Law, draws: int = 200_000) -> tuple[float, float, int]:
    """Power of :func:`chi_square` against :func:`shifted`, at the sample's prefix counts: the
    noncentrality ``sum n (q - p)**2 / p`` over the test's cells, and the noncentral chi-square's mass
    above the threshold (seeded Monte Carlo). Returns (power, noncentrality, degrees of freedom)."""
    alt, lam, df = shifted(law), 0.0, 0
    for pos in POSITIONS:
        counts = Counter(t[:pos] for t in tokens)
        for prefix, groups in _cells(law, counts):
            n = counts[prefix]
            for g in groups:
                p = sum(law[prefix].get(t, 0.0) for t in g)
                q = sum(alt[prefix].get(t, 0.0) for t in g)
                lam += n * (q - p) ** 2 / p
            df += len(groups) - 1
    gen = torch.Generator().manual_seed(1)
    z = torch.randn(draws, df, generator=gen, dtype=torch.float64)
    z[:, 0] += math.sqrt(lam)
    return float((z.square().sum(1) > critical(df)).double().mean()), lam, df


def test_mtp_keeps_the_sampled_distribution(sample: tuple[list[tuple[int, ...]], dict[str, Any]], law: Law) -> None:
    tokens, stats = sample
    # Every request verified drafts in its first decode step, and the verifier accepted and rejected.
    assert stats["spec_drafted"] >= 2 * SEEDS and 0 < stats["spec_accepted"] < stats["spec_drafted"]
    stat, df = chi_square(tokens, law)
    assert df >= 10 and stat < critical(df), (stat, df, critical(df))
    power, lam, _ = shifted_power(tokens, law)
    assert power >= 0.9, (power, lam)


def test_the_check_rejects_a_two_point_shift(sample: tuple[list[tuple[int, ...]], dict[str, Any]], law: Law) -> None:
    """The same sample against the law shifted by 2 points (as a verifier that moved that much mass
    would draw from): rejected."""
    stat, df = chi_square(sample[0], shifted(law))
    assert stat > critical(df), (stat, df, critical(df))
