"""Which part of each checkpoint tensor a tensor-parallel rank of DeepSeek-V4 holds.

The split follows DeepSeek's reference inference code:

- attention: ``wq_b`` (query heads) and ``attn_sink`` by head, ``wo_a`` by output group (its
  block-diagonal projection keeps a group's heads together) and ``wo_b``'s input columns by the same
  groups, so the attention output is one partial sum per rank that an all-reduce completes. The
  single K=V head (``wkv``, its norm), ``wq_a`` with ``q_norm`` and the compressors are replicated:
  every rank computes the same K=V entries and compressed entries. The lightning indexer's query
  projection (``indexer.wq_b``) and head weights (``indexer.weights_proj``) are split by index head
  as the reference splits them; where the reference all-reduces the heads' summed scores, the ranks
  here gather the heads' queries and weights (the top-k kernel scores and selects in one call), so
  each rank picks the single-rank top-k;
- the MoE: the router (gate, bias, hash table) is replicated; each routed expert's intermediate
  dimension is split (tensor-parallel MoE) or, with ``enable_expert_parallel``, whole experts are
  split over the ranks; the shared expert's intermediate dimension is split; the routed and shared
  partial outputs share one all-reduce;
- the embedding and the LM head by vocabulary rows (vocab-parallel; the logits are all-gathered so
  every rank holds the same full logits);
- hyper-connections, norms and the MTP layers' ``e_proj`` / ``h_proj`` are replicated.

Names are the normalised DeepSeek layout (:func:`.weights.normalise_name`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from pypto_serving.parallel import ParallelContext

from .config import CSA, DeepseekV4Config

_LAYER = re.compile(r"^(?:layers|mtp)\.\d+\.")
_EXPERT = re.compile(r"^ffn\.experts\.(\d+)\.(w[123])\.weight$")
_SHARED = re.compile(r"^ffn\.shared_experts\.(w[123])\.weight$")


@dataclass(frozen=True, slots=True)
class TensorPart:
    """This rank's part of a tensor: ``part`` of dimension ``dim``."""

    dim: int
    part: slice


@dataclass(frozen=True, slots=True)
class ShardPlan:
    """What one rank (``parallel``) holds of a model (``cfg``): its tensor-parallel parts, and the
    MTP layers only when speculation uses them (``with_mtp``)."""

    cfg: DeepseekV4Config
    parallel: ParallelContext
    expert_parallel: bool = False
    with_mtp: bool = True

    def check(self) -> None:
        """Refuse, naming the dimension, a world size that does not divide what this rank splits."""
        cfg, ctx = self.cfg, self.parallel
        ctx.shard(cfg.num_attention_heads, what="num_attention_heads")
        ctx.shard(cfg.o_groups, what="o_groups")
        ctx.shard(cfg.vocab_size, what="vocab_size")
        if any(kind == CSA for kind in cfg.layer_types):
            ctx.shard(cfg.index_n_heads, what="index_n_heads")
        if self.expert_parallel:
            ctx.shard(cfg.n_routed_experts, what="n_routed_experts (expert parallel)")
        else:
            ctx.shard(cfg.moe_intermediate_size, what="moe_intermediate_size")

    @property
    def experts(self) -> range:
        """The routed experts this rank holds."""
        n = self.cfg.n_routed_experts
        if not self.expert_parallel:
            return range(n)
        mine = self.parallel.shard(n, what="n_routed_experts (expert parallel)")
        return range(mine.start, mine.stop)

    def wanted(self, name: str) -> bool:
        """False for another rank's routed expert (expert parallel) and for the MTP layers when
        speculation is off; every other tensor is loaded."""
        if not self.with_mtp and name.startswith("mtp."):
            return False
        m = _EXPERT.match(_LAYER.sub("", name))
        return m is None or int(m.group(1)) in self.experts

    def part_of(self, name: str, shape: list[int]) -> TensorPart | None:
        """This rank's part of tensor ``name`` of ``shape``; ``None`` when it is replicated."""
        if not self.parallel.enabled:
            return None
        leaf = _LAYER.sub("", name)
        if leaf in ("embed.weight", "head.weight"):
            return TensorPart(0, self.parallel.shard(shape[0], what="vocab_size"))
        by_head = self._head_part(leaf)
        if by_head is not None:
            return by_head
        m = _SHARED.match(leaf) or _EXPERT.match(leaf)
        if m is None or (self.expert_parallel and m.re is _EXPERT):
            return None
        # w1 / w3 produce the intermediate dimension (rows), w2 consumes it (columns).
        dim = 1 if m.groups()[-1] == "w2" else 0
        what = "shared expert intermediate size" if m.re is _SHARED else "moe_intermediate_size"
        return TensorPart(dim, self.parallel.shard(shape[dim], what=what))

    def _head_part(self, leaf: str) -> TensorPart | None:
        """The parts split by attention head, index head or output group."""
        cfg, ctx = self.cfg, self.parallel
        if leaf in ("attn.indexer.wq_b.weight", "attn.indexer.weights_proj.weight"):
            h = ctx.shard(cfg.index_n_heads, what="index_n_heads")
            width = cfg.index_head_dim if leaf == "attn.indexer.wq_b.weight" else 1
            return TensorPart(0, slice(h.start * width, h.stop * width))
        if leaf in ("attn.wq_b.weight", "attn.attn_sink"):
            h = ctx.shard(cfg.num_attention_heads, what="num_attention_heads")
            width = cfg.head_dim if leaf == "attn.wq_b.weight" else 1
            return TensorPart(0, slice(h.start * width, h.stop * width))
        if leaf in ("attn.wo_a.weight", "attn.wo_b.weight"):
            g = ctx.shard(cfg.o_groups, what="o_groups")
            rows = slice(g.start * cfg.o_lora_rank, g.stop * cfg.o_lora_rank)
            return TensorPart(0 if leaf == "attn.wo_a.weight" else 1, rows)
        return None
