"""Paged KV-cache writes and attention over a flat batch of variable-length requests.

The attention references work request by request, so their cost follows the real (query, key)
pairs of a step and their memory its tokens: nothing is padded to the longest request or query.
Keys are gathered block by block from the cache in the cache dtype (never a float32 copy of the
cache), a few MiB of consecutive requests per ``index_select``. Query heads are viewed as
``[Hkv, group]`` so grouped-query attention never repeats K/V. A decode row (one query) is two
small matmuls over all heads; longer query runs go through ``scaled_dot_product_attention`` (or,
with sinks, an explicit float32 softmax) in query tiles whose score and mask size is bounded by
``_TILE_ELEMENTS``. Small temporaries also matter on the CPU: large fresh ones cost a page fault
per 4 KiB on every layer, small ones are reused by the allocator and stay in cache.

The loops need each request's query and key lengths on the host. They are read from
``query_start_loc``/``seq_lens`` (one host read per call) unless the caller already holds them and
passes ``query_lens_host``/``seq_lens_host``; the device tensors stay the source of truth and the
lists must agree with them. With both lists given, :func:`paged_attention` (like
:func:`write_kv_cache`) reads nothing back from the device: no host sync on an accelerator.
Devices register fused fast paths.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Sequence
from itertools import pairwise
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F

from . import native
from .norm import rms_norm
from .registry import dispatch
from .rope import apply_rope

#: Upper bound on the elements of one query tile's scores (heads x queries x keys): bounds memory
#: by the step's tokens whatever the prompt length, while tiles stay large enough for fast matmuls.
_TILE_ELEMENTS = 1 << 21

#: Bytes of K (and as many of V) gathered by one index_select: a batch of decodes costs a few large
#: copies instead of one per request (each a parallel region, slow when the cores are shared), while
#: the copy stays small enough to be cache-resident and reused by the allocator.
_GATHER_BYTES = 2 << 20


#: A KV cache scale: per tensor (a float or 0-d tensor) or per KV head (a ``[Hkv]`` tensor).
CacheScale = float | torch.Tensor | None


@dispatch("write_kv_cache")
def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    k_scale: CacheScale = None,
    v_scale: CacheScale = None,
) -> None:
    """Scatter this step's K/V [T, Hkv, D] into the paged caches in place.

    An FP8 cache (``float8_e4m3fn``) stores each row divided by its scale (``k_scale``, ``v_scale``:
    a float or 0-d tensor per tensor, or a ``[Hkv]`` tensor per KV head; 1.0 when not given),
    saturated to the format's range; :func:`paged_attention` multiplies it back when it reads.

    Token ``t`` goes to slot ``slot_mapping[t]``: block ``slot // block_size``, offset
    ``slot % block_size``. Every slot must be a real one (``0 <= slot < blocks * block_size``) and
    distinct: there are no padding rows (slot -1), so the write has no data-dependent shape and
    reads nothing back to the host. A caller with padding rows slices them off first (by a count
    it holds on the host). Out-of-range slots raise IndexError on the CPU; on an accelerator they
    are undefined behaviour, as for any out-of-bounds index.
    """
    slots = slot_mapping.to(device=key_cache.device, dtype=torch.int64)
    _scatter_rows(key_cache, slots, key, k_scale)
    _scatter_rows(value_cache, slots, value, v_scale)


@dispatch("qk_norm_rope_write_kv")
def qk_norm_rope_write_kv(
    qkv: torch.Tensor,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    norms: tuple[torch.Tensor | None, torch.Tensor | None],
    eps: float,
    rotary: tuple[torch.Tensor, torch.Tensor],
    caches: tuple[torch.Tensor, torch.Tensor],
    slot_mapping: torch.Tensor,
    *,
    k_scale: CacheScale = None,
    v_scale: CacheScale = None,
) -> torch.Tensor:
    """An attention's work between its fused q/k/v projection and attending: ``qkv`` cut into heads,
    q and k RMS-normalised per head (:func:`rms_norm`; Qwen3's q/k norms, skipped when ``norms`` are
    None), rotated (:func:`apply_rope`), and k and v written into the caches (:func:`write_kv_cache`).

    :param qkv: ``[T, (Hq + 2 Hkv) D]``: each token's q heads, then its k heads, then its v heads.
    :param num_q_heads: ``Hq``.
    :param num_kv_heads: ``Hkv``.
    :param head_dim: ``D``.
    :param norms: the q and the k norm weights ``[D]``, or ``(None, None)``.
    :param eps: the norms' epsilon.
    :param rotary: cos and sin ``[T, rotary_dim]`` (:func:`rope_cos_sin`).
    :param caches: the key and the value cache ``[blocks, block_size, Hkv, D]``.
    :param slot_mapping: ``[T]`` the slot of each token's K/V (:func:`write_kv_cache`).
    :param k_scale: an FP8 cache's key scale (:func:`write_kv_cache`).
    :param v_scale: an FP8 cache's value scale.
    :return: q ``[T, Hq, D]``, rotated.
    """
    t, q_end, k_end = qkv.shape[0], num_q_heads * head_dim, (num_q_heads + num_kv_heads) * head_dim
    q = qkv[:, :q_end].reshape(t, num_q_heads, head_dim)
    k = qkv[:, q_end:k_end].reshape(t, num_kv_heads, head_dim)
    v = qkv[:, k_end:].reshape(t, num_kv_heads, head_dim)
    q_norm, k_norm = norms
    if q_norm is not None and k_norm is not None:
        q, k = rms_norm(q, q_norm, eps), rms_norm(k, k_norm, eps)
    q, k = apply_rope(q, k, *rotary)
    write_kv_cache(k, v, *caches, slot_mapping, k_scale=k_scale, v_scale=v_scale)
    return q


#: KV cache dtypes stored with a scale, and the largest finite value of each.
FP8_CACHE_MAX = {torch.float8_e4m3fn: 448.0}


def _head_factor(scale: CacheScale) -> float | torch.Tensor | None:
    """``scale`` shaped to multiply ``[..., Hkv, D]`` rows (a per-head ``[Hkv]`` tensor as
    ``[Hkv, 1]``); None for no scaling. A float 1.0 is no scaling; a tensor is never compared on the
    host (that would read it back)."""
    if scale is None or (isinstance(scale, float | int) and scale == 1.0):
        return None
    if isinstance(scale, torch.Tensor):
        return scale.float().reshape(-1, 1) if scale.dim() == 1 else scale.float()
    return float(scale)


def quantize_cache_rows(rows: torch.Tensor, dtype: torch.dtype, scale: CacheScale) -> torch.Tensor:
    """``rows`` ``[..., Hkv, D]`` as a cache of ``dtype`` stores them: FP8 divided by ``scale``
    (per tensor or per KV head) and saturated, others cast."""
    if dtype not in FP8_CACHE_MAX:
        return rows.to(dtype)
    limit = FP8_CACHE_MAX[dtype]
    factor = _head_factor(scale)
    values = rows.float() if factor is None else rows.float() / factor
    return values.clamp(-limit, limit).to(dtype)


def _dequantized(raw: torch.Tensor, dtype: torch.dtype, scale: CacheScale) -> torch.Tensor:
    """FP8 cache rows ``[..., Hkv, D]`` in ``dtype``, times their scale."""
    factor = _head_factor(scale)
    return raw.to(dtype) if factor is None else (raw.to(dtype) * factor).to(dtype)


def _scatter_rows(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, scale: CacheScale) -> None:
    """``cache`` [blocks, block_size, ...] at flat ``slots`` <- ``rows`` (cast to the cache dtype)."""
    rows = quantize_cache_rows(rows, cache.dtype, scale)
    if cache.dtype in FP8_CACHE_MAX:  # the CPU's index_copy_ has no FP8 kernel; the bytes are what move
        cache, rows = cache.view(torch.uint8), rows.view(torch.uint8)
    # A view shares storage, so a non-contiguous cache is written flat too when blocks and offsets
    # merge; a head-major one's never do (checked first: a failed view costs a raised error a call).
    flat = None if is_head_major(cache) else _flat_slots(cache)
    if flat is None:  # index by (block, offset) instead
        block_size = cache.shape[1]
        cache.index_put_((slots // block_size, slots % block_size), rows)
        return
    flat.index_copy_(0, slots, rows)


def _flat_slots(cache: torch.Tensor) -> torch.Tensor | None:
    """``cache`` ``[blocks, block_size, ...]`` viewed ``[slots, ...]``, or None where no view exists."""
    try:
        return cache.view(-1, *cache.shape[2:])
    except RuntimeError:
        return None


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


def _query_lens(query_start_loc: torch.Tensor, query_lens_host: Sequence[int] | None) -> list[int]:
    if query_lens_host is not None:
        return [int(n) for n in query_lens_host]
    starts = [int(s) for s in query_start_loc.tolist()]
    return [end - start for start, end in pairwise(starts)]


def _split_heads(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """[n, Hq, D] -> [Hkv, group * n, D]: each KV head's query heads become rows of one matmul."""
    n, num_q_heads, head_dim = q.shape
    if num_q_heads % num_kv_heads:
        raise ValueError(f"query heads ({num_q_heads}) must be a multiple of kv heads ({num_kv_heads})")
    group = num_q_heads // num_kv_heads
    return q.view(n, num_kv_heads, group, head_dim).permute(1, 2, 0, 3).reshape(num_kv_heads, group * n, head_dim)


