"""DeepSeek-V4 compressed sparse attention: compressor pooling, lightning indexer, sink attention.

V4 attention layers read two kinds of keys per request: the last ``sliding_window`` per-token
entries and *compressed* entries, each pooling ``rate`` consecutive source tokens (CSA layers let
the lightning indexer pick the ``topk`` best compressed entries per query). K and V are the same
tensor and there is one KV head.

The attention and indexer references take a flat query batch ``[T, ...]`` split by
``query_start_loc [R + 1]`` plus per-request keys padded to ``[R, L, D]`` and a per-token mask
``[T, L]``; they pad the queries to ``[R, Q_max, ...]`` and run one masked einsum for the whole
batch (no per-request loop). Padded key slots must be masked out by the caller.

The padded shape needs each request's query length on the host: pass ``query_lens_host`` (what
the caller already holds, e.g. ``BatchInput.query_start_loc_host``) and nothing is read back from the
device; without it ``query_start_loc`` is read once per call (a host sync on an accelerator).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .attention import _query_lens
from .registry import dispatch


def _pad_rows(rows: torch.Tensor, query_start_loc: torch.Tensor, q_max: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather flat rows ``[T, ...]`` into ``[R, q_max, ...]`` (``q_max`` from the host, no device read);
    plus the valid mask ``[R, q_max]``. Padding repeats a real row; callers mask it."""
    starts = query_start_loc[:-1]
    q_lens = query_start_loc[1:] - starts
    offsets = torch.arange(q_max, device=rows.device)
    idx = starts[:, None] + offsets[None, :]
    valid = offsets[None, :] < q_lens[:, None]
    safe = torch.where(valid, idx, 0).clamp_(max=max(rows.shape[0] - 1, 0))
    return rows[safe], valid


