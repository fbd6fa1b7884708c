"""Sampler: turns logits rows into tokens, batched over rows, on the logits' device.

Every tensor lives on ``logits.device`` and the step reads the host once, at the end (one
``tolist()`` of the tokens, error flags and logprobs); a second read happens only when a row needs
the full-vocabulary fallback described below.

Greedy rows take one ``argmax``. Sampled rows draw from a candidate set taken by ``topk``, never by
sorting the vocabulary: the row's own top-k when it sets one (exact), otherwise the best
``CANDIDATES`` tokens when it sets top-p or min-p. That bounded set is exact when the tokens past it
are filtered out anyway (the candidates hold more than top-p of the mass, or the last candidate is
below min-p); the sampler checks this on the device and re-samples a row that fails it over the
sorted full vocabulary, so results never depend on the bound. Rows without any filter draw over
the whole (unsorted) vocabulary.

Randomness is a pure function of ``(request seed, output index)``: a counter-based integer hash of
the two gives one uniform per row, and the row takes the token where that uniform falls in the
cumulative distribution of its kept candidates (inverse CDF). Every operation is row-wise and a
row's path depends only on its own parameters and logits, so a seeded request samples the same
tokens in any batch, after preemption, and under sync and async scheduling alike.

Penalties read a per-request :class:`TokenCounts` kept on the device: the prompt's tokens and the
outputs' counts, updated with the few tokens each step adds, never rebuilt from the history.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt
import torch

__all__ = [
    "CANDIDATES",
    "DeviceSample",
    "RowParams",
    "SampleOutput",
    "SamplingRows",
    "TokenCounts",
    "packed",
    "sample",
    "sample_on_device",
    "uniforms",
]

CANDIDATES = 256  # bounded candidate set of rows with top-p or min-p and no top-k
_GOLDEN = 0x9E3779B97F4A7C15 - 2**64  # splitmix64 constants as signed int64 (tensor arithmetic wraps)
_MUL1 = 0xBF58476D1CE4E5B9 - 2**64
_MUL2 = 0x94D049BB133111EB - 2**64


class TokenCounts:
    """A request's token statistics for the penalties, kept on the device across steps: which
    tokens the prompt or outputs hold (repetition penalty), how often each output token occurs, and
    the amount the frequency and presence penalties subtract. Tokens the runner adds wait on the
    host until the next sample folds them in, touching only their own entries."""

    __slots__ = ("_counts", "_pending", "_prompt", "_seen", "_subtract")

    def __init__(self, *, prompt: list[int], outputs: list[int]) -> None:
        self._prompt: list[int] | None = prompt
        self._pending = list(outputs)
        self._seen = self._counts = self._subtract = torch.empty(0)

    def extend(self, tokens: list[int]) -> None:
        self._pending += tokens

    def tensors(
        self, vocab: int, device: torch.device, *, frequency: float, presence: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(seen bool [V], subtract float [V])`` with every added token folded in; ``subtract`` is
        ``frequency * count + presence * (count > 0)`` of the outputs (the request's penalties)."""
        if self._prompt is not None:
            prompt = torch.tensor([t for t in self._prompt if 0 <= t < vocab], dtype=torch.long, device=device)
            self._seen = torch.zeros(vocab, dtype=torch.bool, device=device).index_fill(0, prompt, True)
            self._counts = torch.zeros(vocab, dtype=torch.float32, device=device)
            self._subtract = torch.zeros(vocab, dtype=torch.float32, device=device)
            self._prompt = None
        pending = [t for t in self._pending if 0 <= t < vocab]
        if pending:
            idx = torch.tensor(pending, dtype=torch.long, device=device)
            self._counts.index_add_(0, idx, torch.ones(len(pending), device=device))
            self._seen.index_fill_(0, idx, True)
            counts = self._counts.index_select(0, idx)
            self._subtract.index_copy_(0, idx, frequency * counts + presence * (counts > 0).to(counts.dtype))
        self._pending = []
        return self._seen, self._subtract

    def counts_at(self, idx: torch.Tensor) -> torch.Tensor:
        return self._counts.index_select(0, idx)


