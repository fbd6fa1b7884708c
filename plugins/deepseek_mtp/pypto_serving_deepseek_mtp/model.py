"""DeepSeek-V4 forward pass over a flat, paged token batch.

Every kind of attention state is position-keyed so that results never depend on how a sequence was
split into steps:

* ``swa``: the per-token shared K=V vector of every layer (paged, one entry per token). Sliding
  attention reads the last ``sliding_window`` positions of it.
* ``csa_kv`` / ``hca_kv``: compressed entries, entry ``w`` covers source tokens ``[w*m, (w+1)*m)``
  (paged, ``tokens_per_entry = m``). ``csa_index``: the lightning indexer's compressed keys.
* compressor running state: the projected (kv, gate) rows of the last few source tokens, in a
  per-request ring indexed by ``position % ring_len`` (executor-owned; see :class:`CompressorRing`).

A compressed entry is (re)computed whenever the batch contains the last token of its window, from
the ring (earlier tokens) and the batch (this step's tokens), so entries written for rejected draft
tokens are simply overwritten when the real tokens arrive.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch.profiler import record_function

from pypto_kernels import (
    AbsmaxReduce,
    apply_interleaved_rope,
    compressor_pool,
    grouped_linear,
    hc_head,
    hc_merge,
    hc_sinkhorn_mix,
    indexer_topk,
    interleaved_rope_cos_sin,
    moe_experts,
    quant_linear,
    quant_moe_experts,
    rope_inv_freq,
    sink_attention,
    topk_routing,
    upload,
)
from pypto_kernels.attention import FP8_CACHE_MAX, quantize_cache_rows
from pypto_kernels.compressed_attention import _put, _take
from pypto_serving.parallel import ParallelContext, expert_parallel_moe, vocab_parallel_embedding
from pypto_serving.quantization import QuantizedWeight

from . import ops
from .config import CSA, HCA, SLIDING, DeepseekV4Config
from .emission import EmitPlan, EmitShape, build_emit_plan

STATE_GROUP = "csa_state"
"""The cache group of CSA compressor-state snapshots, one per ``state_every`` positions: what a
prefix-cache hit restarts the compressor rings from."""

logger = logging.getLogger(__name__)

#: One block's parameters: tensors, and the projections and routed experts kept in the checkpoint's
#: stored precision as :class:`QuantizedWeight` (FP8 linears, MXFP4 experts).
Params = dict[str, Any]


def linear(
    x: torch.Tensor, weight: torch.Tensor | QuantizedWeight, reduce_absmax: AbsmaxReduce | None = None
) -> torch.Tensor:
    """``x @ weight.T``: stored-precision weights through ``quant_linear`` (no float copy of them);
    ``reduce_absmax``: ``x`` is a row-parallel rank's slice of each row, which W8A8 quantises with
    the whole row's per-token scale (``ParallelContext.absmax_reduce``)."""
    if isinstance(weight, QuantizedWeight):
        out: torch.Tensor = quant_linear(x, weight, None, reduce_absmax)
        return out
    return F.linear(x, weight)


def adapted_linear(p: Params, key: str, x: torch.Tensor, reduce_absmax: AbsmaxReduce | None = None) -> torch.Tensor:
    """``linear(x, p[key])`` plus each token's LoRA adapter's delta where the layer has adapter
    stacks (``p["lora." + key]``, see :mod:`.lora`; MTP layers have none)."""
    out = linear(x, p[key], reduce_absmax)
    stack = p.get("lora." + key)
    return out if stack is None else stack.add_delta(x, out)


def grouped_projection(x: torch.Tensor, weight: torch.Tensor | QuantizedWeight, groups: int) -> torch.Tensor:
    """``grouped_linear`` (V4's block-diagonal ``wo_a``) for a float or a stored-precision weight:
    group ``g`` meets its rows of the weight (for block FP8 a row range of whole scale blocks,
    checked at load) and their scales."""
    if not isinstance(weight, QuantizedWeight):
        out: torch.Tensor = grouped_linear(x, weight, groups)
        return out
    rows = weight.data.shape[0] // groups
    parts = [quant_linear(x[:, g], _row_range(weight, g * rows, (g + 1) * rows)) for g in range(groups)]
    return torch.cat(parts, dim=-1)