def _softmax_attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    visible: torch.Tensor | None,
    scale: float,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """q [n, Hq, D] over k/v [L, Hkv, D] (cache dtype, matmuls on strided views); float32 softmax; [n, Hq, Dv]."""
    n, num_q_heads = q.shape[:2]
    num_keys, num_kv_heads = k.shape[:2]
    group = num_q_heads // num_kv_heads
    qh = _split_heads(q.to(k.dtype), num_kv_heads)
    scores = torch.matmul(qh, k.permute(1, 2, 0)).float().mul_(scale).view(num_kv_heads, group, n, num_keys)
    if visible is not None:
        scores.masked_fill_(~visible, float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1)
    else:
        # A sink is one extra logit per head that takes probability mass but contributes no value.
        sink = sinks.to(device=q.device, dtype=torch.float32).view(num_kv_heads, group, 1, 1)
        norm = torch.logaddexp(torch.logsumexp(scores, dim=-1, keepdim=True), sink)
        probs = scores.sub_(norm).exp_()
    out = torch.matmul(probs.view(num_kv_heads, group * n, num_keys).to(v.dtype), v.permute(1, 0, 2))
    return out.view(num_kv_heads, group, n, -1).permute(2, 0, 1, 3).reshape(n, num_q_heads, -1)