@dataclass(slots=True, kw_only=True)
class RowParams:
    """How to sample one logits row. Filters and penalties default to off."""

    temperature: float
    seed: int
    draw_index: int  # the request's output index this row samples; with ``seed``, it fixes the draw
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    num_logprobs: int | None = None
    banned: tuple[int, ...] = ()  # eos/stop ids while min_tokens is not reached
    counts: TokenCounts | None = None  # the request's token counts; None: the request has no penalties
    drafts: tuple[int, ...] = ()  # outputs this row follows that ``counts`` does not hold yet


FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]


@dataclass(slots=True, kw_only=True)
class SamplingRows:
    """The parameters of ``N`` logits rows column by column, as host arrays: what the sampler reads.

    The worker gathers these from its persistent rows in a few array operations per step; a list of
    :class:`RowParams` converts with :meth:`from_params`. ``num_logprobs`` is -1 for rows without
    logprobs."""

    temperature: FloatArray
    seed: IntArray
    draw_index: IntArray
    top_k: IntArray
    top_p: FloatArray
    min_p: FloatArray
    presence_penalty: FloatArray
    frequency_penalty: FloatArray
    repetition_penalty: FloatArray
    num_logprobs: IntArray
    banned: list[tuple[int, ...]]
    counts: list[TokenCounts | None]
    drafts: list[tuple[int, ...]]

    def __len__(self) -> int:
        return len(self.temperature)

    @classmethod
    def from_params(cls, params: Sequence[RowParams]) -> SamplingRows:
        def col(name: str) -> FloatArray:
            return np.array([getattr(p, name) for p in params], dtype=np.float64)

        def icol(name: str) -> IntArray:
            return np.array([getattr(p, name) for p in params], dtype=np.int64)

        return cls(
            temperature=col("temperature"),
            seed=icol("seed"),
            draw_index=icol("draw_index"),
            top_k=icol("top_k"),
            top_p=col("top_p"),
            min_p=col("min_p"),
            presence_penalty=col("presence_penalty"),
            frequency_penalty=col("frequency_penalty"),
            repetition_penalty=col("repetition_penalty"),
            num_logprobs=np.array([-1 if p.num_logprobs is None else p.num_logprobs for p in params], dtype=np.int64),
            banned=[p.banned for p in params],
            counts=[p.counts for p in params],
            drafts=[p.drafts for p in params],
        )


def _rows(params: Sequence[RowParams] | SamplingRows) -> SamplingRows:
    return params if isinstance(params, SamplingRows) else SamplingRows.from_params(params)


