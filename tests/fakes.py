"""A deterministic fake executor, registered through the real hook by the tests.

Its "KV cache" stores the token id written at every slot, and the next token is a function of the
whole sequence *read back from the cache through the block table*. Any scheduling bug (wrong
positions, block tables, slot mappings, prefix reuse, a lost chunk) therefore changes the output.

Options (``executor_options``): ``vocab``, ``eos``, ``max_model_len``, ``max_draft`` (drafting depth),
``draft_error_rate`` (fraction of wrong drafts, seeded by context), ``fail_on_token`` (raise in a
step whose input holds it), ``crash_on_token`` (kill the worker process), ``nan_on_token`` (NaN
logits for the request whose last input is it), ``pipelining`` (supports async), ``barrier``,
``uniform`` (all-prefill or all-decode steps), ``verify_drafts`` (declare ``can_verify_drafts``),
``window`` (a sliding window: the next token depends on the last ``window`` tokens only, read
through the block table, and the kv group declares ``window_tokens``), ``step_sleep`` (seconds per
step), ``prompt_logits`` (return a row for every entry of ``logits_indices``, so prompt logprobs
work), ``architecture_from_env`` (report that environment variable of the worker process as the
architecture), ``greedy_steps`` (run a multi-step decode's greedy forwards as one loop,
:meth:`~pypto_serving.Executor.greedy_steps`, counted in ``greedy_forwards``).
"""

from __future__ import annotations

import bisect
import os
import random
import time
from typing import Any

import torch

from pypto_serving import (
    BatchInput,
    CacheGroupSpec,
    Executor,
    ExecutorInfo,
    ExecutorSpec,
    hookimpl,
)


def next_token(ctx: list[int], vocab: int) -> int:
    acc = len(ctx)
    for i, t in enumerate(ctx):
        acc = (acc * 31 + t * (i + 7)) % 1_000_003
    return acc % vocab


def _next_tokens(ctx: list[int], lengths: list[int], vocab: int) -> list[int]:
    """``next_token(ctx[:n], vocab)`` for each ``n`` of ascending ``lengths``, in one pass: after ``k``
    tokens :func:`next_token`'s accumulator is ``k * 31**k + S_k`` (mod its modulus), where
    ``S_{k+1} = 31 * S_k + ctx[k] * (k + 7)``."""
    out, power, s, want = [], 1, 0, iter(lengths)
    n = next(want, None)
    for k in range(len(ctx) + 1):
        while n == k:
            out.append((k * power + s) % 1_000_003 % vocab)
            n = next(want, None)
        if k < len(ctx):
            s = (s * 31 + ctx[k] * (k + 7)) % 1_000_003
            power = power * 31 % 1_000_003
    return out


