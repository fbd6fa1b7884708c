"""Batched rejection sampling of speculative drafts (Leviathan et al. 2023; Chen et al. 2023).

A step verifies, for each request ``r``, ``k_r`` draft tokens ``d_0 .. d_{k_r-1}`` against the
target model's distributions ``p_0 .. p_{k_r}`` (row ``j`` is the distribution of output position
``j`` after the first ``j`` drafts, already processed: temperature, top-k/top-p/min-p, penalties and
bans, i.e. what the non-speculative sampler draws from). Draft ``j`` is accepted with probability
``min(1, p_j(d_j) / q_j(d_j))``; the first rejected position emits a token drawn from
``normalise(max(0, p_j - q_j))``; when every draft is accepted the row emits a bonus token drawn from
``p_{k_r}``. The emitted tokens are then distributed exactly as tokens sampled one by one from the
target. Greedy rows (temperature 0) take the argmax comparison instead: a draft is accepted when it
equals the argmax of its row, and the first mismatch (or the bonus position) emits that argmax,
which is exactly what :func:`pypto_serving.runner._accept` computes from greedy samples.

Layout: flat, as the runner lays out logits rows. ``target [N, V]`` holds request ``r``'s ``k_r + 1``
rows consecutively in request order (``N = sum(k_r + 1)``); ``drafts [D]`` and ``draft_probs [D, V]``
hold its ``k_r`` drafts consecutively (``D = sum(k_r)``). ``draft_probs=None`` stands for point-mass
drafters (n-gram, greedy MTP): ``q_j`` is one-hot at ``d_j``, never materialised, so acceptance is
``u < p_j(d_j)`` and the residual is ``p_j`` with ``d_j`` removed.

Randomness is a pure function of ``(request seed, output index)`` through the sampler's
:func:`~pypto_serving.sampler.uniforms`, in two disjoint streams of indices: the token drawn at output
index ``i`` (residual or bonus) uses index ``i``, the very uniform the non-speculative sampler uses for
that output (so a request without drafts emits the plain sampler's token for an unfiltered row), and
the acceptance test of the draft at output index ``i`` uses index ``-1 - i`` (the hash maps distinct
indices of one seed to distinct values, so the streams never share a uniform). A drafter that
samples its drafts must take its randomness from neither stream (for instance
:func:`draft_uniforms`): the residual draw must be independent of the draft it replaces. A uniform
computed for a position past the first rejection influences nothing emitted, so the next step may
reuse it for the same output index. Every operation is row-wise, so a seeded request emits the same
tokens in any batch, in any order, and under sync and async scheduling alike.

The residual or bonus draw is the sampler's inverse CDF, searched over 128-wide block sums and then
inside one block, so no ``[R, V]`` float64 cumulative is written. Everything runs on ``target``'s
device; the host knows only the per-request parameters it already
has (seed, first output index, draft count, greedy or not). :func:`rejection_sample` reads nothing
back; :func:`read` makes the step's one host read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import numpy as np
import numpy.typing as npt
import torch

from ..sampler import argmax_rows, uniforms

__all__ = ["DeviceVerdict", "SpecRow", "SpecRows", "Verdict", "draft_uniforms", "read", "rejection_sample"]

_EPS = 1e-20  # share of p kept in every residual (see _residual)
_BLOCK = 128  # width of the blocks the inverse-CDF search steps through (151,936 = 128 * 1187)
_DRAFTER_STREAM = -(2**62)  # indices below this are the drafters'; acceptance takes -1 - i above it


@dataclass(slots=True, kw_only=True)
class SpecRow:
    """One request's verification parameters, known on the host."""

    seed: int
    first_index: int  # the request's output index of the row's first emitted token
    num_drafts: int  # k_r
    greedy: bool  # temperature 0: argmax verification


