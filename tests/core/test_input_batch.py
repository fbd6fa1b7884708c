"""The worker's row allocator against a plain dict-of-lists model: rows added, removed (with the
last row moved into the hole) and grown by appended blocks in any order keep the same tables and row
mapping as the model, and a step's tensors equal a brute-force build from the model."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from pypto_serving import CacheGroupSpec
from pypto_serving.input_batch import InputBatch, StepArrays

# A small max_model_len so that tables outgrow their first width, and few rows so that rows grow too.
GROUPS = [CacheGroupSpec("kv", 2, 1), CacheGroupSpec("compressed", 2, 1, tokens_per_entry=4)]
IDS = [f"r{i}" for i in range(7)]


class InputBatchMachine(RuleBasedStateMachine):
    host_tables = True  # the CPU's numpy build; the subclass below runs the torch build of other devices

    def __init__(self) -> None:
        super().__init__()
        self.ib = InputBatch(
            groups=GROUPS, max_model_len=8, device=torch.device("cpu"), rows=2, host_tables=self.host_tables
        )
        self.order: list[str] = []  # the model's rows: the last one fills a hole
        self.model: dict[str, dict[str, Any]] = {}

    @rule(rid=st.sampled_from(IDS))
    def add(self, rid: str) -> None:
        if rid in self.model:  # a request entering again replaces its old row
            self._model_remove(rid)
        assert self.ib.add(rid) == len(self.order)
        self.order.append(rid)
        self.model[rid] = {"blocks": {g.name: [] for g in GROUPS}}

    @rule(rids=st.lists(st.sampled_from(IDS), max_size=4))
    def remove(self, rids: list[str]) -> None:
        self.ib.remove(rids)
        for rid in rids:
            if rid in self.model:
                self._model_remove(rid)

    @rule(data=st.data(), group=st.sampled_from([g.name for g in GROUPS]), blocks=st.lists(st.integers(1, 99)))
    def append(self, data: st.DataObject, group: str, blocks: list[int]) -> None:
        if not self.order:
            return
        rid = data.draw(st.sampled_from(self.order))
        self.ib.append_blocks(self.ib.row_of[rid], {group: blocks})
        self.model[rid]["blocks"][group] += blocks

    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        """A step over some rows in any order: every tensor equals a build from the model's lists."""
        ready = [r for r in self.order if self.model[r]["blocks"]["kv"]]
        if not ready:
            return
        rids = data.draw(st.lists(st.sampled_from(ready), min_size=1, unique=True))
        starts, lens, nlog = [], [], []
        for rid in rids:
            covered = 2 * len(self.model[rid]["blocks"]["kv"])  # positions the kv blocks hold
            n = data.draw(st.integers(1, covered))
            starts.append(data.draw(st.integers(0, covered - n)))
            lens.append(n)
            nlog.append(data.draw(st.integers(0, n)))
        ids = [data.draw(st.integers(0, 99)) for _ in range(sum(lens))]
        arrays = StepArrays(
            rows=np.array([self.ib.row_of[r] for r in rids], dtype=np.int64),
            starts=np.array(starts, dtype=np.int64),
            query_lens=np.array(lens, dtype=np.int64),
            num_logits=np.array(nlog, dtype=np.int64),
            input_ids=np.array(ids, dtype=np.int64),
            # A step of one sampled token a row may take the layout without expansion (or not).
            one_token_each=lens.count(1) == nlog.count(1) == len(rids) and data.draw(st.booleans()),
        )
        got = self.ib.prepare(arrays)
        qsl = [0]
        for n in lens:
            qsl.append(qsl[-1] + n)
        positions = [s + j for s, n in zip(starts, lens) for j in range(n)]
        assert got.input_ids.tolist() == ids
        assert got.positions.tolist() == positions
        assert got.query_start_loc.tolist() == got.query_start_loc_host == qsl
        assert got.query_start_loc.dtype == got.seq_lens.dtype == torch.int32
        assert got.seq_lens.tolist() == got.seq_lens_host == [s + n for s, n in zip(starts, lens)]
        assert got.logits_indices.tolist() == [j for e, n in zip(qsl[1:], nlog) for j in range(e - n, e)]
        for g in GROUPS:
            tables = [self.model[r]["blocks"][g.name] for r in rids]
            width = max(1, *map(len, tables))
            assert got.block_tables[g.name].tolist() == [t + [0] * (width - len(t)) for t in tables]
        kv = [self.model[r]["blocks"]["kv"] for r, n in zip(rids, lens) for _ in range(n)]
        assert got.slot_mapping["kv"].tolist() == [b[p // 2] * 2 + p % 2 for b, p in zip(kv, positions)]
        assert set(got.slot_mapping) == {"kv"}
        for x in (got.input_ids, got.positions, got.logits_indices, got.slot_mapping["kv"]):
            assert x.dtype == torch.int64
        assert all(t.dtype == torch.int32 and t.is_contiguous() for t in got.block_tables.values())

    def _model_remove(self, rid: str) -> None:
        del self.model[rid]
        hole = self.order.index(rid)
        last = self.order.pop()
        if hole < len(self.order):
            self.order[hole] = last

    @invariant()
    def rows_match_the_model(self) -> None:
        ib = self.ib
        assert ib.request_ids == self.order
        assert ib.row_of == {r: i for i, r in enumerate(self.order)}
        for rid in self.order:
            m = self.model[rid]
            for g in GROUPS:
                assert ib.block_ids(rid, g.name) == m["blocks"][g.name]

    @invariant()
    def unused_table_cells_are_zero(self) -> None:
        """Padding and free rows hold 0: a row taken later starts clean, a narrower row pads with 0."""
        for name, t in self.ib.tables.items():
            table = t.table.tolist()
            for row, cells in enumerate(table):
                used = len(self.model[self.order[row]]["blocks"][name]) if row < len(self.order) else 0
                assert cells[used:] == [0] * (len(cells) - used), (name, row)


class TorchBuildMachine(InputBatchMachine):
    host_tables = False


InputBatchMachine.TestCase.settings = settings(max_examples=30, stateful_step_count=25, deadline=None)
TorchBuildMachine.TestCase.settings = InputBatchMachine.TestCase.settings
TestInputBatch = InputBatchMachine.TestCase
TestInputBatchTorchBuild = TorchBuildMachine.TestCase


def test_host_tables_need_cpu_memory() -> None:
    with pytest.raises(ValueError, match="host_tables needs the tables in CPU memory"):
        InputBatch(groups=GROUPS, max_model_len=8, device=torch.device("meta"), host_tables=True)


def test_the_cpu_builds_steps_over_the_tables_memory() -> None:
    """On the CPU a step's tables are gathered from the table's numpy view, with no torch write in between."""
    ib = InputBatch(groups=GROUPS[:1], max_model_len=8, device=torch.device("cpu"))
    assert ib.host_tables
    ib.add("a")
    ib.append_blocks(0, {"kv": [5, 6]})
    t = ib.tables["kv"]
    assert t.host is not None and t.host.ctypes.data == t.table.data_ptr()
    one = np.array([0], dtype=np.int64)
    step = StepArrays(rows=one, starts=np.array([3]), query_lens=np.array([1]), num_logits=np.array([1]),
                      input_ids=np.array([9]), one_token_each=True)  # fmt: skip
    got = ib.prepare(step)
    assert t.table[0, :2].tolist() == [5, 6]  # the pending appends landed in the torch table's memory
    assert got.slot_mapping["kv"].tolist() == [6 * 2 + 1]


def test_growing_keeps_rows_and_tables() -> None:
    """Past its first capacity the batch grows rows and table width without losing data."""
    ib = InputBatch(groups=GROUPS[:1], max_model_len=2, device=torch.device("cpu"), rows=1)
    for i in range(5):
        assert ib.add(f"r{i}") == i
        ib.append_blocks(i, {"kv": list(range(10 * i, 10 * i + i + 1))})
    assert ib.capacity >= 5 and ib.tables["kv"].table.shape[1] >= 5
    assert [ib.block_ids(f"r{i}", "kv") for i in range(5)] == [list(range(10 * i, 10 * i + i + 1)) for i in range(5)]


def test_appends_not_yet_on_the_device_follow_their_row_through_a_removal() -> None:
    """Blocks appended and not yet written (no step ran) land on the right request when a removal
    moves rows first."""
    ib = InputBatch(groups=GROUPS[:1], max_model_len=16, device=torch.device("cpu"), rows=4)
    for rid in ("a", "b", "c"):
        ib.add(rid)
    ib.append_blocks(0, {"kv": [1, 2]})
    ib.append_blocks(2, {"kv": [3]})
    ib.remove(["a"])  # "c" moves into row 0 with its pending block
    assert ib.request_ids == ["c", "b"]
    assert ib.tables["kv"].table.tolist()[:3] == [[3] + [0] * 7, [0] * 8, [0] * 8]
    assert [ib.block_ids(r, "kv") for r in ("c", "b")] == [[3], []]


def test_freed_window_entries_are_written_as_block_zero() -> None:
    """A window group's entries freed before they reach the worker (-1) are held as block 0, so every
    table entry is a valid block id; the entries after them keep their places."""
    ib = InputBatch(groups=GROUPS[:1], max_model_len=16, device=torch.device("cpu"), rows=2)
    ib.add("a")
    ib.append_blocks(0, {"kv": [-1, -1, 7]})
    ib.append_blocks(0, {"kv": [9]})
    ib.remove([])
    assert ib.block_ids("a", "kv") == [0, 0, 7, 9]
    assert ib.tables["kv"].table.tolist()[0][:5] == [0, 0, 7, 9, 0]


def test_a_shifted_group_maps_each_token_to_its_shifted_entry() -> None:
    """A group with ``slot_shift`` keeps position ``i`` at entry ``i + slot_shift``: its slot mapping
    points there (it pointed at entry ``i``, the previous position's entry, before)."""
    groups = [CacheGroupSpec("kv", 2, 1), CacheGroupSpec("mtp", 2, 1, slot_shift=1)]
    ib = InputBatch(groups=groups, max_model_len=8, device=torch.device("cpu"), rows=2)
    row = ib.add("a")
    ib.append_blocks(row, {"kv": [5, 6], "mtp": [7, 8, 9]})
    one = np.array([row], dtype=np.int64)
    arrays = StepArrays(
        rows=one,
        starts=np.array([0], dtype=np.int64),
        query_lens=np.array([4], dtype=np.int64),
        num_logits=np.array([1], dtype=np.int64),
        input_ids=np.arange(4, dtype=np.int64),
    )
    got = ib.prepare(arrays)
    assert got.slot_mapping["kv"].tolist() == [10, 11, 12, 13]  # entries 0..3 in blocks 5, 6
    assert got.slot_mapping["mtp"].tolist() == [15, 16, 17, 18]  # entries 1..4 in blocks 7, 8, 9
