"""Tensor- and expert-parallel building blocks shared by the model executors.

A tensor-parallel engine runs one worker process per rank. The worker initialises torch.distributed's
default process group (gloo on the CPU, nccl on CUDA, hccl on Ascend) before it builds the executor,
so an executor finds its place with :meth:`ParallelContext.current` and shards its weights with
:meth:`ParallelContext.shard`. The collectives here are the only communication a model needs:

- a column-parallel linear keeps its output sharded (no communication);
- a row-parallel linear produces a partial sum that :meth:`ParallelContext.all_reduce` completes;
- a vocab-parallel embedding looks up the ids its rank owns and all-reduces the rows;
- a vocab-parallel LM head computes its slice of the logits and :meth:`ParallelContext.all_gather`
  concatenates them, so every rank holds the same full logits and samples the same tokens.

With one rank every collective is the identity and no process group is needed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

__all__ = ["ParallelContext", "vocab_parallel_embedding"]


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

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's ``x`` along ``dim`` in rank order (all shards have one shape)."""
        if not self.enabled:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)


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
