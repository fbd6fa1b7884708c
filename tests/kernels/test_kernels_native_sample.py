"""The native draw of sampled rows (csrc/sample.c) against a plain-Python float64 reference of the
sampler's rule and against the sampler's torch draw."""

from __future__ import annotations

import math
import random
from typing import Any

import pytest
import torch

from pypto_kernels import native

pytestmark = pytest.mark.skipif(native.library() is None, reason="the native CPU kernels did not build")


def reference(x: list[float], t: float, k: int, p: float, min_p: float, u: float) -> int:
    """The rule written out: weights e**(x/t - max) in float64, tokens ranked by logit with ties by
    lower id (-0 as +0), the k best, of those the best whose mass ahead is at most p of theirs (the
    best always), less those under max + log(min_p); the first token in id order whose cumulative
    weight exceeds u of the kept total."""
    v = (torch.tensor(x, dtype=torch.float32) / torch.tensor(t, dtype=torch.float32)).double().tolist()
    top = max(v)
    w = [math.exp(a - top) for a in v]
    ranked = sorted(range(len(x)), key=lambda i: (-(x[i] + 0.0), i))
    if 0 < k < len(x):
        ranked = ranked[:k]
    kept, ahead, mass = [], 0.0, sum(w[i] for i in ranked)
    for j, i in enumerate(ranked):
        if j and p < 1.0 and ahead > p * mass:
            break
        kept.append(i)
        ahead += w[i]
    if min_p > 0:
        floor = float(torch.tensor(top, dtype=torch.float32) + torch.tensor(math.log(min_p), dtype=torch.float32))
        kept = [i for i in kept if v[i] >= floor]
    goal, total = u * sum(w[i] for i in kept), 0.0
    for i in sorted(kept):
        total += w[i]
        if total > goal:
            return i
    return max(kept)


def draw(x: torch.Tensor, rows: list[int] | None, params: list[tuple[float, int, float, float, float]]) -> list[int]:
    t, k, p, mp, u = zip(*params, strict=True)
    picked = None if rows is None else torch.tensor(rows)
    tokens = native.sample_rows(
        x,
        picked,
        torch.tensor(t),
        torch.tensor(k),
        torch.tensor(p),
        torch.tensor(mp),
        torch.tensor(u, dtype=torch.float64),
    )
    return tokens.tolist()


def test_rows_take_the_references_token() -> None:
    """Ragged vocabularies (1 to 4,099 words: tails past the 16-lane vectors and the 128-token blocks),
    ties (logits on a grid), banned tokens, every filter alone and together, k at and past the
    vocabulary: the reference's token on every row."""
    rng, gen = random.Random(0), torch.Generator().manual_seed(0)
    checked = 0
    for _ in range(150):
        vocab = rng.choice([1, 2, 5, 17, 128, 300, 1000, 4099])
        x = torch.randn(vocab, generator=gen) * rng.choice([0.5, 2.0, 8.0])
        if rng.random() < 0.3:
            x = torch.round(x * 2) / 2
        if vocab > 3 and rng.random() < 0.3:
            x[rng.randrange(vocab)] = -math.inf
        temps, ks, ps = [0.3, 1.0, 1.5], [0, 1, 3, 20, vocab, vocab + 5], [1.0, 0.9, 0.5, 0.05]
        params = [
            (rng.choice(temps), rng.choice(ks), rng.choice(ps), rng.choice([0.0, 0.0, 0.1]), rng.random())
            for _ in range(4)
        ]
        got = draw(x.unsqueeze(0).repeat(4, 1), None, params)
        assert got == [reference(x.tolist(), *q) for q in params], params
        checked += 4
    assert checked == 600


@pytest.mark.parametrize("scale", [0.3, 4.0])
def test_a_full_vocabulary_takes_the_references_token(scale: float) -> None:
    """151,936 words, flat and peaked, with ties on a grid: top-p's boundary found through the
    histogram's three levels (and the ties left at its last) as the reference's sort finds it."""
    gen, rng = torch.Generator().manual_seed(1), random.Random(1)
    for grid in (False, True):
        x = torch.randn(151_936, generator=gen) * scale
        if grid:
            x = torch.round(x * 8) / 8
        params = [
            (0.7, 0, 0.95, 0.0, rng.random()),
            (1.0, 0, 0.5, 0.05, rng.random()),
            (1.0, 500, 0.9, 0.0, rng.random()),
        ]
        got = draw(x.unsqueeze(0).expand(3, -1), None, params)
        assert got == [reference(x.tolist(), *q) for q in params]