def _unpad_rows(padded: torch.Tensor, query_start_loc: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Inverse of ``_pad_rows``: [R, Q_max, ...] -> flat [T, ...]; rows past the last request are zero."""
    tokens = torch.arange(num_tokens, device=padded.device)
    num_req = query_start_loc.numel() - 1
    request = torch.searchsorted(query_start_loc[1:], tokens, right=True).clamp_(max=num_req - 1)
    in_batch = tokens < query_start_loc[-1]
    offset = torch.where(in_batch, tokens - query_start_loc[request], 0).clamp_(min=0, max=padded.shape[1] - 1)
    out = padded[request, offset]
    keep = in_batch.view(-1, *([1] * (out.dim() - 1)))
    return torch.where(keep, out, torch.zeros((), dtype=out.dtype, device=out.device))


def _check_batch(
    name: str, num_tokens: int, query_start_loc: torch.Tensor, keys: torch.Tensor, q_lens: list[int]
) -> None:
    """Shape checks from host values only (``q_lens``: the host query lengths)."""
    if query_start_loc.numel() - 1 != keys.shape[0] or len(q_lens) != keys.shape[0]:
        raise ValueError(
            f"{name}: keys hold {keys.shape[0]} requests but query_start_loc describes {query_start_loc.numel() - 1}"
            f" (query_lens_host {len(q_lens)})"
        )
    if sum(q_lens) > num_tokens:
        raise ValueError(f"{name}: query_start_loc ends at {sum(q_lens)} > {num_tokens} tokens")


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
) -> torch.Tensor:
    """Lightning indexer: per query, keep the ``topk`` best-scoring visible compressed entries.

    ``index_q [T, Hi, Di]``, ``weights [T, Hi]`` (per-head score weights), ``index_keys [R, E, Di]``
    (request r's indexer keys, padded), ``visible [T, E]`` bool. The score of entry ``e`` for token
    ``t`` is ``sum_h weights[t, h] * relu(index_q[t, h] . index_keys[r, e]) * scale`` (float32).
    Returns the selected mask ``[T, E]`` (a subset of ``visible``). Ties are broken towards earlier
    entries (stable sort), so the choice does not depend on how queries are batched.
    ``query_lens_host``: each request's query length on the host (else read from ``query_start_loc``).
    """
    num_tokens = index_q.shape[0]
    if num_tokens == 0 or index_keys.shape[1] == 0 or query_start_loc.numel() < 2:
        return torch.zeros_like(visible, dtype=torch.bool)
    query_start_loc = query_start_loc.to(device=index_q.device, dtype=torch.int64)
    q_lens = _query_lens(query_start_loc, query_lens_host)
    _check_batch("indexer_topk", num_tokens, query_start_loc, index_keys, q_lens)
    q_max = max(q_lens, default=0)
    if q_max == 0:
        return torch.zeros_like(visible, dtype=torch.bool)
    q_pad, q_valid = _pad_rows(index_q, query_start_loc, q_max)  # [R, S, Hi, Di]
    w_pad, _ = _pad_rows(weights, query_start_loc, q_max)  # [R, S, Hi]
    vis_pad, _ = _pad_rows(visible, query_start_loc, q_max)  # [R, S, E]
    vis_pad = vis_pad & q_valid[:, :, None]
    scores = torch.relu(torch.einsum("rshd,red->rshe", q_pad.float(), index_keys.float())) * scale
    scores = (scores * w_pad.float().unsqueeze(-1)).sum(dim=2).masked_fill(~vis_pad, float("-inf"))
    k = min(topk, index_keys.shape[1])
    # Padded entries are masked (-inf) and sit after every real one, so a stable sort never ranks
    # them above a real entry: the picked real entries equal the per-request choice.
    top = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]
    chosen = torch.zeros_like(vis_pad).scatter_(-1, top, True) & vis_pad
    return _unpad_rows(chosen, query_start_loc, num_tokens)


@dispatch("sink_attention")
def sink_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    mask: torch.Tensor,
    query_start_loc: torch.Tensor,
    sinks: torch.Tensor,
    scale: float,
    query_lens_host: Sequence[int] | None = None,
) -> torch.Tensor:
    """Single-KV-head attention (K == V) with a learned per-head sink logit, over a flat batch.

    ``query [T, H, D]``; ``keys [R, L, D]`` request r's keys (sliding entries then compressed ones,
    padded); ``mask [T, L]`` bool, True where token t may attend key l of its request; ``sinks [H]``.
    The sink joins each head's softmax (float32) and is then dropped, so a head may attend to
    "nothing" (a row with no visible key returns zeros). Returns ``[T, H, D]`` in ``query.dtype``.
    ``query_lens_host``: each request's query length on the host (else read from ``query_start_loc``).
    """
    num_tokens = query.shape[0]
    if num_tokens == 0 or query_start_loc.numel() < 2:
        return query.new_zeros((num_tokens, query.shape[1], keys.shape[-1]))
    query_start_loc = query_start_loc.to(device=query.device, dtype=torch.int64)
    q_lens = _query_lens(query_start_loc, query_lens_host)
    _check_batch("sink_attention", num_tokens, query_start_loc, keys, q_lens)
    q_max = max(q_lens, default=0)
    if q_max == 0:
        return query.new_zeros((num_tokens, query.shape[1], keys.shape[-1]))
    q_pad, q_valid = _pad_rows(query, query_start_loc, q_max)  # [R, S, H, D]
    m_pad, _ = _pad_rows(mask, query_start_loc, q_max)  # [R, S, L]
    m_pad = m_pad & q_valid[:, :, None]
    num_req, q_max = q_pad.shape[:2]
    # Key slots no query reads (padding, unwritten cache) may hold garbage; zero them so 0 * NaN
    # cannot leak through the probability-weighted sum.
    keys = torch.where(m_pad.any(dim=1)[:, :, None], keys, torch.zeros((), dtype=keys.dtype, device=keys.device))
    logits = torch.einsum("rshd,rld->rhsl", q_pad.float(), keys.float()) * scale
    logits = logits.masked_fill(~m_pad[:, None], float("-inf"))
    sink = sinks.to(device=query.device, dtype=torch.float32).view(1, -1, 1, 1).expand(num_req, -1, q_max, 1)
    combined = torch.cat([logits, sink], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = torch.softmax(combined, dim=-1)[..., :-1]
    out = torch.einsum("rhsl,rld->rshd", probs.to(keys.dtype), keys)
    return _unpad_rows(out, query_start_loc, num_tokens).to(query.dtype)
