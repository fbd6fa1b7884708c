"""The worker's row allocator and block tables: one row per request the worker holds, kept across steps.

Each step message carries only what changed (requests entering, requests leaving, blocks appended),
so the rows change by diffs too: :meth:`InputBatch.add` takes the next free row, :meth:`InputBatch.remove`
moves the last row into the hole (rows stay dense, ``0 .. num_rows``), and :meth:`InputBatch.append_blocks`
writes appended block ids into the group's table, which lives on the executor's device and is only ever
written where it changed. A step then gathers its tables by row instead of rebuilding them.

Host-side bookkeeping (block counts per row, the step's positions) is numpy rather than torch:
numpy reads cost no dispatch, and under a fake device mode (tests) torch host tensors hold no data.
Everything a step sends to the device goes in one packed int64 upload (:class:`Staging`), from
pinned memory and without blocking where the device is a real accelerator. On the CPU there is no
upload: a step's tensors are numpy arrays computed over the tables' own memory and handed to torch
without a copy (``host_tables``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import torch

from .executor import CacheGroupSpec

__all__ = ["GroupTable", "InputBatch", "Staging", "StepArrays", "StepTensors"]

IntArray = npt.NDArray[np.int64]


class Staging:
    """Packs host int64 arrays into one buffer and sends it to ``device`` in one copy.

    On a CUDA device the buffer is pinned and reused, and the copy does not block; an event recorded
    after the copy guards the next overwrite. Elsewhere each send packs into a fresh array (on the
    CPU the "copy" is the array itself, so a reused buffer would alias earlier batches)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pinned = device.type == "cuda" and torch.cuda.is_available()
        self._buf: torch.Tensor | None = None
        self._event: torch.cuda.Event | None = None

    def send(self, parts: list[IntArray]) -> list[torch.Tensor]:
        """``parts`` on the device, as views of one uploaded tensor, in order."""
        sizes = [len(p) for p in parts]
        total = sum(sizes)
        if self.pinned:
            host = self._pinned(total)
            if parts:
                np.concatenate(parts, out=host.numpy())
            out = host.to(self.device, non_blocking=True)
            self._event = torch.cuda.current_stream().record_event()
        else:
            packed = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
            out = torch.from_numpy(packed).to(self.device, non_blocking=True)
        return list(out.split_with_sizes(sizes))

    def _pinned(self, total: int) -> torch.Tensor:
        if self._event is not None:
            self._event.synchronize()  # the previous copy still reads the buffer
        if self._buf is None or self._buf.numel() < total:
            size = max(total, 2 * (self._buf.numel() if self._buf is not None else 0), 1024)
            self._buf = torch.empty(size, dtype=torch.int64, pin_memory=True)
        return self._buf.narrow(0, 0, total)


