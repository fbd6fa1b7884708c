"""DecodeGraphs: runs decode-only steps through a forward compiled per batch-size bucket (see graph.py)."""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass, field
from itertools import pairwise

import torch
import torch.nn.functional as F

from pypto_serving import BatchInput

from .graph import GraphOptions, compile_decode
from .model import AttentionMetadata, KVCache, QwenForCausalLM

__all__ = ["DecodeGraphs", "GraphStats"]

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class GraphStats:
    """Which path each step took, for logs, tests and benchmarks.

    :param graph_steps: captured decode steps per bucket.
    :param eager_steps: steps that ran eager (prefill, mixed, drafting, or above the largest bucket).
    :param native_decoder_steps: eager decode (or verification) steps whose decoder layers ran as one
        native call (:class:`pypto_kernels.NativeDecoder`).
    :param first_call_seconds: per bucket, the wall time of its first call (compilation included).
    """

    graph_steps: dict[int, int] = field(default_factory=dict)
    eager_steps: int = 0
    native_decoder_steps: int = 0
    first_call_seconds: dict[int, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class _Padding:
    """One bucket's padding rows: token 0 at position 0, writing and reading only the scratch block."""

    input_ids: torch.Tensor  # [B] int64
    positions: torch.Tensor  # [B] int64
    slots: torch.Tensor  # [B] int64, inside the scratch block
    block_tables: torch.Tensor  # [B, W] int32: the scratch block, then 0
    seq_lens: torch.Tensor  # [B] int32, all 1


class DecodeGraphs:
    """Pads a decode-only batch up to its bucket and runs the compiled forward of that bucket.

    :param scratch_block: a cache block no request owns; padding rows write and read only it.
    :param table_width: block-table columns inside a graph (enough for the longest sequence).
    """

    def __init__(
        self,
        model: QwenForCausalLM,
        options: GraphOptions,
        *,
        scratch_block: int,
        block_size: int,
        table_width: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.options = options
        self.stats = GraphStats()
        self._scratch, self._block_size, self._width, self._device = scratch_block, block_size, table_width, device
        self._padding: dict[int, _Padding] = {}
        self._compiled = compile_decode(self._forward, options.mode)

    def use_caches(self, kv_caches: list[KVCache], scratch_block: int) -> None:
        """Take a newly allocated cache (a memory profile allocates one before the real one).

        The block count is a dynamic dimension of the graphs, so a cache of another size reuses
        them instead of compiling every bucket again.
        """
        for key_cache, value_cache in kv_caches:
            torch._dynamo.mark_dynamic(key_cache, 0)
            torch._dynamo.mark_dynamic(value_cache, 0)
        self._scratch = scratch_block
        self._padding.clear()

    def bucket(self, batch: BatchInput) -> int | None:
        """The bucket of a decode-only batch (every request one query token), else None (runs eager)."""
        qsl = batch.query_start_loc_host
        sizes = self.options.batch_sizes
        num_requests = len(qsl) - 1
        if num_requests == 0 or num_requests > sizes[-1] or any(end - start != 1 for start, end in pairwise(qsl)):
            return None
        return sizes[bisect.bisect_left(sizes, num_requests)]

    def run(self, batch: BatchInput, bucket: int, kv_caches: list[KVCache]) -> torch.Tensor:
        """Float32 logits of ``batch.logits_indices`` from the bucket's compiled forward."""
        meta, input_ids, positions = self._padded(batch, bucket)
        start = time.perf_counter()
        hidden, residual = self._call(input_ids, positions, meta, kv_caches)
        if bucket not in self.stats.first_call_seconds:
            self.stats.first_call_seconds[bucket] = time.perf_counter() - start
        self.stats.graph_steps[bucket] = self.stats.graph_steps.get(bucket, 0) + 1
        # Padding rows sit past the real ones, so the sampled rows index the padded output as they are.
        return self.model.logits(hidden[batch.logits_indices], residual[batch.logits_indices])

    def warm_up(self, kv_caches: list[KVCache]) -> float:
        """Compile every bucket with an all-padding batch (it touches only the scratch block); seconds taken."""
        start = time.perf_counter()
        for bucket in self.options.batch_sizes:
            pad = self._pad(bucket)
            meta = self._meta(pad.slots, pad.block_tables, pad.seq_lens, [1] * bucket)
            t0 = time.perf_counter()
            self._call(pad.input_ids, pad.positions, meta, kv_caches)
            self.stats.first_call_seconds.setdefault(bucket, time.perf_counter() - t0)
        return time.perf_counter() - start

    def _call(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, kv_caches: list[KVCache]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.options.mode == "cudagraph":
            torch.compiler.cudagraph_mark_step_begin()  # type: ignore[no-untyped-call] # last replay's outputs are consumed
        # Each bucket (and each executor in one process) is its own compiled entry of the same code;
        # the limit is raised for this call only so that no bucket falls back to eager.
        limit = 8 * len(self.options.batch_sizes) + 8
        with torch._dynamo.config.patch(recompile_limit=limit), torch.inference_mode():
            out: tuple[torch.Tensor, torch.Tensor] = self._compiled(input_ids, positions, meta, kv_caches)
        return out

    def _forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, kv_caches: list[KVCache]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.model.hidden_states(input_ids, positions, meta, kv_caches)

    def _padded(self, batch: BatchInput, bucket: int) -> tuple[AttentionMetadata, torch.Tensor, torch.Tensor]:
        pad, real = self._pad(bucket), len(batch.seq_lens_host)
        table = batch.block_tables["kv"]
        # Widen to the graph's fixed width (a wider table is cropped: no sequence needs more columns).
        table = F.pad(table, (0, self._width - table.shape[1]))
        if real < bucket:
            rest = slice(real, bucket)
            input_ids = torch.cat((batch.input_ids, pad.input_ids[rest]))
            positions = torch.cat((batch.positions, pad.positions[rest]))
            slots = torch.cat((batch.slot_mapping["kv"], pad.slots[rest]))
            table = torch.cat((table, pad.block_tables[rest]))
            seq_lens = torch.cat((batch.seq_lens, pad.seq_lens[rest]))
        else:
            input_ids, positions, slots, seq_lens = (
                batch.input_ids,
                batch.positions,
                batch.slot_mapping["kv"],
                batch.seq_lens,
            )
        lens = [*batch.seq_lens_host, *[1] * (bucket - real)]
        return self._meta(slots, table, seq_lens, lens), input_ids, positions

    def _meta(
        self, slots: torch.Tensor, tables: torch.Tensor, seq_lens: torch.Tensor, lens: list[int]
    ) -> AttentionMetadata:
        static = self.options.attention == "static"
        return AttentionMetadata(
            slot_mapping=slots,
            block_tables=tables,
            query_start_loc=seq_lens,  # unused by the decode paths
            seq_lens=seq_lens,
            query_lens_host=[],
            seq_lens_host=[],
            path="static" if static else "host",
            seq_lens_cpu=None if static else torch.tensor(lens, dtype=torch.int32),
        )

    def _pad(self, bucket: int) -> _Padding:
        if bucket not in self._padding:
            dev = self._device
            table = torch.zeros((bucket, self._width), dtype=torch.int32, device=dev)
            table[:, 0] = self._scratch
            offsets = torch.arange(bucket, dtype=torch.int64, device=dev) % self._block_size
            self._padding[bucket] = _Padding(
                input_ids=torch.zeros(bucket, dtype=torch.int64, device=dev),
                positions=torch.zeros(bucket, dtype=torch.int64, device=dev),
                slots=self._scratch * self._block_size + offsets,
                block_tables=table,
                seq_lens=torch.ones(bucket, dtype=torch.int32, device=dev),
            )
        return self._padding[bucket]
