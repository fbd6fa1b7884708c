"""The batched sampler: greedy, temperature, top-k/p, min-p, penalties, logprobs, errors, seeding."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch

from pypto_serving.sampler import RowParams, _apply_penalties, sample

Row = Callable[..., RowParams]
DRAWS = 4000


@pytest.fixture
def row() -> Row:
    def make(**kw: Any) -> RowParams:
        base: dict[str, Any] = dict(
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            min_p=0.0,
            presence_penalty=0.0,
            frequency_penalty=0.0,
            repetition_penalty=1.0,
            seed=0,
            draw_index=0,
            num_logprobs=None,
            banned=(),
            history=[],
            num_prompt=0,
        )
        base.update(kw)
        return RowParams(**base)

    return make


PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])
LOGITS = PROBS.log()


def draw_many(row: Row, logits: torch.Tensor = LOGITS, **kw: Any) -> Counter[int]:
    """DRAWS draws of one distribution, one row per draw index (deterministic)."""
    params = [row(draw_index=i, seed=12345, **kw) for i in range(DRAWS)]
    return Counter(sample(logits.expand(DRAWS, -1), params).tokens)


def test_greedy_takes_argmax(row: Row) -> None:
    logits = torch.tensor([[0.1, 3.0, 2.0], [5.0, -1.0, 4.9]])
    assert sample(logits, [row(temperature=0.0), row(temperature=0.0)]).tokens == [1, 0]


def test_temperature_samples_the_softmax(row: Row) -> None:
    counts = draw_many(row)
    for t, p in enumerate(PROBS.tolist()):
        assert abs(counts[t] / DRAWS - p) < 0.03
    hot = draw_many(row, temperature=3.0)  # flatter: the rare token gets more mass
    cold = draw_many(row, temperature=0.3)  # sharper
    assert hot[3] > counts[3] > cold[3]
    assert cold[0] > counts[0] > hot[0]


def test_top_k(row: Row) -> None:
    counts = draw_many(row, top_k=2)
    assert set(counts) == {0, 1}
    assert abs(counts[0] / DRAWS - 0.5 / 0.8) < 0.03
    assert set(draw_many(row, top_k=1)) == {0}


@pytest.mark.parametrize(("top_p", "kept"), [(0.4, {0}), (0.75, {0, 1}), (0.9, {0, 1, 2}), (1.0, {0, 1, 2, 3})])
def test_top_p(row: Row, top_p: float, kept: set[int]) -> None:
    assert set(draw_many(row, top_p=top_p)) == kept


@pytest.mark.parametrize(("min_p", "kept"), [(0.05, {0, 1, 2, 3}), (0.2, {0, 1, 2}), (0.5, {0, 1}), (1.0, {0})])
def test_min_p(row: Row, min_p: float, kept: set[int]) -> None:
    assert set(draw_many(row, min_p=min_p)) == kept


def test_filters_are_per_row(row: Row) -> None:
    logits = LOGITS.expand(2, -1)
    for i in range(200):
        out = sample(logits, [row(top_k=1, seed=i), row(seed=i)]).tokens
        assert out[0] == 0
    free = Counter(
        sample(LOGITS.expand(400, -1), [row(top_k=1, seed=i) if i % 2 else row(seed=i) for i in range(400)]).tokens[::2]
    )
    assert len(free) > 1


def test_repetition_penalty(row: Row) -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    _apply_penalties(logits, [0], [row(repetition_penalty=2.0, history=[0, 1, 1], num_prompt=2)])
    assert logits.tolist() == [[1.0, -4.0, 1.0, 0.5]]  # prompt and output tokens, once each


def test_frequency_and_presence_penalties_count_outputs_only(row: Row) -> None:
    logits = torch.zeros(1, 4)
    p = row(frequency_penalty=0.5, presence_penalty=0.25, history=[3, 3, 0, 0, 0, 2], num_prompt=2)
    _apply_penalties(logits, [0], [p])
    # outputs: 0 x3, 2 x1; token 3 only in the prompt
    assert logits.tolist() == [[-(0.5 * 3 + 0.25), 0.0, -(0.5 + 0.25), 0.0]]


def test_penalties_change_the_greedy_choice(row: Row) -> None:
    logits = torch.tensor([[2.0, 1.9, 0.0]])
    assert sample(logits, [row(temperature=0.0, history=[5, 0], num_prompt=1)]).tokens == [0]
    assert sample(logits, [row(temperature=0.0, presence_penalty=0.5, history=[5, 0], num_prompt=1)]).tokens == [1]
    assert sample(logits, [row(temperature=0.0, repetition_penalty=1.2, history=[0], num_prompt=1)]).tokens == [1]


def test_banned_tokens(row: Row) -> None:
    logits = torch.tensor([[5.0, 1.0, 0.0]])
    assert sample(logits, [row(temperature=0.0, banned=(0,))]).tokens == [1]


def test_logprobs_top_n(row: Row) -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    ref = torch.log_softmax(logits, -1)[0]
    out = sample(logits, [row(temperature=0.0, num_logprobs=2)])
    assert out.tokens == [1]
    lp = out.logprobs[0]
    assert lp is not None and set(lp) == {1, 2}
    for t, v in lp.items():
        assert v == pytest.approx(float(ref[t]))
    # the sampled token is always included, even outside the top N
    forced = sample(logits, [row(temperature=0.0, num_logprobs=1, banned=(1, 2))])
    assert forced.tokens == [0] and set(forced.logprobs[0] or {}) == {0, 1}
    zero = sample(logits, [row(temperature=0.0, num_logprobs=0)])
    assert set(zero.logprobs[0] or {}) == {1}
    assert sample(logits, [row(temperature=0.0)]).logprobs == [None]


def test_logprobs_are_before_penalties(row: Row) -> None:
    logits = torch.tensor([[1.0, 3.0]])
    ref = torch.log_softmax(logits, -1)[0]
    out = sample(logits, [row(temperature=0.0, num_logprobs=1, frequency_penalty=2.0, history=[1], num_prompt=0)])
    assert out.tokens == [0]
    assert out.logprobs[0] == pytest.approx({0: float(ref[0]), 1: float(ref[1])})


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_rows_are_errors(row: Row, bad: float) -> None:
    logits = torch.tensor([[1.0, 2.0, 0.0], [1.0, bad, 0.0], [3.0, 2.0, 1.0]])
    out = sample(logits, [row(temperature=0.0), row(), row(temperature=0.0)])
    assert set(out.errors) == {1} and "non-finite" in out.errors[1]
    assert out.tokens[0] == 1 and out.tokens[2] == 0


def test_negative_infinity_is_not_an_error(row: Row) -> None:
    out = sample(torch.tensor([[float("-inf"), 1.0, 0.0]]), [row()])
    assert out.errors == {} and out.tokens[0] in (1, 2)


def test_seeded_row_is_independent_of_batch(row: Row) -> None:
    torch.manual_seed(0)
    vocab = 50
    target = torch.randn(vocab)
    for seed in range(40):
        p = row(seed=seed, draw_index=seed % 7, temperature=0.9, top_p=0.9)
        alone = sample(target.unsqueeze(0), [p]).tokens[0]
        others = torch.randn(5, vocab)
        pos = seed % 6
        batch = torch.cat([others[:pos], target.unsqueeze(0), others[pos:]])
        params = [row(seed=seed + 100 + i, temperature=[0.0, 0.5, 1.5][i % 3], top_k=i) for i in range(5)]
        params.insert(pos, p)
        assert sample(batch, params).tokens[pos] == alone
    # and the seed matters
    draws = {sample(target.unsqueeze(0), [row(seed=s, temperature=1.0)]).tokens[0] for s in range(40)}
    assert len(draws) > 3