class GroupTable:
    """One cache group's block tables: ``[capacity, max_blocks]`` int32 on the device, rows padded with 0."""

    def __init__(self, spec: CacheGroupSpec, rows: int, max_blocks: int, device: torch.device, host: bool) -> None:
        self.spec = spec
        self.device = device
        # ``host`` (a CPU table): its memory as numpy too, where a step's gathers and writes need no torch dispatch.
        self.host: npt.NDArray[np.int32] | None = None
        self.table = self._zeros(rows, max(1, max_blocks), host)
        self.num_blocks = np.zeros(rows, dtype=np.int64)
        # Appended (row, column, block) triples the device table does not hold yet.
        self._rows: list[int] = []
        self._cols: list[int] = []
        self._blocks: list[int] = []

    def append(self, row: int, blocks: list[int]) -> None:
        if min(blocks, default=0) < 0:
            # A window group's blocks freed before they were sent (a prefix hit past the window) are
            # never read; 0 keeps every entry a valid block id for kernels that load before masking.
            blocks = [max(b, 0) for b in blocks]
        n = int(self.num_blocks[row])
        if n + len(blocks) > self.table.shape[1]:
            self._grow(self.table.shape[0], max(n + len(blocks), 2 * self.table.shape[1]))
        self._rows += [row] * len(blocks)
        self._cols += range(n, n + len(blocks))
        self._blocks += blocks
        self.num_blocks[row] = n + len(blocks)

    def pending(self) -> list[IntArray]:
        """The appends not on the device yet, as (rows, columns, blocks), and forget them."""
        out = [np.array(v, dtype=np.int64) for v in (self._rows, self._cols, self._blocks)]
        self._rows, self._cols, self._blocks = [], [], []
        return out

    def has_pending(self) -> bool:
        return bool(self._rows)

    def write(self, rows: torch.Tensor, cols: torch.Tensor, blocks: torch.Tensor) -> None:
        if rows.numel():
            self.table.index_put_((rows, cols), blocks.to(torch.int32))

    def write_host(self) -> None:
        """The pending appends written straight into :attr:`host` (a CPU table)."""
        assert self.host is not None
        if self._rows:
            self.host[self._rows, self._cols] = self._blocks
            self._rows, self._cols, self._blocks = [], [], []

    def compact(self, moves: list[tuple[int, int]], old_rows: int, new_rows: int, staging: Staging) -> None:
        """Copy row ``src`` to row ``dst`` for each move, then clear rows ``new_rows .. old_rows``."""
        if moves:
            dst, src = staging.send([np.array(m, dtype=np.int64) for m in zip(*moves)])
            self.table.index_copy_(0, dst, self.table.index_select(0, src))
            for d, s in moves:
                self.num_blocks[d] = self.num_blocks[s]
        if old_rows > new_rows:
            self.table.narrow(0, new_rows, old_rows - new_rows).zero_()
            self.num_blocks[new_rows:old_rows] = 0

    def _grow(self, rows: int, cols: int) -> None:
        old = self.table
        self.table = self._zeros(rows, cols, self.host is not None)
        self.table.narrow(0, 0, old.shape[0]).narrow(1, 0, old.shape[1]).copy_(old)
        if rows > len(self.num_blocks):
            self.num_blocks = np.concatenate([self.num_blocks, np.zeros(rows - len(self.num_blocks), np.int64)])

    def _zeros(self, rows: int, cols: int, host: bool) -> torch.Tensor:
        """A zeroed ``[rows, cols]`` int32 table; ``host``: over a numpy array kept as :attr:`host`."""
        if not host:
            return torch.zeros(rows, cols, dtype=torch.int32, device=self.device)
        self.host = np.zeros((rows, cols), dtype=np.int32)
        return torch.from_numpy(self.host)

    def grow_rows(self, rows: int) -> None:
        self._grow(rows, self.table.shape[1])


@dataclass(slots=True, kw_only=True)
class StepArrays:
    """A step's batch on the host: rows and token counts per entry, the tokens laid end to end."""

    rows: IntArray  # [R] batch row of each entry
    starts: IntArray  # [R] position of each entry's first token
    query_lens: IntArray  # [R]
    num_logits: IntArray  # [R] sampled rows: the last of each entry's rows
    input_ids: IntArray  # [T]
    num_prompt_logits: IntArray | None = None  # [R] rows for prompt logprobs: the first of each entry's rows
    # Every entry is one token, sampled, with no prompt logprobs rows (a plain decode step): its
    # rows' token and logits indices are 0 .. R - 1, so no per-entry expansion is computed.
    one_token_each: bool = False


