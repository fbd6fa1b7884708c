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
cumulative distribution of its kept tokens taken in id order (inverse CDF; the filters rank tokens
by logit, ties by lower id where the sort is stable). Every operation is row-wise and a row's path
depends only on its own parameters and logits, so a seeded request samples the same tokens in any
batch, after preemption, and under sync and async scheduling alike.

An executor may draw the sampled rows of logits in host memory with a kernel of its own
(:data:`DrawKernel`, from :meth:`pypto_serving.Executor.draw_kernel`): the same rule in a few passes a
row, with no sort of the vocabulary and no bounded candidates (the torch ops above took about 1 ms
for a 151,936-word row with a temperature alone and 24-28 ms with top-p alone on the CPU of
docs/benchmarks.md).
Its tokens are the torch draw's but where a rounding moves the uniform across a boundary between
two tokens' cumulative weights.

Penalties read a per-request :class:`TokenCounts` kept on the device: the prompt's tokens and the
outputs' counts, updated with the few tokens each step adds, never rebuilt from the history.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .structured import GrammarMask, SparseRows, apply_bitmask

__all__ = [
    "CANDIDATES",
    "NON_FINITE",
    "DeviceSample",
    "DrawKernel",
    "LogitEdits",
    "RowParams",
    "SampleOutput",
    "TokenCounts",
    "packed",
    "plain_greedy",
    "prompt_logprobs",
    "read_maxima",
    "read_sample",
    "sample",
    "sample_on_device",
    "uniforms",
]

NON_FINITE = "the model produced non-finite logits (NaN or +inf) for this request"
CANDIDATES = 256  # bounded candidate set of rows with top-p or min-p and no top-k
_GOLDEN = 0x9E3779B97F4A7C15 - 2**64  # splitmix64 constants as signed int64 (tensor arithmetic wraps)
_MUL1 = 0xBF58476D1CE4E5B9 - 2**64
_MUL2 = 0x94D049BB133111EB - 2**64

