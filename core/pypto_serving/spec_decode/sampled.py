"""Sampled drafts and their verification by rejection sampling.

A drafter that exposes its logits draws each draft of a sampled request from its own processed
distribution ``q`` (the request's temperature, top-k, top-p and min-p, as the sampler applies them)
through a :class:`DraftSampler` the runner hands it, and the sampler keeps ``q`` of every draft on
the device. The runner then verifies those drafts with :func:`verify_sampled`: the target rows are
processed by the sampler's own :func:`~pypto_serving.sampler.sample_on_device` (logit edits,
penalties conditioned on the row's drafts, bans), turned into probabilities ``p`` by
:func:`processed_probs` with the same filters, and checked by
:func:`~pypto_serving.spec_decode.rejection.rejection_sample`. Accepted drafts and the residual or
bonus token are then distributed exactly as tokens sampled one by one (Leviathan et al. 2023).
Drafts nobody sampled (the n-gram drafter's) go through :func:`verify_sampled` the same way with no
``q``: a point mass at each draft.

Randomness: the draft at output index ``i`` uses :func:`~.rejection.draft_uniforms` at ``i``, a
stream disjoint from the target's draws (index ``i``) and the acceptance tests (``-1 - i``). A draft
for index ``i`` that a step computes but never verifies (it lies past the first rejection) has
influenced nothing emitted, so the next step may draw index ``i`` again from the same uniform. Every
value is a pure function of the request's seed, the output indices and the committed history.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from ..request import LoopDraw
from ..sampler import RowParams, argmax_rows, sample_on_device
from .rejection import SpecRow, _inverse_cdf, draft_uniforms, rejection_sample

__all__ = ["DraftRow", "DraftSampler", "Filters", "processed_probs", "verify_sampled"]


class Filters(Protocol):
    """The sampling parameters :func:`processed_probs` reads (a :class:`RowParams` has them)."""

    @property
    def temperature(self) -> float: ...
    @property
    def top_k(self) -> int: ...
    @property
    def top_p(self) -> float: ...
    @property
    def min_p(self) -> float: ...


#: How to draw one request's drafts: its filters, seed and the output index of its first draft.
DraftRow = LoopDraw


def _column(values: list[float], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=like.dtype, device=like.device).unsqueeze(1)


def processed_probs(x: torch.Tensor, params: Sequence[Filters]) -> torch.Tensor:
    """``[N, V]`` float32 probabilities the sampler draws row ``i`` of ``x`` from (``x``: logits after
    edits, penalties and bans; every ``params[i].temperature > 0``): temperature, then top-k, then
    top-p over the mass left by top-k (the whole row's without top-k), then min-p against the best
    token, then renormalised. The sampler keeps the same sets; only where rounding puts a token's
    cumulative mass exactly on the top-p boundary may the two differ. Rows without filters take one
    softmax; filtered rows sort the vocabulary (no host read: the bounded candidate set the sampler
    uses would need one to learn whether a row's kept set fits in it)."""
    x = x.float()
    vocab = x.shape[1]
    temp = _column([p.temperature for p in params], x)
    filtered = [0 < p.top_k < vocab or p.top_p < 1.0 or p.min_p > 0.0 for p in params]
    if not any(filtered):
        return torch.softmax(x / temp, dim=-1)
    probs = _filtered_probs(x, params, temp)
    if all(filtered):
        return probs
    plain = torch.tensor(filtered, device=x.device).logical_not().unsqueeze(1)
    return torch.where(plain, torch.softmax(x / temp, dim=-1), probs)


def _filtered_probs(x: torch.Tensor, params: Sequence[Filters], temp: torch.Tensor) -> torch.Tensor:
    """:func:`processed_probs` of rows with filters, over the sorted vocabulary."""
    vocab = x.shape[1]
    top_k = _column([float(p.top_k) if 0 < p.top_k < vocab else float(vocab) for p in params], x)
    top_p = _column([p.top_p for p in params], x)
    min_p = _column([p.min_p for p in params], x)
    vals, ids = (x / temp).sort(dim=-1, descending=True)
    j = torch.arange(vocab, device=x.device, dtype=x.dtype)
    in_k = j < top_k
    probs = torch.softmax(vals.masked_fill(torch.logical_not(in_k), float("-inf")), dim=-1)
    past = ((probs.cumsum(dim=-1) - probs) > top_p) & (top_p < 1.0) & (j > 0)  # the best token always stays
    drop = torch.logical_not(in_k) | past | (vals < vals.narrow(1, 0, 1) + torch.log(min_p))
    kept = probs.masked_fill(drop, 0.0)
    kept = kept / kept.sum(dim=-1, keepdim=True)
    return torch.zeros_like(kept).scatter_(1, ids, kept)


class DraftSampler:
    """Chooses an executor drafter's tokens: the argmax for rows it was not given (greedy requests,
    requests verified by sample-and-compare), a draw from the processed softmax ``q`` for the rest,
    keeping ``q`` of each draw on the device for :meth:`probs`."""

    __slots__ = ("_q", "_rows")

    def __init__(self, rows: dict[int, DraftRow]) -> None:
        self._rows = rows  # batch row -> its draft parameters
        self._q: dict[int, list[torch.Tensor]] = {r: [] for r in rows}

    def samples(self, batch_row: int) -> bool:
        """Whether the drafts of ``batch_row`` are sampled (else argmax)."""
        return batch_row in self._rows

    def pick(self, logits: torch.Tensor, batch_rows: Sequence[int]) -> torch.Tensor:
        """The next draft of each of ``batch_rows`` from the drafter's logits ``[len(batch_rows), V]``
        (row ``i`` drafts for batch row ``batch_rows[i]``, whose earlier drafts came from earlier
        calls); tokens ``[len(batch_rows)]`` on the logits' device, nothing read back."""
        tokens = argmax_rows(logits)[1]
        at = [i for i, r in enumerate(batch_rows) if r in self._rows]
        if not at:
            return tokens
        rows = [self._rows[batch_rows[i]] for i in at]
        dev = logits.device
        at_t = torch.tensor(at, dtype=torch.long, device=dev)
        q = processed_probs(logits.index_select(0, at_t), rows)
        seeds = torch.tensor([r.seed for r in rows], dtype=torch.long, device=dev)
        index = torch.tensor(
            [r.first_index + len(self._q[batch_rows[i]]) for r, i in zip(rows, at)], dtype=torch.long, device=dev
        )
        drawn = _inverse_cdf(q, draft_uniforms(seeds, index))
        for n, i in enumerate(at):
            self._q[batch_rows[i]].append(q.narrow(0, n, 1))
        return tokens.index_copy(0, at_t, drawn)

    def probs(self, batch_row: int, num_drafts: int) -> torch.Tensor | None:
        """``[num_drafts, V]`` ``q`` of the row's drafts in order; None when they were not all sampled here."""
        q = self._q.get(batch_row, [])
        if num_drafts == 0 or len(q) < num_drafts:
            return None
        return torch.cat(q[:num_drafts])


def verify_sampled(
    logits: torch.Tensor,
    params: Sequence[RowParams],
    drafts: Sequence[Sequence[int]],
    draft_probs: torch.Tensor | None,
    rows: Sequence[SpecRow],
) -> list[list[int] | None]:
    """Rejection-sample the drafts of sampled requests; one host read.

    :param logits: ``[N, V]`` raw target logits, request ``r``'s ``k_r + 1`` rows consecutively.
    :param params: the sampler's parameters of each of those rows (row ``j`` follows the first ``j``
        drafts: penalties and bans conditioned on them).
    :param drafts: per request, its ``k_r`` drafts.
    :param draft_probs: ``[sum(k_r), V]`` the drafter's ``q`` of each draft, in the same order;
        None for point-mass drafts (n-gram): ``q`` is one-hot at each draft, so a draft is accepted
        with probability ``p(d)`` and a rejection draws from ``p`` without ``d``, renormalised.
    :param rows: per request, its :class:`SpecRow` (``greedy=False``).
    :return: per request, its accepted drafts then the residual or bonus token; None where the
        request's logits are not finite.
    """
    dev = logits.device
    # Rows without edits, penalties or bans need none of the sampler's processing (nor its draw).
    edited = any(r.counts is not None or r.banned or r.edits is not None for r in params)
    p = processed_probs(sample_on_device(logits, list(params)).logits if edited else logits, params)
    flat = torch.tensor([t for d in drafts for t in d], dtype=torch.long, device=dev)
    verdict = rejection_sample(p, flat, rows, draft_probs)
    req = torch.repeat_interleave(
        torch.arange(len(rows), device=dev),
        torch.tensor([len(d) + 1 for d in drafts], device=dev),
        output_size=logits.shape[0],
    )
    bad_rows = torch.logical_not(logits.amax(dim=-1) < float("inf")).long()  # NaN or +inf
    bad = torch.zeros(len(rows), dtype=torch.long, device=dev).index_add_(0, req, bad_rows)
    num = len(rows)
    host = torch.cat([verdict.num_emitted, bad, verdict.tokens.flatten()]).tolist()
    width = (len(host) - 2 * num) // num if num else 0
    out: list[list[int] | None] = []
    for r in range(num):
        start = 2 * num + r * width
        out.append(None if host[num + r] else host[start : start + host[r]])
    return out