@dataclass(slots=True, kw_only=True)
class StepTensors:
    """What :meth:`InputBatch.prepare` puts on the device, with the host lists the executor gets."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    logits_indices: torch.Tensor
    block_tables: dict[str, torch.Tensor]
    slot_mapping: dict[str, torch.Tensor]
    query_start_loc_host: list[int]
    seq_lens_host: list[int]


class InputBatch:
    """The worker's row allocator: a dense row per request it holds and the device block tables.

    Everything else the worker keeps of a request is its
    :class:`~pypto_serving.runner.WorkerRequest`; a row is only where the request's block tables
    lie on the device (and where a step gathers them from)."""

    def __init__(
        self,
        *,
        groups: list[CacheGroupSpec],
        max_model_len: int,
        device: torch.device,
        rows: int = 16,
        host_tables: bool | None = None,
    ) -> None:
        """``host_tables``: steps are built in numpy over the tables' memory (:meth:`prepare`); None:
        where the device is the CPU, the only device whose memory numpy can address."""
        self.device = device
        self.host_tables = device.type == "cpu" if host_tables is None else host_tables
        if self.host_tables and device.type != "cpu":
            raise ValueError(f"host_tables needs the tables in CPU memory, not on {device}")
        self.staging = Staging(device)
        self.capacity = max(1, rows)
        self.request_ids: list[str] = []  # row -> request id
        self.row_of: dict[str, int] = {}
        self.tables = {
            g.name: GroupTable(g, self.capacity, -(-max_model_len // g.tokens_per_block), device, self.host_tables)
            for g in groups
        }

    @property
    def num_rows(self) -> int:
        return len(self.request_ids)

    # ------------------------------------------------------------------ diffs
    def add(self, request_id: str) -> int:
        """A row for a request entering the worker (a request already here is replaced)."""
        if request_id in self.row_of:
            self.remove([request_id])
        if self.num_rows == self.capacity:
            self._grow(2 * self.capacity)
        row = self.num_rows
        self.request_ids.append(request_id)
        self.row_of[request_id] = row
        return row

    def remove(self, request_ids: list[str]) -> None:
        """Drop the rows of ``request_ids`` (unknown ids are ignored), moving the last row into each hole."""
        old = self.num_rows
        where = list(range(old))  # where each row's table data lies on the device
        for rid in request_ids:
            row = self.row_of.pop(rid, None)
            if row is None:
                continue
            last = self.num_rows - 1
            moved = self.request_ids.pop()
            if row != last:
                self.request_ids[row] = moved
                self.row_of[moved] = row
                where[row] = where[last]
            where.pop()
        new = self.num_rows
        if new == old:
            return
        for table in self.tables.values():
            self._flush(table)
            table.compact([(d, s) for d, s in enumerate(where) if d != s], old, new, self.staging)

    def append_blocks(self, row: int, new_block_ids: dict[str, list[int]]) -> None:
        """Blocks appended to row ``row``'s tables, per cache group."""
        for group, blocks in new_block_ids.items():
            if blocks:
                self.tables[group].append(row, blocks)

    def block_ids(self, request_id: str, group: str) -> list[int]:
        """A request's block ids of ``group`` (reads the device table: for tests and debugging)."""
        table = self.tables[group]
        self._flush(table)
        row = self.row_of[request_id]
        return [int(b) for b in table.table[row, : int(table.num_blocks[row])].tolist()]

    # ------------------------------------------------------------------ the step
    def prepare(self, step: StepArrays) -> StepTensors:
        """The step's tensors on the device, in one upload: pending block appends are written first."""
        if self.host_tables:
            return self._prepare_host(step)
        qsl, positions, logits_idx, row_of_token = _token_layout(step)
        seq_lens = step.starts + step.query_lens
        parts = [step.input_ids, positions, qsl, seq_lens, logits_idx, step.rows]
        slot_groups = [t for t in self.tables.values() if t.spec.tokens_per_entry == 1]
        for t in slot_groups:
            bs, entries = t.spec.block_size, positions + t.spec.slot_shift  # a shifted group's entry index
            parts += [row_of_token * t.table.shape[1] + entries // bs, entries % bs]
        for t in self.tables.values():
            parts += t.pending()
        dev = self.staging.send(parts)
        ids, pos, qsl_d, seq_d, lidx, rows = dev[:6]
        rest = dev[6 + 2 * len(slot_groups) :]
        for i, t in enumerate(self.tables.values()):
            t.write(*rest[3 * i : 3 * i + 3])
        slots: dict[str, torch.Tensor] = {}
        for i, t in enumerate(slot_groups):
            flat_idx, offset = dev[6 + 2 * i], dev[7 + 2 * i]
            blk = t.table.view(-1).index_select(0, flat_idx).long()
            slots[t.spec.name] = blk * t.spec.block_size + offset
        tables = {}
        for name, t in self.tables.items():
            width = max(1, int(t.num_blocks[step.rows].max(initial=0)))
            # Narrow first: the gathered table comes out contiguous, as kernels expect.
            tables[name] = t.table.narrow(1, 0, width).index_select(0, rows)
        return StepTensors(
            input_ids=ids,
            positions=pos,
            query_start_loc=qsl_d.to(torch.int32),
            seq_lens=seq_d.to(torch.int32),
            logits_indices=lidx,
            block_tables=tables,
            slot_mapping=slots,
            query_start_loc_host=qsl.tolist(),
            seq_lens_host=seq_lens.tolist(),
        )

    def _prepare_host(self, step: StepArrays) -> StepTensors:
        """:meth:`prepare` on the CPU, where the tables are host memory: the same tensors computed in
        numpy and handed to torch without a copy. A step then costs a few numpy calls instead of a
        dozen torch dispatches, which matters most at concurrency 1, where the output projection
        streamed before it leaves the caches cold (the torch path took 3x its warm time there)."""
        qsl, positions, logits_idx, row_of_token = _token_layout(step)
        seq_lens = step.starts + step.query_lens
        slots: dict[str, torch.Tensor] = {}
        tables: dict[str, torch.Tensor] = {}
        for name, t in self.tables.items():
            assert t.host is not None
            t.write_host()
            if t.spec.tokens_per_entry == 1:
                bs, entries = t.spec.block_size, positions + t.spec.slot_shift  # a shifted group's entry index
                blk = t.host[row_of_token, entries // bs].astype(np.int64)
                slots[name] = torch.from_numpy(blk * bs + entries % bs)
            width = max(1, int(t.num_blocks[step.rows].max(initial=0)))
            tables[name] = torch.from_numpy(np.ascontiguousarray(t.host[step.rows, :width]))
        return StepTensors(
            input_ids=torch.from_numpy(step.input_ids),
            positions=torch.from_numpy(positions),
            query_start_loc=torch.from_numpy(qsl.astype(np.int32)),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)),
            logits_indices=torch.from_numpy(logits_idx),
            block_tables=tables,
            slot_mapping=slots,
            query_start_loc_host=qsl.tolist(),
            seq_lens_host=seq_lens.tolist(),
        )

    # ------------------------------------------------------------------ internals
    def _flush(self, table: GroupTable) -> None:
        if table.has_pending():
            table.write(*self.staging.send(table.pending()))

    def _grow(self, rows: int) -> None:
        for table in self.tables.values():
            table.grow_rows(rows)
        self.capacity = rows