def _row_range(weight: QuantizedWeight, start: int, stop: int) -> QuantizedWeight:
    """Rows ``start:stop`` of a stored-precision matrix (views), with their scales."""
    br = weight.block[0]
    scale = weight.scale[start // br : stop // br] if weight.scheme == "fp8_block" else weight.scale[start:stop]
    offset = None if weight.offset is None else weight.offset[start:stop]
    return QuantizedWeight(weight.scheme, weight.data[start:stop], scale, weight.block, offset)


# Parameters the reference keeps in float32 whatever the checkpoint dtype (mixing and norm weights, and
# the compressors' projections, which the reference runs in float32).
FP32_SUFFIXES = (
    "compressor.wkv.weight",
    "compressor.wgate.weight",
    "attn_sink",
    "ape",
    "hc_attn_fn",
    "hc_attn_base",
    "hc_attn_scale",
    "hc_ffn_fn",
    "hc_ffn_base",
    "hc_ffn_scale",
    "hc_head_fn",
    "hc_head_base",
    "hc_head_scale",
    "gate.bias",
    "norm.weight",
)


@dataclass
class Segments:
    """How the flat tokens of one forward split into requests."""

    starts: list[int]  # R + 1 row offsets
    pos0: list[int]  # absolute position of each request's first row
    positions: torch.Tensor  # [T]
    input_ids: torch.Tensor  # [T] token ids (hash routing)
    block_tables: dict[str, torch.Tensor]  # group -> [R, max_blocks]
    ring_slots: list[int] | None = None  # compressor ring slot per request (main model only)
    # Built once per forward and shared by every layer: the index tensors (``_rows``), the
    # attention groups with their rows (``_groups``) and the compressor emission plans.
    _index: _Rows | None = field(default=None, repr=False, compare=False)
    _parts: list[tuple[Segments, list[int]]] | None = field(default=None, repr=False, compare=False)
    _emit: dict[str, EmitPlan] = field(default_factory=dict, repr=False, compare=False)  # per layer kind

    def rows(self, r: int) -> tuple[int, int]:
        return self.starts[r], self.starts[r + 1]

    @property
    def q_lens(self) -> list[int]:
        return [b - a for a, b in pairwise(self.starts)]


class _Rows(NamedTuple):
    """Per-request index tensors of a batch (or attention group), built from the host lists (no device read)."""

    qsl: torch.Tensor  # [R + 1] row offsets
    q_lens: torch.Tensor  # [R]
    req: torch.Tensor  # [T] request of each row
    pos0: torch.Tensor  # [R]
    last: torch.Tensor  # [R] position of each request's last row (pos0 - 1 when it has none)
    unit_qsl: torch.Tensor  # [T + 1] row offsets when every row is a request of its own


def _row_wise(seg: Segments) -> bool:
    """Whether ``seg`` (an attention group) attends one query row at a time: a group of short
    requests with a multi-row one among them. Each row then gets its request's keys, so the kernels
    run the whole group as one batched op rather than one op per multi-row request."""
    return 1 < max(seg.q_lens, default=0) <= SHORT_ROWS


def _rows(seg: Segments, dev: torch.device) -> _Rows:
    """``seg``'s index tensors, built once per forward: every layer of it shares them, so the host
    lists are uploaded once rather than per layer."""
    if seg._index is None:
        qsl = upload(seg.starts, dev)
        q_lens = qsl[1:] - qsl[:-1]
        arange = torch.arange(len(seg.pos0), device=dev)
        req = torch.repeat_interleave(arange, q_lens, output_size=seg.starts[-1])
        pos0 = upload(seg.pos0, dev)
        unit = torch.arange(seg.starts[-1] + 1, device=dev)
        seg._index = _Rows(qsl, q_lens, req, pos0, pos0 + q_lens - 1, unit)
    return seg._index


#: Requests with at most this many rows (decodes, draft verifications) attend together, one key row
#: set per query row; longer ones (prefill chunks) attend alone.
SHORT_ROWS = 9


def _groups(seg: Segments) -> list[tuple[Segments, list[int]]]:
    """How ``seg``'s requests attend, built once per forward: all short requests (decodes and draft
    verifications) together, each longer request alone; per group its own ``Segments`` and its rows
    in ``seg``."""
    if seg._parts is None:
        short = [r for r, n in enumerate(seg.q_lens) if 0 < n <= SHORT_ROWS]
        parts = ([short] if short else []) + [[r] for r, n in enumerate(seg.q_lens) if n > SHORT_ROWS]
        seg._parts = [_subset(seg, reqs) for reqs in parts]
    return seg._parts


def _subset(seg: Segments, reqs: list[int]) -> tuple[Segments, list[int]]:
    """Requests ``reqs`` of ``seg`` as a batch of their own (views when they are consecutive)."""
    at = [i for r in reqs for i in range(*seg.rows(r))]
    starts = [0]
    for r in reqs:
        starts.append(starts[-1] + seg.q_lens[r])
    sub = Segments(
        starts=starts,
        pos0=[seg.pos0[r] for r in reqs],
        positions=_take(seg.positions, at),
        input_ids=_take(seg.input_ids, at),
        block_tables={k: _take(v, reqs) for k, v in seg.block_tables.items()},
    )
    return sub, at


class CompressorRing:
    """Per-request ring of projected compressor inputs (kv and gate rows) for one layer.

    ``ring_len`` must cover the ``2*m - 1`` source tokens an entry may still need from earlier steps
    plus the ``max_draft`` positions a rejected draft may have clobbered beyond the accepted ones;
    we write a step's rows only after reading the older ones, so in-step overwrites cannot hurt.
    """

    def __init__(self, slots: int, ring_len: int, width: int, device: torch.device, dtype: torch.dtype) -> None:
        self.ring_len = ring_len
        self.kv = torch.zeros((slots, ring_len, width), device=device, dtype=dtype)
        self.gate = torch.zeros((slots, ring_len, width), device=device, dtype=torch.float32)

    def grow(self, slots: int) -> None:
        extra = slots - self.kv.shape[0]
        if extra > 0:
            self.kv = torch.cat([self.kv, self.kv.new_zeros((extra, *self.kv.shape[1:]))])
            self.gate = torch.cat([self.gate, self.gate.new_zeros((extra, *self.gate.shape[1:]))])


def _slots(
    block_tables: torch.Tensor,
    rows: torch.Tensor,
    idx: torch.Tensor,
    block_size: int,
    num_slots: int,
    *,
    for_write: bool = False,
) -> torch.Tensor:
    """Flat cache slots of entry indices ``idx`` of requests ``rows`` (same shape), for a whole batch.

    Out-of-table reads (only ever made for padding that the caller masks) are clamped in bounds; a
    write is never clamped, so a position past the block table raises instead of landing elsewhere.
    """
    if for_write:
        return block_tables[rows, idx // block_size].long() * block_size + idx % block_size
    col = (idx // block_size).clamp(max=block_tables.shape[1] - 1)
    slots = block_tables[rows, col].long() * block_size + idx % block_size
    return slots.clamp(0, num_slots - 1)


def _cache_write(flat: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """``flat[slots] = rows`` in the cache dtype. An FP8 cache (``kv_cache_dtype = "fp8"``) stores them
    over a per-tensor scale of 1.0, saturated, and moves bytes (the CPU has no FP8 indexing kernels)."""
    if flat.dtype in FP8_CACHE_MAX:
        flat.view(torch.uint8)[slots] = quantize_cache_rows(rows, flat.dtype, None).view(torch.uint8)
    else:
        flat[slots] = rows.to(flat.dtype)


def _cache_read(flat: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``flat[slots]``; an FP8 cache's rows come back in ``dtype`` (the model's)."""
    if flat.dtype in FP8_CACHE_MAX:
        return flat.view(torch.uint8)[slots].view(flat.dtype).to(dtype)
    return flat[slots]


def _gather_entries(
    cache: torch.Tensor, block_tables: torch.Tensor, counts: list[int], block_size: int, dtype: torch.dtype
) -> torch.Tensor:
    """Entries ``0 .. counts[r] - 1`` of every request from a paged cache, padded to ``[R, max(counts), D]``
    (in ``dtype`` when the cache is FP8).

    ``counts`` is a host list (no device read). Padded rows repeat entry 0's slot; callers mask them out.
    """
    flat = cache.view(-1, cache.shape[-1])
    num_req = len(counts)
    n_max = max(counts, default=0)
    dev = block_tables.device
    idx = torch.arange(n_max, device=dev)[None, :].expand(num_req, -1)
    idx = torch.where(idx < upload(counts, dev)[:, None], idx, 0)
    rows = torch.arange(num_req, device=dev)[:, None].expand(-1, n_max)
    return _cache_read(flat, _slots(block_tables, rows, idx, block_size, flat.shape[0]), dtype)


class DeepseekV4Model:
    """Weights plus the batched forward; caches are attached by the executor."""

    def __init__(
        self,
        cfg: DeepseekV4Config,
        weights: dict[str, Any],
        device: torch.device,
        dtype: torch.dtype,
        block_size: int,
        parallel: ParallelContext | None = None,
        experts: range | None = None,
    ) -> None:
        self.cfg = cfg
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        # Tensor parallel: this rank's query heads and output groups, and the routed experts it holds
        # (all of them, each split, unless expert parallel gives it a range of whole ones).
        self.parallel = parallel or ParallelContext()
        self.local_heads = cfg.num_attention_heads // self.parallel.world_size
        self.local_groups = cfg.o_groups // self.parallel.world_size
        self.experts = experts if experts is not None else range(cfg.n_routed_experts)
        self.embed = weights["embed.weight"]
        self.head = weights.get("head.weight", self.embed)
        self.norm = weights["norm.weight"]
        self.hc_head = (weights["hc_head_fn"], weights["hc_head_base"], weights["hc_head_scale"])
        self.layers = [
            _layer_params(weights, f"layers.{i}.", self.experts, groups=self.local_groups, dtype=dtype)
            for i in range(cfg.num_hidden_layers)
        ]
        self.inv_freq: dict[str, tuple[torch.Tensor, float]] = {}
        for name, params in (("main", cfg.rope_main), ("compress", cfg.rope_compress)):
            inv, scaling = rope_inv_freq(
                cfg.rope_head_dim,
                float(params.get("rope_theta", 10000.0)),
                params,
                cfg.max_position_embeddings,
            )
            self.inv_freq[name] = (inv.to(device), scaling)
        # Index of each compressed layer inside its cache group's stacked tensor.
        self.group_index: dict[int, int] = {}
        counts = {CSA: 0, HCA: 0}
        for i, kind in enumerate(cfg.layer_types):
            if kind != SLIDING:
                self.group_index[i] = counts[kind]
                counts[kind] += 1
        self.caches: dict[str, torch.Tensor] = {}
        # Per sliding group: the entry index of position ``i`` is ``i + shift`` (CacheGroupSpec.slot_shift).
        self.slot_shift: dict[str, int] = {}
        self.rings: dict[tuple[int, str], CompressorRing] = {}
        # Positions between CSA compressor-state snapshots: one per block of the CSA groups.
        self.state_every = block_size * cfg.compress_rates.get(CSA, 1)

    # ------------------------------------------------------------------ public entry points

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Embedding rows ``[T, D]``, identical on every rank (each holds a slice of the vocabulary)."""
        return vocab_parallel_embedding(input_ids, self.embed, self.parallel)

    def embed_streams(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        return x.unsqueeze(1).expand(-1, self.cfg.hc_mult, -1).contiguous()

    def forward(self, seg: Segments) -> torch.Tensor:
        """Run all decoder layers; returns the hyper-connection streams ``[T, hc, D]``."""
        x = self.embed_streams(seg.input_ids)
        rope = self._rope_tables(seg.positions)
        for i, p in enumerate(self.layers):
            kind = self.cfg.layer_types[i]
            with record_function(f"layer {kind}"):
                x = self.decoder_layer(p, x, seg, rope, layer=i, kind=kind, swa=self.caches["swa"][i], swa_group="swa")
        return x

    def logits(
        self,
        streams: torch.Tensor,
        hc: tuple[torch.Tensor, ...] | None = None,
        norm: torch.Tensor | None = None,
    ) -> torch.Tensor:
        fn, base, scale = hc if hc is not None else self.hc_head
        h = hc_head(streams, fn, base, scale, self.cfg.hc_eps, self.cfg.rms_norm_eps)
        h = ops.rms_norm(h, self.norm if norm is None else norm, self.cfg.rms_norm_eps)
        # Each rank scores its vocabulary slice; the gather gives every rank the same full logits.
        return self.parallel.all_gather(F.linear(h, self.head)).float()

    # ------------------------------------------------------------------ blocks

    def _rope_tables(self, positions: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        return {k: interleaved_rope_cos_sin(positions, inv, sc) for k, (inv, sc) in self.inv_freq.items()}

    def decoder_layer(
        self,
        p: Params,
        x: torch.Tensor,
        seg: Segments,
        rope: dict[str, tuple[torch.Tensor, torch.Tensor]],
        layer: int,
        kind: str,
        swa: torch.Tensor,
        swa_group: str,
    ) -> torch.Tensor:
        cfg = self.cfg
        post, comb, collapsed = hc_sinkhorn_mix(
            x,
            p["hc_attn_fn"],
            p["hc_attn_base"],
            p["hc_attn_scale"],
            cfg.hc_sinkhorn_iters,
            cfg.hc_eps,
            cfg.rms_norm_eps,
        )
        h = ops.rms_norm(collapsed, p["attn_norm.weight"], cfg.rms_norm_eps)
        with record_function(f"attention {kind}"):
            attn = self.attention(p, h, seg, rope, layer, kind, swa, swa_group)
        x = hc_merge(x, attn, post, comb)
        post, comb, collapsed = hc_sinkhorn_mix(
            x,
            p["hc_ffn_fn"],
            p["hc_ffn_base"],
            p["hc_ffn_scale"],
            cfg.hc_sinkhorn_iters,
            cfg.hc_eps,
            cfg.rms_norm_eps,
        )
        h = ops.rms_norm(collapsed, p["ffn_norm.weight"], cfg.rms_norm_eps)
        with record_function("moe"):
            ffn = self.moe(p, h, seg.input_ids)
        return hc_merge(x, ffn, post, comb)

    def moe(self, p: Params, h: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        logits = linear(h, p["ffn.gate.weight"])
        if "ffn.gate.tid2eid" in p:  # hash routing: a frozen token -> experts table picks the experts
            ids = p["ffn.gate.tid2eid"][input_ids].long()
            weights = ops.router_scores(logits, cfg.scoring_func).gather(1, ids)
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * cfg.routed_scaling_factor
        else:
            # V4 always renormalises the picked scores, whatever norm_topk_prob says.
            weights, ids = topk_routing(
                logits,
                cfg.num_experts_per_tok,
                True,
                cfg.scoring_func,
                p.get("ffn.gate.bias"),
                cfg.routed_scaling_factor,
            )
        limit = cfg.swiglu_limit
        # The shared expert's (and, tensor-parallel, the routed experts') intermediate rows are split
        # over the ranks: W8A8 quantises their down matmuls' inputs with the whole rows' scales.
        reduce = self.parallel.absmax_reduce
        split_experts = len(self.experts) == cfg.n_routed_experts

        def experts(x: torch.Tensor, w: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
            act = lambda gu: ops.clamped_swiglu(gu, limit)  # noqa: E731 - one-line activation
            gate_up, down = p["experts.gate_up"], p["experts.down"]
            if isinstance(gate_up, QuantizedWeight):  # stored precision: dequantised per routed expert, per call
                tp_reduce = reduce if split_experts else None
                out: torch.Tensor = quant_moe_experts(x, gate_up, down, w, i, activation=act, reduce_absmax=tp_reduce)
                return out
            return moe_experts(x, gate_up, down, w, i, activation=act)

        gate_up = ops.clamped_swiglu(adapted_linear(p, "shared.gate_up", h), limit)
        shared = adapted_linear(p, "ffn.shared_experts.w2.weight", gate_up, reduce)
        if not split_experts:
            # Expert parallel: tokens travel to the ranks holding their experts and back (all-to-all).
            routed = expert_parallel_moe(h, weights, ids, experts, cfg.n_routed_experts, self.parallel)
            return routed + self.parallel.all_reduce(shared)
        # Each rank holds a slice of every expert's (and the shared expert's) intermediate dimension:
        # one sum completes both.
        return self.parallel.all_reduce(experts(h, weights, ids) + shared)

    def attention(
        self,
        p: Params,
        h: torch.Tensor,
        seg: Segments,
        rope: dict[str, tuple[torch.Tensor, torch.Tensor]],
        layer: int,
        kind: str,
        swa: torch.Tensor,
        swa_group: str,
    ) -> torch.Tensor:
        cfg = self.cfg
        t = h.shape[0]
        cos, sin = rope["main" if kind == SLIDING else "compress"]
        q_res = ops.rms_norm(adapted_linear(p, "attn.wq_a.weight", h), p["attn.q_norm.weight"], cfg.rms_norm_eps)
        q = adapted_linear(p, "attn.wq_b.weight", q_res).view(t, self.local_heads, cfg.head_dim)
        q = apply_interleaved_rope(ops.rms_norm(q, None, cfg.rms_norm_eps), cos, sin)
        kv = ops.rms_norm(adapted_linear(p, "attn.wkv.weight", h), p["attn.norm.weight"], cfg.rms_norm_eps)
        kv = apply_interleaved_rope(kv, cos, sin)

        n_tok = seg.starts[-1]
        flat_swa = swa.view(-1, cfg.head_dim)
        write = _slots(
            seg.block_tables[swa_group],
            _rows(seg, h.device).req,
            seg.positions[:n_tok] + self.slot_shift.get(swa_group, 0),
            self.block_size,
            flat_swa.shape[0],
            for_write=True,
        )
        _cache_write(flat_swa, write, kv[:n_tok])
        index: tuple[torch.Tensor, torch.Tensor] | None = None
        if kind != SLIDING:
            self._emit_entries(p, h, seg, layer, kind)
            if kind == CSA:
                index = self._index_queries(p, h, q_res, cos, sin)
        out = torch.zeros_like(q)
        # Requests attend in groups (all decodes together, each longer request alone), each group's
        # keys gathered to its own longest, not the batch's.
        for sub, at in _groups(seg):
            sub_index = None if index is None else (_take(index[0], at), _take(index[1], at))
            res = self._attend(p, _take(q, at), sub, flat_swa, swa_group, layer, kind, sub_index)
            _put(out, at, res)

        # K == V carries RoPE on its trailing channels; rotate back by the query position.
        out = apply_interleaved_rope(out, cos, -sin)
        # This rank's output groups (its heads) project to a partial sum of the output.
        grouped = out.reshape(t, self.local_groups, -1)
        o = grouped_projection(grouped, p["attn.wo_a.weight"], self.local_groups)
        return self.parallel.all_reduce(adapted_linear(p, "attn.wo_b.weight", o, self.parallel.absmax_reduce))

    def _index_queries(
        self, p: Params, h: torch.Tensor, q_res: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The lightning indexer's queries ``[T, Hi, Di]`` (with RoPE) and per-head weights ``[T, Hi]``.

        Each rank projects its slice of the index heads and the slices are gathered, so every rank
        scores every head and picks the same top-k, the one a single rank picks."""
        cfg, t = self.cfg, h.shape[0]
        iq = linear(q_res, p["attn.indexer.wq_b.weight"]).view(t, -1, cfg.index_head_dim)
        iq = self.parallel.all_gather(iq, dim=1)
        iw = self.parallel.all_gather(linear(h, p["attn.indexer.weights_proj.weight"]), dim=-1)
        return apply_interleaved_rope(iq, cos, sin), iw.float() * cfg.index_n_heads**-0.5

    def _attend(
        self,
        p: Params,
        q: torch.Tensor,
        seg: Segments,
        flat_swa: torch.Tensor,
        swa_group: str,
        layer: int,
        kind: str,
        index: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> torch.Tensor:
        """Sink attention of one group of requests (``seg``, its queries ``q``) over its sliding keys
        and, on compressed layers, its compressed entries (``index``: the indexer's queries and weights)."""
        rows = _rows(seg, q.device)
        window = self.cfg.sliding_window
        # Each request's keys: its sliding ones (a prefix of the padded Lw) then its compressed entries.
        key_lens = [max(0, p0 + n - max(0, p0 - window + 1)) for p0, n in zip(seg.pos0, seg.q_lens)]
        lw = max(key_lens, default=0)
        shift = self.slot_shift.get(swa_group, 0)
        keys, mask = self._sliding_keys(flat_swa, seg.block_tables[swa_group], seg, rows, seg.positions, lw, shift)
        if kind != SLIDING:
            entries, visible, n_entries = self._compressed_keys(index, seg, rows, layer, kind)
            key_lens = [lw + n for n in n_entries]
            keys = torch.cat([keys, entries.to(keys.dtype)], dim=1)
            mask = torch.cat([mask, visible], dim=1)
        scale = self.cfg.head_dim**-0.5
        qsl, q_lens = rows.qsl, seg.q_lens
        if _row_wise(seg):
            keys = keys.index_select(0, rows.req)
            key_lens = [n for n, rep in zip(key_lens, q_lens) for _ in range(rep)]
            qsl, q_lens = rows.unit_qsl, [1] * len(key_lens)
        return sink_attention(
            q, keys, mask, qsl, p["attn.attn_sink"], scale, query_lens_host=q_lens, key_lens_host=key_lens
        )

    def _sliding_keys(
        self,
        flat_swa: torch.Tensor,
        swa_bt: torch.Tensor,
        seg: Segments,
        rows: _Rows,
        qpos: torch.Tensor,
        lw: int,
        shift: int = 0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sliding keys of request r: positions ``[max(0, pos0 - window + 1), last]``, padded to ``[R, lw]``
        (``lw``, the longest, from the host; position ``i`` at entry ``i + shift``); plus the per-row
        mask ``[T, lw]``."""
        window = self.cfg.sliding_window
        k0 = (rows.pos0 - window + 1).clamp(min=0)
        kpos = k0[:, None] + torch.arange(lw, device=flat_swa.device)[None, :]
        k_valid = kpos <= rows.last[:, None]
        req_rows = torch.arange(len(seg.pos0), device=flat_swa.device)[:, None].expand(-1, lw)
        safe = torch.where(k_valid, kpos, k0[:, None])
        slots = _slots(swa_bt, req_rows, safe + shift, self.block_size, flat_swa.shape[0])
        keys = _cache_read(flat_swa, slots, self.dtype)
        diff = qpos[:, None] - kpos[rows.req]
        return keys, (diff >= 0) & (diff < window) & k_valid[rows.req]

    def _compressed_keys(
        self,
        index: tuple[torch.Tensor, torch.Tensor] | None,
        seg: Segments,
        rows: _Rows,
        layer: int,
        kind: str,
    ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """Every request's visible compressed entries padded to ``[R, E]``, the per-row selection mask
        ``[T, E]`` (the indexer's top-k on CSA layers, from ``index``: its queries and weights) and each
        request's entry count (host)."""
        cfg = self.cfg
        group = "csa_kv" if kind == CSA else "hca_kv"
        gi = self.group_index[layer]
        rate = cfg.compress_rates[kind]
        n_entries = [(p0 + n) // rate if n else 0 for p0, n in zip(seg.pos0, seg.q_lens)]
        entries = _gather_entries(
            self.caches[group][gi], seg.block_tables[group], n_entries, self.block_size, self.dtype
        )
        qpos = seg.positions
        visible = torch.arange(entries.shape[1], device=qpos.device)[None, :] < ((qpos + 1) // rate)[:, None]
        if kind == CSA and entries.shape[1] > 0:
            assert index is not None
            index_keys = _gather_entries(
                self.caches["csa_index"][gi], seg.block_tables["csa_index"], n_entries, self.block_size, self.dtype
            )
            qsl, q_lens, key_lens = rows.qsl, seg.q_lens, n_entries
            if _row_wise(seg):
                index_keys = index_keys.index_select(0, rows.req)
                key_lens = [n for n, rep in zip(n_entries, q_lens) for _ in range(rep)]
                qsl, q_lens = rows.unit_qsl, [1] * len(key_lens)
            visible = indexer_topk(
                index[0],
                index[1],
                index_keys,
                visible,
                qsl,
                cfg.index_topk,
                cfg.index_head_dim**-0.5,
                query_lens_host=q_lens,
                key_lens_host=key_lens,
            )
        return entries, visible, n_entries

    # ------------------------------------------------------------------ compressors

    def _emit_entries(self, p: Params, h: torch.Tensor, seg: Segments, layer: int, kind: str) -> None:
        """(Re)write the compressed entries whose windows close in this step, for every request at
        once, and record this step's compressor inputs in the rings (and, on CSA layers, the state
        snapshots a prefix-cache hit restarts from: :meth:`state_columns`)."""
        gi = self.group_index[layer]
        group = "csa_kv" if kind == CSA else "hca_kv"
        plan = self._emit_plan(seg, layer, kind)
        state = self.caches.get(STATE_GROUP) if kind == CSA else None
        cols = self.state_columns()
        snap = None if state is None else (state[gi], seg.block_tables[STATE_GROUP], cols["kv"])
        kv_ring = self.rings[(layer, "kv")]
        self._compress(p, "attn.compressor.", h, plan, kv_ring, (self.caches[group][gi], group), seg, snap)
        if kind == CSA:
            ring, cache = self.rings[(layer, "index")], self.caches["csa_index"][gi]
            snap = None if state is None else (state[gi], seg.block_tables[STATE_GROUP], cols["index"])
            self._compress(p, "attn.indexer.compressor.", h, plan, ring, (cache, "csa_index"), seg, snap)

    def state_columns(self) -> dict[str, slice]:
        """Where each CSA compressor's rows sit in a ``csa_state`` snapshot row: its ring's kv row
        then its gate row (the kv compressor first, then the indexer's)."""
        cfg = self.cfg
        kv, index = 2 * cfg.head_dim, 2 * cfg.index_head_dim
        return {"kv": slice(0, 2 * kv), "index": slice(2 * kv, 2 * kv + 2 * index)}

    def _emit_plan(self, seg: Segments, layer: int, kind: str) -> EmitPlan:
        """``seg``'s emission plan for layers of ``kind``, built once per forward and shared by them."""
        plan = seg._emit.get(kind)
        if plan is None:
            ring = self.rings[(layer, "kv")]
            assert seg.ring_slots is not None
            plan = build_emit_plan(
                EmitShape(
                    rate=self.cfg.compress_rates[kind],
                    overlap=kind == CSA,
                    ring_len=ring.ring_len,
                    ring_rows=ring.kv.shape[0] * ring.ring_len,
                    snapshot_every=self.state_every if kind == CSA and STATE_GROUP in self.caches else 0,
                ),
                seg.starts,
                seg.pos0,
                seg.ring_slots,
                self.device,
            )
            if plan.entries is not None:
                e = plan.entries
                e.rope = interleaved_rope_cos_sin(e.w * plan.rate, *self.inv_freq["compress"])
            seg._emit[kind] = plan
        return plan

    def _compress(
        self,
        p: Params,
        prefix: str,
        h: torch.Tensor,
        plan: EmitPlan,
        ring: CompressorRing,
        out: tuple[torch.Tensor, str],
        seg: Segments,
        snap: tuple[torch.Tensor, torch.Tensor, slice] | None,
    ) -> None:
        """One compressor over the whole batch: pool the plan's entries from the ring (earlier tokens)
        and this step's projections, write them to the ``out`` cache group, the plan's state snapshots
        to ``snap`` (the layer's state cache, its block table, this compressor's columns), then this
        step's projections to the ring."""
        cache, group = out
        h32 = h.float()  # the reference's compressor runs in float32 whatever the model dtype
        kv = F.linear(h32, p[prefix + "wkv.weight"])
        gate = F.linear(h32, p[prefix + "wgate.weight"])
        width = kv.shape[-1]
        ring_kv, ring_gate = ring.kv.view(-1, width), ring.gate.view(-1, width)
        src_kv = torch.cat([ring_kv, kv.to(ring_kv.dtype)])
        src_gate = torch.cat([ring_gate, gate])
        e = plan.entries
        if e is not None:
            src = e.gather(src_kv, 0.0), e.gather(src_gate, float("-inf"))
            first = 1 if plan.overlap else 0
            pooled = compressor_pool(*src, p[prefix + "ape"], plan.rate, first, plan.overlap)
            pooled = ops.rms_norm(pooled, p[prefix + "norm.weight"], self.cfg.rms_norm_eps)
            assert e.rope is not None
            pooled = apply_interleaved_rope(pooled, *e.rope)
            flat = cache.view(-1, cache.shape[-1])
            _cache_write(flat, e.cache_slots(group, seg.block_tables[group], self.block_size), pooled)
        shots = plan.snapshots
        if snap is not None and shots is not None:
            state, table, cols = snap
            rows = torch.cat([src_kv.index_select(0, shots.src), src_gate.index_select(0, shots.src)], dim=-1)
            blocks = table[shots.req, shots.index].long()
            state[:, :, cols].index_copy_(0, blocks, rows.view(len(shots.index), plan.rate, -1))
        if plan.ring_src is not None:
            kv, gate = kv.index_select(0, plan.ring_src), gate.index_select(0, plan.ring_src)
        ring_kv.index_copy_(0, plan.ring_dst, kv.to(ring_kv.dtype))
        ring_gate.index_copy_(0, plan.ring_dst, gate)

    def restore_compressor_state(self, starts: dict[int, tuple[int, int]], table: torch.Tensor) -> None:
        """Refill the CSA compressor rings of requests that start at a prefix-cache hit: ``starts``
        maps batch row -> (ring slot, hit position), ``table`` is the batch's ``csa_state`` block
        table. Snapshot ``hit // state_every - 1`` holds the rows of positions ``[hit - m, hit)``, the
        only earlier rows the entries from ``hit`` on read (HCA, without overlap, reads none)."""
        state = self.caches.get(STATE_GROUP)
        if state is None or not starts:
            return
        m = self.cfg.compress_rates[CSA]
        dev = state.device
        req = upload(list(starts), dev)
        index = upload([hit // self.state_every - 1 for _, hit in starts.values()], dev)
        blocks = table[req, index].long()
        cols = self.state_columns()
        for layer, gi in self.group_index.items():
            if self.cfg.layer_types[layer] != CSA:
                continue
            snap = state[gi].index_select(0, blocks).reshape(len(starts) * m, -1)
            for name in ("kv", "index"):
                ring = self.rings[(layer, name)]
                n = ring.ring_len
                rows = [slot * n + pos % n for slot, hit in starts.values() for pos in range(hit - m, hit)]
                dst = upload(rows, dev)
                half = snap[:, cols[name]]
                width = half.shape[-1] // 2
                ring.kv.view(-1, width).index_copy_(0, dst, half[:, :width].to(ring.kv.dtype))
                ring.gate.view(-1, width).index_copy_(0, dst, half[:, width:])


def _layer_params(weights: dict[str, Any], prefix: str, experts: range, *, groups: int, dtype: torch.dtype) -> Params:
    """Take one block's tensors out of ``weights`` (prefix stripped) and pre-pack the weights of
    ``experts``; taking them out lets each expert's own tensor go once it is packed, so loading
    peaks at the model plus one layer's experts. Stored-precision experts stay so (stacked by
    :func:`_stack_stored`); FP8 projections stay
    FP8 where the model's fused and grouped (``groups`` output groups of ``wo_a``) uses of them meet
    whole scale blocks, else are dequantized into ``dtype``."""
    p = {k[len(prefix) :]: weights.pop(k) for k in [k for k in weights if k.startswith(prefix)]}
    try:
        w1 = [p.pop(f"ffn.experts.{e}.w1.weight") for e in experts]
        w3 = [p.pop(f"ffn.experts.{e}.w3.weight") for e in experts]
        w2 = [p.pop(f"ffn.experts.{e}.w2.weight") for e in experts]
    except KeyError as e:
        raise ValueError(f"checkpoint is missing expert weight {prefix}{e.args[0]}") from None
    # moe_experts wants [E, 2I, D] gate/up stacked (gate first) and [E, D, I] down.
    p["experts.gate_up"] = _stack([[a, b] for a, b in zip(w1, w3)], dtype)
    p["experts.down"] = _stack([[w] for w in w2], dtype)
    packed = [isinstance(p[k], QuantizedWeight) for k in ("experts.gate_up", "experts.down")]
    if packed[0] != packed[1]:  # one side was dequantized (a split through MXFP4 groups): both float
        key = "experts.gate_up" if packed[0] else "experts.down"
        p[key] = p[key].dequantize(dtype)
    shared = (p.pop("ffn.shared_experts.w1.weight"), p.pop("ffn.shared_experts.w3.weight"))
    p["shared.gate_up"] = _fuse(prefix, *shared, dtype)
    wo_a = p.get("attn.wo_a.weight")
    if isinstance(wo_a, QuantizedWeight) and (wo_a.data.shape[0] // groups) % wo_a.block[0]:
        logger.warning("%sattn.wo_a.weight: dequantized at load; its output groups cut through its FP8 blocks", prefix)
        p["attn.wo_a.weight"] = wo_a.dequantize(dtype)
    return p


def _stack(experts: list[list[Any]], dtype: torch.dtype) -> Any:
    """Each expert's matrices concatenated by rows, stacked: as stored when every one is stored in one
    scheme and block (:func:`_stack_stored`), else float."""
    every = [w for e in experts for w in e]
    kinds = {(w.scheme, w.block) if isinstance(w, QuantizedWeight) else None for w in every}
    if len(kinds) == 1 and None not in kinds:
        return _stack_stored(experts)
    floats = [[w.dequantize(dtype) if isinstance(w, QuantizedWeight) else w for w in e] for e in experts]
    return torch.stack([torch.cat(e, dim=0) for e in floats])


def _stack_stored(experts: list[list[QuantizedWeight]]) -> QuantizedWeight:
    """The stack ``quant_moe_experts`` multiplies by. Scales follow their rows: MXFP4 and W8A8 scales
    are per row; FP8 block rows stay blocks where each matrix but the last of an expert ends on a
    block edge, else every row gets its blocks' scales (block ``(1, bc)``, ``4 / bc`` bytes a value)."""
    first = experts[0][0]
    scheme, (br, bc) = first.scheme, first.block
    block = first.block
    if scheme == "fp8_block" and any(w.data.shape[0] % br for e in experts for w in e[:-1]):
        experts = [[_rows_scaled(w) for w in e] for e in experts]
        block = (1, bc)

    def stacked(field: str) -> torch.Tensor:
        return torch.stack([torch.cat([getattr(w, field) for w in e]) for e in experts])

    offset = None
    if scheme == "w8a8_dynamic" and any(w.offset is not None for e in experts for w in e):
        experts = [[w if w.offset is not None else _with_zero_offset(w) for w in e] for e in experts]
        offset = stacked("offset").reshape(len(experts), -1)
    scale = stacked("scale")
    if scheme == "w8a8_dynamic":
        scale = scale.reshape(len(experts), -1)
    return QuantizedWeight(scheme, stacked("data"), scale, block, offset)


def _rows_scaled(w: QuantizedWeight) -> QuantizedWeight:
    """A block-FP8 matrix with one scale row per row (block ``(1, bc)``)."""
    rows = w.scale.repeat_interleave(w.block[0], dim=0)[: w.data.shape[0]]
    return QuantizedWeight(w.scheme, w.data, rows.contiguous(), (1, w.block[1]))


def _with_zero_offset(w: QuantizedWeight) -> QuantizedWeight:
    return QuantizedWeight(w.scheme, w.data, w.scale, w.block, torch.zeros_like(w.scale))


def _fuse(prefix: str, w1: Any, w3: Any, dtype: torch.dtype) -> Any:
    """The shared expert's gate and up projections as one matrix: as stored when both are stored
    alike and ``w1`` ends on a block edge (each keeps its own scale rows; W8A8 scales are per row),
    else float (dequantized, with a warning)."""
    if (
        isinstance(w1, QuantizedWeight)
        and isinstance(w3, QuantizedWeight)
        and (w1.scheme, w1.block) == (w3.scheme, w3.block)
        and w1.data.shape[0] % w1.block[0] == 0
    ):
        return _stack_stored([[w1, w3]]).expert(0)
    if isinstance(w1, QuantizedWeight) or isinstance(w3, QuantizedWeight):
        logger.warning("%sffn.shared_experts.w1/w3: dequantized at load; fused they cut through FP8 blocks", prefix)
    parts = [w.dequantize(dtype) if isinstance(w, QuantizedWeight) else w for w in (w1, w3)]
    return torch.cat(parts)
