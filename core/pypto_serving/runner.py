"""ModelRunner: the worker side of a step.

It keeps per-request state the scheduler must not need (last sampled token, drafts, sampling
history), turns a :class:`StepCommand` into one flat :class:`BatchInput` on the executor's device,
calls the executor, samples, verifies drafts and returns a :class:`StepResult`.
"""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch

from .executor import BatchInput, Executor, ExecutorInfo
from .messages import NewRequestData, ScheduledEntry, StepCommand, StepResult, WireSampling
from .sampler import RowParams, SampleOutput, TokenCounts, sample

__all__ = ["MissingSampledTokenError", "ModelRunner"]


class MissingSampledTokenError(RuntimeError):
    """A decode asked for the last sampled token of a request that has none."""


@dataclass(slots=True, kw_only=True)
class _ReqState:
    sampling: WireSampling
    seed: int
    num_prompt: int
    history: list[int]  # prompt + outputs sampled here
    last_sampled: int | None
    counts: TokenCounts | None  # the penalties' token counts, on the device; None without penalties
    drafts: list[int] = field(default_factory=list)
    rejected: int = 0  # draft positions given back so far
    block_ids: dict[str, list[int]] = field(default_factory=dict)  # per cache group, grown by each entry's diff

    @property
    def num_outputs(self) -> int:
        return len(self.history) - self.num_prompt


@dataclass(slots=True)
class _EntryTokens:
    """One entry's input rows: known or last sampled tokens, then drafts, from position ``start``."""

    tokens: list[int]
    drafts: list[int]
    start: int