@dataclass(slots=True, kw_only=True)
class SpecRows:
    """The same parameters column by column, as host arrays (what a worker keeping its rows in
    arrays gathers in a few operations per step)."""

    seed: npt.NDArray[np.int64]
    first_index: npt.NDArray[np.int64]
    num_drafts: npt.NDArray[np.int64]
    greedy: npt.NDArray[np.bool_]

    @classmethod
    def of(cls, rows: Sequence[SpecRow]) -> SpecRows:
        return cls(
            seed=np.array([r.seed for r in rows], dtype=np.int64),
            first_index=np.array([r.first_index for r in rows], dtype=np.int64),
            num_drafts=np.array([r.num_drafts for r in rows], dtype=np.int64),
            greedy=np.array([r.greedy for r in rows], dtype=np.bool_),
        )


@dataclass(slots=True, kw_only=True)
class DeviceVerdict:
    """A step's verification before the host read: every tensor on ``target``'s device."""

    tokens: torch.Tensor  # [R, K + 1] long: accepted drafts, then the emitted token, then -1
    num_emitted: torch.Tensor  # [R] long: accepted drafts + 1
    row_tokens: torch.Tensor  # [N] long: the token emitted at each target row (0 past the last), for logprobs


@dataclass(slots=True)
class Verdict:
    tokens: list[list[int]]  # per request: its accepted drafts, then one residual or bonus token
    num_accepted: list[int]  # per request: accepted drafts (len(tokens[r]) - 1)


@dataclass(slots=True)
class _Maps:
    """Index maps of a group of requests into the flat layout, on the device."""

    pos: torch.Tensor  # [G, K] target row of each draft position (clamped where padded)
    draft: torch.Tensor  # [G, K] draft index of each position (clamped where padded)
    valid: torch.Tensor  # [G, K] bool: the position holds a draft
    first_row: torch.Tensor  # [G] the request's first target row
    first_draft: torch.Tensor  # [G] the request's first draft index (clamped into [0, D))
    num_drafts: torch.Tensor  # [G]
    seeds: torch.Tensor  # [G]
    first_index: torch.Tensor  # [G]


