"""Qwen2 / Qwen3 / Qwen3-MoE decoder over the engine's flat token batch.

One forward covers a whole step (prefill chunks and decodes mixed): every token of every request
is a row of a ``[T, hidden]`` matrix, and the only per-request structure lives in the attention
metadata the paged-attention kernel consumes. Projections that HF keeps separate are fused at load
time (q/k/v into one matrix, gate/up into one, experts stacked into ``[E, 2I, H]`` / ``[E, H, I]``)
so each layer is a handful of large matmuls.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import pypto_kernels as K

from .graph import decode_attention, moe_experts, static_decode_attention, write_kv
from .loader import QwenConfig, WeightTarget

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
    # How attention runs: "paged" (any step, eager), or a captured decode step's "host" (lengths from
    # seq_lens_cpu, a host tensor) or "static" (no host lengths at all); see graph.py.
    path: str = "paged"
    seq_lens_cpu: torch.Tensor | None = None  # [R] host copy of seq_lens, for the "host" path


def _param(shape: tuple[int, ...], device: torch.device, dtype: torch.dtype) -> nn.Parameter:
    # Uninitialised on purpose: the loader fills every parameter and fails if one is missing.
    return nn.Parameter(torch.empty(shape, device=device, dtype=dtype), requires_grad=False)


class QwenAttention(nn.Module):
    def __init__(self, cfg: QwenConfig, layer: int, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        qkv = self.q_size + 2 * self.kv_size
        self.qkv_weight = _param((qkv, cfg.hidden_size), device, dtype)
        self.qkv_bias = _param((qkv,), device, dtype) if cfg.qkv_bias else None
        self.o_weight = _param((cfg.hidden_size, self.q_size), device, dtype)
        self.o_bias = _param((cfg.hidden_size,), device, dtype) if cfg.o_bias else None
        self.q_norm = _param((cfg.head_dim,), device, dtype) if cfg.qk_norm else None
        self.k_norm = _param((cfg.head_dim,), device, dtype) if cfg.qk_norm else None
        self.eps = cfg.rms_norm_eps
        self.scale = cfg.head_dim**-0.5
        self.sliding_window = cfg.layer_windows[layer]

    def weight_targets(self, prefix: str) -> dict[str, list[WeightTarget]]:
        q, kv = self.q_size, self.kv_size
        out: dict[str, list[WeightTarget]] = {}
        for part, rows in (("q", slice(0, q)), ("k", slice(q, q + kv)), ("v", slice(q + kv, q + 2 * kv))):
            name = f"{prefix}.{part}_proj.weight"
            out[name] = [WeightTarget(self.qkv_weight.data[rows], (name,))]
            if self.qkv_bias is not None:
                bname = f"{prefix}.{part}_proj.bias"
                out[bname] = [WeightTarget(self.qkv_bias.data[rows], (bname,))]
        out[f"{prefix}.o_proj.weight"] = [WeightTarget(self.o_weight.data, (f"{prefix}.o_proj.weight",))]
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
        qkv = F.linear(x, self.qkv_weight, self.qkv_bias)
        q_end, k_end = self.q_size, self.q_size + self.kv_size
        q = qkv[:, :q_end].reshape(num_tokens, self.num_heads, self.head_dim)
        k = qkv[:, q_end:k_end].reshape(num_tokens, self.num_kv_heads, self.head_dim)
        v = qkv[:, k_end:].reshape(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:  # Qwen3: RMSNorm per head before RoPE
            q = K.rms_norm(q, self.q_norm, self.eps)
            k = K.rms_norm(k, self.k_norm, self.eps)
        q, k = K.apply_rope(q, k, cos, sin)
        out = self._attend(q, k, v, cache, meta)
        return F.linear(out.reshape(num_tokens, self.q_size), self.o_weight, self.o_bias)

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        key_cache, value_cache = cache
        if meta.path == "paged":
            K.write_kv_cache(k, v, key_cache, value_cache, meta.slot_mapping)
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
            )
            return out
        # A captured decode step: ops a compiled graph calls without a break (graph.py).
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
    def __init__(self, hidden: int, intermediate: int, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_weight = _param((2 * intermediate, hidden), device, dtype)
        self.down_weight = _param((hidden, intermediate), device, dtype)

    def weight_targets(self, prefix: str) -> dict[str, list[WeightTarget]]:
        i = self.intermediate
        gate, up, down = (f"{prefix}.{n}_proj.weight" for n in ("gate", "up", "down"))
        return {
            gate: [WeightTarget(self.gate_up_weight.data[:i], (gate,))],
            up: [WeightTarget(self.gate_up_weight.data[i:], (up,))],
            down: [WeightTarget(self.down_weight.data, (down,))],
        }

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(K.silu_and_mul(F.linear(x, self.gate_up_weight)), self.down_weight)


class QwenSparseMoe(nn.Module):
    def __init__(self, cfg: QwenConfig, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        e, i, h = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
        self.num_experts, self.intermediate = e, i
        self.top_k, self.norm_topk_prob = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.router_weight = _param((e, h), device, dtype)
        self.gate_up = _param((e, 2 * i, h), device, dtype)
        self.down = _param((e, h, i), device, dtype)

    def weight_targets(self, prefix: str) -> dict[str, list[WeightTarget]]:
        i = self.intermediate
        router = f"{prefix}.gate.weight"
        out: dict[str, list[WeightTarget]] = {router: [WeightTarget(self.router_weight.data, (router,))]}
        per_expert_gate_up: list[str] = []
        per_expert_down: list[str] = []
        # Released Qwen-MoE checkpoints store one matrix per expert; stack them into [E, 2I, H] / [E, H, I].
        for e in range(self.num_experts):
            gate, up, down = (f"{prefix}.experts.{e}.{n}_proj.weight" for n in ("gate", "up", "down"))
            out[gate] = [WeightTarget(self.gate_up.data[e, :i], (gate,))]
            out[up] = [WeightTarget(self.gate_up.data[e, i:], (up,))]
            out[down] = [WeightTarget(self.down.data[e], (down,))]
            per_expert_gate_up += [gate, up]
            per_expert_down.append(down)
        # transformers' in-memory layout (already stacked) is accepted too and satisfies the same names.
        out[f"{prefix}.experts.gate_up_proj"] = [WeightTarget(self.gate_up.data, tuple(per_expert_gate_up))]
        out[f"{prefix}.experts.down_proj"] = [WeightTarget(self.down.data, tuple(per_expert_down))]
        return out

    def required(self, prefix: str) -> set[str]:
        names = {f"{prefix}.gate.weight"}
        for e in range(self.num_experts):
            names.update(f"{prefix}.experts.{e}.{n}_proj.weight" for n in ("gate", "up", "down"))
        return names

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        router_logits = F.linear(x, self.router_weight)
        weights, ids = K.topk_routing(router_logits, self.top_k, self.norm_topk_prob)
        # A captured decode step calls the kernel as one op (graph.py); eager calls it directly.
        experts = moe_experts if torch.compiler.is_compiling() else K.moe_experts
        out: torch.Tensor = experts(x, self.gate_up, self.down, weights, ids)
        return out


class QwenDecoderLayer(nn.Module):
    def __init__(self, cfg: QwenConfig, layer: int, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = cfg.rms_norm_eps
        self.input_norm = _param((cfg.hidden_size,), device, dtype)
        self.post_attention_norm = _param((cfg.hidden_size,), device, dtype)
        self.self_attn = QwenAttention(cfg, layer, device, dtype)
        self.mlp: QwenMLP | QwenSparseMoe
        if cfg.is_moe_layer(layer):
            self.mlp = QwenSparseMoe(cfg, device, dtype)
        else:
            self.mlp = QwenMLP(cfg.hidden_size, cfg.intermediate_size, device, dtype)

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
    """The full model; parameters are created empty on ``device`` in ``dtype`` and filled by the loader."""

    inv_freq: torch.Tensor

    def __init__(self, cfg: QwenConfig, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.cfg = cfg
        self.dtype = dtype
        # The output projection is stored transposed, [hidden, vocab]: ``hidden @ lm_head_t`` streams it
        # row by row, about 2x faster on the CPU than F.linear over [vocab, hidden] for a few decode
        # rows and 1.2-1.4x for 64 (benchmarks.md). A tied embedding is a [vocab, hidden] view of it.
        self.lm_head_t = _param((cfg.hidden_size, cfg.vocab_size), device, dtype)
        self.embed = (
            self.lm_head_t.t() if cfg.tie_word_embeddings else _param((cfg.vocab_size, cfg.hidden_size), device, dtype)
        )
        self.layers = nn.ModuleList(QwenDecoderLayer(cfg, i, device, dtype) for i in range(cfg.num_layers))
        self.norm = _param((cfg.hidden_size,), device, dtype)
        inv_freq, attention_scaling = K.rope_inv_freq(
            cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings
        )
        self.register_buffer("inv_freq", inv_freq.to(device), persistent=False)
        self.attention_scaling = attention_scaling

    def weight_targets(self) -> tuple[dict[str, list[WeightTarget]], set[str]]:
        """Checkpoint name -> destinations, and the set of names that must be present."""
        out: dict[str, list[WeightTarget]] = {
            "model.embed_tokens.weight": [WeightTarget(self.embed.data, ("model.embed_tokens.weight",))],
            "model.norm.weight": [WeightTarget(self.norm.data, ("model.norm.weight",))],
        }
        if self.cfg.tie_word_embeddings:
            out["lm_head.weight"] = []  # a tied export may still carry a copy; the embedding wins, as in HF
        else:
            out["lm_head.weight"] = [WeightTarget(self.lm_head_t.data.t(), ("lm_head.weight",))]
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

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_caches: list[KVCache],
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """Float32 logits ``[len(logits_indices), vocab]``; writes this step's K/V into ``kv_caches``."""
        hidden, residual = self.hidden_states(input_ids, positions, meta, kv_caches)
        return self.logits(hidden[logits_indices], residual[logits_indices])

    def hidden_states(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, kv_caches: list[KVCache]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The last layer's output and residual for every row (their sum is the final hidden state)."""
        hidden = F.embedding(input_ids, self.embed)
        cos, sin = K.rope_cos_sin(positions, self.inv_freq, self.attention_scaling, self.dtype)
        residual: torch.Tensor | None = None
        for layer, cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(hidden, residual, cos, sin, cache, meta)
        assert residual is not None
        return hidden, residual

    def logits(self, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """Float32 logits of the rows given: the final norm and the (vocab-sized) output projection,
        only for the sampled rows."""
        hidden, _ = K.add_rms_norm(hidden, residual, self.norm, self.cfg.rms_norm_eps)
        return torch.matmul(hidden, self.lm_head_t).float()
