"""Multi-LoRA on DeepSeek-V4 (:mod:`pypto_serving.lora_weights` stacks and reads the adapters).

Adapters may target, in every main-model layer, the attention's projections and their low-rank
parts (transformers' ``self_attn.q_a_proj``, ``q_b_proj``, ``kv_proj``, ``o_b_proj``) and the shared
expert (``mlp.shared_experts.gate_proj``, ``up_proj``, ``down_proj``), the names PEFT gives them on
transformers' ``DeepseekV4ForCausalLM``. Refused, by module: the grouped ``o_a_proj`` (PEFT's LoRA
layer does not run on it: its forward fails, so no PEFT adapter trains it), the compressors' and
the lightning indexer's projections (``self_attn.compressor.*``: a bare ``kv_proj``, ``gate_proj`` or
``q_b_proj`` target also matches them; ``self_attn.kv_proj`` names the attention's only), routed
experts, the router, embeddings and the LM head.

Under tensor parallelism each rank holds its part of every adapter, cut as the base weights are
(:mod:`.sharding`): ``q_b_proj`` (by query head) and the shared expert's ``gate_proj`` / ``up_proj``
(by intermediate row) keep their ``B`` rows of this rank's outputs and all of ``A``; ``o_b_proj`` (by
output group) and the shared ``down_proj`` (by intermediate column) keep their ``A`` columns of this
rank's input and all of ``B``, and their partial deltas join the base's partial outputs before the
layer's all-reduce, so the ranks' sum holds each delta once; the replicated ``q_a_proj`` and
``kv_proj`` keep the whole adapter.

The MTP layers take no adapter: a PEFT adapter of the base model holds no weights for them (they are
not part of transformers' model). Their drafts for an adapter's request are drafted from the main
model's hidden states, which carry the adapter, and only proposals: the main model, adapter applied,
verifies every draft, so greedy output with MTP equals it without.
"""

from __future__ import annotations

import re

import torch

from pypto_serving.lora_weights import LoraAdapter, LoraContext, LoraStack
from pypto_serving.parallel import ParallelContext

from .config import DeepseekV4Config
from .model import Params

__all__ = ["attach_loras", "explain", "lora_shapes", "shard_adapter", "write_lora"]

#: Per projection: the layer parameter it adds to (the stack is stored as ``"lora." + key``) and the
#: PEFT module names of its parts, under ``model.layers.{i}.``.
_STACKS = {
    "attn.wq_a.weight": ("self_attn.q_a_proj",),
    "attn.wq_b.weight": ("self_attn.q_b_proj",),
    "attn.wkv.weight": ("self_attn.kv_proj",),
    "attn.wo_b.weight": ("self_attn.o_b_proj",),
    "shared.gate_up": ("mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj"),
    "ffn.shared_experts.w2.weight": ("mlp.shared_experts.down_proj",),
}
_LAYER = re.compile(r"^model\.layers\.\d+\.")
_ROUTED = re.compile(r"(?:^|\.)(?:experts|gate)(?:\.|$)")  # not shared_experts, gate_proj


def _shapes(cfg: DeepseekV4Config, parallel: ParallelContext | None = None) -> dict[str, tuple[int, int]]:
    """``(out, in)`` of each adaptable projection of one layer, by its name under the layer: the
    checkpoint's, or this rank's part of it (``parallel``)."""
    h, inter = cfg.hidden_size, cfg.moe_intermediate_size
    shapes = {
        "self_attn.q_a_proj": (cfg.q_lora_rank, h),
        "self_attn.q_b_proj": (cfg.num_attention_heads * cfg.head_dim, cfg.q_lora_rank),
        "self_attn.kv_proj": (cfg.head_dim, h),
        "self_attn.o_b_proj": (h, cfg.o_groups * cfg.o_lora_rank),
        "mlp.shared_experts.gate_proj": (inter, h),
        "mlp.shared_experts.up_proj": (inter, h),
        "mlp.shared_experts.down_proj": (h, inter),
    }
    for name, (dim, part) in _cuts(cfg, parallel or ParallelContext()).items():
        out, inp = shapes[name]
        shapes[name] = (part.stop - part.start, inp) if dim == 0 else (out, part.stop - part.start)
    return shapes


