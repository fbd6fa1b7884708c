"""ModelRunner: the worker side of a step.

It keeps per-request state the scheduler must not need (last sampled token, drafts, sampling
history), turns a :class:`StepCommand` into one flat :class:`BatchInput`, calls the executor,
samples, verifies drafts and returns a :class:`StepResult`.
"""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch

from .executor import BatchInput, Executor, ExecutorInfo, ScheduledEntry, StepCommand, StepResult
from .sampler import RowParams, sample

__all__ = ["MissingSampledTokenError", "ModelRunner"]


class MissingSampledTokenError(RuntimeError):
    """A decode asked for the last sampled token of a request that has none."""


@dataclass(slots=True)
class _ReqState:
    sampling: dict[str, Any]
    seed: int
    num_prompt: int
    history: list[int]  # prompt + outputs sampled here
    last_sampled: int | None
    drafts: list[int] = field(default_factory=list)
    rejected: int = 0  # draft positions given back so far

    @property
    def num_outputs(self) -> int:
        return len(self.history) - self.num_prompt


class ModelRunner:
    def __init__(self, executor: Executor, settings: Any) -> None:
        self.executor = executor
        self.settings = settings
        self.states: dict[str, _ReqState] = {}
        self.info: ExecutorInfo | None = None

    def load(self) -> ExecutorInfo:
        self.info = self.executor.load()
        self.device = torch.device(getattr(self.executor, "device", "cpu"))
        return self.info

    def init_kv_cache(self, num_blocks: dict[str, int]) -> None:
        self.executor.init_kv_cache(num_blocks)

    def shutdown(self) -> None:
        self.executor.shutdown()

    # ------------------------------------------------------------------ step
    def step(self, cmd: StepCommand) -> StepResult:
        t0 = time.perf_counter()
        try:
            if cmd.finished_ids:
                for rid in cmd.finished_ids:
                    self.states.pop(rid, None)
                self.executor.release(list(cmd.finished_ids))
            for nr in cmd.new_requests:
                outs = list(nr.output_token_ids)
                self.states[nr.request_id] = _ReqState(
                    dict(nr.sampling),
                    nr.seed,
                    len(nr.prompt_token_ids),
                    [*nr.prompt_token_ids, *outs],
                    outs[-1] if outs else None,
                )
            if not cmd.entries:
                return StepResult(cmd.step_id)
            batch, drafts_used = self._build_batch(cmd.entries)
            logits = self.executor.execute(batch)
            result = self._sample(cmd, batch, logits, drafts_used)
            accepted = [result.sampled.get(rid, []) for rid in batch.request_ids]
            for rid, drafts in zip(batch.request_ids, self.executor.propose_drafts(batch, accepted)):
                st = self.states[rid]
                if rid in result.sampled:
                    st.drafts = list(drafts)
        except Exception as e:
            msg = f"{type(e).__name__}: {e}"
            tb = "".join(traceback.format_exception(e)[-2:])
            return StepResult(cmd.step_id, error=f"{msg}\n{tb}".strip())
        result.execute_seconds = time.perf_counter() - t0
        return result

    def _build_batch(self, entries: list[ScheduledEntry]) -> tuple[BatchInput, list[list[int]]]:
        assert self.info is not None
        ids: list[int] = []
        positions: list[int] = []
        qsl = [0]
        seq_lens: list[int] = []
        num_logits: list[int] = []
        logits_idx: list[int] = []
        drafts_used: list[list[int]] = []
        is_prefill: list[bool] = []
        for e in entries:
            st = self.states.get(e.request_id)
            if st is None:
                raise RuntimeError(f"the worker has no state for request {e.request_id!r}")
            if e.use_last_sampled:
                if st.last_sampled is None:
                    raise MissingSampledTokenError(
                        f"request {e.request_id!r}: decode asks for the last sampled token, but none was sampled"
                    )
                toks = [st.last_sampled]
            else:
                toks = list(e.token_ids)
            drafts = st.drafts[: e.num_draft] if e.num_draft else []
            toks += drafts
            # Rejections the scheduler had not reconciled when it scheduled this entry.
            start = e.start_pos - (st.rejected - e.rejected_seen)
            ids += toks
            positions += range(start, start + len(toks))
            qsl.append(len(ids))
            seq_lens.append(start + len(toks))
            n = 1 + len(drafts) if e.sample else 0
            num_logits.append(n)
            logits_idx += range(len(ids) - n, len(ids))
            drafts_used.append(drafts)
            is_prefill.append(len(toks) - len(drafts) > 1 or start < st.num_prompt)
        dev = self.device
        pos_t = torch.tensor(positions, dtype=torch.long)
        req_of_token = torch.repeat_interleave(
            torch.arange(len(entries)), torch.tensor([qsl[i + 1] - qsl[i] for i in range(len(entries))])
        )
        block_tables: dict[str, torch.Tensor] = {}
        slot_mapping: dict[str, torch.Tensor] = {}
        for g in self.info.cache_groups:
            rows = [e.block_ids.get(g.name, []) for e in entries]
            width = max(1, max(len(r) for r in rows))
            table = torch.zeros(len(entries), width, dtype=torch.int32)
            for i, r in enumerate(rows):
                table[i, : len(r)] = torch.tensor(r, dtype=torch.int32)
            block_tables[g.name] = table.to(dev)
            if g.tokens_per_entry == 1:
                blk = table.long()[req_of_token, pos_t // g.block_size]
                slot_mapping[g.name] = (blk * g.block_size + pos_t % g.block_size).to(dev)
        batch = BatchInput(
            request_ids=[e.request_id for e in entries],
            input_ids=torch.tensor(ids, dtype=torch.long, device=dev),
            positions=pos_t.to(dev),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=block_tables,
            slot_mapping=slot_mapping,
            logits_indices=torch.tensor(logits_idx, dtype=torch.long, device=dev),
            query_lens=[qsl[i + 1] - qsl[i] for i in range(len(entries))],
            seq_lens_list=seq_lens,
            num_logits=num_logits,
            is_prefill=is_prefill,
        )
        return batch, drafts_used

    def _sample(
        self, cmd: StepCommand, batch: BatchInput, logits: torch.Tensor, drafts_used: list[list[int]]
    ) -> StepResult:
        params: list[RowParams] = []
        for i, (e, n) in enumerate(zip(cmd.entries, batch.num_logits)):
            st = self.states[e.request_id]
            sp = st.sampling
            # The token history only matters to penalties; copying it for every row would make
            # each step O(sequence length) per request for nothing.
            penalized = bool(sp["presence_penalty"] or sp["frequency_penalty"] or sp["repetition_penalty"] != 1.0)
            for j in range(n):
                n_out = st.num_outputs + j
                banned = ()
                if n_out < sp["min_tokens"]:
                    banned = tuple(sp["stop_token_ids"]) + (() if sp["ignore_eos"] else tuple(sp["eos_token_ids"]))
                params.append(
                    RowParams(
                        sp["temperature"],
                        sp["top_k"],
                        sp["top_p"],
                        sp["min_p"],
                        sp["presence_penalty"],
                        sp["frequency_penalty"],
                        sp["repetition_penalty"],
                        st.seed,
                        n_out,
                        sp["logprobs"],
                        banned,
                        st.history + drafts_used[i][:j] if penalized else [],
                        st.num_prompt,
                    )
                )
        result = StepResult(cmd.step_id)
        if not params:
            return result
        out = sample(logits, params)
        row = 0
        drafted = 0
        accepted_per_pos = [0] * max((len(d) for d in drafts_used), default=0)
        for i, (e, n) in enumerate(zip(cmd.entries, batch.num_logits)):
            if n == 0:
                continue
            rows = range(row, row + n)
            row += n
            err = next((out.errors[r] for r in rows if r in out.errors), None)
            if err is not None:
                result.request_errors[e.request_id] = err
                continue
            targets = [out.tokens[r] for r in rows]
            drafts = drafts_used[i]
            kept = [targets[0]]
            for j, d in enumerate(drafts):  # greedy verification: longest matching prefix
                if d != targets[j]:
                    break
                kept.append(targets[j + 1])
                accepted_per_pos[j] += 1
            drafted += len(drafts)
            result.num_verify_steps += bool(drafts)
            st = self.states[e.request_id]
            st.history += kept
            st.last_sampled = kept[-1]
            st.rejected += e.num_draft - (len(kept) - 1)
            result.sampled[e.request_id] = kept
            if st.sampling["logprobs"] is not None:
                result.logprobs[e.request_id] = [out.logprobs[r] or {} for r in list(rows)[: len(kept)]]
        result.num_drafted = drafted
        result.num_accepted_per_pos = accepted_per_pos
        return result
