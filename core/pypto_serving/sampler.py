"""Sampler: turns logits rows into tokens, batched over rows.

Randomness is a pure function of ``(request seed, output index)``: each draw uses a generator
seeded from both, so a seeded request samples the same tokens in any batch, after preemption, and
under sync and async scheduling alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["RowParams", "SampleOutput", "sample"]

_MIX = 0x9E3779B97F4A7C15


@dataclass(slots=True, kw_only=True)
class RowParams:
    """How to sample one logits row."""

    temperature: float
    top_k: int
    top_p: float
    min_p: float
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    seed: int
    draw_index: int  # the request's output index this row samples; with ``seed``, it fixes the draw
    num_logprobs: int | None
    banned: tuple[int, ...]  # eos/stop ids while min_tokens is not reached
    history: list[int] | None  # prompt + outputs for the penalties; None: the request has no penalties
    num_prompt: int


@dataclass(slots=True)
class SampleOutput:
    tokens: list[int]
    logprobs: list[dict[int, float] | None]
    errors: dict[int, str]  # row -> message (non-finite logits)


def _draw_seed(seed: int, index: int) -> int:
    return ((seed * _MIX) ^ (index + 1) * 0xBF58476D1CE4E5B9) & 0x7FFF_FFFF_FFFF_FFFF


def _apply_penalties(logits: torch.Tensor, rows: list[int], params: list[RowParams]) -> None:
    vocab = logits.shape[1]
    for r in rows:  # rows with penalties only; the histories differ in length per request
        p = params[r]
        assert p.history is not None, "a row with penalties carries its history"
        hist = torch.tensor(p.history, dtype=torch.long)
        out = hist[p.num_prompt :]  # split before dropping out-of-range ids, or the boundary shifts
        hist = hist[(hist >= 0) & (hist < vocab)]
        out = out[(out >= 0) & (out < vocab)]
        row = logits[r]
        if p.repetition_penalty != 1.0 and len(hist):
            seen = torch.unique(hist)
            vals = row[seen]
            row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if (p.frequency_penalty or p.presence_penalty) and len(out):
            counts = torch.bincount(out, minlength=vocab).to(row.dtype)
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)


def sample(logits: torch.Tensor, params: list[RowParams]) -> SampleOutput:
    """Sample one token per row of float ``logits [N, V]`` according to ``params[row]``."""
    logits = logits.float().clone()
    n, vocab = logits.shape
    errors: dict[int, str] = {}
    bad = torch.isnan(logits).any(-1) | torch.isposinf(logits).any(-1)
    for r in torch.nonzero(bad).flatten().tolist():
        errors[r] = "the model produced non-finite logits (NaN or +inf) for this request"
        logits[r] = 0.0
    raw_logprobs = None
    if any(p.num_logprobs is not None for p in params):
        raw_logprobs = torch.log_softmax(logits, dim=-1)
    _apply_penalties(logits, [i for i, p in enumerate(params) if p.history is not None], params)
    for i, p in enumerate(params):
        if p.banned:
            logits[i, [t for t in p.banned if 0 <= t < vocab]] = float("-inf")

    tokens = torch.empty(n, dtype=torch.long)
    greedy = torch.tensor([p.temperature == 0.0 for p in params], dtype=torch.bool)
    if greedy.any():
        tokens[greedy] = logits[greedy].argmax(-1)
    rand_rows = torch.nonzero(~greedy).flatten()
    if len(rand_rows):
        sub = logits[rand_rows] / torch.tensor([params[r].temperature for r in rand_rows.tolist()]).unsqueeze(1)
        sub = _filter(sub, [params[r] for r in rand_rows.tolist()])
        probs = torch.softmax(sub, dim=-1)
        # Exponential race: argmax(p / E) with E ~ Exp(1) samples from p; E comes from the
        # request's own generator so the draw does not depend on the batch.
        noise = torch.empty_like(probs)
        gen = torch.Generator()
        for j, r in enumerate(rand_rows.tolist()):
            gen.manual_seed(_draw_seed(params[r].seed, params[r].draw_index))
            noise[j].exponential_(generator=gen)
        tokens[rand_rows] = (probs / noise).argmax(-1)

    token_list = tokens.tolist()
    logprobs: list[dict[int, float] | None] = [None] * n
    if raw_logprobs is not None:
        for i, p in enumerate(params):
            if p.num_logprobs is None:
                continue
            entry = {token_list[i]: float(raw_logprobs[i, token_list[i]])}
            if p.num_logprobs > 0:
                vals, ids = raw_logprobs[i].topk(p.num_logprobs)
                entry.update(zip(ids.tolist(), vals.tolist()))
            logprobs[i] = entry
    return SampleOutput(token_list, logprobs, errors)


def _filter(logits: torch.Tensor, params: list[RowParams]) -> torch.Tensor:
    """top-k, top-p and min-p, batched; masked entries become -inf."""
    vocab = logits.shape[1]
    top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params])
    top_p = torch.tensor([p.top_p for p in params], dtype=logits.dtype)
    min_p = torch.tensor([p.min_p for p in params], dtype=logits.dtype)
    if (top_k < vocab).any() or (top_p < 1).any():
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab).expand_as(sorted_logits)
        mask = ranks >= top_k.unsqueeze(1)
        sorted_logits = sorted_logits.masked_fill(mask, float("-inf"))
        probs = torch.softmax(sorted_logits, dim=-1)
        before = probs.cumsum(-1) - probs  # mass strictly above this token
        mask |= before > top_p.unsqueeze(1)
        mask[:, 0] = False  # always keep the best token
        logits = torch.full_like(logits, float("-inf")).scatter(
            1, order, sorted_logits.masked_fill(mask, float("-inf"))
        )
    if (min_p > 0).any():
        probs = torch.softmax(logits, dim=-1)
        keep = probs >= min_p.unsqueeze(1) * probs.max(-1, keepdim=True).values
        logits = logits.masked_fill(~keep, float("-inf"))
    return logits
