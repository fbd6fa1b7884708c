"""Tensor- and expert-parallel building blocks shared by the model executors.

A tensor-parallel engine runs one worker process per rank. The worker initialises torch.distributed's
default process group (gloo on the CPU, nccl on CUDA, hccl on Ascend) before it builds the executor,
so an executor finds its place with :meth:`ParallelContext.current` and shards its weights with
:meth:`ParallelContext.shard`. The collectives here are the only communication a model needs:

- a column-parallel linear keeps its output sharded (no communication);
- a row-parallel linear produces a partial sum that :meth:`ParallelContext.all_reduce` completes;
  a row-parallel dynamic-W8A8 linear also takes each token's absmax over the whole row
  (:meth:`ParallelContext.all_reduce_max`, handed to the kernel as
  :attr:`ParallelContext.absmax_reduce`) so every rank quantises its slice with one rank's scale;
- a vocab-parallel embedding looks up the ids its rank owns and all-reduces the rows;
- a vocab-parallel LM head computes its slice of the logits and :meth:`ParallelContext.all_gather`
  concatenates them, so every rank holds the same full logits and samples the same tokens;
- an expert-parallel MoE layer (each rank holds whole experts) sends tokens to the ranks owning
  their experts and the results back with :func:`expert_parallel_moe` (all-to-all dispatch and
  combine).

With one rank every collective is the identity and no process group is needed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

__all__ = ["ExpertFn", "ParallelContext", "dispatch_combine", "expert_parallel_moe", "vocab_parallel_embedding"]


@dataclass(frozen=True, slots=True)
class ParallelContext:
    """Where this process sits in the tensor-parallel group.

    :ivar rank: this process's rank, ``0 <= rank < world_size``.
    :ivar world_size: the number of tensor-parallel ranks (1: no parallelism).
    :ivar group: the process group of the collectives; ``None`` means the default group.
    """

    rank: int = 0
    world_size: int = 1
    group: Any = None

    @classmethod
    def current(cls) -> ParallelContext:
        """The context of the default process group, or a single rank when none is initialised."""
        if not (dist.is_available() and dist.is_initialized()):
            return cls()
        return cls(rank=dist.get_rank(), world_size=dist.get_world_size())

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    def shard(self, size: int, *, what: str = "dimension") -> slice:
        """This rank's contiguous slice of a dimension of ``size`` split evenly over the ranks.

        :raises ValueError: when ``size`` does not divide by the number of ranks (naming ``what``).
        """
        if size % self.world_size:
            raise ValueError(
                f"tensor_parallel_size={self.world_size} does not divide the {what} ({size}); "
                "choose a tensor_parallel_size that divides it"
            )
        part = size // self.world_size
        return slice(self.rank * part, (self.rank + 1) * part)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place; returns ``x``."""
        if self.enabled:
            dist.all_reduce(x, group=self.group)
        return x

    def all_reduce_max(self, x: torch.Tensor) -> torch.Tensor:
        """Element-wise maximum of ``x`` over the ranks, in place; returns ``x``."""
        if self.enabled:
            dist.all_reduce(x, op=dist.ReduceOp.MAX, group=self.group)
        return x

    @property
    def absmax_reduce(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """What a row-parallel dynamic-W8A8 kernel takes as ``reduce_absmax`` (each token's absmax
        over its slice to the whole row's): :meth:`all_reduce_max` with several ranks, None with one,
        so a single rank runs no collective and no extra op."""
        return self.all_reduce_max if self.enabled else None

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's ``x`` along ``dim`` in rank order (all shards have one shape)."""
        if not self.enabled:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)


#: ``(x [N, H], weights [N, k] float32, local_ids [N, k] int64) -> [N, H]``: the weighted sum over k
#: of this rank's experts ``local_ids`` (numbered from 0) applied to ``x``; an id equal to the number
#: of the rank's experts is a route another rank owns, which adds nothing (and should cost nothing).
ExpertFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def vocab_parallel_embedding(ids: torch.Tensor, weight: torch.Tensor, ctx: ParallelContext) -> torch.Tensor:
    """Embedding rows of ``ids`` when each rank holds the rows ``ctx.shard(vocab)`` of the table.

    :param ids: token ids ``[T]`` over the full vocabulary.
    :param weight: this rank's rows of the embedding table, ``[vocab / world_size, hidden]``.
    :return: ``[T, hidden]``, identical on every rank.
    """
    if not ctx.enabled:
        return F.embedding(ids, weight)
    start = ctx.rank * weight.shape[0]
    local = ids - start
    mine = (local >= 0) & (local < weight.shape[0])
    rows = F.embedding(torch.where(mine, local, torch.zeros_like(local)), weight)
    rows = rows * mine.unsqueeze(-1).to(rows.dtype)
    return ctx.all_reduce(rows)