class FakeExecutor(Executor):
    def __init__(self, settings: Any) -> None:
        self.opts = dict(settings.executor_options)
        self.vocab = int(self.opts.get("vocab", 97))
        self.block_size = settings.block_size
        self.window = int(self.opts["window"]) if self.opts.get("window") else None
        self.greedy_forwards = 0  # forwards run by greedy_steps

    def load(self) -> ExecutorInfo:
        o = self.opts
        self.device = torch.device("cpu")
        return ExecutorInfo(
            # Declared as a small model's KV (1 KiB per token), so that the default kv_cache_memory
            # plans a realistic block count; the fake's own cache holds one int64 per token.
            cache_groups=[
                CacheGroupSpec("kv", self.block_size, bytes_per_block=self.block_size * 1024, window_tokens=self.window)
            ],
            vocab_size=self.vocab,
            max_model_len=int(o.get("max_model_len", 512)),
            eos_token_ids=[int(o["eos"])] if "eos" in o else [],
            # ``architecture_from_env`` reports an environment variable of the worker process instead.
            architecture=os.environ.get(o["architecture_from_env"], "")
            if "architecture_from_env" in o
            else "FakeForCausalLM",
            supports_pipelining=bool(o.get("pipelining", True)),
            uniform_batches=bool(o.get("uniform", False)),
            max_draft_tokens=int(o.get("max_draft", 0)),
            can_verify_drafts=bool(o.get("verify_drafts", False)),
            prefill_barrier=bool(o.get("barrier", False)),
            # It names adapters only (their weights are ignored): the server's adapter tests use it.
            supports_lora=bool(o.get("lora", True)),
        )

    def init_kv_cache(self, num_blocks: dict[str, int]) -> None:
        self.cache = torch.full((num_blocks["kv"] * self.block_size,), -1, dtype=torch.long)

    def _context(self, table: torch.Tensor, upto: int) -> list[int]:
        """The tokens before position ``upto`` the model reads (the last ``window`` with a window),
        from the cache through the block table."""
        pos = torch.arange(max(0, upto - self.window) if self.window else 0, upto)
        slots = table.long()[pos // self.block_size] * self.block_size + pos % self.block_size
        return self.cache[slots].tolist()

    def execute(self, batch: BatchInput) -> torch.Tensor:
        o = self.opts
        ids = batch.input_ids.tolist()
        if "crash_on_token" in o and int(o["crash_on_token"]) in ids:
            os._exit(17)
        if "fail_on_token" in o and int(o["fail_on_token"]) in ids:
            raise RuntimeError("fake executor asked to fail")
        if o.get("step_sleep"):
            time.sleep(float(o["step_sleep"]))
        self.cache[batch.slot_mapping["kv"]] = batch.input_ids
        if o.get("prompt_logits") and not self.window:
            return self._all_rows(batch)
        rows = []
        qsl = batch.query_start_loc.tolist()
        pos = batch.positions.tolist()
        for r in range(len(batch.request_ids)):
            n = batch.num_logits[r]
            for t in range(qsl[r + 1] - n, qsl[r + 1]):
                ctx = self._context(batch.block_tables["kv"][r], pos[t] + 1)
                row = torch.tensor([((v * 7919 + len(ctx)) % 101) / 50.0 for v in range(self.vocab)])
                row[next_token(ctx, self.vocab)] = 10.0
                if "nan_on_token" in o and ids[t] == int(o["nan_on_token"]):
                    row[0] = float("nan")
                rows.append(row)
        return torch.stack(rows) if rows else torch.empty(0, self.vocab)

    def greedy_steps(self, batch: BatchInput, steps: int, stop_ids: list[frozenset[int]]) -> list[list[int]] | None:
        """The forwards :meth:`execute` would run one by one, each row's next input its argmax, the
        slots computed here from the block tables (the first forward's checked against the batch's)."""
        o = self.opts
        if not o.get("greedy_steps"):
            return None
        tokens, positions = batch.input_ids.tolist(), batch.positions.tolist()
        tables = batch.block_tables["kv"]
        forwards: list[list[int]] = []
        for s in range(steps):
            if "crash_on_token" in o and int(o["crash_on_token"]) in tokens:
                os._exit(17)
            if "fail_on_token" in o and int(o["fail_on_token"]) in tokens:
                raise RuntimeError("fake executor asked to fail")
            if "nan_on_token" in o and int(o["nan_on_token"]) in tokens:
                break  # this forward's logits would hold NaN
            if o.get("step_sleep"):
                time.sleep(float(o["step_sleep"]))
            slots = [
                int(t[p // self.block_size]) * self.block_size + p % self.block_size for t, p in zip(tables, positions)
            ]
            assert s or slots == batch.slot_mapping["kv"].tolist(), "the first forward's slots are the batch's"
            self.cache[slots] = torch.tensor(tokens)
            tokens = [next_token(self._context(t, p + 1), self.vocab) for t, p in zip(tables, positions)]
            positions = [p + 1 for p in positions]
            forwards.append(tokens)
            self.greedy_forwards += 1
            if any(t in stop for t, stop in zip(tokens, stop_ids)):
                break
            if batch.interrupt is not None and batch.interrupt.is_set():
                break
        return forwards

    def _all_rows(self, batch: BatchInput) -> torch.Tensor:
        """The logits of every row of ``logits_indices`` (the ``prompt_logits`` option: prompt logprobs
        work), equal to the per-row path's, in time linear in the context: each request's context is
        read once and ``next_token`` of each of its prefixes follows from the previous one's."""
        qsl = batch.query_start_loc.tolist()
        pos = batch.positions.tolist()
        lengths = [pos[t] + 1 for t in batch.logits_indices.tolist()]
        owners = [bisect.bisect_right(qsl, t) - 1 for t in batch.logits_indices.tolist()]
        tokens: list[int] = []
        for r in sorted(set(owners)):
            mine = [n for n, o in zip(lengths, owners, strict=True) if o == r]
            tokens += _next_tokens(self._context(batch.block_tables["kv"][r], max(mine)), mine, self.vocab)
        if not lengths:
            return torch.empty(0, self.vocab)
        base = torch.arange(self.vocab) * 7919
        rows = ((base[None, :] + torch.tensor(lengths)[:, None]) % 101).float() / 50.0
        rows[torch.arange(len(tokens)), torch.tensor(tokens)] = 10.0
        return rows

    def propose_drafts(self, batch: BatchInput, accepted: list[list[int]]) -> list[list[int]]:
        k = int(self.opts.get("max_draft", 0))
        err = float(self.opts.get("draft_error_rate", 0.0))
        out: list[list[int]] = []
        qsl = batch.query_start_loc.tolist()
        pos = batch.positions.tolist()
        for r, acc in enumerate(accepted):
            if not acc or k == 0:
                out.append([])
                continue
            n = batch.num_logits[r]
            first = qsl[r + 1] - n  # row of the last sampled token's input
            ctx = [*self._context(batch.block_tables["kv"][r], pos[first] + len(acc)), acc[-1]]
            rng = random.Random(hash(tuple(ctx)))
            drafts = []
            for _ in range(k):
                t = next_token(ctx, self.vocab)
                if rng.random() < err:
                    t = (t + 1) % self.vocab
                drafts.append(t)
                ctx = [*ctx, t]
            out.append(drafts)
        return out


def make_fake_executor(settings: Any) -> FakeExecutor:
    return FakeExecutor(settings)


def reference_tokens(
    prompt: list[int],
    max_tokens: int,
    vocab: int = 97,
    eos: int | None = None,
    stop_token_ids: tuple[int, ...] = (),
    window: int | None = None,
) -> tuple[list[int], str]:
    """What greedy decoding of the fake model must give for a request run alone."""
    ctx = list(prompt)
    out: list[int] = []
    while len(out) < max_tokens:
        t = next_token(ctx[-window:] if window else ctx, vocab)
        out.append(t)
        ctx.append(t)
        if t == eos or t in stop_token_ids:
            return out, "stop"
    return out, "length"


class FakePlugin:
    """Registered with ``PluginManager(extra_plugins=[FakePlugin])`` by the tests."""

    @staticmethod
    @hookimpl
    def pypto_serving_register_executors() -> list[ExecutorSpec]:
        return [ExecutorSpec("fake", make_fake_executor, ("FakeForCausalLM",), "deterministic test executor")]
