"""Paged KV-cache writes and attention over a flat batch of variable-length requests.

The references are batched: every request's queries and keys are gathered into padded
[R, Q_max, ...] / [R, L_max, ...] tensors and one masked softmax covers prefill chunks,
plain prefill and decode together. Memory is O(R * Q_max * L_max * Hq), which suits tests
and CPU serving of small models; devices register fused fast paths.
"""

from __future__ import annotations

import torch

from .registry import dispatch


@dispatch("write_kv_cache")
def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter this step's K/V [T, Hkv, D] into the paged caches in place; slots < 0 are padding."""
    block_size = key_cache.shape[1]
    slot_mapping = slot_mapping.to(device=key_cache.device, dtype=torch.int64)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    blocks, offsets = slots // block_size, slots % block_size
    # Index by (block, offset) rather than a flattened view so non-contiguous caches are updated too.
    key_cache[blocks, offsets] = key[keep].to(key_cache.dtype)
    value_cache[blocks, offsets] = value[keep].to(value_cache.dtype)


def _pad_queries(query: torch.Tensor, query_start_loc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gather flat rows [T, ...] into [R, Q_max, ...]; plus q_lens [R] and valid mask [R, Q_max]."""
    starts = query_start_loc[:-1]
    q_lens = query_start_loc[1:] - starts
    q_max = int(q_lens.max().item()) if q_lens.numel() else 0
    offsets = torch.arange(q_max, device=query.device)
    rows = starts[:, None] + offsets[None, :]
    valid = offsets[None, :] < q_lens[:, None]
    safe_rows = torch.where(valid, rows, 0).clamp_(max=max(query.shape[0] - 1, 0))
    return query[safe_rows], q_lens, valid


def _unpad_output(out_padded: torch.Tensor, query_start_loc: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Scatter padded [R, Q_max, Hq, Dv] back to flat [T, Hq, Dv]; rows past the last request are zero."""
    if out_padded.shape[1] == 0:
        return out_padded.new_zeros((num_tokens, *out_padded.shape[2:]))
    tokens = torch.arange(num_tokens, device=out_padded.device)
    num_req = query_start_loc.numel() - 1
    request = torch.searchsorted(query_start_loc[1:], tokens, right=True).clamp_(max=num_req - 1)
    offset = tokens - query_start_loc[request]
    in_batch = tokens < query_start_loc[-1]
    offset = torch.where(in_batch, offset, 0).clamp_(max=max(out_padded.shape[1] - 1, 0))
    out = out_padded[request, offset]
    return torch.where(in_batch[:, None, None], out, torch.zeros((), dtype=out.dtype, device=out.device))


def _masked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_pos: torch.Tensor,
    q_valid: torch.Tensor,
    kv_len: torch.Tensor,
    scale: float,
    causal: bool,
    sliding_window: int | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Attention of padded q [R, Q, Hq, D] over padded k/v [R, L, Hkv, D]; returns float32 [R, Q, Hq, Dv].

    ``q_pos`` [R, Q] is each query's absolute position; key j of request r is visible when
    j < kv_len[r], (not causal or j <= pos) and (no window or j > pos - window).
    """
    num_req, q_max, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"query heads ({num_q_heads}) must be a multiple of kv heads ({num_kv_heads})")
    group = num_q_heads // num_kv_heads
    kv_max = k.shape[1]

    key_pos = torch.arange(kv_max, device=q.device)
    pos = q_pos[:, :, None]  # [R, Q, 1]
    visible = key_pos[None, None, :] < kv_len[:, None, None]
    if causal:
        visible = visible & (key_pos[None, None, :] <= pos)
    if sliding_window is not None:
        visible = visible & (key_pos[None, None, :] > pos - sliding_window)
    visible = visible & q_valid[:, :, None]  # [R, Q, L]

    # Cache slots no query reads may hold garbage (even NaN from torch.empty); zero them so 0 * NaN
    # cannot leak through the probability-weighted sum.
    key_used = visible.any(dim=1)  # [R, L]
    v = torch.where(key_used[:, :, None, None], v.to(torch.float32), 0.0)

    qf = q.to(torch.float32).reshape(num_req, q_max, num_kv_heads, group, head_dim)
    scores = torch.einsum("rqhgd,rlhd->rhgql", qf, k.to(torch.float32)) * scale
    scores = scores.masked_fill(~visible[:, None, None, :, :], float("-inf"))
    if sinks is not None:
        sink = sinks.to(device=q.device, dtype=torch.float32).reshape(1, num_kv_heads, group, 1, 1)
        sink = sink.expand(num_req, num_kv_heads, group, q_max, 1)
        probs = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :kv_max]
    else:
        probs = torch.softmax(scores, dim=-1)
    # Padded query rows have no visible key and softmax to NaN; zero them (they are dropped anyway).
    probs = torch.where(q_valid[:, None, None, :, None], probs, 0.0)
    out = torch.einsum("rhgql,rlhd->rqhgd", probs, v)
    return out.reshape(num_req, q_max, num_q_heads, v.shape[-1])


@dispatch("paged_attention")
def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of a flat mixed batch (prefill, chunked prefill, decode) over a paged KV cache.

    Request r owns query rows ``query_start_loc[r]:query_start_loc[r+1]``; its last query sits at
    position ``seq_lens[r] - 1`` and the cache already holds all ``seq_lens[r]`` tokens. Returns
    [T, Hq, Dv] in the query dtype; softmax runs in float32.
    """
    num_tokens = query.shape[0]
    block_size = key_cache.shape[1]
    out_shape = (num_tokens, query.shape[1], value_cache.shape[-1])
    if num_tokens == 0 or seq_lens.numel() == 0:
        return query.new_zeros(out_shape)
    device = query.device
    query_start_loc = query_start_loc.to(device=device, dtype=torch.int64)
    seq_lens = seq_lens.to(device=device, dtype=torch.int64)

    q_pad, q_lens, q_valid = _pad_queries(query, query_start_loc)
    q_pos = (seq_lens - q_lens)[:, None] + torch.arange(q_pad.shape[1], device=device)[None, :]

    kv_max = int(seq_lens.max().item())
    num_blocks = max(-(-kv_max // block_size), 1)
    if num_blocks > block_tables.shape[1]:
        raise ValueError(f"seq_lens need {num_blocks} blocks but block_tables has {block_tables.shape[1]} columns")
    # Unused table entries may be padding (-1, stale ids); clamp so the gather stays in bounds.
    tables = block_tables[:, :num_blocks].to(device=device, dtype=torch.int64)
    tables = tables.clamp(0, key_cache.shape[0] - 1)
    k_pad = key_cache[tables].flatten(1, 2)[:, :kv_max]  # [R, L, Hkv, D]
    v_pad = value_cache[tables].flatten(1, 2)[:, :kv_max]

    out = _masked_attention(q_pad, k_pad, v_pad, q_pos, q_valid, seq_lens, scale, True, sliding_window, sinks)
    return _unpad_output(out, query_start_loc, num_tokens).to(query.dtype)


@dispatch("varlen_attention")
def varlen_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    causal: bool = True,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Prefill-only attention with flat per-token K/V [T, Hkv, D] sharing the query's start locations."""
    num_tokens = query.shape[0]
    out_shape = (num_tokens, query.shape[1], value.shape[-1])
    if num_tokens == 0 or query_start_loc.numel() < 2:
        return query.new_zeros(out_shape)
    if sliding_window is not None and not causal:
        raise ValueError("sliding_window is only defined for causal attention")
    query_start_loc = query_start_loc.to(device=query.device, dtype=torch.int64)
    q_pad, q_lens, q_valid = _pad_queries(query, query_start_loc)
    k_pad, _, _ = _pad_queries(key, query_start_loc)
    v_pad, _, _ = _pad_queries(value, query_start_loc)
    q_pos = torch.arange(q_pad.shape[1], device=query.device)[None, :].expand(q_pad.shape[0], -1)
    out = _masked_attention(q_pad, k_pad, v_pad, q_pos, q_valid, q_lens, scale, causal, sliding_window, sinks)
    return _unpad_output(out, query_start_loc, num_tokens).to(query.dtype)