def _token_layout(step: StepArrays) -> tuple[IntArray, IntArray, IntArray, IntArray]:
    """The step's query start offsets, each token's position, the logits rows and each token's batch row."""
    if step.one_token_each:
        counted = np.arange(len(step.rows) + 1, dtype=np.int64)
        return counted, step.starts, counted[:-1], step.rows
    qsl = np.zeros(len(step.rows) + 1, dtype=np.int64)
    np.cumsum(step.query_lens, out=qsl[1:])
    first = np.repeat(qsl[:-1], step.query_lens)
    positions = np.repeat(step.starts, step.query_lens) + (np.arange(int(qsl[-1])) - first)
    logits_idx = _logit_rows(qsl, step.num_logits, step.num_prompt_logits)
    return qsl, positions, logits_idx, np.repeat(step.rows, step.query_lens)


def _logit_rows(qsl: IntArray, num_logits: IntArray, num_prompt: IntArray | None) -> IntArray:
    """The rows whose logits the step returns, per entry: its first ``num_prompt`` rows (prompt
    logprobs), then its last ``num_logits`` rows (sampling)."""
    sampled = _ranges(qsl[1:], num_logits)
    if num_prompt is None or not num_prompt.any():
        return sampled
    prompt = _ranges(qsl[:-1] + num_prompt, num_prompt)
    entry = np.arange(len(num_logits))
    keys = np.concatenate([np.repeat(entry, num_prompt), np.repeat(entry, num_logits)])
    # A stable sort by entry keeps each entry's prompt rows before its sampled rows.
    return np.concatenate([prompt, sampled])[np.argsort(keys, kind="stable")]


def _ranges(ends: IntArray, lengths: IntArray) -> IntArray:
    """``concat(range(end - n, end) for end, n in zip(ends, lengths))``."""
    total = int(lengths.sum())
    offsets = np.arange(total) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    return np.repeat(ends - lengths, lengths) + offsets