def test_picked_rows_and_threads_do_not_change_a_token() -> None:
    """A row's token is the same drawn alone, among others, picked by index from a larger batch, and
    on one thread or two."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(9, 3000, generator=gen) * 2
    params = [(1.0, [0, 40][r % 2], [1.0, 0.8][r // 2 % 2], 0.0, (r + 0.5) / 9) for r in range(9)]
    whole = draw(x, None, params)
    assert [draw(x[r : r + 1], None, [params[r]])[0] for r in range(9)] == whole
    assert draw(x, [7, 2, 2], [params[7], params[2], params[2]]) == [whole[7], whole[2], whole[2]]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert draw(x, None, params) == whole
    finally:
        torch.set_num_threads(threads)


def test_rows_the_sampler_reports_draw_their_first_maximum() -> None:
    """NaN, +inf and every-token-banned rows (the sampler's errors) get a token and no crash."""
    x = torch.zeros(3, 50)
    x[0, 7], x[1, 9], x[2] = math.nan, math.inf, -math.inf
    got = draw(x, None, [(1.0, 0, 0.9, 0.0, 0.5)] * 3)
    assert got[1] == 9 and got[2] == 0 and 0 <= got[0] < 50


def test_bad_input_is_refused() -> None:
    x = torch.randn(2, 10)
    with pytest.raises(ValueError, match="one parameter a row"):
        draw(x, None, [(1.0, 0, 1.0, 0.0, 0.5)])
    with pytest.raises(ValueError, match="outside"):
        draw(x, [2], [(1.0, 0, 1.0, 0.0, 0.5)])
    assert not native.sample_rows_takes(x.double()) and not native.sample_rows_takes(x.t())


def test_the_sampler_with_the_kernel_draws_the_torch_draws_tokens() -> None:
    """pypto_serving's sampler handed the kernel (as the Qwen and DeepSeek executors hand it on the CPU)
    gives the tokens its torch ops give, row by row, over every filter and the full vocabulary, and
    the kernel drew them all (the grammar-listed rows aside, which no step here has)."""
    sampler = pytest.importorskip("pypto_serving.sampler")
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(12, 151_936, generator=gen) * torch.tensor([0.5, 3.0, 8.0]).repeat(4).unsqueeze(1)
    cases: list[dict[str, Any]] = [
        {}, {"top_k": 20}, {"top_p": 0.95}, {"top_p": 0.8, "top_k": 50}, {"min_p": 0.05}, {"temperature": 0.0},
    ]  # fmt: skip
    kernel = native.SampleDraw()
    for s in range(3):
        params = [
            sampler.RowParams(**{"temperature": 0.8, "seed": 100 * s + r, "draw_index": s, **cases[r % len(cases)]})
            for r in range(12)
        ]
        assert sampler.sample(logits, params, draw=kernel).tokens == sampler.sample(logits, params).tokens
    assert kernel.rows == 3 * 10  # the two greedy rows of each step take their argmax


def test_the_c_uniform_is_the_samplers() -> None:
    """The native loop's uniform of (seed, output index) (``pypto_sample_uniform``) is the sampler's
    ``uniforms``, bit for bit, over seeds of every size and sign."""
    sampler = pytest.importorskip("pypto_serving.sampler")
    lib = native.library()
    assert lib is not None
    gen = torch.Generator().manual_seed(4)
    seeds = torch.cat([torch.randint(-(2**63), 2**63 - 1, (200,), generator=gen), torch.tensor([0, -1, 2**63 - 1])])
    index = torch.randint(0, 1 << 40, (seeds.shape[0],), generator=gen)
    want = sampler.uniforms(seeds, index).tolist()
    assert [lib.pypto_sample_uniform(int(s), int(i)) for s, i in zip(seeds, index, strict=True)] == want
