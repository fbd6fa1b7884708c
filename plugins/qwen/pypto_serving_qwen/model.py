"""Qwen2 / Qwen3 / Qwen3-MoE decoder over the engine's flat token batch.

One forward covers a whole step (prefill chunks and decodes mixed): every token of every request
is a row of a ``[T, hidden]`` matrix, and the only per-request structure lives in the attention
metadata the paged-attention kernel consumes. Projections that HF keeps separate are fused at load
time (q/k/v into one matrix, gate/up into one, experts stacked into ``[E, 2I, H]`` / ``[E, H, I]``)
so each layer is a handful of large matmuls.

Under tensor parallelism each rank builds only its part of every matrix (:mod:`.sharding`); the
row-parallel projections all-reduce their partial sums and the LM head all-gathers its vocabulary
slices, so every rank returns the same full logits.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import pypto_kernels as K
from pypto_kernels.native_decoder import MAX_QUERIES
from pypto_serving import StepInterrupt
from pypto_serving.lora_weights import LoraAdapter, LoraContext, LoraStack
from pypto_serving.parallel import expert_parallel_moe, vocab_parallel_embedding

from .graph import decode_attention, moe_experts, static_decode_attention, write_kv
from .loader import CheckpointError, QuantPlan, QwenConfig, WeightTarget
from .quantized import QuantizedWeight, Weight, linear, make_weight, pack_projections, weight_targets
from .sharding import QwenSharding

logger = logging.getLogger(__name__)

__all__ = ["AttentionMetadata", "KVCache", "QwenForCausalLM"]

KVCache = tuple[torch.Tensor, torch.Tensor]  # (key_cache, value_cache), each [blocks, block_size, Hkv, D]


@dataclass(slots=True)
class AttentionMetadata:
    """The per-step tensors every attention layer shares (one cache group, ``"kv"``).

    The tensors live on the model's device; ``query_lens_host`` / ``seq_lens_host`` are the same
    per-request lengths on the host, so no layer reads a length back from the device (a host sync).
    """

    slot_mapping: torch.Tensor  # [T]
    block_tables: torch.Tensor  # [R, max_blocks]
    query_start_loc: torch.Tensor  # [R + 1]
    seq_lens: torch.Tensor  # [R]
    query_lens_host: list[int]  # [R] query rows of each request
    seq_lens_host: list[int]  # [R] equal to seq_lens
    # [R] how many of each request's first rows are prompt tokens (BatchInput.prompt_rows), or None
    prompt_rows_host: list[int] | None = None
    # How attention runs: "paged" (any step, eager), or a captured decode step's "host" (lengths from
    # seq_lens_cpu, a host tensor) or "static" (no host lengths at all); see graph.py.
    path: str = "paged"
    seq_lens_cpu: torch.Tensor | None = None  # [R] host copy of seq_lens, for the "host" path


def _param(shape: tuple[int, ...], device: torch.device, dtype: torch.dtype) -> nn.Parameter:
    # Uninitialised on purpose: the loader fills every parameter and fails if one is missing.
    return nn.Parameter(torch.empty(shape, device=device, dtype=dtype), requires_grad=False)


def _size(part: slice) -> int:
    return int(part.stop) - int(part.start)


def _scaled(part: slice, width: int) -> slice:
    """``part`` (in heads) as rows of ``width`` each."""
    return slice(part.start * width, part.stop * width)


def _part(rows: slice, dim: int, full: int) -> tuple[slice | None, int, int]:
    """WeightTarget's ``part, dim, full`` for ``rows`` of dimension ``dim`` (``None``: all of it)."""
    whole = rows.start == 0 and rows.stop == full
    return (None if whole else rows), dim, full


def _edges(part: slice, full: int) -> tuple[int, ...]:
    """Where ``part`` cuts a checkpoint dimension of ``full``: its start, and its stop unless that is the end."""
    return (int(part.start),) if int(part.stop) == full else (int(part.start), int(part.stop))


def _scheme(plan: QuantPlan | None, *names: str, cuts: tuple[int, ...] = (), dim: int = 0) -> str | None:
    """The stored-precision scheme of the matrix fusing ``names``; ``cuts``: where this rank's matrix
    splits its checkpoint weights along ``dim`` (fusion boundaries, tensor-parallel part edges).
    Block-FP8 whose cuts fall inside a scale block is dequantized at load instead (as before stored
    precision existed; same values, more memory, logged), since no scale block would fit its rows."""
    scheme = plan.scheme(*names) if plan is not None else None
    if scheme == "fp8_block" and plan is not None and any(c % plan.block[dim] for c in cuts):
        logger.warning(
            "%s: dequantized at load; its fused or tensor-parallel parts (edges %s) are not whole %d-wide FP8 "
            "scale blocks",
            names[0].rsplit(".", 2)[0],
            list(cuts),
            plan.block[dim],
        )
        return None
    return scheme


def _block(plan: QuantPlan | None) -> tuple[int, int]:
    return plan.block if plan is not None else (1, 1)


