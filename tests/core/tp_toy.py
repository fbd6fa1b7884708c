"""A toy tensor-parallel executor for the worker-group tests: a small model whose forward really
shards over :class:`~pypto_serving.parallel.ParallelContext`, so TP=2 against TP=1 is a real check.

Per token: a vocab-parallel embedding (each rank owns a slice of the table, the rows are
all-reduced), a column-parallel up-projection ``z = tanh(h @ W1[:, shard])`` whose ``[F / TP]`` slice
is this rank's "KV cache" entry for the token, and per sampled row a sum of the cached ``z`` of every
position up to it weighted by recency (``0.5 ** distance``, read back through the block table), a
row-parallel down-projection (partial sums all-reduced) and a vocab-parallel head (logit slices
all-gathered).
With one rank every collective is the identity and the matrices are whole: the plain computation.
Everything is float64, so the summation order of the all-reduce cannot flip a greedy choice.

Options (``executor_options``): ``diverge_rank`` (that rank's logits are changed after the gather,
so it samples other tokens), ``step_sleep`` (seconds per step).
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch

from pypto_serving import BatchInput, CacheGroupSpec, Executor, ExecutorInfo, ExecutorSpec, hookimpl
from pypto_serving.parallel import ParallelContext, vocab_parallel_embedding

VOCAB, HIDDEN, FFN = 64, 16, 32


class ToyTPExecutor(Executor):
    def __init__(self, settings: Any) -> None:
        self.opts = dict(settings.executor_options)
        self.block_size = settings.block_size

    def load(self) -> ExecutorInfo:
        self.device = torch.device("cpu")
        ctx = self.ctx = ParallelContext.current()
        g = torch.Generator().manual_seed(1234)
        emb = torch.randn(VOCAB, HIDDEN, generator=g, dtype=torch.float64)
        w1 = torch.randn(HIDDEN, FFN, generator=g, dtype=torch.float64) / math.sqrt(HIDDEN)
        w2 = torch.randn(FFN, HIDDEN, generator=g, dtype=torch.float64) / math.sqrt(FFN)
        head = torch.randn(VOCAB, HIDDEN, generator=g, dtype=torch.float64)
        ffn = ctx.shard(FFN, what="ffn size")
        self.emb = emb[ctx.shard(VOCAB, what="vocabulary")].clone()
        self.w1, self.w2 = w1[:, ffn].clone(), w2[ffn].clone()
        self.head = head[ctx.shard(VOCAB, what="vocabulary")].clone()
        self.width = self.w1.shape[1]
        return ExecutorInfo(
            cache_groups=[CacheGroupSpec("kv", self.block_size, bytes_per_block=self.block_size * self.width * 8)],
            vocab_size=VOCAB,
            max_model_len=256,
            architecture="ToyTPForCausalLM",
        )

    def init_kv_cache(self, num_blocks: dict[str, int]) -> None:
        self.cache = torch.zeros(num_blocks["kv"] * self.block_size, self.width, dtype=torch.float64)

    def _chaos(self, batch: BatchInput) -> None:
        o = self.opts
        if o.get("step_sleep"):
            time.sleep(float(o["step_sleep"]))

    def execute(self, batch: BatchInput) -> torch.Tensor:
        self._chaos(batch)
        h = vocab_parallel_embedding(batch.input_ids, self.emb, self.ctx)
        self.cache[batch.slot_mapping["kv"]] = torch.tanh(h @ self.w1)
        qsl, pos = batch.query_start_loc_host, batch.positions.tolist()
        rows = []
        for t in batch.logits_indices.tolist():
            r = max(i for i in range(len(batch.request_ids)) if qsl[i] <= t)
            p = torch.arange(pos[t] + 1)
            slots = batch.block_tables["kv"][r].long()[p // self.block_size] * self.block_size + p % self.block_size
            weights = 0.5 ** (pos[t] - p).to(torch.float64)  # the latest tokens weigh most
            rows.append((self.cache[slots] * weights.unsqueeze(1)).sum(0))
        if not rows:  # every rank sees the same batch, so all of them skip the collectives
            return torch.zeros(0, VOCAB, dtype=torch.float64)
        context = torch.stack(rows)
        out = self.ctx.all_reduce(context @ self.w2)
        logits = self.ctx.all_gather(4.0 * out @ self.head.T, dim=-1)
        if int(self.opts.get("diverge_rank", -1)) == self.ctx.rank:
            logits = logits.flip(-1)
        return logits


def make_toy(settings: Any) -> ToyTPExecutor:
    return ToyTPExecutor(settings)


class ToyTPPlugin:
    """Registered with ``PluginManager(extra_plugins=[ToyTPPlugin])``, or through the entry point
    the multi-node test writes for its ``pypto-serving worker`` subprocess."""

    @staticmethod
    @hookimpl
    def pypto_serving_register_executors() -> list[ExecutorSpec]:
        return [ExecutorSpec("tp_toy", make_toy, ("ToyTPForCausalLM",), "toy tensor-parallel test executor")]
