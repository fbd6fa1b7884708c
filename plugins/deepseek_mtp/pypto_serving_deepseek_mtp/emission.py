"""Compressed-entry emission for a whole batch: one host-built plan per step and layer kind.

An entry ``w`` of a compressor with rate ``m`` pools source tokens ``[w*m, (w+1)*m)`` (plus the
window before it, ``[(w-1)*m, w*m)``, with overlap). Its sources live either in the request's
compressor ring (tokens of earlier steps, row ``slot * ring_len + pos % ring_len``) or in this
step's projections (batch row ``t``). Both sit in one source tensor, the flat ring followed by this
step's rows, so each layer gathers every emitted entry's sources with one index tensor, however
many requests and entries the step holds; the plan's index tensors are built once per step from
the host lists (no device read).

The gathered blocks are laid out for :func:`pypto_kernels.compressor_pool` as one sequence of
complete windows. Without overlap block ``j`` is entry ``j``'s window. With overlap the kernel pools
the first-half channels of block ``j`` with the second-half channels of block ``j + 1``, so block
``j`` carries entry ``j``'s previous window in its first half and entry ``j - 1``'s own window in its
second half; entry 0 of a request has no previous window and those slots get zero weight.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from pypto_kernels import upload


@dataclass(slots=True, frozen=True)
class EmitShape:
    """The compressor geometry a plan is built for."""

    rate: int
    overlap: bool
    ring_len: int
    ring_rows: int  # rows of the flat ring (slots * ring_len); this step's rows follow them
    snapshot_every: int = 0  # positions between compressor-state snapshots (0: none are kept)


@dataclass(slots=True)
class Emitted:
    """The entries one step emits: where their sources are and where they go."""

    first: torch.Tensor  # [blocks, rate] source rows (first-half channels with overlap)
    second: torch.Tensor | None  # [blocks, rate] second-half channel sources (overlap only)
    missing: torch.Tensor | None  # [blocks, 1, 1] True where the first half is window -1 (overlap only)
    req: torch.Tensor  # [E] request of each entry
    w: torch.Tensor  # [E] entry index within its request
    rope: tuple[torch.Tensor, torch.Tensor] | None = None  # RoPE of the entries, at position w * rate
    slots: dict[str, torch.Tensor] = field(default_factory=dict)  # cache group -> entries' flat slots

    def gather(self, src: torch.Tensor, fill: float) -> torch.Tensor:
        """The pooling input ``[blocks * rate, W]`` from ``src`` (flat ring then batch rows);
        ``fill`` goes into window -1's slots."""
        width = src.shape[-1]
        out = src[self.first]
        if self.second is not None:
            half = width // 2
            prev = out[..., :half]
            if self.missing is not None:
                prev = prev.masked_fill(self.missing, fill)
            out = torch.cat([prev, src[self.second][..., half:]], dim=-1)
        return out.reshape(-1, width)

    def cache_slots(self, group: str, block_tables: torch.Tensor, block_size: int) -> torch.Tensor:
        """Flat cache slots of the entries in ``group``'s paged cache (computed once per group)."""
        got = self.slots.get(group)
        if got is None:
            blocks = block_tables[self.req, self.w // block_size].long()
            got = self.slots[group] = blocks * block_size + self.w % block_size
        return got


@dataclass(slots=True)
class EmitPlan:
    """One step's emission for every layer of one kind: the entries (None when no window closes)
    and the batch rows recorded in the rings."""

    rate: int
    overlap: bool
    entries: Emitted | None
    ring_src: torch.Tensor | None  # batch rows recorded in the rings (None: all, in order)
    ring_dst: torch.Tensor  # their flat ring rows
    snapshots: Snapshots | None = None  # the compressor-state snapshots this step writes


@dataclass(slots=True)
class Snapshots:
    """Compressor-state snapshots a step writes: at each multiple ``E`` of ``snapshot_every`` that a
    request's rows reach, the source rows of positions ``[E - rate, E)`` (what the entry after ``E``
    reads from before it), so a prefix-cache hit at ``E`` can restart the compressor exactly. Snapshot
    ``j`` (``E = (j + 1) * snapshot_every``) goes to entry ``j`` of the request's state table."""

    src: torch.Tensor  # [S * rate] rows of the source tensor (flat ring then batch rows)
    req: torch.Tensor  # [S] request of each snapshot
    index: torch.Tensor  # [S] its table entry j


def build_emit_plan(
    shape: EmitShape, starts: list[int], pos0: list[int], ring_slots: list[int], device: torch.device
) -> EmitPlan:
    """The plan of one step: requests ``r`` hold batch rows ``[starts[r], starts[r + 1])`` at positions
    from ``pos0[r]`` and own compressor ring slot ``ring_slots[r]``."""
    m, ring_len = shape.rate, shape.ring_len
    prev: list[list[int]] = []
    cur: list[list[int]] = []
    missing: list[bool] = []
    entries: list[tuple[int, int]] = []
    ring_src: list[int] = []
    ring_dst: list[int] = []
    snaps: tuple[list[int], list[int], list[int]] = ([], [], [])
    for r, (a, b) in enumerate(itertools.pairwise(starts)):
        p0, slot = pos0[r], ring_slots[r]

        def row(pos: int, a: int = a, p0: int = p0, slot: int = slot) -> int:
            return shape.ring_rows + a + pos - p0 if pos >= p0 else slot * ring_len + pos % ring_len

        for w in range(p0 // m, (p0 + b - a) // m):
            cur.append([row(w * m + i) for i in range(m)])
            prev.append([row((w - 1) * m + i) if w > 0 else 0 for i in range(m)])
            missing.append(w == 0)
            entries.append((r, w))
        every = shape.snapshot_every
        for end in range((p0 // every + 1) * every, p0 + b - a + 1, every) if every else ():
            snaps[0].extend(row(pos) for pos in range(end - m, end))
            snaps[1].append(r)
            snaps[2].append(end // every - 1)
        # Only a request's last ring_len rows can be read again; older ones would collide in the ring.
        keep = max(a, b - ring_len)
        ring_src += range(keep, b)
        ring_dst += [slot * ring_len + (p0 + t - a) % ring_len for t in range(keep, b)]
    plan = _upload(shape, prev, cur, missing, entries, (ring_src, ring_dst, starts[-1]), device)
    if snaps[1]:
        src, req, index = (upload(x, device, torch.long) for x in snaps)
        plan.snapshots = Snapshots(src=src, req=req, index=index)
    return plan


def _upload(
    shape: EmitShape,
    prev: list[list[int]],
    cur: list[list[int]],
    missing: list[bool],
    entries: list[tuple[int, int]],
    ring: tuple[list[int], list[int], int],
    device: torch.device,
) -> EmitPlan:
    """The plan's host lists as device index tensors, laid out as the module docstring describes."""
    m = shape.rate
    ring_src, ring_dst, num_rows = ring

    def idx(x: Sequence[Any]) -> torch.Tensor:
        return upload(x, device, torch.long)

    emitted = None
    if entries:
        second, miss = None, None
        if shape.overlap:
            first, second = idx([*prev, [0] * m]), idx([[0] * m, *cur])
            if any(missing):
                miss = upload([*missing, True], device).view(-1, 1, 1)
        else:
            first = idx(cur).view(-1, m)
        emitted = Emitted(
            first=first, second=second, missing=miss, req=idx([r for r, _ in entries]), w=idx([w for _, w in entries])
        )
    return EmitPlan(
        rate=m,
        overlap=shape.overlap,
        entries=emitted,
        ring_src=None if ring_src == list(range(num_rows)) else idx(ring_src),
        ring_dst=idx(ring_dst),
    )
