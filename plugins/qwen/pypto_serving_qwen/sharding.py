"""Which part of each Qwen weight a tensor-parallel rank holds.

- attention: q/k/v are column-parallel by head, o_proj row-parallel by the same query heads (one
  all-reduce). With fewer KV heads than ranks, each KV head is replicated on the ranks whose query
  heads read it (the world size must then be a multiple of the KV heads); each rank's KV cache holds
  only its KV heads;
- dense MLP: gate/up column-parallel, down_proj row-parallel over the intermediate dimension (one
  all-reduce);
- MoE: the router is replicated; by default every expert's intermediate dimension is split
  (tensor-parallel MoE, one all-reduce); with ``enable_expert_parallel`` whole experts are split over
  the ranks and tokens travel by all-to-all (:func:`pypto_serving.parallel.expert_parallel_moe`);
- the embedding and the LM head by vocabulary rows (tied or not); the logits are all-gathered so every
  rank holds the same full logits;
- norms (including the per-head q/k norms) are replicated.

A dimension the world size does not divide is refused, naming it.
"""

from __future__ import annotations

from dataclasses import dataclass

from pypto_serving.parallel import ParallelContext

from .loader import QwenConfig

__all__ = ["QwenSharding"]


@dataclass(frozen=True, slots=True)
class QwenSharding:
    """This rank's ranges (global indices) of every dimension the Qwen model splits.

    :ivar ctx: the rank and world of the collectives.
    :ivar q_heads: the query heads (and o_proj input columns, in heads) of this rank.
    :ivar kv_heads: the KV heads this rank holds (all its query heads read one of them).
    :ivar intermediate: the dense MLP's intermediate rows.
    :ivar moe_intermediate: every expert's intermediate rows (all of them under expert parallel).
    :ivar experts: the experts this rank holds (all of them under tensor-parallel MoE).
    :ivar vocab: the embedding and LM head rows.
    :ivar expert_parallel: whole experts per rank (all-to-all) instead of split experts.
    """

    ctx: ParallelContext
    q_heads: slice
    kv_heads: slice
    intermediate: slice
    moe_intermediate: slice
    experts: slice
    vocab: slice
    expert_parallel: bool = False

    @classmethod
    def single(cls, cfg: QwenConfig) -> QwenSharding:
        """Everything on one rank."""
        return cls.plan(cfg, ParallelContext(), expert_parallel=False)

    @classmethod
    def plan(cls, cfg: QwenConfig, ctx: ParallelContext, *, expert_parallel: bool) -> QwenSharding:
        """The layout of rank ``ctx.rank``.

        :raises ValueError: the world size does not divide a split dimension (the message names it),
            or there are fewer KV heads than ranks and the ranks are not a multiple of them.
        """
        moe = cfg.num_experts > 0
        ep = moe and expert_parallel and ctx.enabled
        return cls(
            ctx=ctx,
            q_heads=ctx.shard(cfg.num_heads, what="num_attention_heads"),
            kv_heads=_kv_heads(cfg, ctx),
            intermediate=ctx.shard(cfg.intermediate_size, what="intermediate_size"),
            moe_intermediate=(
                slice(0, cfg.moe_intermediate_size)
                if ep or not moe
                else ctx.shard(cfg.moe_intermediate_size, what="moe_intermediate_size")
            ),
            experts=(
                ctx.shard(cfg.num_experts, what="num_experts (expert parallel)") if ep else slice(0, cfg.num_experts)
            ),
            vocab=ctx.shard(cfg.vocab_size, what="vocab_size"),
            expert_parallel=ep,
        )


def _kv_heads(cfg: QwenConfig, ctx: ParallelContext) -> slice:
    world = ctx.world_size
    if cfg.num_kv_heads >= world:
        return ctx.shard(cfg.num_kv_heads, what="num_key_value_heads")
    if world % cfg.num_kv_heads:
        raise ValueError(
            f"tensor_parallel_size={world} is larger than num_key_value_heads ({cfg.num_kv_heads}) but not a "
            "multiple of it, so the ranks' query heads cannot each read one whole KV head; choose a "
            "tensor_parallel_size that divides num_key_value_heads or is a multiple of it"
        )
    group = cfg.num_heads // cfg.num_kv_heads
    first = ctx.shard(cfg.num_heads, what="num_attention_heads").start // group
    return slice(first, first + 1)