def _sdpa_attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """Same contract as :func:`_softmax_attend` without sinks, through torch's fused (flash on CPU) kernel."""
    out = F.scaled_dot_product_attention(
        q.to(k.dtype).transpose(0, 1).unsqueeze(0),
        k.permute(1, 0, 2).unsqueeze(0),
        v.permute(1, 0, 2).unsqueeze(0),
        attn_mask=visible,
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return out.squeeze(0).transpose(0, 1)


def _tile_visibility(
    first: int, count: int, num_keys: int, causal: bool, window: int | None, device: torch.device
) -> tuple[int, int, torch.Tensor | None]:
    """Key range [lo, hi) that queries at positions first..first+count-1 may see, and their mask (None: all)."""
    last = first + count - 1
    hi = min(num_keys, last + 1) if causal else num_keys
    lo = max(0, first - window + 1) if window is not None else 0
    if (not causal or hi - 1 <= first) and (window is None or lo > last - window):
        return lo, hi, None
    key_pos = torch.arange(lo, hi, device=device)[None, :]
    query_pos = torch.arange(first, last + 1, device=device)[:, None]
    visible = key_pos <= query_pos if causal else torch.ones_like(key_pos, dtype=torch.bool)
    if window is not None:
        visible = visible & (key_pos > query_pos - window)
    return lo, hi, visible


def _attend_request(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    first_pos: int,
    scale: float,
    causal: bool,
    window: int | None,
    sinks: torch.Tensor | None,
    out: torch.Tensor,
) -> None:
    """One request: q [n, Hq, D] at key positions first_pos.. over k/v [L, Hkv, D]; writes ``out`` [n, Hq, Dv].

    Queries are processed in tiles of at most ``_TILE_ELEMENTS`` scores, each over the key range
    it can see, so a long prompt never materialises a [Hq, n, L] tensor.
    """
    n, num_q_heads = q.shape[:2]
    tile = max(1, _TILE_ELEMENTS // max(1, num_q_heads * k.shape[0]))
    for start in range(0, n, tile):
        count = min(tile, n - start)
        lo, hi, visible = _tile_visibility(first_pos + start, count, k.shape[0], causal, window, q.device)
        q_tile, k_tile, v_tile = q[start : start + count], k[lo:hi], v[lo:hi]
        # Single queries (decode rows) are cheaper as two plain matmuls than through SDPA's dispatch.
        if sinks is None and count > 1:
            res = _sdpa_attend(q_tile, k_tile, v_tile, visible, scale)
        else:
            res = _softmax_attend(q_tile, k_tile, v_tile, visible, scale, sinks)
        out[start : start + count] = res


class _Span(NamedTuple):
    """One request of a paged step: its query rows, the key range [lo, hi) it reads and the blocks holding it."""

    request: int
    row: int
    num_queries: int
    lo: int
    hi: int
    first_block: int
    end_block: int


def _spans(q_lens: list[int], kv_lens: list[int], block_size: int, window: int | None) -> list[_Span]:
    spans, row = [], 0
    for r, (n, seq) in enumerate(zip(q_lens, kv_lens, strict=True)):
        # A sliding window never looks further back than window - 1 keys before the first query.
        lo = max(0, seq - n - window + 1) if window is not None else 0
        if n:
            spans.append(_Span(r, row, n, lo, seq, lo // block_size, -(-seq // block_size)))
        row += n
    return spans


def _gather_chunks(spans: list[_Span], block_bytes: int) -> list[list[_Span]]:
    """Consecutive requests whose blocks fit in ``_GATHER_BYTES`` (at least one request per chunk)."""
    chunks: list[list[_Span]] = []
    size = 0
    for span in spans:
        nbytes = (span.end_block - span.first_block) * block_bytes
        if not chunks or size + nbytes > _GATHER_BYTES:
            chunks.append([])
            size = 0
        chunks[-1].append(span)
        size += nbytes
    return chunks


def _gather_blocks(
    cache: torch.Tensor, tables: torch.Tensor, chunk: list[_Span], dtype: torch.dtype, scale: CacheScale
) -> torch.Tensor:
    """The chunk's blocks, request after request, as [tokens, Hkv, D] (one index_select): in the cache
    dtype, or for an FP8 cache dequantized to ``dtype`` (times ``scale``)."""
    ids = [tables[s.request, s.first_block : s.end_block] for s in chunk]
    index = ids[0] if len(ids) == 1 else torch.cat(ids)
    if cache.dtype not in FP8_CACHE_MAX:
        return cache.index_select(0, index).flatten(0, 1)
    raw = cache.view(torch.uint8).index_select(0, index).view(cache.dtype).flatten(0, 1)
    return _dequantized(raw, dtype, scale)


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
    *,
    query_lens_host: Sequence[int] | None = None,
    seq_lens_host: Sequence[int] | None = None,
    k_scale: CacheScale = None,
    v_scale: CacheScale = None,
    prompt_rows_host: Sequence[int] | None = None,
) -> torch.Tensor:
    """Causal attention of a flat mixed batch (prefill, chunked prefill, decode) over a paged KV cache.

    Request r owns query rows ``query_start_loc[r]:query_start_loc[r+1]``; its last query sits at
    position ``seq_lens[r] - 1`` and the cache already holds all ``seq_lens[r]`` tokens. Returns
    [T, Hq, Dv] in the query dtype (rows past the last request are zero); softmax runs in float32.
    ``query_lens_host`` / ``seq_lens_host`` are optional host copies of the per-request query and
    sequence lengths that spare the host read of the device tensors; they must match them. An FP8
    cache is read back chunk by chunk in the query dtype times ``k_scale`` / ``v_scale``.
    ``prompt_rows_host``: how many of each request's first rows are prompt tokens (host list); a
    backend whose kernels differ by run length attends those with its prompt kernel and the others
    (decode rows, drafts) with its decode kernel, whatever the run's length, so that a query's result
    does not depend on how the scheduler cut its request's prompt (None: by run length). This
    reference attends every row alike.
    """
    out = query.new_zeros((query.shape[0], query.shape[1], value_cache.shape[-1]))
    if query.shape[0] == 0 or seq_lens.numel() == 0:
        return out
    tables, spans = _tables_and_spans(
        query, key_cache, block_tables, query_start_loc, seq_lens, sliding_window, query_lens_host, seq_lens_host
    )
    _attend_spans(query, key_cache, value_cache, tables, spans, out, scale, sliding_window, sinks, k_scale, v_scale)
    return out


def _tables_and_spans(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    sliding_window: int | None,
    query_lens_host: Sequence[int] | None,
    seq_lens_host: Sequence[int] | None,
) -> tuple[torch.Tensor, list[_Span]]:
    """The block tables on the query's device as int64 and each request's span, checked against the
    tables' width (a non-empty batch)."""
    q_lens = _query_lens(query_start_loc, query_lens_host)
    kv_lens = [int(s) for s in (seq_lens_host if seq_lens_host is not None else seq_lens.tolist())]
    block_size = key_cache.shape[1]
    needed = -(-max(kv_lens) // block_size)
    if needed > block_tables.shape[1]:
        raise ValueError(f"seq_lens need {needed} blocks but block_tables has {block_tables.shape[1]} columns")
    tables = block_tables.to(device=query.device, dtype=torch.int64)
    return tables, _spans(q_lens, kv_lens, block_size, sliding_window)


def _attend_spans(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    tables: torch.Tensor,
    spans: list[_Span],
    out: torch.Tensor,
    scale: float,
    window: int | None,
    sinks: torch.Tensor | None,
    k_scale: CacheScale,
    v_scale: CacheScale,
) -> None:
    """Attend ``spans`` request by request into ``out``, their blocks gathered a few MiB at a time."""
    block_size = key_cache.shape[1]
    block_size = key_cache.shape[1]
    block_bytes = key_cache[0].numel() * key_cache.element_size()
    for chunk in _gather_chunks(spans, block_bytes):
        keys = _gather_blocks(key_cache, tables, chunk, query.dtype, k_scale)
        values = _gather_blocks(value_cache, tables, chunk, query.dtype, v_scale)
        base = 0
        for span in chunk:
            start = base + span.lo - span.first_block * block_size
            keys_r, values_r = keys[start : start + span.hi - span.lo], values[start : start + span.hi - span.lo]
            rows = slice(span.row, span.row + span.num_queries)
            first = span.hi - span.num_queries - span.lo
            _attend_request(query[rows], keys_r, values_r, first, scale, True, window, sinks, out[rows])
            base += (span.end_block - span.first_block) * block_size


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
    *,
    query_lens_host: Sequence[int] | None = None,
) -> torch.Tensor:
    """Prefill-only attention with flat per-token K/V [T, Hkv, D] sharing the query's start locations.

    ``query_lens_host`` optionally carries the per-request lengths on the host (see paged_attention).
    """
    num_tokens = query.shape[0]
    out = query.new_zeros((num_tokens, query.shape[1], value.shape[-1]))
    if num_tokens == 0 or query_start_loc.numel() < 2:
        return out
    if sliding_window is not None and not causal:
        raise ValueError("sliding_window is only defined for causal attention")
    row = 0
    for n in _query_lens(query_start_loc, query_lens_host):
        rows = slice(row, row + n)
        if n:
            _attend_request(query[rows], key[rows], value[rows], 0, scale, causal, sliding_window, sinks, out[rows])
        row += n
    return out


# The former padded path: the reference the tests and benchmarks/attention.py measure against.


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


def _reference_paged_attention(
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
    """The former padded implementation, kept as the reference the tests and benchmark compare against.

    It pads every request to the longest query and sequence: O(R * Q_max * L_max * Hq) memory.

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


# The CPU fast path: every decode row of a step (one query) in a few batched matmuls.

#: Bytes of padded K (and as many of V) one batched decode group gathers: rows are sorted by their
#: block count and cut into groups under this size, so padding stays small and the copy cache-sized.
_DECODE_GROUP_BYTES = 2 << 20


def _decode_groups(spans: list[_Span], block_bytes: int) -> list[list[_Span]]:
    """Decode spans sorted by block count, cut so that rows x longest row x ``block_bytes`` fits the budget."""
    ordered = sorted(spans, key=lambda s: s.end_block - s.first_block)
    groups: list[list[_Span]] = []
    for span in ordered:
        width = span.end_block - span.first_block
        if not groups or (len(groups[-1]) + 1) * width * block_bytes > _DECODE_GROUP_BYTES:
            groups.append([])
        groups[-1].append(span)
    return groups


def _padded_blocks(tables: torch.Tensor, group: list[_Span], block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Block ids [B, W] of each row's blocks (padding repeats its first block) and the hidden-key mask
    [B, W * block_size] (True where a key lies outside the row's range [lo, hi))."""
    device = tables.device
    width = max(s.end_block - s.first_block for s in group)
    geometry = torch.tensor([(s.request, s.first_block, s.end_block, s.lo, s.hi) for s in group], dtype=torch.int64).to(
        device
    )
    request, first, end, lo, hi = geometry.unbind(1)
    cols = first[:, None] + torch.arange(width, device=device)[None, :]
    real = cols < end[:, None]
    ids = tables[request[:, None], cols.clamp(max=tables.shape[1] - 1)]
    ids = torch.where(real, ids, ids[:, :1])
    key_pos = (first * block_size)[:, None] + torch.arange(width * block_size, device=device)[None, :]
    hidden = (key_pos < lo[:, None]) | (key_pos >= hi[:, None])
    return ids, hidden


def _gather_padded(cache: torch.Tensor, ids: torch.Tensor, dtype: torch.dtype, scale: CacheScale) -> torch.Tensor:
    """Blocks ``ids`` [B, W] of ``cache`` as [B, W * block_size, Hkv, D] (FP8 dequantized to ``dtype``)."""
    rows, width = ids.shape
    if cache.dtype not in FP8_CACHE_MAX:
        return cache.index_select(0, ids.flatten()).view(rows, width * cache.shape[1], *cache.shape[2:])
    raw = cache.view(torch.uint8).index_select(0, ids.flatten()).view(cache.dtype)
    out = _dequantized(raw, dtype, scale)
    return out.view(rows, width * cache.shape[1], *cache.shape[2:])


def _attend_decode_group(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    hidden: torch.Tensor,
    scale: float,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """q [B, Hq, D] over padded keys/values [B, L, Hkv, D] with ``hidden`` [B, L] keys masked; [B, Hq, Dv].

    One bmm per KV head over all rows (its query heads are the rows of each matrix), so grouped-query
    attention never repeats K/V; the softmax is float32 as in :func:`_softmax_attend`.
    """
    rows, num_q_heads, head_dim = q.shape
    num_kv_heads = keys.shape[2]
    group = num_q_heads // num_kv_heads
    qh = q.to(keys.dtype).view(rows, num_kv_heads, group, head_dim)
    scores = torch.stack([torch.bmm(qh[:, h], keys[:, :, h].transpose(1, 2)) for h in range(num_kv_heads)], 1)
    scores = scores.float().mul_(scale).masked_fill_(hidden[:, None, None, :], float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1)
    else:
        sink = sinks.to(device=q.device, dtype=torch.float32).view(1, num_kv_heads, group, 1)
        norm = torch.logaddexp(torch.logsumexp(scores, dim=-1, keepdim=True), sink)
        probs = scores.sub_(norm).exp_()
    # Padded and stale slots may hold anything (even NaN from torch.empty): zero them, 0 * NaN is NaN.
    slots = values.view(rows * values.shape[1], -1)
    slots.index_fill_(0, hidden.flatten().nonzero().squeeze(1), 0.0)
    probs = probs.to(values.dtype)
    outs = [torch.bmm(probs[:, h], values[:, :, h]) for h in range(num_kv_heads)]
    return torch.stack(outs, 1).view(rows, num_q_heads, -1)


#: Cache dtypes whose decode rows are read in place (torch's sampled matrix product, which the in-place
#: scores need, takes float32 and float64 only); other caches use the padded gather.
IN_PLACE_CACHE_DTYPES = (torch.float32, torch.float64)


#: Entries (decode row x query head x key, padded to the group's longest row) of one in-place group:
#: each of the plan's index arrays and the softmax matrix stays within a few tens of MiB whatever the
#: step's rows and contexts (64 rows of 400 keys x 16 heads are one group).
_IN_PLACE_ENTRIES = 1 << 22


class _InPlacePlan(NamedTuple):
    """Every (decode row, query head, visible key) triple of a group of decode rows, as one sparse pattern.

    Pattern row ``r * Hq + h`` (row r's query head h) holds the flat K/V table rows
    ``slot * Hkv + h // group`` of the keys it sees, in key order; ``crow`` delimits the pattern rows
    (CSR) and ``padded`` places each entry in a dense ``[R * Hq, width]`` score matrix for the softmax,
    whose last column holds the sink when there is one."""

    rows: torch.Tensor
    cols: torch.Tensor
    crow: torch.Tensor
    padded: torch.Tensor
    width: int
    zeros: torch.Tensor  # the pattern's float32 values, read-only zeros shared by every layer of the step


def _in_place_groups(spans: list[_Span], num_q_heads: int) -> list[list[_Span]]:
    """Decode spans sorted by key count, cut so that rows x heads x longest stays within the budget."""
    groups: list[list[_Span]] = []
    for span in sorted(spans, key=lambda s: s.hi - s.lo):
        if not groups or (len(groups[-1]) + 1) * num_q_heads * (span.hi - span.lo) > _IN_PLACE_ENTRIES:
            groups.append([])
        groups[-1].append(span)
    return groups


def _in_place_plan(
    tables: torch.Tensor,
    spans: list[_Span],
    block_size: int,
    heads: tuple[int, int],
    sink: bool,
    head_major: bool,
) -> _InPlacePlan:
    device = tables.device
    num_q_heads, num_kv_heads = heads
    geometry = torch.tensor([(s.request, s.lo, s.hi - s.lo) for s in spans], dtype=torch.int64).to(device)
    request, lo, count = geometry.unbind(1)
    width = max(s.hi - s.lo for s in spans) + int(sink)
    row_counts = count.repeat_interleave(num_q_heads)
    crow = F.pad(row_counts.cumsum(0), (1, 0))
    pattern_row = torch.repeat_interleave(row_counts)  # of every entry, in (row, head, key) order
    within = torch.arange(pattern_row.numel(), device=device) - crow[pattern_row]
    decode_row = pattern_row // num_q_heads
    pos = lo[decode_row] + within
    block, offset = tables[request[decode_row], pos // block_size], pos % block_size
    kv_head = (pattern_row % num_q_heads) // (num_q_heads // num_kv_heads)
    if head_major:  # physical [blocks, Hkv, block_size, D]: a head's keys of a block are one run
        cols = (block * num_kv_heads + kv_head) * block_size + offset
    else:  # [blocks, block_size, Hkv, D]
        cols = (block * block_size + offset) * num_kv_heads + kv_head
    rows = torch.tensor([s.row for s in spans], dtype=torch.int64, device=device)
    zeros = torch.zeros(cols.numel(), device=device)
    return _InPlacePlan(rows, cols, crow, pattern_row * width + within, width, zeros)


class _PlanMemo:
    """The last step's plan, reused while the same step's layers call with the same tables and lengths.

    Every layer of a step shares its block tables and lengths, so the plan (about a tenth of the
    in-place kernel's time on Qwen3-0.6B's heads) is built once a step, not once a layer. The entry
    is reused only when the tables' content, the spans and the head geometry all equal the ones it was
    built from, so it is never stale whatever the caller mutates in place between calls.
    """

    def __init__(self) -> None:
        # One tuple, replaced whole: a caller on another thread reads either entry, never a mix.
        self.entry: tuple[tuple[object, ...], torch.Tensor, list[_InPlacePlan]] | None = None

    def get(
        self,
        tables: torch.Tensor,
        spans: list[_Span],
        block_size: int,
        heads: tuple[int, int],
        sink: bool,
        head_major: bool,
    ) -> list[_InPlacePlan]:
        key = (tuple(spans), block_size, heads, sink, head_major, tables.shape, tables.device, _IN_PLACE_ENTRIES)
        entry = self.entry
        if entry is not None and entry[0] == key and torch.equal(entry[1], tables):
            return entry[2]
        plans = [
            _in_place_plan(tables, group, block_size, heads, sink, head_major)
            for group in _in_place_groups(spans, heads[0])
        ]
        self.entry = (key, tables.clone(), plans)
        return plans


_PLANS = _PlanMemo()


def _attend_in_place(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    plan: _InPlacePlan,
    scale: float,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Decode rows q [R, Hq, D] over the K/V table rows ``plan`` names (``keys``/``values``: the
    caches' :func:`_table_rows`), read where they lie; [R, Hq, Dv].

    The scores are a sampled matrix product (``torch.sparse.sampled_addmm``: only the pattern's
    dot products, straight from the cache), the float32 softmax runs on them placed in a dense
    padded matrix, and the output is ``embedding_bag``'s weighted sum of the cache's V rows. Nothing
    of the cache is copied, and grouped-query heads share K/V rows by index.
    """
    rows, num_q_heads, head_dim = q.shape
    size = (rows * num_q_heads, keys.shape[0])
    with warnings.catch_warnings():
        # torch calls sparse CSR tensors a beta API; this one is an index pattern only (the values are
        # zeros, as beta=0 still reads them), and the path is checked against the reference in the tests.
        warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta", category=UserWarning)
        zeros = plan.zeros if plan.zeros.dtype == keys.dtype else keys.new_zeros(plan.cols.numel())
        pattern = torch.sparse_csr_tensor(plan.crow, plan.cols, zeros, size=size, check_invariants=False)
        # Written through ``out``: without it the op copies the pattern's indices and values into its
        # result (two of a 64-stream Qwen3-0.6B step's largest copies per layer).
        result = torch.sparse_csr_tensor(
            plan.crow, plan.cols, keys.new_empty(plan.cols.numel()), size=size, check_invariants=False
        )
    flat_q = q.to(keys.dtype).reshape(rows * num_q_heads, head_dim)
    torch.sparse.sampled_addmm(pattern, flat_q, keys.t(), beta=0.0, alpha=scale, out=result)
    scores = result.values()
    dense = scores.new_full((rows * num_q_heads, plan.width), float("-inf"))
    if sinks is not None:
        dense[:, -1] = sinks.to(device=q.device, dtype=dense.dtype).repeat(rows)
    dense.view(-1).index_copy_(0, plan.padded, scores)
    probs = torch.softmax(dense.float(), dim=-1).to(values.dtype).view(-1).index_select(0, plan.padded)
    out = F.embedding_bag(plan.cols, values, plan.crow[:-1], mode="sum", per_sample_weights=probs)
    return out.view(rows, num_q_heads, -1)


def _attend_decode_rows(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    tables: torch.Tensor,
    decode: list[_Span],
    out: torch.Tensor,
    scale: float,
    sinks: torch.Tensor | None,
    k_scale: CacheScale,
    v_scale: CacheScale,
) -> None:
    """The decode rows into ``out``: read in place (groups of the step's plan) or gathered padded."""
    if reads_in_place(key_cache, value_cache):
        heads = (query.shape[1], key_cache.shape[2])
        head_major = is_head_major(key_cache)
        keys, values = _table_rows(key_cache), _table_rows(value_cache)  # once for every group of the call
        for plan in _PLANS.get(tables, decode, key_cache.shape[1], heads, sinks is not None, head_major):
            res = _attend_in_place(query.index_select(0, plan.rows), keys, values, plan, scale, sinks)
            out.index_copy_(0, plan.rows, res.to(out.dtype))
        return
    block_size = key_cache.shape[1]
    block_bytes = key_cache[0].numel() * key_cache.element_size()
    for group in _decode_groups(decode, block_bytes):
        ids, hidden = _padded_blocks(tables, group, block_size)
        keys = _gather_padded(key_cache, ids, query.dtype, k_scale)
        values = _gather_padded(value_cache, ids, query.dtype, v_scale)
        rows = torch.tensor([s.row for s in group], dtype=torch.int64, device=query.device)
        res = _attend_decode_group(query.index_select(0, rows), keys, values, hidden, scale, sinks)
        out.index_copy_(0, rows, res.to(out.dtype))


def in_place_caches(cache_dtype: torch.dtype, value_dtype: torch.dtype, dense: bool) -> bool:
    """Whether :func:`batched_decode_paged_attention` reads caches of these dtypes (K, V) in place;
    ``dense``: both are contiguous or both head-major (:func:`is_head_major`). The registry's
    ``explain`` asks it of a call's features."""
    return cache_dtype in IN_PLACE_CACHE_DTYPES and value_dtype == cache_dtype and dense


def empty_paged_cache(
    shape: tuple[int, int, int, int], *, dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor:
    """A paged K or V cache ``[blocks, block_size, Hkv, D]`` in the memory layout this device's
    attention reads fastest: uninitialised on accelerators, zeroed on the CPU (its pages committed).

    A CPU cache that decode rows read in place (:data:`IN_PLACE_CACHE_DTYPES`, and bfloat16 where
    the native kernels are built: :func:`pypto_kernels.native.reads_dtypes`) is stored head-major,
    a contiguous ``[blocks, Hkv, block_size, D]`` tensor returned as its ``[blocks, block_size,
    Hkv, D]`` view: every kernel indexes it as before, and one head's keys of a block are one run
    of memory instead of rows a token's heads apart, which the in-place scores and values read
    about a quarter faster (a 64-stream Qwen3-0.6B decode step's attention 323 -> 240 ms,
    docs/benchmarks.md). Other caches and devices are token-major (contiguous), the layout the
    accelerators' paged kernels and the padded gathers take. :func:`memory_order` is the tensor
    whose blocks are the bytes a transfer moves.
    """
    if paged_cache_layout(dtype, device) == "head_major":
        blocks, block_size, kv_heads, dim = shape
        cache = torch.empty((blocks, kv_heads, block_size, dim), dtype=dtype, device=device).transpose(1, 2)
    else:
        cache = torch.empty(shape, dtype=dtype, device=device)
    if cache.device.type == "cpu":
        # Commit the pages now, at start-up: a block's first write otherwise faults its memory in
        # (with transparent huge pages, 2 MiB for a 64 KiB block), which made the first 64-prompt
        # Qwen3-0.6B prefill 15 % slower than the same prefill on touched blocks (docs/benchmarks.md).
        memory_order(cache).zero_()
    return cache


def paged_cache_layout(dtype: torch.dtype, device: torch.device | str) -> Literal["head_major", "token_major"]:
    """The memory layout :func:`empty_paged_cache` gives a cache of ``dtype`` on ``device``."""
    cpu = torch.device(device).type == "cpu"
    in_place = cpu and (dtype in IN_PLACE_CACHE_DTYPES or native.reads_dtypes(dtype, dtype))
    return "head_major" if in_place else "token_major"


def memory_order(cache: torch.Tensor) -> torch.Tensor:
    """``cache`` with its dimensions in memory order (a head-major cache as ``[blocks, Hkv,
    block_size, D]``, others as they are): block ``b`` is ``[b]`` either way, and a contiguous
    cache's blocks are dense runs of bytes, as transfers and offload tiers copy them. Two engines'
    blocks are interchangeable when these shapes and dtypes are equal."""
    return cache.transpose(1, 2) if is_head_major(cache) else cache


def is_head_major(cache: torch.Tensor) -> bool:
    """Whether ``cache`` ``[blocks, block_size, Hkv, D]`` is a view of a contiguous ``[blocks, Hkv,
    block_size, D]`` tensor (:func:`empty_paged_cache`'s CPU layout) and not also contiguous as it is."""
    if cache.dim() != 4 or cache.is_contiguous():
        return False
    _, block_size, heads, dim = cache.shape  # strides compared directly: this runs several times a layer
    return cache.stride() == (heads * block_size * dim, dim, block_size * dim, 1)


def _table_rows(cache: torch.Tensor) -> torch.Tensor:
    """The cache's rows of one head's D values, in memory order (the in-place plan's columns)."""
    return memory_order(cache).view(-1, cache.shape[-1])


def reads_in_place(key_cache: torch.Tensor, value_cache: torch.Tensor) -> bool:
    """:func:`in_place_caches` of these caches."""
    contiguous = key_cache.is_contiguous() and value_cache.is_contiguous()
    dense = contiguous or (is_head_major(key_cache) and is_head_major(value_cache))
    return in_place_caches(key_cache.dtype, value_cache.dtype, dense)


#: Most queries of one request's run that the native kernel attends row by row (decode rows,
#: speculative verification); longer runs (prefill chunks) take the native prefill kernel, whose
#: query tiles share each key.
NATIVE_MAX_QUERIES = 16


def _native_rows(spans: list[_Span], window: int | None) -> torch.Tensor:
    """:func:`pypto_kernels.native.paged_attention`'s rows for every query of ``spans``: query ``i`` of
    a run of ``n`` ending at key ``hi`` sees the keys up to its own position ``hi - n + i`` (causal),
    the last ``window`` of them under a sliding window. Every layer of a step asks for the same rows:
    the last few answers are kept (never written to by their callers). ``[n, 4]``, the transposed view
    of a contiguous ``[4, n]``: the kernel's four columns, read without a copy."""
    return _native_rows_of(tuple(spans), window)


@functools.lru_cache(maxsize=4)
def _native_rows_of(spans: tuple[_Span, ...], window: int | None) -> torch.Tensor:
    rows: list[int] = []
    requests: list[int] = []
    firsts: list[int] = []
    counts: list[int] = []
    for span in spans:
        for i in range(span.num_queries):
            end = span.hi - span.num_queries + i + 1
            lo = max(0, end - window) if window is not None else 0
            rows.append(span.row + i)
            requests.append(span.request)
            firsts.append(lo)
            counts.append(end - lo)
    return torch.tensor([rows, requests, firsts, counts], dtype=torch.int64).t()


def _native_prefill(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    tables: torch.Tensor,
    spans: list[_Span],
    out: torch.Tensor,
    scale: float,
    window: int | None,
    sinks: torch.Tensor | None,
) -> None:
    """Every long run of ``spans`` in one call of :func:`pypto_kernels.native.prefill_attention`, into ``out``."""
    rows = torch.tensor([(s.row, s.request, s.num_queries, s.lo, s.hi) for s in spans], dtype=torch.int64)
    if out.dtype in native.NATIVE_DTYPES:  # written in place, bfloat16 rounded by the kernel
        native.prefill_attention(query, key_cache, value_cache, tables, rows, scale, window, sinks, out)
        return
    flat = torch.zeros(out.shape, dtype=torch.float32)
    native.prefill_attention(query, key_cache, value_cache, tables, rows, scale, window, sinks, flat)
    for s in spans:  # only the runs' rows: the others hold the decode rows already written
        out[s.row : s.row + s.num_queries] = flat[s.row : s.row + s.num_queries]


def _by_kernel(spans: list[_Span], prompt_rows: Sequence[int] | None) -> tuple[list[_Span], list[_Span]]:
    """The runs the native row kernel attends and those the prefill kernel does: by run length
    (:data:`NATIVE_MAX_QUERIES`), or, given each request's prompt rows, its prompt rows (the run's
    first) by the prefill kernel and the rest by the row kernel."""
    if prompt_rows is None:
        return [s for s in spans if s.num_queries <= NATIVE_MAX_QUERIES], [
            s for s in spans if s.num_queries > NATIVE_MAX_QUERIES
        ]
    short, long = [], []
    for s in spans:
        prompt = min(max(prompt_rows[s.request], 0), s.num_queries)
        if not prompt:  # a decode row and its drafts: the span as it is (a decode step's every span)
            short.append(s)
        elif prompt == s.num_queries:
            long.append(s)
        else:  # a recomputation: its prompt, then its outputs
            rest = s.num_queries - prompt
            long.append(s._replace(num_queries=prompt, hi=s.hi - rest))
            short.append(s._replace(row=s.row + prompt, num_queries=rest))
    return short, long


def batched_decode_paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    *,
    query_lens_host: Sequence[int] | None = None,
    seq_lens_host: Sequence[int] | None = None,
    k_scale: CacheScale = None,
    v_scale: CacheScale = None,
    prompt_rows_host: Sequence[int] | None = None,
) -> torch.Tensor:
    """:func:`paged_attention` with every decode row (one query) of the step attended at once.

    Where the native CPU kernels are built (:mod:`pypto_kernels.native`) and the caches are float32
    or bfloat16 without scales, every run of at most :data:`NATIVE_MAX_QUERIES` queries (decode rows,
    speculative verification) is attended by one call of the C kernel, each query row over its keys
    read in place, and every longer run (prefill chunks) by one call of the C prefill kernel, tiles of
    queries sharing each chunk of keys (the request loop only for a value head size not divisible by
    16); with ``prompt_rows_host``, a request's prompt rows take the prefill kernel and its other rows
    the row kernel at any length instead (the two sum in other orders: a prompt cut into a long and a
    short chunk would otherwise attend its last queries with the row kernel alone and the prefill
    kernel among others). Otherwise a float32 cache is read in
    place (:func:`_attend_in_place`: sampled scores, a padded softmax, an ``embedding_bag`` of
    values), and other caches (bfloat16, FP8) are gathered: rows sorted by length, cut into groups
    of bounded padded size, each group's K/V copied once into a padded tensor and attended with one
    masked matmul/softmax/matmul per KV head; longer query runs go request by request as in the
    reference. Same contract and results as the reference, to float rounding."""
    out = query.new_zeros((query.shape[0], query.shape[1], value_cache.shape[-1]))
    if query.shape[0] == 0 or seq_lens.numel() == 0:
        return out
    tables, spans = _tables_and_spans(
        query, key_cache, block_tables, query_start_loc, seq_lens, sliding_window, query_lens_host, seq_lens_host
    )
    if native.reads(key_cache, value_cache, k_scale is not None or v_scale is not None):
        short, long = _by_kernel(spans, prompt_rows_host)
        if short:
            rows = _native_rows(short, sliding_window)
            if out.dtype in native.NATIVE_DTYPES:  # written in place, bfloat16 rounded by the kernel
                native.paged_attention(query, key_cache, value_cache, tables, rows, scale, sinks, out)
            else:
                out.copy_(native.paged_attention(query, key_cache, value_cache, tables, rows, scale, sinks))
        if not long:  # a decode step: every layer's call ends here
            return out
        if native.prefill_routed(value_cache):
            _native_prefill(query, key_cache, value_cache, tables, long, out, scale, sliding_window, sinks)
        else:
            _attend_spans(query, key_cache, value_cache, tables, long, out, scale, sliding_window, sinks, None, None)
        return out
    decode = [s for s in spans if s.num_queries == 1]
    if decode:
        _attend_decode_rows(query, key_cache, value_cache, tables, decode, out, scale, sinks, k_scale, v_scale)
    prefill = [s for s in spans if s.num_queries > 1]
    _attend_spans(query, key_cache, value_cache, tables, prefill, out, scale, sliding_window, sinks, k_scale, v_scale)
    return out
