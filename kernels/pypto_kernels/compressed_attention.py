"""DeepSeek-V4 compressed sparse attention: compressor pooling, lightning indexer, sink attention.

V4 attention layers read two kinds of keys per request: the last ``sliding_window`` per-token
entries and *compressed* entries, each pooling ``rate`` consecutive source tokens (CSA layers let
the lightning indexer pick the ``topk`` best compressed entries per query). K and V are the same
tensor and there is one KV head.

The attention and indexer references take a flat query batch ``[T, ...]`` split by
``query_start_loc [R + 1]`` plus per-request keys padded to ``[R, L, D]`` and a per-token mask
``[T, L]``. They work request by request, in query tiles of at most ``_TILE_ELEMENTS`` scores, so
their memory follows the step's tokens: no query is padded to the longest one, and with
``key_lens_host`` a request only reads its own ``key_lens_host[r]`` keys, not the longest request's.
Single-query requests (decodes) are batched, a tile's worth at a time, over their group's longest keys.
Padded key slots must be masked out by the caller (and lie at or past ``key_lens_host[r]``).

The loops need each request's query length on the host: pass ``query_lens_host`` (what the caller
already holds, e.g. ``BatchInput.query_start_loc_host``) and nothing is read back from the device;
without it ``query_start_loc`` is read once per call (a host sync on an accelerator).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from .attention import _query_lens
from .registry import dispatch

#: Upper bound on the float32 scores of one query tile (heads x queries x keys), as in ``attention``.
_TILE_ELEMENTS = 1 << 21


def _tiles(q_lens: list[int], key_lens: list[int], row_cost: int) -> Iterator[tuple[int, int, int, int]]:
    """``(request, first row, end row, keys)`` query tiles of the requests with more than one query,
    each at most ``_TILE_ELEMENTS`` scores (``row_cost`` per query row and key); host values only."""
    start = 0
    for r, (n, kl) in enumerate(zip(q_lens, key_lens)):
        if n > 1:
            tile = max(1, _TILE_ELEMENTS // max(1, row_cost * kl))
            for a in range(start, start + n, tile):
                yield r, a, min(a + tile, start + n), kl
        start += n


def _single_rows(
    q_lens: list[int], key_lens: list[int], row_cost: int
) -> Iterator[tuple[list[int], list[int], list[int]]]:
    """The requests with one query (decodes) in groups of at most ``_TILE_ELEMENTS`` scores:
    ``(requests, their rows, their key lengths)``; one batched op per group, over its longest keys."""
    reqs: list[int] = []
    rows: list[int] = []
    lens: list[int] = []
    start = 0
    for r, (n, kl) in enumerate(zip(q_lens, key_lens)):
        if n == 1:
            if reqs and (len(reqs) + 1) * row_cost * max(*lens, kl) > _TILE_ELEMENTS:
                yield reqs, rows, lens
                reqs, rows, lens = [], [], []
            reqs.append(r)
            rows.append(start)
            lens.append(kl)
        start += n
    if reqs:
        yield reqs, rows, lens


def _take(x: torch.Tensor, idx: list[int]) -> torch.Tensor:
    """Rows ``idx`` of ``x``: a view when they are consecutive (a decode-only batch), else a gather."""
    if idx == list(range(idx[0], idx[0] + len(idx))):
        return x.narrow(0, idx[0], len(idx))
    return x.index_select(0, torch.tensor(idx, device=x.device))


def _put(out: torch.Tensor, idx: list[int], rows: torch.Tensor) -> None:
    """``out[idx] = rows`` in place (``_take``'s inverse)."""
    if idx == list(range(idx[0], idx[0] + len(idx))):
        out.narrow(0, idx[0], len(idx)).copy_(rows)
    else:
        out.index_copy_(0, torch.tensor(idx, device=out.device), rows)


def _group_mask(mask: torch.Tensor, rows: list[int], lens: list[int]) -> torch.Tensor:
    """``mask``'s rows ``rows`` over the group's longest keys, False past each row's own key length
    (a request never reads past its ``key_lens_host``): ``[n, 1, max(lens)]``."""
    width = max(lens)
    m = _take(mask.narrow(1, 0, width), rows)
    if any(n != width for n in lens):
        limit = torch.tensor(lens, device=mask.device)[:, None]
        m = m & (torch.arange(width, device=mask.device)[None, :] < limit)
    return m[:, None]


def _lengths(
    name: str,
    num_tokens: int,
    query_start_loc: torch.Tensor,
    keys: torch.Tensor,
    query_lens_host: Sequence[int] | None,
    key_lens_host: Sequence[int] | None,
) -> tuple[list[int], list[int]]:
    """Host query and key lengths per request, checked against the shapes (no device read when the
    caller passes ``query_lens_host``)."""
    q_lens = _query_lens(query_start_loc, query_lens_host)
    num_req, width = keys.shape[0], keys.shape[1]
    k_lens = [width] * num_req if key_lens_host is None else [int(n) for n in key_lens_host]
    if query_start_loc.numel() - 1 != num_req or len(q_lens) != num_req or len(k_lens) != num_req:
        raise ValueError(
            f"{name}: keys hold {num_req} requests but query_start_loc describes {query_start_loc.numel() - 1}"
            f" (query_lens_host {len(q_lens)}, key_lens_host {len(k_lens)})"
        )
    if sum(q_lens) > num_tokens:
        raise ValueError(f"{name}: query_start_loc ends at {sum(q_lens)} > {num_tokens} tokens")
    if any(not 0 <= n <= width for n in k_lens):
        raise ValueError(f"{name}: key_lens_host {k_lens} must lie in [0, {width}]")
    return q_lens, k_lens


@dispatch("compressor_pool")
def compressor_pool(
    kv: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor, rate: int, first_window: int, overlap: bool
) -> torch.Tensor:
    """Softmax-gated pooling of the complete windows of one request's source rows.

    ``kv``/``gate`` ``[L, W]`` hold consecutive source tokens starting at absolute position
    ``first_window * rate - (rate if overlap and first_window > 0 else 0)``; every complete window
    from ``first_window`` on yields one entry. Without overlap an entry pools its own ``rate`` tokens
    (``W`` = head dim). With overlap (CSA) ``W`` = 2 * head dim: entry ``w`` pools the first halves of
    window ``w - 1`` together with the second halves of window ``w`` (2 * rate slots); window -1 does
    not exist, its slots get zero weight. ``bias [rate, W]`` is the per-slot position bias. Gate
    softmax runs in float32; returns ``[n_windows, head dim]`` in ``kv.dtype``.
    """
    has_prev = overlap and first_window > 0
    start = rate if has_prev else 0
    n_win = (kv.shape[0] - start) // rate
    if n_win <= 0:
        return kv.new_zeros((0, kv.shape[1] // (2 if overlap else 1)))
    # The tensor starts on a window boundary, so row i sits in window slot i % rate.
    g = gate.float() + bias.float().repeat(kv.shape[0] // rate + 1, 1)[: kv.shape[0]]
    cur_kv = kv[start : start + n_win * rate].view(n_win, rate, -1)
    cur_g = g[start : start + n_win * rate].view(n_win, rate, -1)
    if not overlap:
        w = torch.softmax(cur_g, dim=1).to(kv.dtype)
        return (cur_kv * w).sum(dim=1)
    hd = kv.shape[1] // 2
    prev_kv = kv.new_zeros((n_win, rate, hd))
    prev_g = g.new_full((n_win, rate, hd), float("-inf"))
    if has_prev:
        prev_kv = kv[: n_win * rate].view(n_win, rate, -1)[..., :hd]
        prev_g = g[: n_win * rate].view(n_win, rate, -1)[..., :hd]
    elif n_win > 1:
        prev_kv[1:] = cur_kv[:-1, :, :hd]
        prev_g[1:] = cur_g[:-1, :, :hd]
    all_kv = torch.cat([prev_kv, cur_kv[..., hd:]], dim=1)
    all_g = torch.cat([prev_g, cur_g[..., hd:]], dim=1)
    w = torch.softmax(all_g, dim=1).to(kv.dtype)
    return (all_kv * w).sum(dim=1)


def _indexer_core(
    q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, vis: torch.Tensor, topk: int, scale: float
) -> torch.Tensor:
    """Top-k of ``B`` independent groups: ``q [B, S, Hi, Di]``, ``w [B, S, Hi]``, ``keys [B, E, Di]``,
    ``vis [B, S, E]``; returns the chosen mask ``[B, S, E]``."""
    scores = torch.relu(torch.einsum("bshd,bed->bshe", q.float(), keys.float())) * scale
    scores = (scores * w.float().unsqueeze(-1)).sum(dim=2).masked_fill(~vis, float("-inf"))
    # Masked entries score -inf and a stable sort ranks them after every visible one, so the picked
    # visible entries are the group's top-k whatever the padding.
    top = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., : min(topk, keys.shape[1])]
    return torch.zeros_like(vis).scatter_(-1, top, True) & vis


def _sink_core(
    q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor, sinks: torch.Tensor, scale: float
) -> torch.Tensor:
    """Sink attention of ``B`` independent groups: ``q [B, S, H, D]``, ``keys [B, L, D]``, ``mask
    [B, S, L]``, float32 ``sinks [H]``; returns ``[B, S, H, D]`` in ``keys.dtype``."""
    # Key slots no query reads (padding, unwritten cache) may hold garbage; zero them so 0 * NaN
    # cannot leak through the probability-weighted sum.
    keys = torch.where(mask.any(dim=1)[:, :, None], keys, torch.zeros((), dtype=keys.dtype, device=keys.device))
    logits = torch.einsum("bshd,bld->bhsl", q.float(), keys.float()) * scale
    logits = logits.masked_fill(~mask[:, None], float("-inf"))
    sink = sinks.view(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[1], 1)
    combined = torch.cat([logits, sink], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = torch.softmax(combined, dim=-1)[..., :-1]
    return torch.einsum("bhsl,bld->bshd", probs.to(keys.dtype), keys)


@dispatch("indexer_topk")
def indexer_topk(
    index_q: torch.Tensor,
    weights: torch.Tensor,
    index_keys: torch.Tensor,
    visible: torch.Tensor,
    query_start_loc: torch.Tensor,
    topk: int,
    scale: float,
    query_lens_host: Sequence[int] | None = None,
    key_lens_host: Sequence[int] | None = None,
) -> torch.Tensor:
    """Lightning indexer: per query, keep the ``topk`` best-scoring visible compressed entries.

    ``index_q [T, Hi, Di]``, ``weights [T, Hi]`` (per-head score weights), ``index_keys [R, E, Di]``
    (request r's indexer keys, padded), ``visible [T, E]`` bool. The score of entry ``e`` for token
    ``t`` is ``sum_h weights[t, h] * relu(index_q[t, h] . index_keys[r, e]) * scale`` (float32).
    Returns the selected mask ``[T, E]`` (a subset of ``visible``). Ties are broken towards earlier
    entries (stable sort), so the choice does not depend on how queries are batched.
    ``query_lens_host``: each request's query length on the host (else read from ``query_start_loc``);
    ``key_lens_host``: each request's entry count (``visible`` must be False past it; default ``E``).
    """
    num_tokens = index_q.shape[0]
    chosen = torch.zeros_like(visible, dtype=torch.bool)
    if num_tokens == 0 or index_keys.shape[1] == 0 or query_start_loc.numel() < 2:
        return chosen
    query_start_loc = query_start_loc.to(device=index_q.device, dtype=torch.int64)
    q_lens, e_lens = _lengths("indexer_topk", num_tokens, query_start_loc, index_keys, query_lens_host, key_lens_host)
    for reqs, rows, lens in _single_rows(q_lens, e_lens, index_q.shape[1]):
        e = max(lens)
        picked = _indexer_core(
            _take(index_q, rows)[:, None],
            _take(weights, rows)[:, None],
            _take(index_keys.narrow(1, 0, e), reqs),
            _group_mask(visible, rows, lens),
            topk,
            scale,
        )
        _put(chosen.narrow(1, 0, e), rows, picked[:, 0])
    for r, a, b, e in _tiles(q_lens, e_lens, index_q.shape[1]):
        picked = _indexer_core(
            index_q[a:b][None], weights[a:b][None], index_keys[r : r + 1, :e], visible[a:b, :e][None], topk, scale
        )
        chosen[a:b, :e] = picked[0]
    return chosen


@dispatch("sink_attention")
def sink_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    mask: torch.Tensor,
    query_start_loc: torch.Tensor,
    sinks: torch.Tensor,
    scale: float,
    query_lens_host: Sequence[int] | None = None,
    key_lens_host: Sequence[int] | None = None,
) -> torch.Tensor:
    """Single-KV-head attention (K == V) with a learned per-head sink logit, over a flat batch.

    ``query [T, H, D]``; ``keys [R, L, D]`` request r's keys (sliding entries then compressed ones,
    padded); ``mask [T, L]`` bool, True where token t may attend key l of its request; ``sinks [H]``.
    The sink joins each head's softmax (float32) and is then dropped, so a head may attend to
    "nothing" (a row with no visible key returns zeros). Returns ``[T, H, D]`` in ``query.dtype``.
    ``query_lens_host``: each request's query length on the host (else read from ``query_start_loc``);
    ``key_lens_host``: how many leading keys of each request may be visible (``mask`` must be False
    past it; default ``L``): the rest is never read.
    """
    num_tokens = query.shape[0]
    out = query.new_zeros((num_tokens, query.shape[1], keys.shape[-1]))
    if num_tokens == 0 or query_start_loc.numel() < 2:
        return out
    query_start_loc = query_start_loc.to(device=query.device, dtype=torch.int64)
    q_lens, k_lens = _lengths("sink_attention", num_tokens, query_start_loc, keys, query_lens_host, key_lens_host)
    sink = sinks.to(device=query.device, dtype=torch.float32)
    for reqs, rows, lens in _single_rows(q_lens, k_lens, query.shape[1]):
        k = _take(keys.narrow(1, 0, max(lens)), reqs)
        res = _sink_core(_take(query, rows)[:, None], k, _group_mask(mask, rows, lens), sink, scale)
        _put(out, rows, res[:, 0].to(out.dtype))
    for r, a, b, kl in _tiles(q_lens, k_lens, query.shape[1]):
        res = _sink_core(query[a:b][None], keys[r : r + 1, :kl], mask[a:b, :kl][None], sink, scale)
        out[a:b] = res[0].to(out.dtype)
    return out
