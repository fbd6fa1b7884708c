"""The batched sampler: greedy, temperature, top-k/p, min-p, penalties, logprobs, errors, seeding."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import pypto_serving.sampler as sampler_mod
from pypto_serving.sampler import RowParams, TokenCounts, _apply_penalties, sample, uniforms

Row = Callable[..., RowParams]
DRAWS = 4000


@pytest.fixture
def row() -> Row:
    def make(**kw: Any) -> RowParams:
        base: dict[str, Any] = {"temperature": 1.0, "seed": 0, "draw_index": 0}
        history = kw.pop("history", None)
        num_prompt = kw.pop("num_prompt", 0)
        if history is not None:  # a request with penalties: its prompt and outputs, as the runner keeps them
            base["counts"] = TokenCounts(prompt=history[:num_prompt], outputs=history[num_prompt:])
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
    logits = _apply_penalties(logits, [0], [row(repetition_penalty=2.0, history=[0, 1, 1], num_prompt=2)])
    assert logits.tolist() == [[1.0, -4.0, 1.0, 0.5]]  # prompt and output tokens, once each


def test_frequency_and_presence_penalties_count_outputs_only(row: Row) -> None:
    logits = torch.zeros(1, 4)
    p = row(frequency_penalty=0.5, presence_penalty=0.25, history=[3, 3, 0, 0, 0, 2], num_prompt=2)
    logits = _apply_penalties(logits, [0], [p])
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


class _Reductions(TorchDispatchMode):
    """Adds up the elements that ``max``, ``amax`` and ``argmax`` read inside it, and counts every operation."""

    def __init__(self) -> None:
        super().__init__()
        self.read = 0
        self.ops = 0  # every operation, reductions or not

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops += 1
        if func.overloadpacket.__name__ in ("max", "amax", "argmax"):
            self.read += args[0].numel()
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("vocab", [37, 151_936])
def test_greedy_rows_read_the_logits_once_and_equal_argmax(row: Row, vocab: int) -> None:
    """Greedy rows that nothing edits take their tokens and the non-finite check from one pass over
    the logits (the reductions' reads counted: ``amax`` then ``argmax`` read them twice): the tokens
    are ``argmax``'s (ties: the lowest id) and rows holding NaN or +inf are errors, on rows with
    planted ties (across and within blocks), NaNs, +infs and only -inf."""
    logits = torch.randint(-3, 4, (6, vocab), generator=torch.Generator().manual_seed(0)).float()
    logits[1, [vocab - 1, min(300, vocab - 2), 9, 5]] = 10.0  # ties in one block, in another, at the end of the row
    logits[2, [3, 7]] = torch.tensor([20.0, float("nan")])
    logits[3, [11, 4]] = torch.tensor([float("inf"), 30.0])
    logits[4] = float("-inf")
    with _Reductions() as reductions:
        out = sample(logits, [row(temperature=0.0) for _ in range(6)])
    assert reductions.read <= logits.numel() + 6 * (2 * 128 + vocab // 128 + 1), reductions.read
    assert set(out.errors) == {2, 3}
    expected = logits.argmax(dim=-1).tolist()
    assert [t for i, t in enumerate(out.tokens) if i not in (2, 3)] == [
        e for i, e in enumerate(expected) if i not in (2, 3)
    ]
    assert out.tokens[1] == 5 and out.tokens[4] == 0


def test_an_all_greedy_step_takes_the_executors_maxima_without_a_reduction(row: Row) -> None:
    """Every row greedy and unedited, with the executor's maxima: the tokens are its indices and
    rows whose maximum is NaN or +inf are errors, with no reduction over the logits; the result is
    the one-pass argmax's where the maxima are the logits' own. A row with logprobs takes its log-softmax."""
    logits = torch.randint(-3, 4, (4, 300), generator=torch.Generator().manual_seed(1)).float()
    logits[1, 7] = float("nan")
    logits[2, 9] = float("inf")
    params = [row(temperature=0.0) for _ in range(4)]
    own = sampler_mod.argmax_rows(logits)
    with _Reductions() as reductions:
        dev = sampler_mod.sample_on_device(logits, params, maxima=own)
    assert reductions.read == 0 and reductions.ops == 3  # the non-finite flags (two) and no-fallback flags
    out = sampler_mod.read_sample(dev, sampler_mod.packed(dev), params)
    assert out == sample(logits, params)
    assert set(out.errors) == {1, 2} and out.tokens[0] == int(logits[0].argmax())
    planted = (torch.zeros(4), torch.tensor([5, 6, 7, 8]))  # not the logits' argmax: taken as given
    dev = sampler_mod.sample_on_device(logits, params, maxima=planted)
    assert sampler_mod.read_sample(dev, sampler_mod.packed(dev), params).tokens == [5, 6, 7, 8]
    dev = sampler_mod.sample_on_device(logits, [*params[:3], row(temperature=0.0, num_logprobs=1)], maxima=own)
    assert dev.lp_rows == [3] and dev.raw is not None


def test_maxima_read_from_host_memory_equal_the_device_samples_read(row: Row) -> None:
    """``read_maxima`` (a CPU step's plain greedy rows) gives the tokens, logprobs and errors that the
    device sample of the same maxima gives through its packed read: NaN and +inf maxima are errors,
    a row whose every logit is -inf is not."""
    logits = torch.randint(-3, 4, (5, 300), generator=torch.Generator().manual_seed(2)).float()
    logits[1, 7] = float("nan")
    logits[2, 9] = float("inf")
    logits[3] = float("-inf")
    params = [row(temperature=0.0) for _ in range(5)]
    for maxima in (sampler_mod.argmax_rows(logits), (torch.zeros(5), torch.tensor([5, 6, 7, 8, 9]))):
        dev = sampler_mod.sample_on_device(logits, params, maxima=maxima)
        expected = sampler_mod.read_sample(dev, sampler_mod.packed(dev), params)
        assert sampler_mod.read_maxima(maxima) == expected
    assert set(sampler_mod.read_maxima(sampler_mod.argmax_rows(logits)).errors) == {1, 2}


def test_edited_greedy_rows_still_take_the_argmax_of_the_edited_logits(row: Row) -> None:
    """A banned token (min_tokens' EOS) changes the row: its token is the argmax after the ban."""
    logits = torch.tensor([[1.0, 9.0, 8.0], [7.0, 1.0, 2.0]])
    out = sample(logits, [row(temperature=0.0, banned=(1,)), row(temperature=0.0)])
    assert out.tokens == [2, 0]


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


# ---------------------------------------------------------------- against a brute-force reference


def penalised(logits: list[float], p: RowParams, prompt: list[int], outputs: list[int]) -> list[float]:
    vals = list(logits)
    for t in set(prompt + outputs):
        if p.repetition_penalty != 1.0:
            vals[t] = vals[t] / p.repetition_penalty if vals[t] > 0 else vals[t] * p.repetition_penalty
    for t, c in Counter(outputs).items():
        vals[t] -= p.frequency_penalty * c + p.presence_penalty
    return vals


def reference(logits: list[float], p: RowParams, prompt: list[int], outputs: list[int]) -> list[float]:
    """The exact filtered distribution of one row, computed independently in plain Python."""
    vals = penalised(logits, p, prompt, outputs)
    for t in p.banned:
        vals[t] = -math.inf
    order = sorted(range(len(vals)), key=lambda i: -vals[i])
    if 0 < p.top_k < len(vals):
        order = order[: p.top_k]
    top = max(vals[i] for i in order) / p.temperature
    weights = {i: math.exp(vals[i] / p.temperature - top) for i in order}
    total = sum(weights.values())
    kept, above = [], 0.0
    for i in order:
        if kept and p.top_p < 1.0 and above > p.top_p:
            break
        kept.append(i)
        above += weights[i] / total
    kept = [i for i in kept if weights[i] >= p.min_p]  # weights are relative to the best token
    z = sum(weights[i] for i in kept)
    return [weights[i] / z if i in kept else 0.0 for i in range(len(vals))]


def total_variation(counts: Counter[int], probs: list[float], draws: int) -> float:
    return 0.5 * sum(abs(counts[t] / draws - q) for t, q in enumerate(probs))


CASES: list[dict[str, Any]] = [
    dict(temperature=1.0),
    dict(temperature=0.7, top_k=5),
    dict(temperature=1.3, top_p=0.6),
    dict(temperature=1.0, top_k=8, top_p=0.8),
    dict(temperature=0.9, min_p=0.1),
    dict(temperature=1.0, top_p=0.9, min_p=0.05, banned=(3,)),
    dict(temperature=1.0, top_k=10, repetition_penalty=1.5, frequency_penalty=0.3, presence_penalty=0.2),
]


@pytest.mark.parametrize("candidates", [4, 256])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_sampled_frequencies_match_the_reference(
    row: Row, case: int, candidates: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over many seeds and draw indices, the sampled frequencies are the exact filtered distribution
    (total variation within sampling noise), and no token outside it is ever drawn. With 4
    candidates most top-p/min-p rows reach past the bounded set and take the fallback."""
    monkeypatch.setattr(sampler_mod, "CANDIDATES", candidates)
    gen = torch.Generator().manual_seed(case)
    logits = torch.randn(24, generator=gen) * 1.5
    prompt, outputs = [1, 2, 5], [5, 7, 7, 0]
    kw = dict(CASES[case])
    if "frequency_penalty" in kw:
        kw.update(history=prompt + outputs, num_prompt=len(prompt))
    params = [row(seed=1000 + i, draw_index=i % 7, **kw) for i in range(DRAWS)]
    probs = reference(logits.tolist(), params[0], *((prompt, outputs) if "history" in kw else ([], [])))
    counts = Counter(sample(logits.expand(DRAWS, -1), params).tokens)
    assert all(probs[t] > 0 for t in counts), "a filtered-out token was drawn"
    assert total_variation(counts, probs, DRAWS) < 0.05


def inverse_cdf(probs: list[float], u: float) -> int:
    """The first token, in id order, whose cumulative probability exceeds ``u`` of the total."""
    goal, total = u * sum(probs), 0.0
    for t, q in enumerate(probs):
        total += q
        if q > 0 and total > goal:
            return t
    return max(t for t, q in enumerate(probs) if q > 0)


@pytest.mark.parametrize("candidates", [4, 256])
def test_a_row_takes_the_token_where_its_uniform_falls_in_its_kept_tokens_in_id_order(
    row: Row, candidates: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Draw by draw, every filter's token is the reference's inverse CDF over the kept tokens taken in
    id order (top-k and top-p rank tokens by logit, but the draw walks ids: the order an executor's
    kernel draws in without sorting the vocabulary); with 4 candidates most top-p/min-p rows take the
    full-vocabulary fallback."""
    monkeypatch.setattr(sampler_mod, "CANDIDATES", candidates)
    gen = torch.Generator().manual_seed(11)
    for case, kw in enumerate(CASES):
        if "frequency_penalty" in kw or "banned" in kw:
            continue
        logits = torch.randn(3, 40, generator=gen) * (0.5 + case)
        for s in range(30):
            params = [row(seed=s * 3 + r, draw_index=s, **kw) for r in range(3)]
            got = sample(logits, params).tokens
            u = uniforms(torch.tensor([p.seed for p in params]), torch.tensor([s] * 3)).tolist()
            want = [inverse_cdf(reference(logits[r].tolist(), params[r], [], []), u[r]) for r in range(3)]
            assert got == want, (kw, s)


def test_the_candidate_bound_never_changes_a_token(row: Row, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows whose top-p/min-p kept set fits the bounded candidates and rows that fall back to the full
    vocabulary give the tokens an unbounded run gives, draw for draw."""
    gen = torch.Generator().manual_seed(7)
    logits = torch.cat([torch.randn(2, 300, generator=gen) * 6, torch.randn(2, 300, generator=gen) * 0.3])
    params = [row(seed=s, draw_index=s, top_p=0.85, min_p=0.01 * (s % 3), num_logprobs=1) for s in range(4)]
    monkeypatch.setattr(sampler_mod, "CANDIDATES", 16)  # peaked rows fit, flat rows fall back
    dev = sampler_mod.sample_on_device(logits, params)
    assert dev.needs_full.tolist() == [False, False, True, True]
    for s in range(50):
        params = [row(seed=s, draw_index=s + i, top_p=0.85, min_p=0.01 * (i % 3), num_logprobs=1) for i in range(4)]
        monkeypatch.setattr(sampler_mod, "CANDIDATES", 16)
        bounded = sample(logits, params)
        monkeypatch.setattr(sampler_mod, "CANDIDATES", 10_000)
        assert sample(logits, params) == bounded
        for r, t in enumerate(bounded.tokens):  # the chosen logprob follows a re-sampled token
            assert (bounded.logprobs[r] or {})[t] == pytest.approx(float(torch.log_softmax(logits[r], -1)[t]))


def test_uniforms_are_a_pure_function_of_seed_and_index() -> None:
    seeds = torch.arange(20_000, dtype=torch.long) * 7919 + 2**62
    index = torch.arange(20_000, dtype=torch.long) % 97
    u = uniforms(seeds, index)
    assert u.dtype == torch.float64 and float(u.min()) >= 0.0 and float(u.max()) < 1.0
    one = [float(uniforms(seeds[i : i + 1], index[i : i + 1])) for i in range(0, 20_000, 997)]
    assert one == u[::997].tolist()  # the same value alone as in any batch
    hist = torch.histc(u.float(), bins=10, min=0.0, max=1.0) / len(u)
    assert float((hist - 0.1).abs().max()) < 0.01
    assert len(set(uniforms(torch.full((100,), 5), torch.arange(100)).tolist())) == 100


def test_seeded_rows_of_every_kind_are_independent_of_batch(row: Row, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sampler_mod, "CANDIDATES", 8)
    gen = torch.Generator().manual_seed(3)
    kinds: list[dict[str, Any]] = [
        dict(top_k=5),
        dict(top_p=0.9),
        dict(min_p=0.2),
        dict(),
        dict(top_k=3, frequency_penalty=0.5, history=[1, 2, 3], num_prompt=1),
    ]
    for seed in range(30):
        target = torch.randn(1, 60, generator=gen) * (seed % 3)
        p = row(seed=seed, draw_index=seed % 5, **kinds[seed % len(kinds)])
        alone = sample(target, [p]).tokens[0]
        others = [row(seed=seed + i, temperature=[0.0, 0.8][i % 2], **kinds[i % len(kinds)]) for i in range(6)]
        pos = seed % 7
        batch = torch.cat([torch.randn(pos, 60, generator=gen), target, torch.randn(6 - pos, 60, generator=gen)])
        assert sample(batch, [*others[:pos], p, *others[pos:]]).tokens[pos] == alone


def test_counts_fold_in_added_tokens_and_drafts_stay_per_row(row: Row) -> None:
    counts = TokenCounts(prompt=[0, 9], outputs=[1])
    logits = torch.zeros(3, 4)
    params = [
        row(temperature=0.0, frequency_penalty=1.0, counts=counts),
        row(temperature=0.0, frequency_penalty=1.0, counts=counts, drafts=(2,)),
        row(temperature=0.0, frequency_penalty=1.0, counts=counts, drafts=(2, 2)),
    ]
    assert _apply_penalties(logits, [0, 1, 2], params).tolist() == [
        [0.0, -1.0, 0.0, 0.0],
        [0.0, -1.0, -1.0, 0.0],
        [0.0, -1.0, -2.0, 0.0],
    ]
    counts.extend([1, 3])
    seen, minus = counts.tensors(4, logits.device, params[0])
    assert minus.tolist() == [0.0, 2.0, 0.0, 1.0]  # the drafts did not stay
    assert seen.tolist() == [True, True, False, True]  # 9 is out of range


def test_counts_kept_across_steps_penalise_like_the_whole_history(row: Row) -> None:
    """The runner's per-step use: counts built once, extended with each step's kept tokens, read with
    the row's drafts; the penalties equal those of the full history, recomputed from scratch."""
    gen = torch.Generator().manual_seed(11)
    vocab = 32
    prompt = torch.randint(0, vocab, (20,), generator=gen).tolist()
    outputs: list[int] = []
    counts = TokenCounts(prompt=prompt, outputs=[])
    kw = dict(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2)
    for _ in range(12):
        logits = torch.randn(1, vocab, generator=gen) * 3
        drafts = torch.randint(0, vocab, (int(torch.randint(0, 3, ()).item()),), generator=gen).tolist()
        p = row(counts=counts, drafts=tuple(drafts), **kw)
        got = _apply_penalties(logits, [0], [p])[0].tolist()
        assert got == pytest.approx(penalised(logits[0].tolist(), p, prompt, outputs + drafts), rel=1e-6, abs=1e-6)
        kept = torch.randint(0, vocab, (int(torch.randint(1, 4, ()).item()),), generator=gen).tolist()
        counts.extend(kept)
        outputs += kept


def _edited_reference(logits: torch.Tensor, bias: dict[int, float], allowed: list[int] | None) -> torch.Tensor:
    """The hand-made edit of logits rows: bias added, every token outside ``allowed`` at -inf."""
    ref = logits.clone().float()
    for t, b in bias.items():
        ref[:, t] += b
    if allowed is not None:
        keep = torch.zeros(ref.shape[1], dtype=torch.bool)
        keep[allowed] = True
        ref[:, ~keep] = float("-inf")
    return ref


@pytest.mark.parametrize("kw", [{"temperature": 0.0}, {"temperature": 1.0}, {"temperature": 0.8, "top_p": 0.9}])
def test_logit_bias_and_allowed_tokens_equal_editing_the_logits_by_hand(kw: dict[str, Any]) -> None:
    """Each row samples exactly what the same row samples from logits edited by hand, seed by seed."""
    from pypto_serving.sampler import LogitEdits

    gen = torch.Generator().manual_seed(0)
    vocab = 64
    logits = torch.randn(32, vocab, generator=gen) * 3
    cases = [({5: 30.0, 6: -100.0}, None), ({}, [1, 2, 3, 40]), ({2: 3.0, 40: -2.0}, [2, 3, 40, 41])]
    for bias, allowed in cases:
        edits = LogitEdits(bias=tuple(bias.items()), allowed=tuple(allowed) if allowed else None)
        mine = [RowParams(seed=s, draw_index=s % 3, edits=edits, **kw) for s in range(32)]
        plain = [RowParams(seed=s, draw_index=s % 3, **kw) for s in range(32)]
        got = sample(logits, mine).tokens
        assert got == sample(_edited_reference(logits, bias, allowed), plain).tokens
        if allowed is not None:
            assert set(got) <= set(allowed)
        if 5 in bias and kw["temperature"] == 0.0:
            assert got == [5] * 32  # +30 outweighs any gap between these logits


def test_a_row_with_every_token_banned_is_flagged_not_drawn() -> None:
    from pypto_serving.sampler import LogitEdits

    logits = torch.randn(3, 16, generator=torch.Generator().manual_seed(1))
    only_3 = LogitEdits(bias=(), allowed=(3,))
    params = [
        RowParams(temperature=0.0, seed=0, draw_index=0, edits=only_3),
        RowParams(temperature=1.0, seed=0, draw_index=0, edits=only_3, banned=(3,)),  # allowed and banned
        RowParams(temperature=0.0, seed=0, draw_index=0, edits=only_3, banned=(3,)),
    ]
    out = sample(logits, params)
    assert out.tokens[0] == 3 and out.empty == {1, 2} and not out.errors


def test_unmasked_draw_of_rows_listed_by_disallowed_id_equals_the_masked_draw() -> None:
    """A whole-vocabulary row drawn from its unmasked logits with the disallowed weights zeroed after
    each exp takes the token the masked row takes, at 500 uniforms spread over [0, 1) per row (the
    weights keep their bits, so no boundary moves), with tokens past the tokenizer's disallowed."""
    gen = torch.Generator().manual_seed(3)
    vocab, tokenizer_vocab, rows, per_row = 5000, 4990, 4, 500
    unmasked = (torch.randn(rows, vocab, generator=gen) * 3).bfloat16().float()
    banned = torch.stack([torch.randperm(tokenizer_vocab, generator=gen)[:700].sort().values for _ in range(rows)])
    masked = unmasked.clone()
    masked.scatter_(1, banned, float("-inf"))
    masked[:, tokenizer_vocab:] = float("-inf")
    pick = torch.arange(rows).repeat_interleave(per_row)
    temps = [0.5 + 0.25 * r for r in range(rows)]
    params = [RowParams(temperature=temps[int(r)], seed=0, draw_index=0) for r in pick]
    spread = torch.arange(rows * per_row, dtype=torch.float64) % per_row
    u = (spread + torch.rand(rows * per_row, generator=gen).double()) / per_row
    got = sampler_mod._draw_unmasked(masked[pick], unmasked[pick], banned[pick], tokenizer_vocab, params, u)
    want, _ = sampler_mod._draw(masked[pick], "all", vocab, params, u)
    assert torch.equal(got, want)
    for r, t in zip(pick.tolist(), got.tolist()):
        assert t < tokenizer_vocab and t not in set(banned[r].tolist())


@pytest.mark.parametrize("vocab", [1, 5, 128, 129, 300, 1000])
def test_argmax_rows_equals_amax_and_argmax(vocab: int) -> None:
    """Every vocabulary size (under, at and past a block, partial last blocks), rows of few distinct
    values (many ties), with NaN, +inf and -inf planted."""
    gen = torch.Generator().manual_seed(vocab)
    for trial in range(50):
        x = torch.randint(-2, 3, (7, vocab), generator=gen).float()
        for value, share in ((float("nan"), 0.01), (float("inf"), 0.01), (float("-inf"), 0.3)):
            if trial % 4:
                x[torch.rand(x.shape, generator=gen) < share] = value
        x[0] = float("-inf")
        peak, index = sampler_mod.argmax_rows(x)
        assert torch.equal(index, x.argmax(dim=-1)), (trial, index, x.argmax(dim=-1))
        torch.testing.assert_close(peak, x.amax(dim=-1), rtol=0, atol=0, equal_nan=True)