def _cuts(cfg: DeepseekV4Config, parallel: ParallelContext) -> dict[str, tuple[int, slice]]:
    """This rank's part of each tensor-parallel projection, by its name under the layer: ``(0, rows)``
    of the output (column-parallel) or ``(1, columns)`` of the input (row-parallel); none on one rank."""
    if not parallel.enabled:
        return {}
    heads = parallel.shard(cfg.num_attention_heads, what="num_attention_heads")
    groups = parallel.shard(cfg.o_groups, what="o_groups")
    inter = parallel.shard(cfg.moe_intermediate_size, what="shared expert intermediate size")
    return {
        "self_attn.q_b_proj": (0, slice(heads.start * cfg.head_dim, heads.stop * cfg.head_dim)),
        "self_attn.o_b_proj": (1, slice(groups.start * cfg.o_lora_rank, groups.stop * cfg.o_lora_rank)),
        "mlp.shared_experts.gate_proj": (0, inter),
        "mlp.shared_experts.up_proj": (0, inter),
        "mlp.shared_experts.down_proj": (1, inter),
    }


def lora_shapes(cfg: DeepseekV4Config) -> dict[str, tuple[int, int]]:
    """``(out, in)`` of every projection an adapter may target, by PEFT module path: the checkpoint's
    (every rank reads the whole adapter, then keeps its part: :func:`shard_adapter`)."""
    one = _shapes(cfg)
    return {f"model.layers.{i}.{name}": shape for i in range(cfg.num_hidden_layers) for name, shape in one.items()}


def shard_adapter(adapter: LoraAdapter, cfg: DeepseekV4Config, parallel: ParallelContext) -> LoraAdapter:
    """This rank's part of ``adapter`` (itself on one rank): a column-parallel projection keeps the
    rows of ``B`` of this rank's outputs, a row-parallel one the columns of ``A`` of its input."""
    cuts = _cuts(cfg, parallel)
    if not cuts:
        return adapter
    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for module, (a, b) in adapter.pairs.items():
        dim, part = cuts.get(_LAYER.sub("", module), (-1, slice(None)))
        if dim == 0:  # B stays column-major (its transpose contiguous), as read_adapter keeps it
            b = b[part].t().contiguous().t()
        elif dim == 1:
            a = a[:, part].contiguous()
        pairs[module] = (a, b)
    return LoraAdapter(adapter.name, adapter.rank, adapter.scale, pairs)


def explain(module: str) -> str | None:
    """Why ``module`` (a PEFT module path, or a target name) takes no adapter, where DeepSeek-V4 has
    a reason."""
    leaf = _LAYER.sub("", module)
    if leaf.endswith("o_a_proj"):
        return "the grouped o_a_proj takes no adapter (PEFT's LoRA layer cannot run on it)"
    if "compressor." in leaf or "indexer." in leaf:
        return (
            "compressor and indexer projections take no adapter (target 'self_attn.kv_proj' or "
            "'self_attn.q_b_proj' to adapt the attention's own)"
        )
    if _ROUTED.search(leaf):
        return "routed experts and the router take no adapter"
    if module.startswith("mtp"):
        return "the MTP layers take no adapter"
    return None


def attach_loras(
    layers: list[Params],
    cfg: DeepseekV4Config,
    adapters: list[LoraAdapter],
    slots: int,
    dtype: torch.dtype,
    device: torch.device,
    parallel: ParallelContext | None = None,
) -> LoraContext:
    """Give every main-model layer's params (``layers``) its LoRA stacks of ``slots`` slots (at least
    one per adapter and the base's), of this rank's widths (``parallel``), and write ``adapters``
    (already cut by :func:`shard_adapter`) into them (slot ``i + 1`` for ``adapters[i]``); returns
    the context whose per-token one-hot selects each token's adapter."""
    slots = max(slots, len(adapters) + 1)
    ctx, one = LoraContext(slots=slots), _shapes(cfg, parallel)
    for i, p in enumerate(layers):
        for key, names in _STACKS.items():
            parts = tuple(f"model.layers.{i}.{n}" for n in names)
            outs = tuple(one[n][0] for n in names)
            p["lora." + key] = LoraStack(parts, outs, one[names[0]][1], ctx, dtype, device, slots)
    for slot, adapter in enumerate(adapters, start=1):
        write_lora(layers, ctx, slot, adapter)
    return ctx


def write_lora(layers: list[Params], ctx: LoraContext, slot: int, adapter: LoraAdapter) -> None:
    """Put ``adapter`` into ``slot`` of every stack (after :func:`attach_loras`); the stacks grow
    together, so ``ctx.slots`` is every stack's slot count."""
    stacks = [v for p in layers for v in p.values() if isinstance(v, LoraStack)]
    for stack in stacks:
        stack.write(slot, adapter)
    ctx.slots = max(stack.slots for stack in stacks)