def draft_uniforms(seeds: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """Uniforms for a drafter that samples the draft at output index ``indices``: disjoint from both
    streams the verification uses."""
    return uniforms(seeds, _DRAFTER_STREAM - 1 - indices)


def _maps(rows: SpecRows, width: int, device: torch.device) -> _Maps:
    """Every request's index maps, built on the device from one host-to-device copy of its parameters."""
    host = torch.from_numpy(np.stack([rows.seed, rows.first_index, rows.num_drafts], axis=1))
    seeds, first_index, k = host.to(device).unbind(1)
    first_row = torch.cumsum(k + 1, 0) - (k + 1)
    first_draft = torch.cumsum(k, 0) - k
    last = max(int(rows.num_drafts.sum()) - 1, 0)  # a request without drafts may sit past the last one
    j = torch.arange(width, device=device)
    return _Maps(
        pos=first_row.unsqueeze(1) + torch.minimum(j, k.unsqueeze(1)),
        draft=(first_draft.unsqueeze(1) + torch.minimum(j, (k - 1).clamp(min=0).unsqueeze(1))).clamp(max=last),
        valid=j < k.unsqueeze(1),
        first_row=first_row,
        first_draft=first_draft.clamp(max=last),
        num_drafts=k,
        seeds=seeds,
        first_index=first_index,
    )


def _subset(m: _Maps, at: torch.Tensor) -> _Maps:
    """The maps of the requests ``at``."""
    return _Maps(**{f.name: getattr(m, f.name).index_select(0, at) for f in fields(m)})


def _at(x: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """``x[rows, cols]`` elementwise for a 2-D ``x``, as one ``take`` of the flattened tensor."""
    return torch.take(x, rows * x.shape[1] + cols)


def _leading(accept: torch.Tensor) -> torch.Tensor:
    """Per row, the number of leading True values of ``accept [G, K]``."""
    return accept.long().cumprod(dim=1).sum(dim=1)


def _greedy(target: torch.Tensor, drafts: torch.Tensor, m: _Maps, whole: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Accepted count and emitted token of greedy requests: argmax comparison, with the sampler's
    own greedy op (:func:`~pypto_serving.sampler.argmax_rows`: ``argmax``'s index, first among ties,
    in one blocked pass). ``whole``: the group is every request, so the argmax runs over ``target``
    in place rather than over a copy of the group's rows."""
    rows = torch.cat([m.pos, (m.first_row + m.num_drafts).unsqueeze(1)], dim=1)  # [G, K + 1]
    if whole:
        best = argmax_rows(target)[1].take(rows)
    else:
        best = argmax_rows(target.index_select(0, rows.flatten()))[1].view_as(rows)
    d = drafts.take(m.draft) if drafts.numel() else torch.zeros_like(m.pos)
    n_acc = _leading((d == best.narrow(1, 0, m.pos.shape[1])) & m.valid)
    return n_acc, best.gather(1, n_acc.unsqueeze(1)).squeeze(1)


def _residual(
    target: torch.Tensor, drafts: torch.Tensor, q: torch.Tensor | None, m: _Maps, n_acc: torch.Tensor
) -> torch.Tensor:
    """``[G, V]`` float32 weights of each request's emitted token: ``max(0, p - q)`` at a rejected
    position, ``p`` at the bonus position.

    ``_EPS * p`` more keeps mass where rounding leaves the residual none (``p <= q`` everywhere yet
    the draft was rejected): the draw then follows ``p``. Elsewhere it moves the emitted distribution
    by about ``2 * _EPS`` in total variation (it weighs ``_EPS`` against a residual whose mass is the
    probability of reaching it), and it needs neither a host-side branch nor a second distribution."""
    p = target.index_select(0, m.first_row + n_acc).float()
    if drafts.numel() == 0:
        return p
    rejected = (n_acc < m.num_drafts).unsqueeze(1)
    at = m.first_draft + n_acc.clamp(max=(m.num_drafts - 1).clamp(min=0))
    if q is None:  # point mass: the residual is p with the draft token (all but) removed
        d = drafts.take(at).unsqueeze(1)
        at_d = p.gather(1, d)
        return p.scatter_(1, d, torch.where(rejected, _EPS * at_d, at_d))
    w = torch.addcmul(p, q.index_select(0, at).float(), rejected.float(), value=-1.0).clamp_(min=0.0)
    return w.add_(p, alpha=_EPS)


def _sampled(
    target: torch.Tensor, drafts: torch.Tensor, q: torch.Tensor | None, m: _Maps
) -> tuple[torch.Tensor, torch.Tensor]:
    """Accepted count and emitted token of sampled requests: the rejection rule."""
    width = m.pos.shape[1]
    if width:
        tokens = drafts.take(m.draft)
        p_d = _at(target, m.pos, tokens).double()
        offsets = torch.arange(width, device=target.device)
        u = uniforms(m.seeds.unsqueeze(1).expand_as(m.pos), -1 - (m.first_index.unsqueeze(1) + offsets))
        # u * q < p is min(1, p/q) > u without a division: q = 0 < p accepts, p = 0 never does.
        q_d = 1.0 if q is None else _at(q, m.draft, tokens).double()
        n_acc = _leading((u * q_d < p_d) & m.valid)
    else:
        n_acc = torch.zeros_like(m.first_row)
    w = _residual(target, drafts, q, m, n_acc)
    return n_acc, _inverse_cdf(w, uniforms(m.seeds, m.first_index + n_acc))


def _inverse_cdf(w: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row of float32 weights ``w [G, V]`` (each with positive mass), the index where ``u [G]``
    falls in the cumulative weights (the sampler's rule: the first index whose cumulative weight
    exceeds ``u * total``). The search runs over ``_BLOCK``-wide block sums, then inside one block,
    so no ``[G, V]`` cumulative (in float64, twice the weights' size) is ever written."""
    rows, vocab = w.shape
    nb = -(-vocab // _BLOCK)
    wp = torch.nn.functional.pad(w, (0, nb * _BLOCK - vocab)) if vocab % _BLOCK else w
    blocks = wp.view(rows, nb, _BLOCK).sum(dim=2).double().cumsum(dim=1)  # [G, nb]
    # u < 1 has 32 bits, so the goal stays below the total and the block found has positive mass.
    goal = u.unsqueeze(1) * blocks.narrow(1, nb - 1, 1)
    b = torch.searchsorted(blocks, goal, right=True).clamp(max=nb - 1)  # [G, 1]
    before = torch.where(b > 0, blocks.gather(1, (b - 1).clamp(min=0)), 0.0)
    inner = wp.gather(1, b * _BLOCK + torch.arange(_BLOCK, device=w.device))  # [G, _BLOCK]
    at = torch.searchsorted(inner.double().cumsum(dim=1), goal - before, right=True)
    # The block's float32 sum and its float64 cumulative differ by rounding: a goal past the
    # cumulative's end takes the block's last positive weight.
    last = _BLOCK - 1 - (inner.flip(1) > 0).long().argmax(dim=1, keepdim=True)
    return (b * _BLOCK + torch.minimum(at, last)).squeeze(1)


def rejection_sample(
    target: torch.Tensor,
    drafts: torch.Tensor,
    rows: SpecRows | Sequence[SpecRow],
    draft_probs: torch.Tensor | None = None,
) -> DeviceVerdict:
    """Verify every request's drafts without reading the host.

    :param target: ``[N, V]`` float, request ``r``'s ``k_r + 1`` rows consecutively: probabilities for
        sampled requests; any scores with the wanted argmax (e.g. processed logits) for greedy ones.
    :param drafts: ``[D]`` long, request ``r``'s ``k_r`` drafts consecutively, on ``target``'s device.
    :param rows: per request, its :class:`SpecRow` (or all of them as :class:`SpecRows` columns).
    :param draft_probs: ``[D, V]`` float, the drafter's distribution of each draft; ``None`` for
        point-mass drafters.
    """
    cols = rows if isinstance(rows, SpecRows) else SpecRows.of(rows)
    dev = target.device
    num = len(cols.seed)
    width = int(cols.num_drafts.max()) if num else 0
    n_acc = torch.zeros(num, dtype=torch.long, device=dev)
    token = torch.zeros(num, dtype=torch.long, device=dev)
    every = _maps(cols, width, dev)
    for greedy in (True, False):
        group = np.flatnonzero(cols.greedy == greedy)
        if not len(group):
            continue
        at = torch.from_numpy(group).to(dev) if len(group) < num else None
        m = every if at is None else _subset(every, at)
        acc, tok = _greedy(target, drafts, m, at is None) if greedy else _sampled(target, drafts, draft_probs, m)
        if at is None:
            n_acc, token = acc, tok
        else:
            n_acc, token = n_acc.index_copy(0, at, acc), token.index_copy(0, at, tok)
    return _assemble(target, drafts, every, n_acc, token)


def _assemble(
    target: torch.Tensor, drafts: torch.Tensor, every: _Maps, n_acc: torch.Tensor, token: torch.Tensor
) -> DeviceVerdict:
    dev = target.device
    width = every.pos.shape[1]
    pos = torch.arange(width + 1, device=dev)
    acc = n_acc.unsqueeze(1)
    placed = token.unsqueeze(1).expand(-1, width + 1)
    if width:
        d = torch.cat([drafts.take(every.draft), torch.zeros_like(acc)], dim=1)
        placed = torch.where(pos < acc, d, placed)
    tokens = torch.where(pos <= acc, placed, -1)
    # Row i of the flat target belongs to request req[i] at position i - first_row[req[i]].
    req = torch.repeat_interleave(
        torch.arange(acc.shape[0], device=dev), every.num_drafts + 1, output_size=target.shape[0]
    )
    local = torch.arange(target.shape[0], device=dev) - every.first_row.take(req)
    row_tokens = _at(tokens, req, local).clamp(min=0)
    return DeviceVerdict(tokens=tokens, num_emitted=n_acc + 1, row_tokens=row_tokens)


def read(verdict: DeviceVerdict) -> Verdict:
    """The step's one host read: each request's emitted tokens."""
    num = verdict.num_emitted.shape[0]
    flat = torch.cat([verdict.num_emitted, verdict.tokens.flatten()]).tolist()
    width = (len(flat) - num) // num if num else 0
    tokens = [flat[num + r * width : num + r * width + flat[r]] for r in range(num)]
    return Verdict(tokens=tokens, num_accepted=[n - 1 for n in flat[:num]])