#: An executor's draw of sampled rows (:meth:`pypto_serving.Executor.draw_kernel`):
#: ``(logits [N, V] float32, rows [S] int64 or None (every row), temperature [S] float32, top_k [S]
#: int64, top_p [S] float32, min_p [S] float32, uniforms [S] float64) -> tokens [S] int64`` by the
#: module's rule, or None where it does not take these logits (the torch ops then draw).
DrawKernel = Callable[
    [torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    torch.Tensor | None,
]


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

    def tensors(self, vocab: int, device: torch.device, p: RowParams) -> tuple[torch.Tensor, torch.Tensor]:
        """``(seen bool [V], subtract float [V])`` with every added token folded in; ``subtract`` is
        ``frequency_penalty * count + presence_penalty * (count > 0)`` of the outputs."""
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
            self._subtract.index_copy_(0, idx, _subtract(self._counts.index_select(0, idx), p))
        self._pending = []
        return self._seen, self._subtract

    def counts_at(self, idx: torch.Tensor) -> torch.Tensor:
        return self._counts.index_select(0, idx)


class LogitEdits:
    """A request's fixed edits of its logits, made on the device once and reused every step: the
    ``logit_bias`` added to its tokens, and with ``allowed_token_ids`` every other token set to
    ``-inf``. Ids outside the vocabulary are dropped (the server refuses them with a 400)."""

    __slots__ = ("_allowed", "_bias", "_ids", "_keep", "_made", "_vals")

    def __init__(self, *, bias: tuple[tuple[int, float], ...], allowed: tuple[int, ...] | None) -> None:
        self._bias = bias
        self._allowed = allowed
        self._made = False
        self._ids = self._vals = self._keep = torch.empty(0)

    def apply(self, row: torch.Tensor) -> None:
        """Edits one ``[V]`` logits row in place (every tensor stays on its device)."""
        vocab, dev = row.shape[0], row.device
        if not self._made:  # first use: the tensors are made where the logits are
            pairs = [(t, b) for t, b in self._bias if 0 <= t < vocab]
            self._ids = torch.tensor([t for t, _ in pairs], dtype=torch.long, device=dev)
            self._vals = torch.tensor([b for _, b in pairs], dtype=torch.float32, device=dev)
            if self._allowed is not None:
                ids = sorted({t for t in self._allowed if 0 <= t < vocab})
                self._keep = torch.tensor(ids, dtype=torch.long, device=dev)
            self._made = True
        if self._ids.numel():
            row.index_add_(0, self._ids, self._vals.to(row.dtype))
        if self._allowed is not None:
            # Keep the allowed values, fill the row, put them back: a fraction of a boolean mask's time.
            kept = row.index_select(0, self._keep)
            row.fill_(float("-inf")).index_copy_(0, self._keep, kept)


def _apply_edits(logits: torch.Tensor, params: list[RowParams]) -> torch.Tensor:
    """``logits`` with the rows' :class:`LogitEdits` applied (a new tensor when any row has some)."""
    rows = [i for i, p in enumerate(params) if p.edits is not None]
    if not rows:
        return logits
    out = logits.clone()
    for r in rows:
        edits = params[r].edits
        assert edits is not None
        edits.apply(out.select(0, r))
    return out


def _subtract(counts: torch.Tensor, p: RowParams) -> torch.Tensor:
    return p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(counts.dtype)


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
    banned: tuple[int, ...] = ()  # eos/stop ids while min_tokens is not reached, bad words' last tokens
    edits: LogitEdits | None = None  # the request's logit_bias and allowed_token_ids
    counts: TokenCounts | None = None  # the request's token counts; None: the request has no penalties
    drafts: tuple[int, ...] = ()  # outputs this row follows that ``counts`` does not hold yet


@dataclass(slots=True)
class SampleOutput:
    tokens: list[int]
    logprobs: list[dict[int, float] | None]
    errors: dict[int, str]  # row -> message (non-finite logits)
    empty: set[int] = field(default_factory=set)  # rows whose every token is banned: nothing to sample


@dataclass(slots=True, kw_only=True)
class DeviceSample:
    """A step's sample before the host read: every tensor on the logits' device."""

    tokens: torch.Tensor  # [N] long
    bad: torch.Tensor  # [N] bool: NaN or +inf logits
    needs_full: torch.Tensor  # [N] bool: the bounded candidates cannot hold the row's kept set
    logits: (
        torch.Tensor
    )  # [N, V] float32 after penalties and bans, for the fallback (all-greedy steps: before the grammar)
    empty: torch.Tensor | None = None  # [N] bool: every token banned (None: the step bans nothing)
    lp_rows: list[int] = field(default_factory=list)  # rows that want logprobs
    raw: torch.Tensor | None = None  # [L, V] log-softmax of those rows, before penalties
    top: tuple[torch.Tensor, torch.Tensor] | None = None  # [L, K] values and ids of the top logprobs
    greedy_grammar: GrammarMask | None = None  # an all-greedy step's masks, for its fallback rows


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


def _apply_penalties(logits: torch.Tensor, rows: list[int], params: list[RowParams]) -> torch.Tensor:
    """``logits`` with the penalties of ``rows`` applied (a new tensor; the input is untouched)."""
    vocab = logits.shape[1]
    dev = logits.device
    # Row by row into one new tensor: stacking the requests' [V] tensors would allocate and copy
    # [rows, V] twice more per step, and fresh allocations that size dominate the CPU step.
    out = torch.empty_like(logits) if rows == list(range(logits.shape[0])) else logits.clone()
    for r in rows:
        p = params[r]
        seen, minus = _counts(p).tensors(vocab, dev, p)
        drafts = [t for t in p.drafts if 0 <= t < vocab]
        if drafts:  # out of place: the drafts stay out of the request's own tensors
            at = torch.tensor(drafts, dtype=torch.long, device=dev)
            minus = minus.index_put((at,), _draft_subtract(p, drafts, at))
            seen = seen.index_fill(0, at, True)
        row = logits.select(0, r)
        if p.repetition_penalty != 1.0:
            rep = p.repetition_penalty
            row = torch.where(seen, torch.where(row > 0, row / rep, row * rep), row)
        torch.sub(row, minus, out=out.select(0, r))
    return out


def _counts(p: RowParams) -> TokenCounts:
    assert p.counts is not None, "a row with penalties carries its request's counts"
    return p.counts


def _draft_subtract(p: RowParams, drafts: list[int], at: torch.Tensor) -> torch.Tensor:
    """What the frequency and presence penalties subtract at each draft token: the request's output
    count plus every copy of the token among the row's drafts."""
    extra = torch.tensor([float(drafts.count(t)) for t in drafts], dtype=torch.float32, device=at.device)
    return p.frequency_penalty * (_counts(p).counts_at(at) + extra) + p.presence_penalty


def _ban(logits: torch.Tensor, params: list[RowParams]) -> torch.Tensor:
    vocab = logits.shape[1]
    pairs = [(i, t) for i, p in enumerate(params) for t in p.banned if 0 <= t < vocab]
    if not pairs:
        return logits
    return logits.index_put(_pairs(pairs, logits.device), torch.tensor(float("-inf"), device=logits.device))


def _pairs(pairs: list[tuple[int, int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, column) index tensors of ``pairs`` for ``index_put``."""
    # select/narrow/index_select rather than ``t[...]``: they are what the fake-device test can trace.
    at = torch.tensor(pairs, dtype=torch.long, device=device)
    return at.select(1, 0), at.select(1, 1)


def _kind(p: RowParams, vocab: int) -> tuple[str, int]:
    """The candidate set a sampled row draws from; it depends on the row alone (batch invariance)."""
    if 0 < p.top_k < vocab:
        return "top", p.top_k
    if p.top_p < 1.0 or p.min_p > 0.0:
        return ("bounded", CANDIDATES) if vocab > CANDIDATES else ("sorted", vocab)
    return "all", vocab


def _fallback_kind(p: RowParams, vocab: int) -> tuple[str, int]:
    return ("sorted", vocab) if p.top_p < 1.0 else ("all", vocab)


def _column(values: list[float], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=like.dtype, device=like.device).unsqueeze(1)


def _row_mass(x: torch.Tensor, top: torch.Tensor, temp: torch.Tensor) -> torch.Tensor:
    """``logsumexp(x / temp)`` per row given the row maxima ``top``, in one temporary: the full-row
    exp pass is most of a bounded row's cost, and ``logsumexp`` makes several."""
    t = x - top
    t.div_(temp).exp_()
    return top / temp + t.sum(dim=-1, keepdim=True).log()


def _draw(
    x: torch.Tensor, kind: str, k: int, params: list[RowParams], u: torch.Tensor, listed: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens ``[S]`` of rows ``x [S, V]`` sharing one candidate kind, and whether each row's kept
    set lies inside its candidates (always, except for the ``bounded`` kind). ``listed [S, V]``:
    the token ids of ``x``'s columns for the ``all`` kind (default: the column indices)."""
    temp = _column([p.temperature for p in params], x)
    if kind == "all":
        vals, ids = x, torch.arange(x.shape[1], device=x.device).expand_as(x) if listed is None else listed
    elif kind == "sorted":
        vals, ids = x.sort(dim=-1, descending=True, stable=True)
    else:
        vals, ids = x.topk(k, dim=-1)
    v = vals / temp
    # Top-p weighs the candidates against the whole row's mass unless top-k has cut the row first.
    norm = _row_mass(x, vals.narrow(1, 0, 1), temp) if kind == "bounded" else torch.logsumexp(v, -1, keepdim=True)
    probs = torch.exp(v - norm)
    min_p = _column([p.min_p for p in params], x)
    drop = v < v.amax(dim=-1, keepdim=True) + torch.log(min_p)  # log(0) = -inf drops nothing
    fits = torch.ones(x.shape[0], dtype=torch.bool, device=x.device)
    if kind != "all":
        top_p = _column([p.top_p for p in params], x)
        cum = probs.cumsum(dim=-1)
        past = ((cum - probs) > top_p) & (top_p < 1.0)  # the mass strictly above the token exceeds top-p
        drop |= past & (torch.arange(k, device=x.device) > 0)  # the best token always stays
        if kind == "bounded":
            fits = ((cum.narrow(1, k - 1, 1) > top_p) & (top_p < 1.0)).squeeze(1) | drop.select(1, k - 1)
    kept = probs.masked_fill(drop, 0.0)
    if kind != "all":  # the kept candidates in id order, the order every kind draws in
        ids, order = ids.sort(dim=-1)
        kept = kept.gather(1, order)
    cdf = kept.double().cumsum(dim=-1)
    # u < 1 has 32 bits, so u * total stays below total and lands on a kept (positive) weight.
    at = torch.searchsorted(cdf, u.unsqueeze(1) * cdf.narrow(1, k - 1, 1), right=True)
    return ids.gather(1, at.clamp(max=ids.shape[1] - 1)).squeeze(1), fits


@dataclass(slots=True, kw_only=True)
class _Listed:
    """Grammar rows listed by id (:class:`SparseRows`) as the draw takes them: rows listed by allowed
    id as their allowed tokens' logits after every edit (padding at ``-inf``) and those tokens' ids;
    rows listed by disallowed id as their logits before the grammar's mask and the ids it disallows
    (and every token from ``vocab`` on)."""

    vocab: int
    at: dict[int, int] = field(default_factory=dict)  # logits row -> row of ``vals`` and ``ids``
    vals: torch.Tensor = field(default_factory=lambda: torch.empty(0))  # [S, K] float32
    ids: torch.Tensor = field(default_factory=lambda: torch.empty(0))  # [S, K] long
    banned_at: dict[int, int] = field(default_factory=dict)  # logits row -> row of ``unmasked`` and ``banned``
    unmasked: torch.Tensor = field(default_factory=lambda: torch.empty(0))  # [B, V] float32
    banned: torch.Tensor = field(default_factory=lambda: torch.empty(0))  # [B, K'] long


def _group(p: RowParams, row: int, vocab: int, fallback: bool, listed: _Listed | None) -> tuple[str, int]:
    """A sampled row's draw group. Listed rows without filters draw over their allowed tokens in id
    order, or over their unmasked logits with the disallowed weights zeroed: the same cumulative
    weights as the masked row's, whose disallowed tokens weigh exactly 0."""
    if fallback:
        return _fallback_kind(p, vocab)
    kind = _kind(p, vocab)
    if listed is not None and kind[0] == "all" and row in listed.at:
        return "listed", listed.vals.shape[1]
    if listed is not None and kind[0] == "all" and row in listed.banned_at:
        return "unmasked", vocab
    return kind


def _draw_rows(
    x: torch.Tensor,
    params: list[RowParams],
    rows: list[int],
    tokens: torch.Tensor,
    fallback: bool,
    listed: _Listed | None = None,
    draw: DrawKernel | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``tokens`` with ``rows`` sampled, grouped by candidate kind (``draw``: the executor's kernel
    draws every row it takes, all but those a grammar lists by id); and ``needs_full [N]``."""
    n, vocab = x.shape
    dev = x.device
    seeds = torch.tensor([params[r].seed for r in rows], dtype=torch.long, device=dev)
    index = torch.tensor([params[r].draw_index for r in rows], dtype=torch.long, device=dev)
    u_all = uniforms(seeds, index)
    keyed = [(_group(params[r], r, vocab, fallback, listed), j) for j, r in enumerate(rows)]
    if draw is not None and not fallback:
        js = [j for (kind, _), j in keyed if kind not in _LISTED_KINDS]
        drawn = _kernel_draw(draw, x, params, [rows[j] for j in js], _subset(u_all, js, len(rows))) if js else None
        if drawn is not None:
            tokens = tokens.index_copy(0, torch.tensor([rows[j] for j in js], dtype=torch.long, device=dev), drawn)
            keyed = [(key, j) for key, j in keyed if key[0] in _LISTED_KINDS]
    groups: dict[tuple[str, int], list[int]] = defaultdict(list)
    for key, j in keyed:
        groups[key].append(j)
    needs_full = torch.zeros(n, dtype=torch.bool, device=dev)
    for (kind, k), js in groups.items():
        group = [rows[j] for j in js]
        rows_t = torch.tensor(group, dtype=torch.long, device=dev)
        u = _subset(u_all, js, len(rows))
        sub = x if group == list(range(n)) else x.index_select(0, rows_t)
        ps = [params[r] for r in group]
        if listed is not None and kind in _LISTED_KINDS:
            drawn, fits = _draw_listed(sub, kind, group, ps, u, listed)
        else:
            drawn, fits = _draw(sub, kind, k, ps, u)
        tokens = tokens.index_copy(0, rows_t, drawn)
        needs_full = needs_full.index_copy(0, rows_t, torch.logical_not(fits))
    return tokens, needs_full


_LISTED_KINDS = ("listed", "unmasked")


def _subset(u: torch.Tensor, js: list[int], count: int) -> torch.Tensor:
    return u if len(js) == count else u.index_select(0, torch.tensor(js, dtype=torch.long, device=u.device))


def _kernel_draw(
    draw: DrawKernel, x: torch.Tensor, params: list[RowParams], rows: list[int], u: torch.Tensor
) -> torch.Tensor | None:
    """The kernel's tokens of ``x``'s ``rows`` (their uniforms ``u``), or None where it does not take them."""
    dev = x.device
    picked = None if rows == list(range(x.shape[0])) else torch.tensor(rows, dtype=torch.long, device=dev)
    ps = [params[r] for r in rows]
    temperature = torch.tensor([p.temperature for p in ps], dtype=torch.float32, device=dev)
    top_k = torch.tensor([p.top_k for p in ps], dtype=torch.long, device=dev)
    top_p = torch.tensor([p.top_p for p in ps], dtype=torch.float32, device=dev)
    min_p = torch.tensor([p.min_p for p in ps], dtype=torch.float32, device=dev)
    return draw(x, picked, temperature, top_k, top_p, min_p, u)


def _draw_listed(
    x: torch.Tensor, kind: str, group: list[int], params: list[RowParams], u: torch.Tensor, listed: _Listed
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_draw` of whole-vocabulary rows ``group`` (``x``: their masked logits) listed by id."""
    where = listed.at if kind == "listed" else listed.banned_at
    js = [where[r] for r in group]
    at = torch.tensor(js, device=x.device)
    fits = torch.ones(len(group), dtype=torch.bool, device=x.device)
    if kind == "listed":
        vals, ids = listed.vals.index_select(0, at), listed.ids.index_select(0, at)
        return _draw(vals, "all", vals.shape[1], params, u, ids)[0], fits
    # Every listed row in order (a step inside JSON strings): no copy of the whole rows.
    whole = js == list(range(len(where)))
    unmasked = listed.unmasked if whole else listed.unmasked.index_select(0, at)
    banned = listed.banned if whole else listed.banned.index_select(0, at)
    return _draw_unmasked(x, unmasked, banned, listed.vocab, params, u), fits


def _draw_unmasked(
    masked: torch.Tensor,
    unmasked: torch.Tensor,
    banned: torch.Tensor,
    vocab: int,
    params: list[RowParams],
    u: torch.Tensor,
) -> torch.Tensor:
    """What :func:`_draw` draws from whole-vocabulary rows ``masked [S, V]``, computed from the same
    rows before the grammar's mask (``unmasked``) with the weights of the ``banned`` ids and of the
    tokens from ``vocab`` on zeroed after each ``exp``: ``exp`` of ``-inf`` runs several times slower
    than of a finite value, and every weight keeps its bits (``exp(-inf)`` is exactly 0). The
    normaliser is ``torch.logsumexp``'s own arithmetic: row max (0 where infinite), the sum of
    ``exp`` past it, log, plus the max."""
    temp = _column([p.temperature for p in params], masked)
    top = masked.amax(dim=-1, keepdim=True) / temp  # x -> x / t is monotonic: the max of the quotients
    top = top.masked_fill(top.abs() == float("inf"), 0.0)
    v = unmasked / temp
    norm = _zero((v - top).exp_(), banned, vocab).sum(dim=-1, keepdim=True).log_().add_(top)
    cdf = _zero(v.sub_(norm).exp_(), banned, vocab).double().cumsum(dim=-1)
    width = masked.shape[1]
    at = torch.searchsorted(cdf, u.unsqueeze(1) * cdf.narrow(1, width - 1, 1), right=True)
    return at.clamp(max=width - 1).squeeze(1)


def _zero(w: torch.Tensor, banned: torch.Tensor, vocab: int) -> torch.Tensor:
    """``w [S, V]`` with the ``banned [S, K]`` ids of each row and every column from ``vocab`` on at 0."""
    rows = torch.arange(w.shape[0], device=w.device).unsqueeze(1).expand_as(banned)
    w.index_put_((rows, banned), torch.tensor(0.0, device=w.device))
    if vocab < w.shape[1]:
        w.narrow(1, vocab, w.shape[1] - vocab).zero_()
    return w


def _apply_grammar(x: torch.Tensor, grammar: GrammarMask) -> tuple[torch.Tensor, _Listed | None]:
    """``x`` with the tokens ``grammar`` disallows at ``-inf`` (a new tensor), and what the draw
    takes of its rows listed by id."""
    sparse = grammar.sparse
    if sparse is None or sparse.max_id >= x.shape[1]:
        return apply_bitmask(x, grammar.rows, grammar.bitmask), None
    listed = _Listed(vocab=min(sparse.vocab, x.shape[1]))
    if sparse.num_dense:
        dense = sparse.dense
        x = apply_bitmask(x, grammar.rows.index_select(0, dense), grammar.bitmask.index_select(0, dense))
    if sparse.banned_rows:
        x = _ban_listed(x, sparse, listed)
    if sparse.rows:
        x = _mask_listed(x, sparse, listed)
    return x, listed


def _ban_listed(x: torch.Tensor, sparse: SparseRows, listed: _Listed) -> torch.Tensor:
    """``x`` with the rows listed by disallowed id masked (a new tensor): those ids, and the tokens
    from ``listed.vocab`` on, at ``-inf``."""
    at = torch.tensor(sparse.banned_rows, dtype=torch.long, device=x.device)
    listed.banned_at = {r: j for j, r in enumerate(sparse.banned_rows)}
    # ``x`` itself when every row is listed: the masking below writes a clone, never ``x``.
    whole = list(sparse.banned_rows) == list(range(x.shape[0]))
    listed.unmasked, listed.banned = x if whole else x.index_select(0, at), sparse.banned
    x = x.clone()
    _ban_rows(x, sparse)
    return x


def _mask_listed(x: torch.Tensor, sparse: SparseRows, listed: _Listed) -> torch.Tensor:
    """``x`` with the rows listed by allowed id masked (a fill and a scatter: the same rows as
    unpacking their bitmasks, at a fraction of its time); their candidates go to ``listed``."""
    n, vocab = x.shape
    at = torch.tensor(sparse.rows, dtype=torch.long, device=x.device)
    whole = list(sparse.rows) == list(range(n))
    vals = (x if whole else x.index_select(0, at)).gather(1, sparse.ids)
    masked = torch.full((len(sparse.rows), vocab), float("-inf"), dtype=x.dtype, device=x.device)
    masked.scatter_(1, sparse.ids, vals)
    listed.at = {r: j for j, r in enumerate(sparse.rows)}
    listed.vals, listed.ids = vals.masked_fill(sparse.pad, float("-inf")), sparse.ids
    return masked if whole else x.index_copy(0, at, masked)


def _greedy_under_grammar(x: torch.Tensor, grammar: GrammarMask) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``[N]`` the argmax of each row of ``x [N, V]`` among the tokens ``grammar`` allows it (ties: the
    lowest id, as ``argmax`` of the masked row), with one argmax pass per row: rows listed by allowed
    id take theirs over their ids, the others over one masked copy of ``x``, except rows marked
    ``checked`` (nearly every token allowed), which take their unmasked argmax when their bitmask
    allows it. Also ``[N]`` bool: the checked rows whose argmax it does not allow (None: no row
    checked); they need the masked argmax (:func:`_resample_full`)."""
    n, vocab = x.shape
    dev, sparse = x.device, grammar.sparse
    if sparse is None or sparse.max_id >= vocab:
        return apply_bitmask(x, grammar.rows, grammar.bitmask).argmax(dim=-1), None
    plain = sparse.unchecked if sparse.unchecked is not None else sparse.dense
    if plain.shape[0]:
        y = apply_bitmask(x, grammar.rows.index_select(0, plain), grammar.bitmask.index_select(0, plain))
    else:
        y = x.clone() if sparse.banned_rows else x
    if sparse.banned_rows:
        _ban_rows(y, sparse)
    listed = set(sparse.rows)
    rest = [r for r in range(n) if r not in listed]
    tokens = torch.empty(n, dtype=torch.long, device=dev)
    if rest:
        keep = torch.tensor(rest, dtype=torch.long, device=dev)
        tokens.index_copy_(0, keep, (y if len(rest) == n else y.index_select(0, keep)).argmax(dim=-1))
    if sparse.rows:
        at = torch.tensor(sparse.rows, dtype=torch.long, device=dev)
        vals = (x if len(rest) == 0 else x.index_select(0, at)).gather(1, sparse.ids)
        tokens.index_copy_(0, at, sparse.ids.gather(1, vals.argmax(dim=-1, keepdim=True)).squeeze(1))
    if sparse.checked is None:
        return tokens, None
    rows = grammar.rows.index_select(0, sparse.checked)
    bits = grammar.bitmask.index_select(0, sparse.checked)
    t = tokens.index_select(0, rows)
    width = 32 * bits.shape[1]
    word = bits.gather(1, (t >> 5).clamp(max=bits.shape[1] - 1).unsqueeze(1)).squeeze(1).long()
    allowed = ((word >> (t & 31)) & 1).bool() & (t < width)
    return tokens, torch.zeros(n, dtype=torch.bool, device=dev).index_copy(0, rows, torch.logical_not(allowed))


def _ban_rows(y: torch.Tensor, sparse: SparseRows) -> None:
    """Set ``y``'s rows listed by disallowed id to ``-inf`` at those ids and from ``sparse.vocab`` on."""
    dev, vocab = y.device, y.shape[1]
    at = torch.tensor(sparse.banned_rows, dtype=torch.long, device=dev)
    inf = torch.tensor(float("-inf"), device=dev)
    y.index_put_((at.unsqueeze(1).expand_as(sparse.banned), sparse.banned), inf)
    end = min(sparse.vocab, vocab)
    y.index_put_((at.unsqueeze(1), torch.arange(end, vocab, device=dev).unsqueeze(0)), inf)


#: Columns per block of :func:`argmax_rows`' first pass.
_ARGMAX_BLOCK = 128


def argmax_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x.amax(-1), x.argmax(-1))`` of a ``[N, V]`` tensor, in one pass over it.

    ``torch.argmax`` over a 151,936-column row is not vectorised on the CPU (2.7 ms for 64 rows where
    ``amax`` takes 0.56), so the rows are cut into blocks of 128 columns: ``amax`` of each block
    (vectorised), the first block holding the row's maximum, then ``argmax`` inside that block.
    The same index as ``argmax`` in every case: the first block with the maximum holds its first
    occurrence (ties: the lowest id), and both maxima propagate NaN, so a row with a NaN gives its
    first NaN, as ``argmax`` does. Device ops only (no host read).
    """
    rows, vocab = x.shape
    whole = vocab - vocab % _ARGMAX_BLOCK
    grid = x.narrow(1, 0, whole).reshape(rows, whole // _ARGMAX_BLOCK, _ARGMAX_BLOCK)
    blocks = grid.amax(dim=-1)
    if whole < vocab:  # a partial last block, padded with -inf, which never comes first
        pad = x.new_full((rows, whole + _ARGMAX_BLOCK - vocab), float("-inf"))
        last = torch.cat([x.narrow(1, whole, vocab - whole), pad], dim=1)
        blocks = torch.cat([blocks, last.amax(dim=-1, keepdim=True)], dim=1)
    best = blocks.argmax(dim=-1)
    if whole == 0:
        window = last
    else:
        picked = best.clamp_max(grid.shape[1] - 1).view(rows, 1, 1).expand(rows, 1, _ARGMAX_BLOCK)
        window = grid.gather(1, picked).squeeze(1)
        if whole < vocab:
            window = torch.where((best == grid.shape[1]).unsqueeze(1), last, window)
    index = best * _ARGMAX_BLOCK + window.argmax(dim=-1)
    return blocks.gather(1, best.unsqueeze(1)).squeeze(1), index


def _greedy_on_raw(params: list[RowParams], grammar: GrammarMask | None) -> bool:
    """Whether some row takes the argmax of the logits as they come: a greedy row, and nothing (logit
    bias, allowed tokens, penalties, bans, a grammar) edits any row first."""
    if grammar is not None or not any(p.temperature == 0.0 for p in params):
        return False
    return all(p.edits is None and p.counts is None and not p.banned for p in params)


def plain_greedy(params: list[RowParams]) -> bool:
    """Whether every row is greedy over the logits as they come, with no logprobs (and no grammar
    mask: the caller's to check): the rows' tokens are their argmax and nothing else of the logits is
    read."""
    return _greedy_on_raw(params, None) and all(p.temperature == 0.0 and p.num_logprobs is None for p in params)


def _raw_pass(
    x: torch.Tensor,
    params: list[RowParams],
    grammar: GrammarMask | None,
    maxima: tuple[torch.Tensor, torch.Tensor] | None,
) -> tuple[DeviceSample, torch.Tensor | None]:
    """What :func:`sample_on_device` reads of the raw logits ``x``: the non-finite check, the logprobs
    rows, and the greedy rows' argmax where nothing edits any row (None otherwise)."""
    top = None
    if _greedy_on_raw(params, grammar):
        # One pass for the tokens and the check below (none: the executor's output projection took them).
        peak, top = maxima if maxima is not None else argmax_rows(x)
    else:
        peak = x.amax(dim=-1)
    bad = torch.logical_not(peak < float("inf"))  # the maximum propagates NaN: this flags NaN and +inf
    dev = x.device
    out = DeviceSample(tokens=torch.zeros(x.shape[0], dtype=torch.long, device=dev), bad=bad, needs_full=bad, logits=x)
    out.lp_rows = [i for i, p in enumerate(params) if p.num_logprobs is not None]
    if out.lp_rows:
        out.raw = torch.log_softmax(x.index_select(0, torch.tensor(out.lp_rows, device=dev)), dim=-1)
        k = max(params[i].num_logprobs or 0 for i in out.lp_rows)
        out.top = out.raw.topk(k, dim=-1) if k else None
    return out, top


def sample_on_device(
    logits: torch.Tensor,
    params: list[RowParams],
    grammar: GrammarMask | None = None,
    maxima: tuple[torch.Tensor, torch.Tensor] | None = None,
    draw: DrawKernel | None = None,
) -> DeviceSample:
    """Sample one token per row of ``logits [N, V]`` without reading the host. In order: the rows'
    logit bias and allowed tokens, penalties, bans (min_tokens, bad words), and ``grammar``'s masks of
    the tokens its rows' grammars disallow; then the draw. Logprobs stay those of the raw logits.
    ``maxima``: :func:`argmax_rows` of ``logits`` where the executor took them with the logits (the
    greedy rows of a step nothing edits take them instead of a pass over the logits). ``draw``: the
    executor's kernel for the sampled rows (:data:`DrawKernel`), which then never need the fallback."""
    x = raw = logits.float()
    if maxima is not None and grammar is None and plain_greedy(params):
        # Every row takes its argmax as it came, and the executor took it already: nothing to pass over.
        bad = torch.logical_not(maxima[0] < float("inf"))
        return DeviceSample(tokens=maxima[1], bad=bad, needs_full=torch.zeros_like(bad), logits=x)
    out, top = _raw_pass(x, params, grammar, maxima)
    bad = out.bad
    x = _apply_edits(x, params)
    pen = [i for i, p in enumerate(params) if p.counts is not None]
    if pen:
        x = _apply_penalties(x, pen, params)
    x = _ban(x, params)
    listed = None
    edited = any(p.edits is not None for p in params) or (grammar is not None and any(p.banned for p in params))
    if grammar is not None and not edited and all(p.temperature == 0.0 for p in params):
        # Nothing reads the masked logits of an all-greedy step: its rows only need their argmax.
        out.tokens, checked = _greedy_under_grammar(x, grammar)
        out.needs_full = torch.zeros_like(bad) if checked is None else checked & torch.logical_not(bad)
        out.greedy_grammar = grammar
        return out
    if grammar is not None:
        x, listed = _apply_grammar(x, grammar)
    if edited:
        # Allowed tokens, bad words and a grammar together can leave a row nothing: flag it, draw nothing.
        # A grammar alone always allows EOS, and bans alone never cover the vocabulary: no pass for them.
        out.empty = torch.logical_not(x.amax(dim=-1) > float("-inf")) & torch.logical_not(bad)
    out.logits = x
    if any(p.temperature == 0.0 for p in params):
        out.tokens = top if top is not None and x is raw else argmax_rows(x)[1]
    rand = [i for i, p in enumerate(params) if p.temperature != 0.0]
    if rand:
        out.tokens, needs_full = _draw_rows(x, params, rand, out.tokens, False, listed, draw)
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
    token ids): tokens, error flags (1: non-finite logits, 2: every token banned), fallback flags,
    chosen logprobs, top logprob values and ids."""
    flags = dev.bad.double() if dev.empty is None else dev.bad.double() + 2 * dev.empty.double()
    parts = [dev.tokens.double(), flags, dev.needs_full.double()]
    if dev.lp_rows:
        parts.append(_chosen(dev, dev.lp_rows).double().flatten())
    if dev.top is not None:
        parts += [dev.top[0].double().flatten(), dev.top[1].double().flatten()]
    return torch.cat(parts)


def sample(
    logits: torch.Tensor, params: list[RowParams], grammar: GrammarMask | None = None, draw: DrawKernel | None = None
) -> SampleOutput:
    """Sample one token per row of float ``logits [N, V]`` according to ``params[row]`` and ``grammar``
    (``draw``: as :func:`sample_on_device` takes it)."""
    dev = sample_on_device(logits, params, grammar, draw=draw)
    return read_sample(dev, packed(dev), params)


def read_maxima(maxima: tuple[torch.Tensor, torch.Tensor]) -> SampleOutput:
    """The host side of a step whose every row is :func:`plain_greedy` and whose tokens the executor
    took as it wrote the logits (:func:`sample_on_device`'s ``maxima``), where they lie in host memory:
    the tokens and their maxima read as they are, with the rows :func:`read_sample` would flag as
    non-finite, without the device sample and its packed read (which exist for one read per step
    from an accelerator)."""
    peaks, tokens = maxima[0].tolist(), maxima[1].tolist()
    errors = {r: NON_FINITE for r, peak in enumerate(peaks) if not peak < math.inf}  # NaN and +inf
    return SampleOutput(tokens, [None] * len(tokens), errors)


def read_sample(dev: DeviceSample, flat_device: torch.Tensor, params: list[RowParams]) -> SampleOutput:
    """The host side of :func:`sample` for a device sample queued earlier (``flat_device`` is
    ``packed(dev)``): the one host read, the full-vocabulary fallback of the rows that need it (a
    second read), and the logprobs."""
    n = len(params)
    flat = flat_device.tolist()  # the step's one host read
    tokens = [int(t) for t in flat[:n]]
    errors = {r: NON_FINITE for r in range(n) if flat[n + r] == 1}
    empty = {r for r in range(n) if flat[n + r] == 2}
    chosen = flat[3 * n : 3 * n + len(dev.lp_rows)]
    full = [r for r in range(n) if flat[2 * n + r]]
    if full:
        chosen = _resample_full(dev, params, full, tokens, chosen)
    lps = _logprobs(dev, params, tokens, chosen, flat[3 * n + len(dev.lp_rows) :])
    return SampleOutput(tokens, lps, errors, empty)


def _resample_full(
    dev: DeviceSample, params: list[RowParams], rows: list[int], tokens: list[int], chosen: list[float]
) -> list[float]:
    """Re-sample ``rows`` over the sorted full vocabulary (their kept set reaches past the bounded
    candidates), or, in an all-greedy step under grammars, take their argmax over their masked rows
    (their unmasked argmax is disallowed), updating ``tokens`` in place; returns the chosen logprobs,
    refreshed."""
    if dev.greedy_grammar is not None:
        g = dev.greedy_grammar
        at = torch.tensor(rows, dtype=torch.long, device=dev.tokens.device)
        masked = apply_bitmask(dev.logits, g.rows, g.bitmask).index_select(0, at)
        dev.tokens = dev.tokens.index_copy(0, at, masked.argmax(dim=-1))
    else:
        dev.tokens, _ = _draw_rows(dev.logits, params, rows, dev.tokens, fallback=True)
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
    dev: DeviceSample, params: list[RowParams], tokens: list[int], chosen: list[float], top: list[float]
) -> list[dict[int, float] | None]:
    out: list[dict[int, float] | None] = [None] * len(params)
    k = dev.top[0].shape[1] if dev.top is not None else 0
    half = len(dev.lp_rows) * k
    for i, r in enumerate(dev.lp_rows):
        entry = {tokens[r]: chosen[i]}
        want = params[r].num_logprobs or 0
        entry.update(zip((int(t) for t in top[half + i * k : half + i * k + want]), top[i * k : i * k + want]))
        out[r] = entry
    return out


def prompt_logprobs(logits: torch.Tensor, targets: list[int], tops: list[int]) -> list[dict[int, float]]:
    """Per row of ``logits [P, V]``: the log-probability of ``targets[row]`` (the prompt token that
    follows the row's position) and of the row's ``tops[row]`` most likely tokens, from the raw
    logits. One host read."""
    dev = logits.device
    lp = torch.log_softmax(logits.float(), dim=-1)
    parts = [lp.gather(1, torch.tensor(targets, dtype=torch.long, device=dev).unsqueeze(1)).double().flatten()]
    k = max(tops, default=0)
    if k:
        values, ids = lp.topk(k, dim=-1)
        parts += [values.double().flatten(), ids.double().flatten()]
    flat = torch.cat(parts).tolist()
    n = len(targets)
    out = []
    for i, (target, want) in enumerate(zip(targets, tops)):
        entry = {target: flat[i]}
        at = n + i * k
        entry.update(zip((int(t) for t in flat[n + n * k + i * k : n + n * k + i * k + want]), flat[at : at + want]))
        out.append(entry)
    return out