def _upload(values: npt.NDArray[np.generic], like: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Host ``values`` on ``like``'s device, in one copy."""
    return torch.from_numpy(np.ascontiguousarray(values)).to(device=like.device, dtype=dtype or like.dtype)


@dataclass(slots=True)
class SampleOutput:
    tokens: list[int]
    logprobs: list[dict[int, float] | None]
    errors: dict[int, str]  # row -> message (non-finite logits)


@dataclass(slots=True, kw_only=True)
class DeviceSample:
    """A step's sample before the host read: every tensor on the logits' device."""

    tokens: torch.Tensor  # [N] long
    bad: torch.Tensor  # [N] bool: NaN or +inf logits
    needs_full: torch.Tensor  # [N] bool: the bounded candidates cannot hold the row's kept set
    logits: torch.Tensor  # [N, V] float32 after penalties and bans, for the fallback
    lp_rows: list[int] = field(default_factory=list)  # rows that want logprobs
    raw: torch.Tensor | None = None  # [L, V] log-softmax of those rows, before penalties
    top: tuple[torch.Tensor, torch.Tensor] | None = None  # [L, K] values and ids of the top logprobs


def _mix(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 tensors; the masks make the right shifts logical."""
    z = z ^ ((z >> 30) & ((1 << 34) - 1))
    z = z * _MUL1
    z = z ^ ((z >> 27) & ((1 << 37) - 1))
    z = z * _MUL2
    return z ^ ((z >> 31) & ((1 << 33) - 1))


def uniforms(seeds: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """One float64 uniform in [0, 1) per (seed, index), a pure function of the pair (32 bits)."""
    z = _mix(_mix(seeds) + (indices + 1) * _GOLDEN)
    return ((z >> 32) & 0xFFFF_FFFF).double() * 2.0**-32


def _apply_penalties(logits: torch.Tensor, rows: list[int], params: Sequence[RowParams] | SamplingRows) -> torch.Tensor:
    """``logits`` with the penalties of ``rows`` applied (a new tensor; the input is untouched)."""
    p = _rows(params)
    vocab = logits.shape[1]
    dev = logits.device
    # Row by row into one new tensor: stacking the requests' [V] tensors would allocate and copy
    # [rows, V] twice more per step, and fresh allocations that size dominate the CPU step.
    out = torch.empty_like(logits) if rows == list(range(logits.shape[0])) else logits.clone()
    for r in rows:
        counts = _counts(p, r)
        freq, pres = float(p.frequency_penalty[r]), float(p.presence_penalty[r])
        seen, minus = counts.tensors(vocab, dev, frequency=freq, presence=pres)
        drafts = [t for t in p.drafts[r] if 0 <= t < vocab]
        if drafts:  # out of place: the drafts stay out of the request's own tensors
            at = torch.tensor(drafts, dtype=torch.long, device=dev)
            minus = minus.index_put((at,), _draft_subtract(counts, freq, pres, drafts, at))
            seen = seen.index_fill(0, at, True)
        row = logits.select(0, r)
        rep = float(p.repetition_penalty[r])
        if rep != 1.0:
            row = torch.where(seen, torch.where(row > 0, row / rep, row * rep), row)
        torch.sub(row, minus, out=out.select(0, r))
    return out


def _counts(p: SamplingRows, r: int) -> TokenCounts:
    counts = p.counts[r]
    assert counts is not None, "a row with penalties carries its request's counts"
    return counts


def _draft_subtract(
    counts: TokenCounts, frequency: float, presence: float, drafts: list[int], at: torch.Tensor
) -> torch.Tensor:
    """What the frequency and presence penalties subtract at each draft token: the request's output
    count plus every copy of the token among the row's drafts."""
    extra = torch.tensor([float(drafts.count(t)) for t in drafts], dtype=torch.float32, device=at.device)
    return frequency * (counts.counts_at(at) + extra) + presence


def _ban(logits: torch.Tensor, p: SamplingRows) -> torch.Tensor:
    vocab = logits.shape[1]
    pairs = [(i, t) for i, banned in enumerate(p.banned) for t in banned if 0 <= t < vocab]
    if not pairs:
        return logits
    return logits.index_put(_pairs(pairs, logits.device), torch.tensor(float("-inf"), device=logits.device))


def _pairs(pairs: list[tuple[int, int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, column) index tensors of ``pairs`` for ``index_put``."""
    # select/narrow/index_select rather than ``t[...]``: they are what the fake-device test can trace.
    at = torch.tensor(pairs, dtype=torch.long, device=device)
    return at.select(1, 0), at.select(1, 1)


_KINDS = ("top", "bounded", "sorted", "all")


def _kinds(p: SamplingRows, rows: IntArray, vocab: int, fallback: bool) -> dict[tuple[str, int], IntArray]:
    """Positions in ``rows`` grouped by the candidate set each row draws from: a row's own top-k
    (exact), the bounded ``CANDIDATES``, the sorted or the whole vocabulary. A row's kind depends on
    the row alone (batch invariance); the fallback re-draws top-p rows over the sorted vocabulary."""
    top_p, min_p, top_k = p.top_p[rows], p.min_p[rows], p.top_k[rows]
    code = np.full(len(rows), 3, dtype=np.int64)  # "all"
    size = np.full(len(rows), vocab, dtype=np.int64)
    if fallback:
        code[top_p < 1.0] = 2
    else:
        code[(top_p < 1.0) | (min_p > 0.0)] = 1 if vocab > CANDIDATES else 2
        size[code == 1] = CANDIDATES
        top = (top_k > 0) & (top_k < vocab)
        code[top] = 0
        size[top] = top_k[top]
    keys = code * (vocab + 1) + size
    groups: dict[tuple[str, int], IntArray] = {}
    for key in np.unique(keys).tolist():
        groups[(_KINDS[key // (vocab + 1)], key % (vocab + 1))] = np.flatnonzero(keys == key)
    return groups


def _row_mass(x: torch.Tensor, top: torch.Tensor, temp: torch.Tensor) -> torch.Tensor:
    """``logsumexp(x / temp)`` per row given the row maxima ``top``, in one temporary: the full-row
    exp pass is most of a bounded row's cost, and ``logsumexp`` makes several."""
    t = x - top
    t.div_(temp).exp_()
    return top / temp + t.sum(dim=-1, keepdim=True).log()


def _draw(
    x: torch.Tensor, kind: str, k: int, p: SamplingRows, group: IntArray, u: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens ``[S]`` of rows ``x [S, V]`` (the rows ``group`` of ``p``) sharing one candidate kind,
    and whether each row's kept set lies inside its candidates (always, except for ``bounded``)."""
    cols = _upload(np.stack([p.temperature[group], p.min_p[group], p.top_p[group]], axis=1), x)
    temp, min_p, top_p = cols.narrow(1, 0, 1), cols.narrow(1, 1, 1), cols.narrow(1, 2, 1)
    if kind == "all":
        vals, ids = x, torch.arange(x.shape[1], device=x.device).expand_as(x)
    elif kind == "sorted":
        vals, ids = x.sort(dim=-1, descending=True)
    else:
        vals, ids = x.topk(k, dim=-1)
    v = vals / temp
    # Top-p weighs the candidates against the whole row's mass unless top-k has cut the row first.
    norm = _row_mass(x, vals.narrow(1, 0, 1), temp) if kind == "bounded" else torch.logsumexp(v, -1, keepdim=True)
    probs = torch.exp(v - norm)
    drop = v < v.amax(dim=-1, keepdim=True) + torch.log(min_p)  # log(0) = -inf drops nothing
    fits = torch.ones(x.shape[0], dtype=torch.bool, device=x.device)
    if kind != "all":
        cum = probs.cumsum(dim=-1)
        past = ((cum - probs) > top_p) & (top_p < 1.0)  # the mass strictly above the token exceeds top-p
        drop |= past & (torch.arange(k, device=x.device) > 0)  # the best token always stays
        if kind == "bounded":
            fits = ((cum.narrow(1, k - 1, 1) > top_p) & (top_p < 1.0)).squeeze(1) | drop.select(1, k - 1)
    cdf = probs.masked_fill(drop, 0.0).double().cumsum(dim=-1)
    # u < 1 has 32 bits, so u * total stays below total and lands on a kept (positive) weight.
    at = torch.searchsorted(cdf, u.unsqueeze(1) * cdf.narrow(1, k - 1, 1), right=True)
    return ids.gather(1, at.clamp(max=ids.shape[1] - 1)).squeeze(1), fits


def _draw_rows(
    x: torch.Tensor,
    params: Sequence[RowParams] | SamplingRows,
    rows: Sequence[int] | IntArray,
    tokens: torch.Tensor,
    fallback: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``tokens`` with ``rows`` sampled, grouped by candidate kind; and ``needs_full [N]``."""
    p = _rows(params)
    n, vocab = x.shape
    rows = np.asarray(rows, dtype=np.int64)
    keys = _upload(np.stack([p.seed[rows], p.draw_index[rows]]), x, torch.long)
    u_all = uniforms(keys.select(0, 0), keys.select(0, 1))
    needs_full = torch.zeros(n, dtype=torch.bool, device=x.device)
    for (kind, k), js in _kinds(p, rows, vocab, fallback).items():
        group = rows[js]
        whole = len(js) == len(rows)
        at = _upload(group if whole else np.concatenate([group, js]), x, torch.long)
        rows_t = at.narrow(0, 0, len(js))
        sub = x if whole and len(group) == n and (group == np.arange(n)).all() else x.index_select(0, rows_t)
        u = u_all if whole else u_all.index_select(0, at.narrow(0, len(js), len(js)))
        drawn, fits = _draw(sub, kind, k, p, group, u)
        tokens = tokens.index_copy(0, rows_t, drawn)
        needs_full = needs_full.index_copy(0, rows_t, torch.logical_not(fits))
    return tokens, needs_full


def sample_on_device(logits: torch.Tensor, params: Sequence[RowParams] | SamplingRows) -> DeviceSample:
    """Sample one token per row of ``logits [N, V]`` without reading the host."""
    p = _rows(params)
    x = logits.float()
    n = x.shape[0]
    dev = x.device
    bad = torch.logical_not(x.amax(dim=-1) < float("inf"))  # amax propagates NaN: this flags NaN and +inf
    out = DeviceSample(tokens=torch.zeros(n, dtype=torch.long, device=dev), bad=bad, needs_full=bad, logits=x)
    out.lp_rows = np.flatnonzero(p.num_logprobs >= 0).tolist()
    if out.lp_rows:
        out.raw = torch.log_softmax(x.index_select(0, torch.tensor(out.lp_rows, device=dev)), dim=-1)
        k = int(p.num_logprobs.max())
        out.top = out.raw.topk(k, dim=-1) if k else None
    pen = [i for i, c in enumerate(p.counts) if c is not None]
    if pen:
        x = _apply_penalties(x, pen, p)
    x = _ban(x, p)
    out.logits = x
    greedy = p.temperature == 0.0
    if greedy.any():
        out.tokens = x.argmax(dim=-1)
    rand = np.flatnonzero(~greedy)
    if len(rand):
        out.tokens, needs_full = _draw_rows(x, p, rand, out.tokens, fallback=False)
        out.needs_full = needs_full & torch.logical_not(bad)
    else:
        out.needs_full = torch.zeros_like(bad)
    return out


def _chosen(dev: DeviceSample, rows: list[int]) -> torch.Tensor:
    """The logprob of each of ``rows``' tokens (rows that want logprobs)."""
    assert dev.raw is not None
    where = {r: i for i, r in enumerate(dev.lp_rows)}
    at = torch.tensor([where[r] for r in rows], dtype=torch.long, device=dev.tokens.device)
    tokens = dev.tokens.index_select(0, torch.tensor(rows, dtype=torch.long, device=at.device))
    return dev.raw.index_select(0, at).gather(1, tokens.unsqueeze(1))


def packed(dev: DeviceSample) -> torch.Tensor:
    """Everything the host reads of a step, in one float64 vector (exact for float32 values and
    token ids): tokens, error flags, fallback flags, chosen logprobs, top logprob values and ids."""
    parts = [dev.tokens.double(), dev.bad.double(), dev.needs_full.double()]
    if dev.lp_rows:
        parts.append(_chosen(dev, dev.lp_rows).double().flatten())
    if dev.top is not None:
        parts += [dev.top[0].double().flatten(), dev.top[1].double().flatten()]
    return torch.cat(parts)


def sample(logits: torch.Tensor, params: Sequence[RowParams] | SamplingRows) -> SampleOutput:
    """Sample one token per row of float ``logits [N, V]`` according to row ``r`` of ``params``."""
    p = _rows(params)
    dev = sample_on_device(logits, p)
    n = len(p)
    flat = packed(dev).tolist()  # the step's one host read
    tokens = [int(t) for t in flat[:n]]
    errors = {r: "the model produced non-finite logits (NaN or +inf) for this request" for r in range(n) if flat[n + r]}
    chosen = flat[3 * n : 3 * n + len(dev.lp_rows)]
    full = [r for r in range(n) if flat[2 * n + r]]
    if full:
        chosen = _resample_full(dev, p, full, tokens, chosen)
    return SampleOutput(tokens, _logprobs(dev, p, tokens, chosen, flat[3 * n + len(dev.lp_rows) :]), errors)


def _resample_full(
    dev: DeviceSample, p: SamplingRows, rows: list[int], tokens: list[int], chosen: list[float]
) -> list[float]:
    """Re-sample ``rows`` over the sorted full vocabulary (their kept set reaches past the bounded
    candidates), updating ``tokens`` in place; returns the chosen logprobs, refreshed."""
    dev.tokens, _ = _draw_rows(dev.logits, p, rows, dev.tokens, fallback=True)
    wants = set(dev.lp_rows)
    lp = [r for r in rows if r in wants]
    parts = [dev.tokens.index_select(0, torch.tensor(rows, dtype=torch.long, device=dev.tokens.device)).double()]
    if lp:
        parts.append(_chosen(dev, lp).double().flatten())
    flat = torch.cat(parts).tolist()
    for r, t in zip(rows, flat):
        tokens[r] = int(t)
    fresh = dict(zip(lp, flat[len(rows) :]))
    return [fresh.get(r, c) for r, c in zip(dev.lp_rows, chosen)]


def _logprobs(
    dev: DeviceSample, p: SamplingRows, tokens: list[int], chosen: list[float], top: list[float]
) -> list[dict[int, float] | None]:
    out: list[dict[int, float] | None] = [None] * len(p)
    k = dev.top[0].shape[1] if dev.top is not None else 0
    half = len(dev.lp_rows) * k
    for i, r in enumerate(dev.lp_rows):
        entry = {tokens[r]: chosen[i]}
        want = int(p.num_logprobs[r])
        entry.update(zip((int(t) for t in top[half + i * k : half + i * k + want]), top[i * k : i * k + want]))
        out[r] = entry
    return out
