"""N-gram (prompt-lookup) drafting: propose the tokens that followed an earlier occurrence of a
request's last tokens in its own history (prompt + outputs).

Parameters follow vLLM's names: ``num_speculative_tokens`` (``k``, the most drafts proposed),
``prompt_lookup_min`` and ``prompt_lookup_max`` (the n-gram lengths tried).

Rule, per request with history ``h`` of length ``L``: for ``n`` from ``prompt_lookup_max`` down to
``prompt_lookup_min``, the pattern is ``h[L-n:]``; an occurrence is a start ``i`` with
``h[i:i+n] == h[L-n:]`` and ``i < L - n`` (strictly earlier than the suffix itself; it may overlap
it). The first ``n`` with an occurrence wins (longest first) and, among its occurrences, the most
recent one (largest ``i``). The proposal is ``h[i+n : i+n+k]``, which holds between 1 and ``k``
tokens (fewer when the occurrence ends less than ``k`` tokens before the history does). No
occurrence for any ``n`` (including ``n > L - 1``, so whenever ``prompt_lookup_min >= L``) proposes
nothing.

The search is batched over requests on a right-aligned, padded ``[R, L]`` history tensor: for
every window end ``e`` it keeps whether the last ``n`` tokens ending at ``e`` equal the history's
last ``n``, one elementwise comparison per ``n`` (the match for ``n + 1`` is the match for ``n``
and one more comparison), then takes the largest valid ``e`` per row and ``n``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["NgramDrafter", "pad_histories", "propose_ngram"]

_PAD = -1  # left padding of the history tensor: never a token id


@dataclass(slots=True, kw_only=True, frozen=True)
class NgramDrafter:
    """The prompt-lookup drafter's settings; :meth:`propose` drafts for a batch of histories."""

    num_speculative_tokens: int
    prompt_lookup_min: int = 2  # the defaults of ``SpeculativeConfig`` for method ngram
    prompt_lookup_max: int = 5
    device: str = "cpu"  # where the search runs

    def __post_init__(self) -> None:
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {lo} and {hi}")
        if self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {self.num_speculative_tokens}")

    def propose(self, histories: Sequence[Sequence[int]]) -> list[list[int]]:
        """Per history, its drafts (``[]`` for none); one host read for the whole batch."""
        if not histories:
            return []
        hist = pad_histories(histories, torch.device(self.device))
        lo, hi, k = self.prompt_lookup_min, self.prompt_lookup_max, self.num_speculative_tokens
        tokens, counts = propose_ngram(hist, k=k, lookup_min=lo, lookup_max=hi)
        flat = torch.cat([counts, tokens.flatten()]).tolist()
        num = len(histories)
        return [flat[num + r * k : num + r * k + flat[r]] for r in range(num)]


def pad_histories(histories: Sequence[Sequence[int]], device: torch.device) -> torch.Tensor:
    """``[R, max length]`` long, each history right-aligned and left-padded with -1."""
    width = max(len(h) for h in histories)
    out = np.full((len(histories), width), _PAD, dtype=np.int64)
    for r, h in enumerate(histories):
        if len(h):
            out[r, width - len(h) :] = h
    return torch.from_numpy(out).to(device)


def _last_match(hist: torch.Tensor, lookup_min: int, lookup_max: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the end ``e`` (column) of the most recent earlier occurrence of its last ``n`` tokens
    for the longest ``n`` that has one, and that ``n`` (``e = -1`` where none has)."""
    rows, width = hist.shape
    dev = hist.device
    start = (hist == _PAD).sum(dim=1, keepdim=True)  # first real column of each row
    ends = torch.arange(width - 1, device=dev)  # an earlier occurrence ends before the last column
    alive = torch.ones(rows, width - 1, dtype=torch.bool, device=dev)
    best = torch.full((rows,), -1, dtype=torch.long, device=dev)
    size = torch.zeros(rows, dtype=torch.long, device=dev)
    for t in range(min(lookup_max, width - 1)):
        n = t + 1
        # Column e - t of the history against the row's t-th last token, for every end e.
        shifted = torch.cat(
            [torch.full((rows, t), _PAD - 1, dtype=hist.dtype, device=dev), hist.narrow(1, 0, width - 1 - t)], 1
        )
        alive &= shifted == hist.narrow(1, width - 1 - t, 1)
        if n < lookup_min:
            continue
        inside = ends >= start + (n - 1)  # the whole window lies in the row's real tokens
        found = torch.where(alive & inside, ends, -1).amax(dim=1)
        # Longer n overrides: the loop runs n upwards, so the last hit is the longest.
        hit = found >= 0
        best = torch.where(hit, found, best)
        size = torch.where(hit, n, size)
    return best, size


def propose_ngram(hist: torch.Tensor, *, k: int, lookup_min: int, lookup_max: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Drafts of right-aligned histories ``hist [R, L]`` (left padding -1), without a host read.

    :return: ``tokens [R, k]`` (``-1`` past each row's count) and ``counts [R]`` long.
    """
    rows, width = hist.shape
    if width < 2:
        return torch.full((rows, k), _PAD, dtype=torch.long, device=hist.device), torch.zeros(
            rows, dtype=torch.long, device=hist.device
        )
    end, _ = _last_match(hist, lookup_min, lookup_max)
    follow = end.unsqueeze(1) + 1 + torch.arange(k, device=hist.device)  # [R, k]
    counts = torch.where(end >= 0, (width - 1 - end).clamp(max=k), 0)
    tokens = hist.gather(1, follow.clamp(max=width - 1))
    tokens = torch.where(torch.arange(k, device=hist.device) < counts.unsqueeze(1), tokens, _PAD)
    return tokens, counts