class ModelRunner:
    def __init__(self, executor: Executor, settings: Any) -> None:
        self.executor = executor
        self.settings = settings
        self.states: dict[str, _ReqState] = {}
        self.info: ExecutorInfo | None = None

    def load(self) -> ExecutorInfo:
        self.info = self.executor.load()
        try:
            self.device = self.executor.device
        except AttributeError:
            raise TypeError(
                f"{type(self.executor).__name__}.load() must set self.device (a torch.device): "
                "the runner places every BatchInput tensor there"
            ) from None
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
                self._admit(nr)
            # Every entry's blocks are taken before anything can fail, so the tables stay in step
            # with the scheduler's record of what was sent whatever happens to this step.
            self._append_blocks(cmd.entries)
            if not cmd.entries:
                return StepResult(step_id=cmd.step_id)
            batch, drafts_used = self._build_batch(cmd.entries)
            logits = self.executor.execute(batch)
            result = self._sample(cmd, batch, logits, drafts_used)
            accepted = [result.sampled.get(rid, []) for rid in batch.request_ids]
            for rid, drafts in zip(batch.request_ids, self.executor.propose_drafts(batch, accepted)):
                if rid in result.sampled:
                    self.states[rid].drafts = list(drafts)
        except Exception as e:
            msg = f"{type(e).__name__}: {e}"
            tb = "".join(traceback.format_exception(e)[-2:])
            return StepResult(step_id=cmd.step_id, error=f"{msg}\n{tb}".strip())
        result.execute_seconds = time.perf_counter() - t0
        return result

    def _admit(self, nr: NewRequestData) -> None:
        outs = list(nr.output_token_ids)
        self.states[nr.request_id] = _ReqState(
            sampling=nr.sampling,
            seed=nr.seed,
            num_prompt=len(nr.prompt_token_ids),
            history=[*nr.prompt_token_ids, *outs],
            last_sampled=outs[-1] if outs else None,
            counts=TokenCounts(prompt=list(nr.prompt_token_ids), outputs=outs) if nr.sampling.has_penalties else None,
        )

    # ------------------------------------------------------------------ batch
    def _build_batch(self, entries: list[ScheduledEntry]) -> tuple[BatchInput, list[list[int]]]:
        assert self.info is not None
        ids: list[int] = []
        positions: list[int] = []
        qsl = [0]
        seq_lens: list[int] = []
        num_logits: list[int] = []
        logits_idx: list[int] = []
        drafts_used: list[list[int]] = []
        for e in entries:
            et = self._entry_tokens(e)
            toks = et.tokens + et.drafts
            ids += toks
            positions += range(et.start, et.start + len(toks))
            qsl.append(len(ids))
            seq_lens.append(et.start + len(toks))
            n = 1 + len(et.drafts) if e.sample else 0
            num_logits.append(n)
            logits_idx += range(len(ids) - n, len(ids))
            drafts_used.append(et.drafts)
        dev = self.device
        pos_t = torch.tensor(positions, dtype=torch.long)
        block_tables, slot_mapping = self._cache_tensors(entries, qsl, pos_t)
        batch = BatchInput(
            request_ids=[e.request_id for e in entries],
            input_ids=torch.tensor(ids, dtype=torch.long, device=dev),
            positions=pos_t.to(dev),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=block_tables,
            slot_mapping=slot_mapping,
            logits_indices=torch.tensor(logits_idx, dtype=torch.long, device=dev),
            num_logits=num_logits,
            query_start_loc_host=qsl,
            seq_lens_host=seq_lens,
            input_ids_host=ids,
        )
        return batch, drafts_used

    def _append_blocks(self, entries: list[ScheduledEntry]) -> None:
        for e in entries:
            st = self.states.get(e.request_id)
            if st is None:
                raise RuntimeError(f"the worker has no state for request {e.request_id!r}")
            for group, blocks in e.new_block_ids.items():
                st.block_ids.setdefault(group, []).extend(blocks)

    def _entry_tokens(self, e: ScheduledEntry) -> _EntryTokens:
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
        # Rejections the scheduler had not reconciled when it scheduled this entry.
        start = e.start_pos - (st.rejected - e.rejected_seen)
        return _EntryTokens(tokens=toks, drafts=drafts, start=start)

    def _cache_tensors(
        self, entries: list[ScheduledEntry], qsl: list[int], pos_t: torch.Tensor
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """Block tables of every cache group and slot mappings of the single-token groups, on the device."""
        assert self.info is not None
        query_lens = torch.tensor([qsl[i + 1] - qsl[i] for i in range(len(entries))])
        # output_size is known here: the op needs no read of its (host) repeats to size its result.
        req_of_token = torch.repeat_interleave(torch.arange(len(entries)), query_lens, output_size=qsl[-1])
        block_tables: dict[str, torch.Tensor] = {}
        slot_mapping: dict[str, torch.Tensor] = {}
        for g in self.info.cache_groups:
            table = _block_table([self.states[e.request_id].block_ids.get(g.name, []) for e in entries])
            block_tables[g.name] = table.to(self.device)
            if g.tokens_per_entry == 1:
                blk = table.long()[req_of_token, pos_t // g.block_size]
                slot_mapping[g.name] = (blk * g.block_size + pos_t % g.block_size).to(self.device)
        return block_tables, slot_mapping

    # ------------------------------------------------------------------ sample and verify
    def _sample(
        self, cmd: StepCommand, batch: BatchInput, logits: torch.Tensor, drafts_used: list[list[int]]
    ) -> StepResult:
        result = StepResult(step_id=cmd.step_id)
        params = self._row_params(cmd.entries, batch.num_logits, drafts_used)
        if params:
            self._verify(cmd.entries, batch.num_logits, drafts_used, sample(logits, params), result)
        return result

    def _row_params(
        self, entries: list[ScheduledEntry], num_logits: list[int], drafts_used: list[list[int]]
    ) -> list[RowParams]:
        """One sampler row per logits row: row ``j`` of a request follows its first ``j`` drafts."""
        params: list[RowParams] = []
        for e, n, drafts in zip(entries, num_logits, drafts_used):
            st = self.states[e.request_id]
            params += (_row(st, st.num_outputs + j, drafts[:j]) for j in range(n))
        return params

    def _verify(
        self,
        entries: list[ScheduledEntry],
        num_logits: list[int],
        drafts_used: list[list[int]],
        out: SampleOutput,
        result: StepResult,
    ) -> None:
        """Keep each request's accepted tokens, commit them to its state and record them in ``result``."""
        result.num_accepted_per_pos = [0] * max((len(d) for d in drafts_used), default=0)
        row = 0
        for e, n, drafts in zip(entries, num_logits, drafts_used):
            rows = range(row, row + n)
            row += n
            if n == 0:
                continue
            err = next((out.errors[r] for r in rows if r in out.errors), None)
            if err is not None:
                result.request_errors[e.request_id] = err
                continue
            kept = _accept([out.tokens[r] for r in rows], drafts)
            for j in range(len(kept) - 1):
                result.num_accepted_per_pos[j] += 1
            result.num_drafted += len(drafts)
            result.num_verify_steps += bool(drafts)
            st = self.states[e.request_id]
            st.history += kept
            if st.counts is not None:
                st.counts.extend(kept)
            st.last_sampled = kept[-1]
            st.rejected += e.num_draft - (len(kept) - 1)
            result.sampled[e.request_id] = kept
            if st.sampling.logprobs is not None:
                result.logprobs[e.request_id] = [out.logprobs[r] or {} for r in rows[: len(kept)]]


def _block_table(rows: list[list[int]]) -> torch.Tensor:
    """``[R, max_blocks]`` int32 block ids of one group, padded with 0, on the host."""
    table = torch.zeros(len(rows), max(1, max(len(r) for r in rows)), dtype=torch.int32)
    for i, r in enumerate(rows):
        table[i, : len(r)] = torch.tensor(r, dtype=torch.int32)
    return table


def _row(st: _ReqState, draw_index: int, drafts: list[int]) -> RowParams:
    """Sampler parameters of a request's output ``draw_index``, sampled after ``drafts``."""
    sp = st.sampling
    return RowParams(
        temperature=sp.temperature,
        top_k=sp.top_k,
        top_p=sp.top_p,
        min_p=sp.min_p,
        presence_penalty=sp.presence_penalty,
        frequency_penalty=sp.frequency_penalty,
        repetition_penalty=sp.repetition_penalty,
        seed=st.seed,
        draw_index=draw_index,
        num_logprobs=sp.logprobs,
        banned=sp.min_tokens_banned if draw_index < sp.min_tokens else (),
        # Penalties read the request's device counts plus this row's drafts: no history copy per step.
        counts=st.counts,
        drafts=tuple(drafts) if st.counts is not None else (),
    )


def _accept(targets: list[int], drafts: list[int]) -> list[int]:
    """Greedy verification: the target's first token, then one more for each leading draft that
    matches the target's token at its position."""
    kept = [targets[0]]
    for j, d in enumerate(drafts):
        if d != targets[j]:
            break
        kept.append(targets[j + 1])
    return kept