def _stored_experts(
    scheme: str, shape: tuple[int, int, int], device: torch.device, block: tuple[int, int]
) -> QuantizedWeight:
    """An empty expert stack ``[E, out, in]``: block-FP8 with ``[E, ceil(out/br), ceil(in/bc)]``
    scales, or dynamic W8A8 int8 with per-row ``[E, out]`` scales and offsets."""
    e, rows, cols = shape
    if scheme == "fp8_block":
        data = torch.empty(shape, device=device, dtype=torch.float8_e4m3fn)
        scale = torch.empty((e, -(-rows // block[0]), -(-cols // block[1])), device=device)
        return QuantizedWeight(scheme, data, scale, block)
    data = torch.empty(shape, device=device, dtype=torch.int8)
    scale, offset = (torch.empty((e, rows), device=device) for _ in range(2))
    return QuantizedWeight(scheme, data, scale, offset=offset)


def _expert(stack: QuantizedWeight, index: int) -> QuantizedWeight:
    """Expert ``index`` of ``stack`` as a 2-D weight viewing the stack's storage (the loader fills it);
    W8A8 scales and offsets as the checkpoint's ``[out, 1]``."""
    if stack.scheme == "fp8_block":
        return QuantizedWeight(stack.scheme, stack.data[index], stack.scale[index], stack.block)
    assert stack.offset is not None
    return QuantizedWeight(
        stack.scheme, stack.data[index], stack.scale[index, :, None], offset=stack.offset[index, :, None]
    )


def _target(dest: torch.Tensor, name: str, rows: slice, full: int, dim: int = 0) -> WeightTarget:
    """``dest`` filled from ``rows`` of dimension ``dim`` (``full`` long) of checkpoint tensor ``name``."""
    return WeightTarget(dest, (name,), *_part(rows, dim, full))


class QwenAttention(nn.Module):
    """Self-attention over this rank's query heads and the KV heads they read."""

    def __init__(
        self,
        cfg: QwenConfig,
        layer: int,
        device: torch.device,
        dtype: torch.dtype,
        shards: QwenSharding,
        plan: QuantPlan | None = None,
    ) -> None:
        super().__init__()
        self.cfg, self.shards = cfg, shards
        self.num_heads, self.num_kv_heads = _size(shards.q_heads), _size(shards.kv_heads)
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * cfg.head_dim
        self.kv_size = self.num_kv_heads * cfg.head_dim
        qkv = self.q_size + 2 * self.kv_size
        p = f"model.layers.{layer}.self_attn"
        q_rows, kv_rows = _scaled(shards.q_heads, cfg.head_dim), _scaled(shards.kv_heads, cfg.head_dim)
        q_full, kv_full = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        edges = (self.q_size, self.q_size + self.kv_size, *_edges(q_rows, q_full), *_edges(kv_rows, kv_full))
        qkv_scheme = _scheme(plan, *(f"{p}.{n}_proj.weight" for n in "qkv"), cuts=edges)
        self.qkv_weight: Weight = make_weight((qkv, cfg.hidden_size), device, dtype, qkv_scheme, _block(plan), 3)
        self.qkv_bias = _param((qkv,), device, dtype) if cfg.qkv_bias else None
        o_scheme = _scheme(plan, f"{p}.o_proj.weight", cuts=_edges(q_rows, q_full), dim=1)
        self.o_weight: Weight = make_weight((cfg.hidden_size, self.q_size), device, dtype, o_scheme, _block(plan))
        self.o_bias = _param((cfg.hidden_size,), device, dtype) if cfg.o_bias else None
        self.q_norm = _param((cfg.head_dim,), device, dtype) if cfg.qk_norm else None
        self.k_norm = _param((cfg.head_dim,), device, dtype) if cfg.qk_norm else None
        self.eps = cfg.rms_norm_eps
        self.scale = cfg.head_dim**-0.5
        self.sliding_window = cfg.layer_windows[layer]
        # FP8 KV cache scales of this rank's KV heads ([heads] float32), from the checkpoint where it
        # has them (set by the executor); None: 1.0, as vLLM without calibrated scales.
        self.kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None
        self.lora_qkv: LoraStack | None = None  # set by QwenForCausalLM.attach_loras
        # Set by QwenForCausalLM.pack_linears (the eager CPU forward): plain projections run
        # pypto_kernels.linear, whose CPU fast path multiplies large float32 weights transposed.
        self.kernel_linear = False
        self.lora_o: LoraStack | None = None

    def weight_targets(self, prefix: str) -> dict[str, list[WeightTarget]]:
        cfg, q, kv, d = self.cfg, self.q_size, self.kv_size, self.cfg.head_dim
        q_rows, kv_rows = _scaled(self.shards.q_heads, d), _scaled(self.shards.kv_heads, d)
        out: dict[str, list[WeightTarget]] = {}
        for index, (part, rows, src, full) in enumerate(
            (
                ("q", slice(0, q), q_rows, cfg.num_heads * d),
                ("k", slice(q, q + kv), kv_rows, cfg.num_kv_heads * d),
                ("v", slice(q + kv, q + 2 * kv), kv_rows, cfg.num_kv_heads * d),
            )
        ):
            name = f"{prefix}.{part}_proj.weight"
            out.update(weight_targets(self.qkv_weight, name, rows, src, full, index=index))
            if self.qkv_bias is not None:
                bname = f"{prefix}.{part}_proj.bias"
                out[bname] = [_target(self.qkv_bias.data[rows], bname, src, full)]
        oname = f"{prefix}.o_proj.weight"
        out.update(weight_targets(self.o_weight, oname, slice(None), q_rows, cfg.num_heads * d, dim=1))
        if self.o_bias is not None:
            out[f"{prefix}.o_proj.bias"] = [WeightTarget(self.o_bias.data, (f"{prefix}.o_proj.bias",))]
        if self.q_norm is not None and self.k_norm is not None:
            out[f"{prefix}.q_norm.weight"] = [WeightTarget(self.q_norm.data, (f"{prefix}.q_norm.weight",))]
            out[f"{prefix}.k_norm.weight"] = [WeightTarget(self.k_norm.data, (f"{prefix}.k_norm.weight",))]
        return out

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = linear(x, self.qkv_weight, self.qkv_bias, kernel=self.kernel_linear)
        if self.lora_qkv is not None:
            qkv = self.lora_qkv.add_delta(x, qkv)
        if meta.path == "paged":
            out = self._attend_paged(qkv, cos, sin, cache, meta)
        else:
            q_end, k_end = self.q_size, self.q_size + self.kv_size
            q = qkv[:, :q_end].reshape(num_tokens, self.num_heads, self.head_dim)
            k = qkv[:, q_end:k_end].reshape(num_tokens, self.num_kv_heads, self.head_dim)
            v = qkv[:, k_end:].reshape(num_tokens, self.num_kv_heads, self.head_dim)
            if self.q_norm is not None and self.k_norm is not None:  # Qwen3: RMSNorm per head before RoPE
                q = K.rms_norm(q, self.q_norm, self.eps)
                k = K.rms_norm(k, self.k_norm, self.eps)
            q, k = K.apply_rope(q, k, cos, sin)
            out = self._attend_captured(q, k, v, cache, meta)
        # Row-parallel o_proj: each rank's heads give a partial sum; the bias is added once, after it.
        attended = out.reshape(num_tokens, self.q_size)
        projected = linear(
            attended, self.o_weight, reduce_absmax=self.shards.ctx.absmax_reduce, kernel=self.kernel_linear
        )
        if self.lora_o is not None:
            projected = self.lora_o.add_delta(attended, projected)
        hidden = self.shards.ctx.all_reduce(projected)
        return hidden if self.o_bias is None else hidden + self.o_bias

    def _attend_paged(
        self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        """An eager step: the q/k norms, the rotation and the K/V write in one kernel (one C pass on
        the CPU), then paged attention."""
        key_cache, value_cache = cache
        # An FP8 cache (kv_cache_dtype = "fp8") holds K/V over the checkpoint's per-tensor or per-head
        # scales, else 1.0 (vLLM's default without calibrated scales); the kernels quantise on
        # write and dequantise on read.
        fp8: dict[str, Any] = {}
        if key_cache.dtype == torch.float8_e4m3fn:
            k_scale, v_scale = self.kv_scales if self.kv_scales is not None else (1.0, 1.0)
            fp8 = {"k_scale": k_scale, "v_scale": v_scale}
        q = K.qk_norm_rope_write_kv(
            qkv,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            (self.q_norm, self.k_norm),
            self.eps,
            (cos, sin),
            cache,
            meta.slot_mapping,
            **fp8,
        )
        out: torch.Tensor = K.paged_attention(
            q,
            key_cache,
            value_cache,
            meta.block_tables,
            meta.query_start_loc,
            meta.seq_lens,
            self.scale,
            sliding_window=self.sliding_window,
            query_lens_host=meta.query_lens_host,
            seq_lens_host=meta.seq_lens_host,
            prompt_rows_host=meta.prompt_rows_host,
            **fp8,
        )
        return out

    def _attend_captured(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        """A captured decode step: ops a compiled graph calls without a break (graph.py)."""
        key_cache, value_cache = cache
        write_kv(k, v, key_cache, value_cache, meta.slot_mapping)
        if meta.path == "static":
            return static_decode_attention(
                q, key_cache, value_cache, meta.block_tables, meta.seq_lens, self.scale, self.sliding_window
            )
        assert meta.seq_lens_cpu is not None
        attended: torch.Tensor = decode_attention(
            q,
            key_cache,
            value_cache,
            meta.block_tables,
            meta.seq_lens,
            meta.seq_lens_cpu,
            self.scale,
            self.sliding_window,
        )
        return attended


class QwenMLP(nn.Module):
    """SwiGLU MLP, column-parallel gate/up and row-parallel down over this rank's intermediate rows."""

    def __init__(
        self,
        cfg: QwenConfig,
        device: torch.device,
        dtype: torch.dtype,
        shards: QwenSharding,
        plan: QuantPlan | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        self.shards, self.full = shards, cfg.intermediate_size
        self.intermediate = i = _size(shards.intermediate)
        edges = (i, *_edges(shards.intermediate, cfg.intermediate_size))
        gate_up = _scheme(plan, f"{prefix}.gate_proj.weight", f"{prefix}.up_proj.weight", cuts=edges)
        down = _scheme(plan, f"{prefix}.down_proj.weight", cuts=edges[1:], dim=1)
        self.gate_up_weight: Weight = make_weight((2 * i, cfg.hidden_size), device, dtype, gate_up, _block(plan), 2)
        self.down_weight: Weight = make_weight((cfg.hidden_size, i), device, dtype, down, _block(plan))
        self.lora_gate_up: LoraStack | None = None  # set by QwenForCausalLM.attach_loras
        self.kernel_linear = False  # as QwenAttention's
        self.lora_down: LoraStack | None = None

    def weight_targets(self, prefix: str) -> dict[str, list[WeightTarget]]:
        i, rows, full = self.intermediate, self.shards.intermediate, self.full
        gate, up, down = (f"{prefix}.{n}_proj.weight" for n in ("gate", "up", "down"))
        return {
            **weight_targets(self.gate_up_weight, gate, slice(0, i), rows, full),
            **weight_targets(self.gate_up_weight, up, slice(i, 2 * i), rows, full, index=1),
            **weight_targets(self.down_weight, down, slice(None), rows, full, dim=1),
        }

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Row-parallel down_proj: a W8A8 weight quantises this rank's intermediate rows with the scale
        # of the whole row (one max all-reduce under tensor parallelism), as one rank does.
        reduce, kernel = self.shards.ctx.absmax_reduce, self.kernel_linear
        if self.lora_gate_up is None or self.lora_down is None:
            act = K.silu_and_mul(linear(x, self.gate_up_weight, kernel=kernel))
            return self.shards.ctx.all_reduce(linear(act, self.down_weight, reduce_absmax=reduce, kernel=kernel))
        act = K.silu_and_mul(self.lora_gate_up.add_delta(x, linear(x, self.gate_up_weight, kernel=kernel)))
        down = linear(act, self.down_weight, reduce_absmax=reduce, kernel=kernel)
        return self.shards.ctx.all_reduce(self.lora_down.add_delta(act, down))


class QwenSparseMoe(nn.Module):
    """Routed experts: this rank's part of every expert (tensor-parallel MoE) or its whole experts
    (expert parallel); the router is replicated."""

    def __init__(
        self,
        cfg: QwenConfig,
        device: torch.device,
        dtype: torch.dtype,
        shards: QwenSharding,
        plan: QuantPlan | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        e, h = _size(shards.experts), cfg.hidden_size
        self.shards, self.num_experts, self.full = shards, cfg.num_experts, cfg.moe_intermediate_size
        self.intermediate = i = _size(shards.moe_intermediate)
        self.top_k, self.norm_topk_prob = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.router_weight = _param((cfg.num_experts, h), device, dtype)
        self.gate_up: nn.Parameter | QuantizedWeight | K.native.PackedExperts
        self.down: nn.Parameter | QuantizedWeight | K.native.PackedExperts
        scheme = self._expert_scheme(plan, prefix)
        if scheme is not None:
            self.gate_up = _stored_experts(scheme, (e, 2 * i, h), device, _block(plan))
            self.down = _stored_experts(scheme, (e, h, i), device, _block(plan))
        else:
            self.gate_up = _param((e, 2 * i, h), device, dtype)
            self.down = _param((e, h, i), device, dtype)

    def _expert_scheme(self, plan: QuantPlan | None, prefix: str) -> str | None:
        """The scheme every local expert is stored in (``fp8_block``: only when this rank's gate/up/down
        parts are whole scale blocks; ``w8a8_dynamic``), kept as stored; None: float (FP8 dequantized
        at load)."""
        names = [self._expert_names(prefix, e) for e in self.local_experts()]
        if plan is None or not names:
            return None
        edges = (self.intermediate, *_edges(self.shards.moe_intermediate, self.full))
        gate_up = _scheme(plan, *(n for gate, up, _ in names for n in (gate, up)), cuts=edges)
        down = _scheme(plan, *(down for _, _, down in names), cuts=edges[1:], dim=1)
        return gate_up if gate_up == down else None

    def _expert_names(self, prefix: str, e: int) -> tuple[str, str, str]:
        gate, up, down = (f"{prefix}.experts.{e}.{n}_proj.weight" for n in ("gate", "up", "down"))
        return gate, up, down

    def weight_targets(self, prefix: str) -> dict[str, list[WeightTarget]]:
        i, rows, full, first = self.intermediate, self.shards.moe_intermediate, self.full, self.shards.experts.start
        router = f"{prefix}.gate.weight"
        out: dict[str, list[WeightTarget]] = {router: [WeightTarget(self.router_weight.data, (router,))]}
        for e in range(self.num_experts):  # another rank's experts (expert parallel) are skipped
            for name in self._expert_names(prefix, e):
                out[name] = []
        if isinstance(self.gate_up, QuantizedWeight):
            out.update(self._stored_targets(prefix))
            return out
        # Released Qwen-MoE checkpoints store one matrix per expert; stack them into [E, 2I, H] / [E, H, I].
        gate_up, down_w = self._float_experts()
        for e in self.local_experts():
            gate, up, down = self._expert_names(prefix, e)
            out[gate] = [_target(gate_up[e - first, :i], gate, rows, full)]
            out[up] = [_target(gate_up[e - first, i:], up, rows, full)]
            out[down] = [_target(down_w[e - first], down, rows, full, dim=1)]
        out.update(self._stacked_targets(prefix))
        return out

    def _stored_targets(self, prefix: str) -> dict[str, list[WeightTarget]]:
        """Each expert's data and scales (FP8 ``weight_scale_inv``, W8A8 ``weight_scale`` and
        ``weight_offset``) copied as stored into its place in the stacks (per-expert checkpoints only:
        a stacked quantized layout is not published)."""
        assert isinstance(self.gate_up, QuantizedWeight) and isinstance(self.down, QuantizedWeight)
        i, rows, full, first = self.intermediate, self.shards.moe_intermediate, self.full, self.shards.experts.start
        out: dict[str, list[WeightTarget]] = {}
        for e in self.local_experts():
            gate, up, down = self._expert_names(prefix, e)
            gate_up, down_w = (_expert(w, e - first) for w in (self.gate_up, self.down))
            out.update(weight_targets(gate_up, gate, slice(0, i), rows, full))
            out.update(weight_targets(gate_up, up, slice(i, 2 * i), rows, full))
            out.update(weight_targets(down_w, down, slice(None), rows, full, dim=1))
        return out

    def _stacked_targets(self, prefix: str) -> dict[str, list[WeightTarget]]:
        """transformers' in-memory layout (already stacked), accepted too; it fills the same names."""
        i, rows, full, experts = self.intermediate, self.shards.moe_intermediate, self.full, self.shards.experts
        names = [self._expert_names(prefix, e) for e in self.local_experts()]
        gate_up_fills = tuple(n for gate, up, _ in names for n in (gate, up))
        down_fills = tuple(down for _, _, down in names)
        gate_up, down = self._float_experts()
        if self.shards.expert_parallel:
            return {
                f"{prefix}.experts.gate_up_proj": [WeightTarget(gate_up, gate_up_fills, experts, 0, self.num_experts)],
                f"{prefix}.experts.down_proj": [WeightTarget(down, down_fills, experts, 0, self.num_experts)],
            }
        up_rows = slice(full + rows.start, full + rows.stop)
        return {
            f"{prefix}.experts.gate_up_proj": [
                WeightTarget(gate_up[:, :i], gate_up_fills, *_part(rows, 1, 2 * full)),
                WeightTarget(gate_up[:, i:], gate_up_fills, *_part(up_rows, 1, 2 * full)),
            ],
            f"{prefix}.experts.down_proj": [WeightTarget(down, down_fills, *_part(rows, 2, full))],
        }

    def _float_experts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The float expert stacks a checkpoint fills: the weights load before :meth:`pack_experts`."""
        if not isinstance(self.gate_up, nn.Parameter) or not isinstance(self.down, nn.Parameter):
            raise RuntimeError("the routed experts are packed (or stored quantized): load the weights before packing")
        return self.gate_up.data, self.down.data

    def local_experts(self) -> range:
        return range(self.shards.experts.start, self.shards.experts.stop)

    def pack_experts(self) -> bool:
        """Replace float experts by panels (:func:`pypto_kernels.native.pack_experts`, after loading, on
        the CPU) where the native block takes them: its products then reach the FLOP peak with a few rows
        an expert and serve every row count (docs/benchmarks.md). Stored-precision experts and expert
        parallelism (whose routes go through ``moe_experts``) keep theirs; returns whether it packed."""
        if self.shards.expert_parallel or not isinstance(self.gate_up, nn.Parameter):
            return False
        if not isinstance(self.down, nn.Parameter) or self.gate_up.device.type != "cpu":
            return False
        row = torch.empty(1, self.router_weight.shape[1], dtype=self.router_weight.dtype)
        try:
            gate_up, down = K.native.pack_experts(self.gate_up.data), K.native.pack_experts(self.down.data)
        except ValueError:  # a dtype panels do not hold, or odd bfloat16 widths
            return False
        if not K.native.moe_block_takes(row, self.router_weight, gate_up, down):
            return False
        del self._parameters["gate_up"], self._parameters["down"]
        self.gate_up, self.down = gate_up, down
        return True

    def required(self, prefix: str) -> set[str]:
        names = {f"{prefix}.gate.weight"}
        for e in self.local_experts():
            names.update(self._expert_names(prefix, e))
        if isinstance(self.gate_up, QuantizedWeight):  # stored experts need their scales too
            names |= set(self._stored_targets(prefix))
        return names

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up, down = self.gate_up, self.down
        local = not self.shards.expert_parallel and not torch.compiler.is_compiling()
        if local and not isinstance(gate_up, QuantizedWeight) and not isinstance(down, QuantizedWeight):
            # The router, routing and experts as one kernel (on the CPU one native call, which the
            # native decoder's MoE layers make too, so both give the same bits).
            routed = K.routed_moe(x, self.router_weight, gate_up, down, self.top_k, self.norm_topk_prob)
            return self.shards.ctx.all_reduce(routed)
        router_logits = F.linear(x, self.router_weight)
        weights, ids = K.topk_routing(router_logits, self.top_k, self.norm_topk_prob)
        # A captured decode step calls the kernel as one op (graph.py); eager calls it directly. Stored
        # (FP8, int8) experts stay so: quant_moe_experts dequantizes only the experts a step routes to.
        if isinstance(self.gate_up, QuantizedWeight):
            experts: Callable[..., torch.Tensor] = K.quant_moe_experts
        else:
            experts = moe_experts if torch.compiler.is_compiling() else K.moe_experts
        if self.shards.expert_parallel:
            return expert_parallel_moe(
                x,
                weights,
                ids,
                lambda xs, ws, local: experts(xs, self.gate_up, self.down, ws, local),
                self.num_experts,
                self.shards.ctx,
            )
        if isinstance(self.gate_up, QuantizedWeight):
            # Every expert's intermediate rows are split: W8A8 quantises the down matmuls' inputs
            # with the whole rows' scales (one max all-reduce under tensor parallelism).
            out: torch.Tensor = experts(
                x, self.gate_up, self.down, weights, ids, reduce_absmax=self.shards.ctx.absmax_reduce
            )
        else:
            out = experts(x, self.gate_up, self.down, weights, ids)
        return self.shards.ctx.all_reduce(out)


class QwenDecoderLayer(nn.Module):
    def __init__(
        self,
        cfg: QwenConfig,
        layer: int,
        device: torch.device,
        dtype: torch.dtype,
        shards: QwenSharding,
        plan: QuantPlan | None = None,
    ) -> None:
        super().__init__()
        self.eps = cfg.rms_norm_eps
        self.input_norm = _param((cfg.hidden_size,), device, dtype)
        self.post_attention_norm = _param((cfg.hidden_size,), device, dtype)
        self.self_attn = QwenAttention(cfg, layer, device, dtype, shards, plan)
        self.mlp: QwenMLP | QwenSparseMoe
        if cfg.is_moe_layer(layer):
            self.mlp = QwenSparseMoe(cfg, device, dtype, shards, plan, f"model.layers.{layer}.mlp")
        else:
            self.mlp = QwenMLP(cfg, device, dtype, shards, plan, f"model.layers.{layer}.mlp")

    def weight_targets(self, prefix: str) -> dict[str, list[WeightTarget]]:
        out = {
            f"{prefix}.input_layernorm.weight": [
                WeightTarget(self.input_norm.data, (f"{prefix}.input_layernorm.weight",))
            ],
            f"{prefix}.post_attention_layernorm.weight": [
                WeightTarget(self.post_attention_norm.data, (f"{prefix}.post_attention_layernorm.weight",))
            ],
        }
        out.update(self.self_attn.weight_targets(f"{prefix}.self_attn"))
        out.update(self.mlp.weight_targets(f"{prefix}.mlp"))
        return out

    def forward(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: KVCache,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # The residual add of the previous sub-block is fused into this norm (same sums as HF's order).
        if residual is None:
            residual = hidden
            hidden = K.rms_norm(hidden, self.input_norm, self.eps)
        else:
            hidden, residual = K.add_rms_norm(hidden, residual, self.input_norm, self.eps)
        hidden = self.self_attn(hidden, cos, sin, cache, meta)
        hidden, residual = K.add_rms_norm(hidden, residual, self.post_attention_norm, self.eps)
        return self.mlp(hidden), residual


class QwenForCausalLM(nn.Module):
    """The full model; parameters are created empty on ``device`` in ``dtype`` and filled by the loader.

    ``shards`` is this rank's tensor-parallel layout (:mod:`.sharding`); by default everything is on
    one rank. Every rank's forward returns the same full logits.
    """

    inv_freq: torch.Tensor

    def __init__(
        self,
        cfg: QwenConfig,
        device: torch.device,
        dtype: torch.dtype,
        shards: QwenSharding | None = None,
        plan: QuantPlan | None = None,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.dtype = dtype
        self.shards = shards = shards if shards is not None else QwenSharding.single(cfg)
        vocab = _size(shards.vocab)
        # The output projection is stored transposed, [hidden, vocab]: ``hidden @ lm_head_t`` streams it
        # row by row, about 2x faster on the CPU than F.linear over [vocab, hidden] for a few decode
        # rows and 1.2-1.4x for 64 (benchmarks.md). A tied embedding is a [vocab, hidden] view of it.
        # Under tensor parallelism both hold this rank's vocabulary rows only.
        self.lm_head_q = self._stored_head(plan, device, dtype)
        # A head kept in its stored precision leaves ``lm_head_t`` empty ([hidden, 0]: only its device
        # and dtype are read).
        head_cols = 0 if self.lm_head_q is not None else vocab
        self.lm_head_t = _param((cfg.hidden_size, head_cols), device, dtype)
        self.embed = self.lm_head_t.t() if cfg.tie_word_embeddings else _param((vocab, cfg.hidden_size), device, dtype)
        # Set by pack_linears: ``lm_head_t.t()`` (a view) with a packed copy of it, or (an untied head
        # packed in place) the packed copy alone, ``lm_head_t`` then emptied.
        self.lm_head_packed: K.PackedLinearWeight | None = None
        # Set by pack_linears (the eager CPU forward): the output projection runs pypto_kernels.linear
        # over ``lm_head_t.t()``, whose CPU fast path multiplies it transposed from 16 rows.
        self.lm_head_kernel = False
        self.layers = nn.ModuleList(
            QwenDecoderLayer(cfg, i, device, dtype, shards, plan) for i in range(cfg.num_layers)
        )
        self.norm = _param((cfg.hidden_size,), device, dtype)
        # Set by the executor (``executor_options["native_decoder"]``, after pack_linears): decode steps
        # run the decoder layers as one native call where they can (:meth:`_native_decoder`).
        self.native_decoder_enabled = False
        self.native_decoder_steps = 0
        self.greedy_loop_steps = 0  # forwards run by greedy_steps
        self.sampled_loop_steps = 0  # of them, those that drew a sampled request's token
        self._native: tuple[list[KVCache], K.NativeDecoder | None] | None = None
        inv_freq, attention_scaling = K.rope_inv_freq(
            cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings
        )
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)
        self.attention_scaling = attention_scaling
        self.rope_table = K.RopeTable(self.inv_freq, attention_scaling, dtype)

    def _stored_head(self, plan: QuantPlan | None, device: torch.device, dtype: torch.dtype) -> QuantizedWeight | None:
        """The output projection in its stored precision where the checkpoint quantizes ``lm_head.weight``
        (``pypto-serving convert --quantize-head`` writes one; CTranslate2's int8 quantizes it too), else
        None (a float head).

        :raises CheckpointError: a quantized head in a checkpoint that ties it to the embedding (the
            head would then be the float embedding, and the quantized tensor silently unused).
        """
        vocab, full = self.shards.vocab, self.cfg.vocab_size
        scheme = _scheme(plan, "lm_head.weight", cuts=_edges(vocab, full))
        if scheme is None:
            return None
        if self.cfg.tie_word_embeddings:
            raise CheckpointError(
                f"lm_head.weight is quantized ({scheme}) but config.json sets tie_word_embeddings, which makes "
                "the head the float embedding; set tie_word_embeddings to false to serve the quantized head"
            )
        weight = make_weight((_size(vocab), self.cfg.hidden_size), device, dtype, scheme, _block(plan))
        assert isinstance(weight, QuantizedWeight)
        return weight

    def weight_targets(self) -> tuple[dict[str, list[WeightTarget]], set[str]]:
        """Checkpoint name -> destinations, and the set of names that must be present."""
        vocab, full = self.shards.vocab, self.cfg.vocab_size
        out: dict[str, list[WeightTarget]] = {
            "model.embed_tokens.weight": [_target(self.embed.data, "model.embed_tokens.weight", vocab, full)],
            "model.norm.weight": [WeightTarget(self.norm.data, ("model.norm.weight",))],
        }
        if self.lm_head_q is not None:
            rows = slice(0, _size(vocab))  # all of this rank's matrix
            out.update(weight_targets(self.lm_head_q, "lm_head.weight", rows, vocab, full))
        elif self.cfg.tie_word_embeddings:
            out["lm_head.weight"] = []  # a tied export may still carry a copy; the embedding wins, as in HF
        else:
            out["lm_head.weight"] = [_target(self.lm_head_t.data.t(), "lm_head.weight", vocab, full)]
        required = {n for n, ts in out.items() if ts}
        for i, layer in enumerate(self.layers):
            assert isinstance(layer, QwenDecoderLayer)
            prefix = f"model.layers.{i}"
            layer_targets = layer.weight_targets(prefix)
            out.update(layer_targets)
            if isinstance(layer.mlp, QwenSparseMoe):
                # Only the per-expert names are required; the stacked aliases fill them when used.
                required |= {n for n in layer_targets if ".mlp." not in n} | layer.mlp.required(f"{prefix}.mlp")
            else:
                required |= set(layer_targets)
        return out, required

    def lora_shapes(self) -> dict[str, tuple[int, int]]:
        """``(out, in)`` of every projection an adapter may target, by PEFT module path:
        attention in every layer, the MLP in dense layers (routed experts take no adapter)."""
        cfg, d = self.cfg, self.cfg.head_dim
        h, q, kv = cfg.hidden_size, cfg.num_heads * d, cfg.num_kv_heads * d
        shapes: dict[str, tuple[int, int]] = {}
        for i, layer in enumerate(self.layers):
            attn, mlp = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
            shapes |= {attn + "q_proj": (q, h), attn + "k_proj": (kv, h), attn + "v_proj": (kv, h)}
            shapes[attn + "o_proj"] = (h, q)
            if isinstance(layer.mlp, QwenMLP):
                inter = cfg.intermediate_size
                shapes |= {mlp + "gate_proj": (inter, h), mlp + "up_proj": (inter, h), mlp + "down_proj": (h, inter)}
        return shapes

    def attach_loras(self, adapters: list[LoraAdapter], slots: int = 0) -> LoraContext:
        """Give every projection LoRA stacks of ``slots`` slots (at least one per adapter and the
        base's) and write ``adapters`` into them (slot ``i + 1`` for ``adapters[i]``, each already
        cut to this rank by :meth:`shard_lora`); returns the context whose per-token one-hot selects
        each token's adapter. The stacks have this rank's widths: its rows of the column-parallel
        projections' outputs, its columns of the row-parallel ones' inputs."""
        slots = max(slots, len(adapters) + 1)
        ctx, cfg, dev, sh = LoraContext(slots=slots), self.cfg, self.lm_head_t.device, self.shards
        h, q, kv = cfg.hidden_size, _size(sh.q_heads) * cfg.head_dim, _size(sh.kv_heads) * cfg.head_dim
        for i, layer in enumerate(self.layers):
            assert isinstance(layer, QwenDecoderLayer)
            attn = layer.self_attn
            a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
            qkv = (a + "q_proj", a + "k_proj", a + "v_proj")
            attn.lora_qkv = LoraStack(qkv, (q, kv, kv), h, ctx, self.dtype, dev, slots)
            attn.lora_o = LoraStack((a + "o_proj",), (h,), q, ctx, self.dtype, dev, slots)
            if isinstance(layer.mlp, QwenMLP):
                inter = layer.mlp.intermediate
                gate_up = (m + "gate_proj", m + "up_proj")
                layer.mlp.lora_gate_up = LoraStack(gate_up, (inter, inter), h, ctx, self.dtype, dev, slots)
                layer.mlp.lora_down = LoraStack((m + "down_proj",), (h,), inter, ctx, self.dtype, dev, slots)
        for slot, adapter in enumerate(adapters, start=1):
            self.write_lora(ctx, slot, adapter)
        return ctx

    def shard_lora(self, adapter: LoraAdapter) -> LoraAdapter:
        """This rank's part of ``adapter`` (read whole, with the checkpoint's shapes; itself on one
        rank), cut as the base weights are: a column-parallel projection (q/k/v, gate/up) keeps the
        rows of ``B`` of this rank's output rows and all of ``A``; a row-parallel one (o_proj,
        down_proj) keeps the columns of ``A`` of this rank's input and all of ``B``. The row-parallel
        delta of a rank's input part is then a partial sum, added to the base's partial output before
        the layer's all-reduce, so the ranks' sum holds the whole delta exactly once."""
        if not self.shards.ctx.enabled:
            return adapter
        sh, d = self.shards, self.cfg.head_dim
        q_rows, kv_rows = _scaled(sh.q_heads, d), _scaled(sh.kv_heads, d)
        out_rows = {"q_proj": q_rows, "k_proj": kv_rows, "v_proj": kv_rows}
        out_rows |= {"gate_proj": sh.intermediate, "up_proj": sh.intermediate}
        in_cols = {"o_proj": q_rows, "down_proj": sh.intermediate}
        pairs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for module, (a, b) in adapter.pairs.items():
            leaf = module.rpartition(".")[2]
            if leaf in out_rows:
                # B stays column-major (its transpose contiguous), as read_adapter keeps it.
                pairs[module] = (a, b[out_rows[leaf]].t().contiguous().t())
            else:
                pairs[module] = (a[:, in_cols[leaf]].contiguous(), b)
        return LoraAdapter(adapter.name, adapter.rank, adapter.scale, pairs)

    def write_lora(self, ctx: LoraContext, slot: int, adapter: LoraAdapter) -> None:
        """Put ``adapter`` into ``slot`` of every projection's stacks (after :meth:`attach_loras`);
        the stacks grow together, so ``ctx.slots`` is every stack's slot count."""
        stacks = [m for m in self.modules() if isinstance(m, LoraStack)]
        for stack in stacks:
            stack.write(slot, adapter)
        ctx.slots = max(stack.slots for stack in stacks)

    def quantized_weights(self) -> list[QuantizedWeight]:
        """The projections and routed expert stacks kept in their stored precision."""
        return [w for _, w in self.named_quantized_weights()]

    def named_quantized_weights(self) -> list[tuple[str, QuantizedWeight]]:
        """(module path and attribute, weight) of every projection and expert stack kept in its stored
        precision."""
        found: list[tuple[str, QuantizedWeight]] = []
        for path, module in self.named_modules():
            for attr in ("qkv_weight", "o_weight", "gate_up_weight", "down_weight", "gate_up", "down", "lm_head_q"):
                value = getattr(module, attr, None)
                if isinstance(value, QuantizedWeight):
                    found.append((f"{path}.{attr}", value))
        return found

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[KVCache],
        logits_indices: torch.Tensor,
        maxima: tuple[torch.Tensor, torch.Tensor] | None = None,
        store_logits: bool = True,
    ) -> torch.Tensor:
        """Float32 logits ``[len(logits_indices), vocab]``; writes this step's K/V into ``kv_caches``.
        ``maxima`` and ``store_logits``: as :meth:`logits` takes them."""
        hidden, residual = self.hidden_states(input_ids, positions, meta, kv_caches)
        return self.logits(hidden[logits_indices], residual[logits_indices], maxima, store_logits)

    def greedy_steps(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        block_tables: torch.Tensor,
        kv_caches: list[KVCache],
        steps: int,
        stop_ids: list[frozenset[int]],
        interrupt: StepInterrupt | None = None,
        draws: list[K.SampledRun | None] | None = None,
    ) -> list[list[int]] | None:
        """Up to ``steps`` decode forwards of ``R`` requests back to back, each row's next input its
        greedy token (:meth:`pypto_serving.Executor.greedy_steps`), or the token ``draws[r]`` draws
        from the row's stored logits (:meth:`pypto_serving.Executor.sampled_steps`, the C draw with
        the sampler's uniform): each forward is what :meth:`forward`
        runs for that step (the native decoder's layers, the final norm, the output projection taking
        each row's maximum as it goes, no logits stored), so its tokens are the forward's bit for bit,
        without the engine's work per forward (on the CPU at one request a third of a small model's
        token, measured in docs/benchmarks.md).

        :param input_ids: ``[R]`` each request's input token (its last sampled one); ``positions`` ``[R]`` its position.
        :param block_tables: ``[R, blocks]``, covering each request's next ``steps`` positions.
        :param interrupt: the run ends after any forward once it is set (``BatchInput.interrupt``).
        :return: each forward's ``R`` tokens (see the executor's contract for where the run stops), or
            None where the forward would not run the native decoder with such an output projection.
        """
        rows = input_ids.shape[0]
        native = self._native_decoder(kv_caches) if self.native_decoder_enabled else None
        if native is None or not self.takes_maxima(rows) or input_ids.device.type != "cpu":
            return None
        draws = draws if draws is not None and any(d is not None for d in draws) else None
        tail = self._greedy_tail(rows, int(positions.max()) + steps) if rows else None
        if tail is not None:  # one request whose output projection is a panels copy: a native loop
            word, seen = (None, 0) if interrupt is None else (interrupt.word, interrupt.seen)
            draw = None if draws is None else draws[0]
            run = native.greedy_run(
                tail, int(input_ids[0]), int(positions[0]), block_tables[0], steps, stop_ids[0], word, seen, draw
            )
            self.greedy_loop_steps += len(run)
            self.sampled_loop_steps += len(run) if draw is not None else 0
            return [[t] for t in run]
        return self._greedy_rows(input_ids, positions, block_tables, kv_caches, steps, stop_ids, interrupt, draws)

    def _greedy_rows(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        block_tables: torch.Tensor,
        kv_caches: list[KVCache],
        steps: int,
        stop_ids: list[frozenset[int]],
        interrupt: StepInterrupt | None,
        draws: list[K.SampledRun | None] | None = None,
    ) -> list[list[int]]:
        """:meth:`greedy_steps` of several rows: :meth:`forward` itself for each forward, its one-token
        step's tensors made here (the slots from the block tables, as the runner's batch gives them);
        where some row draws, the logits are stored and its token drawn from them
        (:func:`pypto_kernels.native.sample_rows`, the uniform of its seed and output index)."""
        rows, tables = input_ids.shape[0], block_tables.to(torch.int64).contiguous()
        table, block_size, each = tables.numpy(), kv_caches[0][0].shape[1], np.arange(rows)
        pos, tokens, every = positions.numpy().astype(np.int64), input_ids, torch.arange(rows)
        drawing = _RowDraws(draws, self.cfg.vocab_size) if draws is not None else None
        forwards: list[list[int]] = []
        for n in range(steps):
            ends = pos + 1
            meta = AttentionMetadata(
                slot_mapping=torch.from_numpy(table[each, pos // block_size] * block_size + pos % block_size),
                block_tables=tables, query_start_loc=torch.arange(rows + 1, dtype=torch.int32),
                seq_lens=torch.from_numpy(ends.astype(np.int32)), query_lens_host=[1] * rows,
                seq_lens_host=ends.tolist(),
            )  # fmt: skip
            maxima = torch.empty(rows), torch.empty(rows, dtype=torch.long)
            store = drawing is not None
            logits = self.forward(tokens, torch.from_numpy(pos), meta, kv_caches, every, maxima, store_logits=store)
            if not all(peak < math.inf for peak in maxima[0].tolist()):
                break  # NaN or infinite logits: the runner computes this forward again and fails the request
            tokens, pos = maxima[1] if drawing is None else drawing.tokens(logits, maxima[1], n), ends
            forwards.append(tokens.tolist())
            self.greedy_loop_steps += 1
            self.sampled_loop_steps += drawing is not None
            if any(t in stop for t, stop in zip(forwards[-1], stop_ids, strict=True)):
                break
            if interrupt is not None and interrupt.is_set():
                break
        return forwards

    def _greedy_tail(self, rows: int, bound: int) -> K.GreedyTail | None:
        """What :meth:`pypto_kernels.NativeDecoder.greedy_run` reads beyond the layers, where a step of
        ``rows`` rows takes the output projection's panels copy (one row: the product the eager
        forward's logits take too), with RoPE tables below ``bound``."""
        head = self.lm_head_packed
        if rows != 1 or head is None or head.library != "panels" or not head.serves(1):
            return None
        if self.embed.dtype != self.dtype or self.embed.stride(-1) != 1:
            return None
        cos, sin = self.rope_table.tables(bound)
        return K.GreedyTail(self.embed, self.norm, self.cfg.rms_norm_eps, head, cos, sin)

    def hidden_states(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, kv_caches: list[KVCache]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The last layer's output and residual for every row (their sum is the final hidden state)."""
        hidden = vocab_parallel_embedding(input_ids, self.embed, self.shards.ctx)
        cos, sin = self._rotary(positions, meta)
        # A decode or verification step (a few query rows a request) through the native decoder, whose
        # attention is the row kernel: prompt rows take the prefill kernel at any run length (eager).
        eligible = self.native_decoder_enabled and meta.path == "paged" and not any(meta.prompt_rows_host or ())
        short = eligible and max(meta.query_lens_host, default=0) <= MAX_QUERIES
        native = self._native_decoder(kv_caches) if short else None
        if native is not None and native.takes_rows(hidden.shape[0]):
            self.native_decoder_steps += 1
            lens = (meta.query_lens_host, meta.seq_lens_host)
            return native.run(hidden, (cos, sin), meta.slot_mapping, meta.block_tables, *lens)
        residual: torch.Tensor | None = None
        for layer, cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(hidden, residual, cos, sin, cache, meta)
        assert residual is not None
        return hidden, residual

    def _rotary(self, positions: torch.Tensor, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's cos/sin rows: gathered from the model's table where the step's lengths are on
        the host (an eager step), computed for the positions in a captured or compiled one (whose
        graph must not hold a table that grows)."""
        if meta.path == "paged" and meta.seq_lens_host and not torch.compiler.is_compiling():
            return self.rope_table.lookup(positions, max(meta.seq_lens_host))
        return K.rope_cos_sin(positions, self.inv_freq, self.attention_scaling, self.dtype)

    def _native_decoder(self, kv_caches: list[KVCache]) -> K.NativeDecoder | None:
        """The layers over ``kv_caches`` as a :class:`pypto_kernels.NativeDecoder`, made at the first decode
        step over these caches; None where it is off or the layers are not all panel-packed (or routed
        experts kept in float), without LoRA, on one rank (the reason logged once per cache)."""
        if not self.native_decoder_enabled:
            return None
        if self._native is None or self._native[0] is not kv_caches:
            self._native = (kv_caches, self._build_native_decoder(kv_caches))
        return self._native[1]

    def drop_native_decoder(self) -> None:
        """Forget the native decoder (it holds the caches it was made over, which are then freed)."""
        self._native = None

    def _build_native_decoder(self, kv_caches: list[KVCache]) -> K.NativeDecoder | None:
        cfg, layers = self.cfg, []
        try:
            for index, (layer, cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
                assert isinstance(layer, QwenDecoderLayer)
                layers.append(self._native_layer(index, layer, cache))
            decoder = K.NativeDecoder(
                layers, heads=_size(self.shards.q_heads), kv_heads=_size(self.shards.kv_heads), head_dim=cfg.head_dim,
                rotary_dim=cfg.rotary_dim, eps=cfg.rms_norm_eps, scale=cfg.head_dim**-0.5,
            )  # fmt: skip
        except ValueError as e:
            logger.info("decode steps run the layers one kernel call at a time: %s", e)
            return None
        logger.info("decode steps run the %d decoder layers as one native call", len(layers))
        return decoder

    def _native_layer(self, index: int, layer: QwenDecoderLayer, cache: KVCache) -> K.DecoderLayerWeights:
        """Layer ``index`` as :class:`pypto_kernels.NativeDecoder` takes it; ValueError: why it cannot."""
        attn, mlp = layer.self_attn, layer.mlp
        if self.shards.ctx.enabled:
            raise ValueError("tensor parallel")
        if attn.lora_qkv is not None or (isinstance(mlp, QwenMLP) and mlp.lora_gate_up is not None):
            raise ValueError("LoRA adapters")
        if attn.o_bias is not None:
            raise ValueError("an o_proj bias")
        qkv, o = attn.qkv_weight, attn.o_weight
        gate_up, down, experts = self._native_mlp(index, mlp)
        if not (isinstance(qkv, K.PackedLinearWeight) and isinstance(o, K.PackedLinearWeight)):
            raise ValueError(f"layer {index} has projections without a packed copy")
        return K.DecoderLayerWeights(
            input_norm=layer.input_norm, post_norm=layer.post_attention_norm, qkv=qkv, qkv_bias=attn.qkv_bias,
            q_norm=attn.q_norm, k_norm=attn.k_norm, o=o, gate_up=gate_up, down=down, key_cache=cache[0],
            value_cache=cache[1], window=attn.sliding_window, experts=experts,
        )  # fmt: skip

    @staticmethod
    def _native_mlp(
        index: int, mlp: QwenMLP | QwenSparseMoe
    ) -> tuple[K.PackedLinearWeight | None, K.PackedLinearWeight | None, K.RoutedExperts | None]:
        """Layer ``index``'s MLP as :class:`pypto_kernels.NativeDecoder` takes it: a dense one's packed
        gate-up and down, or a mixture of experts' routed block; ValueError: why it cannot."""
        if isinstance(mlp, QwenSparseMoe):
            if isinstance(mlp.gate_up, QuantizedWeight) or isinstance(mlp.down, QuantizedWeight):
                raise ValueError(f"layer {index}'s experts are stored quantized")
            return None, None, K.RoutedExperts(mlp.router_weight, mlp.gate_up, mlp.down, mlp.top_k, mlp.norm_topk_prob)
        gate_up, down = mlp.gate_up_weight, mlp.down_weight
        if not (isinstance(gate_up, K.PackedLinearWeight) and isinstance(down, K.PackedLinearWeight)):
            raise ValueError(f"layer {index} has projections without a packed copy")
        return gate_up, down, None

    def takes_maxima(self, rows: int) -> bool:
        """Whether :meth:`logits` of ``rows`` rows takes each row's maximum and its index as the output
        projection writes them (a panels copy on one rank: :func:`pypto_kernels.linear_takes_maxima`)."""
        head = self.lm_head_packed
        return head is not None and self.shards.ctx.world_size == 1 and K.linear_takes_maxima(rows, head)

    def logits(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor,
        maxima: tuple[torch.Tensor, torch.Tensor] | None = None,
        store_logits: bool = True,
    ) -> torch.Tensor:
        """Float32 logits of the rows given: the final norm and the (vocab-sized) output projection,
        only for the sampled rows; each rank's vocabulary slice is gathered into the full rows.
        ``maxima`` (where :meth:`takes_maxima`): float32 and int64 ``[rows]`` tensors, filled with each
        row's ``amax`` and ``argmax`` by the output projection as it writes the logits. ``store_logits``
        False (with ``maxima``): only the maxima are read, and the product may write no logits and
        return ``[rows, 0]`` (:func:`pypto_kernels.linear`)."""
        hidden, _ = K.add_rms_norm(hidden, residual, self.norm, self.cfg.rms_norm_eps)
        if maxima is not None:
            if not self.takes_maxima(hidden.shape[0]):
                raise ValueError(f"this output projection takes no maxima of {hidden.shape[0]} rows")
            assert self.lm_head_packed is not None
            return K.linear(hidden, self.lm_head_packed, float_out=True, maxima=maxima, store_logits=store_logits)
        if self.lm_head_q is not None:
            logits: torch.Tensor = K.quant_linear(hidden, self.lm_head_q)
        elif self.lm_head_packed is not None:
            # Outside the packed row counts this is F.linear over lm_head_t's transpose: the matmul's product.
            # Float32 straight from a bfloat16 panels product (the same values as .float() after it).
            logits = K.linear(hidden, self.lm_head_packed, float_out=True)
        elif self.lm_head_kernel:
            # The reference (and the fast path's fallback) is F.linear over the view: the matmul's product.
            logits = K.linear(hidden, self.lm_head_t.t())
        else:
            logits = torch.matmul(hidden, self.lm_head_t)
        return self.shards.ctx.all_gather(logits.float(), dim=-1)

    def pack_linears(self, batch_rows: int, library: str | None = None, *, tied_head_copy: bool = True) -> int:
        """Give the float projections and the output projection packed copies
        (:func:`pypto_kernels.pack_linear` for a full decode batch of ``batch_rows``; ``library`` None:
        its rule); returns how many matrices got one. CPU only, after loading. The output projection
        and the projections left plain then run :func:`pypto_kernels.linear` (packed, or transposed in
        chunks where its CPU rule says so). ``tied_head_copy`` False leaves a tied output projection
        unpacked (see :meth:`_pack_head`)."""
        packed = pack_projections(self, batch_rows, library)
        self._small_panels_on_huge_pages(packed)
        # Routed experts as panels where the projections got panels (the CPUs where those win).
        panels = any(w.library == "panels" for w in packed)
        experts = sum(m.pack_experts() for m in self.modules() if panels and isinstance(m, QwenSparseMoe))
        self.lm_head_kernel = True
        for module in self.modules():
            if isinstance(module, (QwenAttention, QwenMLP)):
                module.kernel_linear = True
        tied, stored = self.cfg.tie_word_embeddings, self.lm_head_q is not None
        self.lm_head_packed = None if stored or (tied and not tied_head_copy) else self._pack_head(batch_rows, library)
        # An int8 output projection takes oneDNN's prepacked product at every row count (1.1x at one
        # row, 2.2x at 8-64); the decoder's int8 projections keep torch._int_mm, which is faster at one.
        packed_int8 = self.lm_head_q is not None and K.pack_quant_linear(self.lm_head_q)
        return len(packed) + 2 * experts + (self.lm_head_packed is not None) + packed_int8

    @staticmethod
    def _small_panels_on_huge_pages(packed: list[K.PackedLinearWeight]) -> None:
        """The decoder projections' panels under 2 MiB (of ``packed``, in the order a decode step reads
        them) moved into one buffer on huge pages (:func:`pypto_kernels.on_huge_pages`: torch leaves
        such tensors on 4 KiB pages, where a concurrency-1 step reads each cold through a page walk per
        page; larger ones get huge pages from the worker's allocator)."""
        small = [w for w in packed if w.library == "panels" and w.packed.nbytes < K.HUGE_PAGE]
        for w, moved in zip(small, K.on_huge_pages([w.packed for w in small]), strict=True):
            w.packed = moved

    def _pack_head(self, batch_rows: int, library: str | None) -> K.PackedLinearWeight | None:
        """The output projection's packed copy (``library``, or the rule's), or None. An untied head's
        oneDNN or panels copy replaces it (its plain matrix is freed). A tied head is the embedding too,
        so its plain matrix stays and a copy sits beside it: the vocabulary matrix held twice, as vLLM's
        CPU backend holds it; the copy serves calls of :func:`pypto_kernels.tied_head_min_rows` rows or
        more (on an AVX2 CPU one row stays a GEMV on the plain matrix, docs/benchmarks.md, "The output
        projection packed"; a panels copy serves one row too, so a row's logits are the same alone
        and in a batch). Where the native CPU kernels are built, a tied head's matrix is stored
        ``[vocab, hidden]`` instead (see :meth:`_vocab_rows_dense`)."""
        plain, tied = self.lm_head_t.data.t(), self.cfg.tie_word_embeddings
        if library == "mkl":
            return K.pack_linear(plain, batch_rows, library=library)
        rows = K.tied_head_min_rows(plain.dtype) if tied else 1
        head = K.pack_linear(plain, batch_rows, library=library, min_rows=rows, keep_plain=tied)
        if head is not None and head.weight is None:
            self.lm_head_t.data = self.lm_head_t.data.new_empty(0)  # only the packed copy is held
        native_row = plain.dtype in K.native.NATIVE_DTYPES and K.native.library() is not None
        if head is not None and head.weight is not None and native_row:
            head = dataclasses.replace(head, weight=self._vocab_rows_dense())
        return head

    def _vocab_rows_dense(self) -> torch.Tensor:
        """Store the (tied, CPU) output projection ``[vocab, hidden]``, each vocabulary row dense, and
        return that matrix: an embedding lookup (the native greedy run's too) then reads a token's row
        as one run of bytes, and the one-row GEMV beside a oneDNN copy
        (:func:`pypto_kernels.native.gemv`, which read the 151,936-row matrices of the small shape and
        Qwen3-0.6B 1.17-1.30x (float32) and 1.02-1.39x (bfloat16) as fast as oneDNN's packed copy on the
        AVX-512 AMD EPYC, docs/benchmarks.md) streams it row after row. ``lm_head_t`` stays its
        ``[hidden, vocab]`` view, so every other product is unchanged; the packed copy does not depend
        on the layout."""
        dense = self.lm_head_t.data.t().contiguous()
        self.lm_head_t.data = dense.t()
        self.embed = self.lm_head_t.t()  # the old view would keep the old storage alive
        return dense


class _RowDraws:
    """The sampled rows of :meth:`QwenForCausalLM._greedy_rows`: their draws as the C draw takes them."""

    def __init__(self, draws: list[K.SampledRun | None], vocab: int) -> None:
        self.rows = [r for r, d in enumerate(draws) if d is not None]
        picked = [d for d in draws if d is not None]
        self.picked = torch.tensor(self.rows, dtype=torch.int64)
        self.temperature = torch.tensor([d.temperature for d in picked], dtype=torch.float32)
        self.top_k = torch.tensor([d.top_k if 0 < d.top_k < vocab else 0 for d in picked], dtype=torch.int64)
        self.top_p = torch.tensor([d.top_p for d in picked], dtype=torch.float32)
        self.min_p = torch.tensor([d.min_p for d in picked], dtype=torch.float32)
        self.seeds = [d.seed for d in picked]
        self.first = [d.first_index for d in picked]

    def tokens(self, logits: torch.Tensor, argmax: torch.Tensor, forward: int) -> torch.Tensor:
        """Forward ``forward``'s tokens: the greedy rows' argmax, the sampled rows' draws."""
        u = K.native.sample_uniforms(self.seeds, [i + forward for i in self.first])
        drawn = K.native.sample_rows(logits, self.picked, self.temperature, self.top_k, self.top_p, self.min_p, u)
        return argmax.index_copy(0, self.picked, drawn)