def dispatch_combine(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    local_experts: ExpertFn,
    experts_per_rank: int,
    ctx: ParallelContext,
) -> torch.Tensor:
    """The MoE output of this rank's tokens when rank ``d`` holds experts
    ``d * experts_per_rank ... (d + 1) * experts_per_rank - 1``: all-to-all dispatch, local experts,
    all-to-all combine.

    Every rank passes its own tokens ``x [N, H]`` with their routes (``weights [N, k]``, ``ids [N, k]``
    over all experts); ``N`` must be the same on every rank. Each destination gets a fixed capacity
    of ``N`` token rows, the worst case (all of a token's routes may land on one rank), so the split
    sizes of both ``all_to_all_single`` calls are equal and known without reading any count back to
    the host. A token row goes to every rank at its own index; the routes another rank owns travel
    with weight 0 and the local id ``experts_per_rank`` (one past the rank's experts), which
    ``local_experts`` must treat as dropped: no expert runs for them (``pypto_kernels.moe_experts``
    skips them without a host sync).

    Cost per MoE layer and rank: send and receive buffers of ``world_size x N`` rows of ``H`` (plus
    ``2k`` float32 route values per row) for the dispatch and again for the combine; the experts
    run over the routes this rank owns only. Variable splits would shrink the buffers but need the
    per-destination counts on the host (one sync per layer), which the forward avoids.

    :return: ``[N, H]`` in ``x.dtype``: for each token, the sum over its routes of
        ``weight * expert(x)``, identical (up to summation order) to running every expert locally.
    """
    if not ctx.enabled:
        return local_experts(x, weights, ids)
    world, (num_tokens, hidden), top_k = ctx.world_size, x.shape, ids.shape[1]
    owner = torch.div(ids, experts_per_rank, rounding_mode="floor")
    dests = torch.arange(world, device=ids.device).view(world, 1, 1)
    mine = owner.unsqueeze(0) == dests  # [W, N, k]: which routes each destination owns
    send_w = torch.where(mine, weights.float().unsqueeze(0), 0.0)
    send_ids = torch.where(mine, ids.unsqueeze(0) - dests * experts_per_rank, experts_per_rank)
    # Expert ids stay exact in float32 (below 2**24), so weights and ids share one message.
    send_meta = torch.cat([send_w, send_ids.to(torch.float32)], dim=-1).reshape(world * num_tokens, 2 * top_k)
    send_x = x.unsqueeze(0).expand(world, num_tokens, hidden).reshape(world * num_tokens, hidden)
    recv_x, recv_meta = torch.empty_like(send_x), torch.empty_like(send_meta)
    dist.all_to_all_single(recv_x, send_x.contiguous(), group=ctx.group)
    dist.all_to_all_single(recv_meta, send_meta, group=ctx.group)
    out = local_experts(recv_x, recv_meta[:, :top_k], recv_meta[:, top_k:].to(torch.int64))
    back = torch.empty_like(out)
    dist.all_to_all_single(back, out.contiguous(), group=ctx.group)
    return back.view(world, num_tokens, hidden).sum(dim=0, dtype=torch.float32).to(x.dtype)


def expert_parallel_moe(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    local_experts: ExpertFn,
    num_experts: int,
    ctx: ParallelContext,
) -> torch.Tensor:
    """The MoE output of tokens every rank holds alike (tensor-parallel attention), when each rank
    holds the experts ``ctx.shard(num_experts)``.

    Each rank takes its ``ceil(T / world_size)`` rows of the (zero-padded) batch, runs
    :func:`dispatch_combine` on them, and an all-gather gives every rank every row again, so no
    rank computes another rank's tokens' routes to its own experts twice.

    What it costs against tensor-parallel MoE (every expert split, one all-reduce): each rank holds
    ``1 / world_size`` of the experts as whole matrices (bigger, better-shaped matmuls) and runs them
    over the routes it owns only (the ranks together do the expert FLOPs of one rank running every
    expert), but each rank sends about ``3 x T x H`` values per layer (dispatch, combine,
    all-gather) where a ring all-reduce sends about ``2 x T x H``.

    :param x: ``[T, H]`` hidden states, identical on every rank.
    :param weights: ``[T, k]`` routing weights (the router is replicated, so identical too).
    :param ids: ``[T, k]`` expert ids over all ``num_experts`` experts.
    :param local_experts: this rank's experts (:data:`ExpertFn`), numbered from 0.
    :raises ValueError: ``num_experts`` does not divide by the number of ranks.
    :return: ``[T, H]`` in ``x.dtype``, identical on every rank.
    """
    mine = ctx.shard(num_experts, what="number of experts (expert parallel)")
    if not ctx.enabled:
        return local_experts(x, weights, ids)
    num_tokens = x.shape[0]
    chunk = -(-num_tokens // ctx.world_size)
    pad = chunk * ctx.world_size - num_tokens
    if pad:
        x = F.pad(x, (0, 0, 0, pad))
        # Padding rows route to no rank's experts (id ``num_experts``), so no expert runs for them.
        weights, ids = F.pad(weights, (0, 0, 0, pad)), F.pad(ids, (0, 0, 0, pad), value=num_experts)
    rows = slice(ctx.rank * chunk, (ctx.rank + 1) * chunk)
    part = dispatch_combine(x[rows], weights[rows], ids[rows], local_experts, mine.stop - mine.start, ctx)
    return ctx.all_gather(part, dim=0)[:num_tokens]
