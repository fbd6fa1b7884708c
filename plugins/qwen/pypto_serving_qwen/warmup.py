"""The CPU warm-up steps :class:`~pypto_serving_qwen.executor.QwenExecutor` runs over fresh caches.

A spawned CPU worker's glibc keeps freed memory for reuse (``worker_heap_reuse``) and torch puts
tensors of 2 MiB and more on transparent huge pages (``worker_huge_pages``): a step's buffers then
cost nothing once the heap has grown to hold them, but growing it faults huge pages in, which the
kernel compacts memory for. The first 64-prompt batch after start-up spent about a second so on the
small shape (its prefill and first decode steps 3-10x their later time, the worker growing by about
200 MB; docs/benchmarks.md). A prefill step of the most tokens a step computes and two decode steps
of the most rows, run at start-up as vLLM's CPU runner runs its profile step, grow it then.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pypto_serving import BatchInput

__all__ = ["WarmupPlan", "warmup_batches", "warmup_plan"]


@dataclass(frozen=True, slots=True)
class WarmupPlan:
    """``requests`` requests of ``prompt`` tokens, request ``i`` in blocks ``i * blocks .. (i + 1) *
    blocks - 1``: a prefill step of ``requests * prompt`` tokens, then two decode steps."""

    requests: int
    prompt: int
    blocks: int

    @property
    def used_blocks(self) -> int:
        return self.requests * self.blocks


def warmup_plan(num_blocks: int, block_size: int, max_tokens: int, max_rows: int) -> WarmupPlan | None:
    """The largest warm-up the caches hold: ``max_rows`` requests (fewer where there are fewer
    blocks) sharing ``max_tokens`` prompt tokens, each leaving room for two more; None when a
    request's blocks cannot hold three tokens."""
    requests = min(max_rows, num_blocks)
    if requests < 1:
        return None
    blocks = num_blocks // requests
    prompt = min(max(max_tokens // requests, 1), blocks * block_size - 2)
    return WarmupPlan(requests, prompt, blocks) if prompt >= 1 else None


def warmup_batches(plan: WarmupPlan, block_size: int, vocab_size: int, group: str) -> list[BatchInput]:
    """The plan's three steps as CPU :class:`BatchInput` (cache group ``group``): token ids cycle
    through the vocabulary, every request's last row is a logits row."""
    r, p = plan.requests, plan.prompt
    tables = torch.arange(r * plan.blocks, dtype=torch.int32).view(r, plan.blocks)
    steps = [_step(plan, tables, block_size, vocab_size, group, start=0, length=p)]
    steps += [_step(plan, tables, block_size, vocab_size, group, start=p + i, length=1) for i in range(2)]
    return steps


def _step(
    plan: WarmupPlan, tables: torch.Tensor, block_size: int, vocab_size: int, group: str, *, start: int, length: int
) -> BatchInput:
    """Every request's positions ``start .. start + length - 1``."""
    r = plan.requests
    positions = torch.arange(start, start + length, dtype=torch.int64).repeat(r)
    owner = torch.arange(r, dtype=torch.int64).repeat_interleave(length)
    slots = tables.long()[owner, positions // block_size] * block_size + positions % block_size
    input_ids = (torch.arange(r * length, dtype=torch.int64) + start) % vocab_size
    qsl = [i * length for i in range(r + 1)]
    lens = [start + length] * r
    return BatchInput(
        request_ids=[f"warmup-{i}" for i in range(r)],
        input_ids=input_ids,
        positions=positions,
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_tables={group: tables},
        slot_mapping={group: slots},
        logits_indices=torch.tensor(qsl[1:], dtype=torch.int64) - 1,
        num_logits=[1] * r,
        query_start_loc_host=qsl,
        seq_lens_host=lens,
        input_ids_host=input_ids.tolist(),
    )
