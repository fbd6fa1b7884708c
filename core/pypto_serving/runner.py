"""ModelRunner: the worker side of a step.

It keeps per-request state the scheduler must not need: a persistent
:class:`~pypto_serving.input_batch.InputBatch` row per request (sampling parameters, last sampled
token, output count, block tables on the device), updated by the step message's diffs, and the token
history, penalty counts and drafts beside it. It turns a :class:`StepCommand` into one flat
:class:`BatchInput` on the executor's device, calls the executor, samples, verifies drafts and
returns a :class:`StepResult`. A step runs in two parts: :meth:`ModelRunner.launch` queues the
forward and the sampler's device work without reading anything back, :meth:`ModelRunner.finish`
makes the step's host read and the rest; between them the worker may stage the next step's
admissions and blocks (:meth:`ModelRunner.stage`).
"""

from __future__ import annotations

import contextlib
import os
import time
import traceback
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from .executor import BatchInput, Executor, ExecutorInfo
from .input_batch import InputBatch, StepArrays
from .messages import NewRequestData, ScheduledEntry, StepCommand, StepResult
from .sampler import (
    DeviceSample,
    LogitEdits,
    RowParams,
    SampleOutput,
    TokenCounts,
    packed,
    prompt_logprobs,
    read_sample,
    sample_on_device,
)
from .spec_decode import DraftRow, DraftSampler, NgramDrafter, SpecRow, verify_sampled
from .speculative import drafts_for
from .structured import GrammarCompiler, HostMask, RequestGrammar, fill_step_mask

__all__ = ["LaunchedStep", "MissingSampledTokenError", "ModelRunner"]


class MissingSampledTokenError(RuntimeError):
    """A decode asked for the last sampled token of a request that has none."""


class _ReqState:
    """What the worker keeps of a request beyond its batch row: token history, penalty counts and
    drafts. Its last sampled token lives in the row (the step gathers it from there)."""

    __slots__ = (
        "_batch",
        "counts",
        "draft_probs",
        "drafts",
        "edits",
        "grammar",
        "grammar_error",
        "history",
        "last_base",
        "num_prompt",
        "request_id",
        "rows",
        "sampling",
        "seed",
    )

    def __init__(
        self,
        batch: InputBatch,
        nr: NewRequestData,
        counts: TokenCounts | None,  # counts: None without penalties
    ) -> None:
        self._batch = batch
        self.request_id = nr.request_id
        self.sampling = nr.sampling
        self.seed = nr.seed
        self.num_prompt = len(nr.prompt_token_ids)
        self.history = [*nr.prompt_token_ids, *nr.output_token_ids]  # prompt + outputs sampled here
        self.counts = counts
        sp = nr.sampling
        has_edits = sp.logit_bias or sp.allowed_token_ids is not None
        self.edits = LogitEdits(bias=sp.logit_bias, allowed=sp.allowed_token_ids) if has_edits else None
        self.drafts: list[int] = []
        self.draft_probs: torch.Tensor | None = None  # [len(drafts), V] q of sampled drafts, on the device
        self.last_base: int | None = None  # outputs before the last step that sampled for this request
        self.rows: list[RowParams] = []  # the sampler's rows of this request, reused across steps
        self.grammar: RequestGrammar | None = None  # structured output: the grammar's state
        self.grammar_error: str | None = None  # the grammar could not be built: the request fails

    @property
    def last_sampled(self) -> int | None:
        token = int(self._batch.ints["last_sampled"][self._batch.row_of[self.request_id]])
        return None if token < 0 else token

    @last_sampled.setter
    def last_sampled(self, token: int | None) -> None:
        self._batch.ints["last_sampled"][self._batch.row_of[self.request_id]] = -1 if token is None else token

    @property
    def num_outputs(self) -> int:
        return len(self.history) - self.num_prompt

    @property
    def rejection_sampled(self) -> bool:
        """Whether sampled drafts of this request are verified by rejection sampling. Greedy requests
        keep the argmax comparison. Requests with logprobs, a grammar, logit_bias or allowed_token_ids
        keep sample-and-compare: the sampler reports logprobs of the tokens it draws (not of a
        residual draw), a grammar advances and masks per drafted prefix on the host, and allowed
        tokens with bans can leave a row nothing to sample, an error only the sampler's path reports."""
        sp = self.sampling
        return sp.temperature > 0 and sp.logprobs is None and self.grammar is None and self.edits is None


class ModelRunner:
    #: Fill a step's grammar masks on a thread while its forward runs (llguidance and numpy release
    #: the GIL) rather than before it; the masks are the same either way. None: when the forward
    #: leaves a core free, i.e. it runs on an accelerator, or on the CPU with fewer intra-op threads
    #: than cores (a fill beside a forward on every core slows both: benchmarks/structured.py).
    overlap_grammar_masks: bool | None = None

    def __init__(self, executor: Executor, settings: Any) -> None:
        self.executor = executor
        self.settings = settings
        self.states: dict[str, _ReqState] = {}
        self.info: ExecutorInfo | None = None
        self._input_batch: InputBatch | None = None
        self._ngram = _ngram_drafter(settings)
        self._drafts_for = drafts_for(settings)  # the requests the policy can give drafts: only they draft
        self._grammars = GrammarCompiler(getattr(settings, "tokenizer", None) or getattr(settings, "model", None))
        self._mask_thread: ThreadPoolExecutor | None = None  # made by the first constrained step
        self._staged: _Staged | None = None  # the next step's admissions and blocks, taken early
        self._compiles_of: StepCommand | None = None  # the last command whose grammars were taken

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
        if self._mask_thread is not None:
            self._mask_thread.shutdown(wait=True)
        self.executor.shutdown()

    @property
    def input_batch(self) -> InputBatch:
        """The persistent rows, made on first use (the executor's info and device are known by then)."""
        if self._input_batch is None:
            assert self.info is not None
            rows = int(getattr(self.settings, "max_num_seqs", 16))
            self._input_batch = InputBatch(
                groups=self.info.cache_groups, max_model_len=self.info.max_model_len, device=self.device, rows=rows
            )
        return self._input_batch

    # ------------------------------------------------------------------ step
    def step(self, cmd: StepCommand) -> StepResult:
        """Run ``cmd`` whole: :meth:`launch`, then :meth:`finish`, nothing staged between them."""
        return self.finish(self.launch(cmd))

    def launch(self, cmd: StepCommand) -> LaunchedStep:
        """A step's first part: finished requests leave, new requests and blocks enter (unless
        :meth:`stage` took them), the batch is built, the forward and the sampler's device work are
        queued. Nothing the device computes for the sampled rows is read, so on an accelerator this
        returns while the device still works (steps with prompt logprobs or rejection-sampled drafts
        read their scores here); :meth:`finish` makes the step's host read."""
        t0 = time.perf_counter()
        staged, self._staged = self._staged, None
        assert staged is None or staged.cmd is cmd, "a staged step runs next, before any other"
        state: StepResult | _Work
        try:
            self._take_grammars(cmd)
            self._enter(cmd, staged)
            state = self._forward(cmd) if cmd.entries else StepResult(step_id=cmd.step_id)
        except Exception as e:
            state = _failed(cmd, e)
        seconds = time.perf_counter() - t0 + (0.0 if staged is None else staged.seconds)
        return LaunchedStep(cmd=cmd, seconds=seconds, state=state)

    def finish(self, run: LaunchedStep) -> StepResult:
        """A step's second part: its one host read of the sampled tokens, then verification, the
        requests' states, next step's drafts and the result, with the requests whose grammar
        finished compiling meanwhile (failed steps too: readiness is not the step's)."""
        result = self._finish(run)
        result.grammars_ready = self._grammars.compiled()
        return result

    def _finish(self, run: LaunchedStep) -> StepResult:
        if isinstance(run.state, StepResult):
            return run.state
        t0 = time.perf_counter()
        work = run.state
        try:
            result = self._finish_sample(run.cmd, work)
            if isinstance(work.prompt_lps, str):  # the executor returned the sampled rows only
                _fail_prompt_rows(result, work.prompt_rows, work.prompt_lps)
            else:
                result.prompt_logprobs = work.prompt_lps
            t_draft = time.perf_counter()
            work.batch.draft_depth = run.cmd.draft_depth
            self._draft(work.batch, result)
            result.draft_seconds = time.perf_counter() - t_draft
        except Exception as e:
            return _failed(run.cmd, e)
        result.execute_seconds = run.seconds + time.perf_counter() - t0
        return result

    def stage(self, cmd: StepCommand) -> bool:
        """Take ``cmd``'s new requests and appended blocks while the step before it is between
        :meth:`launch` and :meth:`finish`. New rows go after that step's rows and blocks wait on the
        host until ``cmd``'s batch is built, so the step in flight reads nothing staging writes and
        finishes as it would have. Finished requests stay until ``cmd`` is launched: the step in
        flight may still hold their rows. Returns False, having done nothing, where staging could
        move a row of the step in flight or differ from the plain order; ``cmd`` then runs in the
        plain order. Its time counts in ``cmd``'s ``execute_seconds``."""
        with contextlib.suppress(Exception):  # raised again where launch takes them
            self._take_grammars(cmd)
        if self._staged is not None or not self._can_stage(cmd):
            return False
        t0 = time.perf_counter()
        error: Exception | None = None
        try:
            for nr in cmd.new_requests:
                self._admit(nr)
            self._append_blocks(cmd.entries)
        except Exception as e:  # raised by ``launch`` after the removals, where the plain order fails
            error = e
        self._staged = _Staged(cmd=cmd, seconds=time.perf_counter() - t0, error=error)
        return True

    def _take_grammars(self, cmd: StepCommand) -> None:
        """Forget the grammars of requests that finished and start compiling those of requests just
        added, once per command (as soon as the worker holds it: at :meth:`stage` if it comes early)."""
        if self._compiles_of is cmd:
            return
        for rid in cmd.forget_grammars:
            self._grammars.forget(rid)
        for g in cmd.compile_grammars:
            self._grammars.prepare(g.request_id, g.spec, g.eos)
        self._compiles_of = cmd

    def _can_stage(self, cmd: StepCommand) -> bool:
        """Whether staging ``cmd`` is safe: no new request is live here (a preempted or aborted id
        coming back before its old row leaves: adding it would first remove that row, moving the
        last row into the hole), no id comes twice, and no entry names a request ``cmd`` finishes
        (the plain order would fail that entry's step before taking any block)."""
        new = [nr.request_id for nr in cmd.new_requests]
        live = self.input_batch.row_of
        finished = set(cmd.finished_ids)
        return (
            len(set(new)) == len(new)
            and not any(rid in live or rid in self.states for rid in new)
            and not any(e.request_id in finished for e in cmd.entries)
        )

    def _enter(self, cmd: StepCommand, staged: _Staged | None) -> None:
        """The step's row diffs: finished requests leave, then new requests and blocks enter, unless
        ``staged`` took them (what staging raised is raised here, after the removals)."""
        if cmd.finished_ids:
            for rid in cmd.finished_ids:
                self.states.pop(rid, None)
            self.input_batch.remove(list(cmd.finished_ids))
            self.executor.release(list(cmd.finished_ids))
        if staged is not None:
            if staged.error is not None:
                raise staged.error
            return
        for nr in cmd.new_requests:
            self._admit(nr)
        # Every entry's blocks are taken before anything can fail, so the tables stay in step
        # with the scheduler's record of what was sent whatever happens to this step.
        self._append_blocks(cmd.entries)

    def _forward(self, cmd: StepCommand) -> _Work:
        """Build the batch, run the forward, queue the sampling: everything before the host read."""
        batch, drafts_used, prompt_rows = self._build_batch(cmd.entries)
        rejecting = self._rejecting(cmd.entries, drafts_used)
        masks = self._start_masks(cmd.entries, batch.num_logits, drafts_used, rejecting)
        try:
            logits = self.executor.execute(batch)
            logits, prompt_lps = self._split_prompt_rows(batch, logits, prompt_rows)
            pending = _Pending(rejecting=rejecting, masks=masks)
            sampling = self._launch_sample(cmd.entries, batch, logits, drafts_used, pending)
        finally:
            if masks is not None:
                masks.exception()  # the fill is done before anything else touches the grammars
        return _Work(
            batch=batch, drafts_used=drafts_used, prompt_rows=prompt_rows, prompt_lps=prompt_lps, sampling=sampling
        )

    def _draft(self, batch: BatchInput, result: StepResult) -> None:
        """Next step's drafts of every request that sampled: the core's n-gram drafter over the token
        histories when ``speculative_config.method`` is ``ngram``, else the executor's own drafter;
        at most ``batch.draft_depth`` of them where the policy set a drafting depth."""
        sampler: DraftSampler | None = None
        depth = batch.draft_depth
        ids = batch.request_ids
        drafted: list[list[int]]
        if self._ngram is not None:
            ids = [rid for rid in batch.request_ids if rid in result.sampled]
            if depth == 0:
                drafted = [[] for _ in ids]
            else:
                drafted = self._ngram.propose([self.states[rid].history for rid in ids])
        else:
            drafting = [self._drafts_for(self.states[rid].sampling) for rid in batch.request_ids]
            accepted = [result.sampled.get(rid, []) if d else [] for rid, d in zip(batch.request_ids, drafting)]
            sampler = self._draft_sampler(batch, result)
            drafted = (
                self.executor.propose_drafts(batch, accepted)
                if sampler is None
                else self.executor.propose_sampled_drafts(batch, accepted, sampler)
            )
        for i, (rid, drafts) in enumerate(zip(ids, drafted)):
            if rid in result.sampled:
                st = self.states[rid]
                st.drafts = list(drafts if depth is None else drafts[:depth])
                st.draft_probs = None if sampler is None else sampler.probs(i, len(st.drafts))

    def _draft_sampler(self, batch: BatchInput, result: StepResult) -> DraftSampler | None:
        """The sampler of the executor's drafts: requests verified by rejection sampling draw theirs;
        None when there is none (every draft is an argmax)."""
        rows: dict[int, DraftRow] = {}
        for i, rid in enumerate(batch.request_ids):
            st = self.states.get(rid)
            if rid in result.sampled and st is not None and st.rejection_sampled:
                sp = st.sampling
                rows[i] = DraftRow(
                    temperature=sp.temperature,
                    top_k=sp.top_k,
                    top_p=sp.top_p,
                    min_p=sp.min_p,
                    seed=st.seed,
                    first_index=st.num_outputs,
                )
        return DraftSampler(rows) if rows else None

    def _admit(self, nr: NewRequestData) -> None:
        outs = list(nr.output_token_ids)
        counts = TokenCounts(prompt=list(nr.prompt_token_ids), outputs=outs) if nr.sampling.has_penalties else None
        self.input_batch.add(nr.request_id, sampling=nr.sampling, seed=nr.seed, outputs=outs)
        st = self.states[nr.request_id] = _ReqState(self.input_batch, nr, counts)
        spec = nr.sampling.structured
        if spec is not None:
            try:  # a request resuming after preemption replays its outputs through its grammar
                st.grammar = self._grammars.matcher(
                    spec, nr.sampling.grammar_eos, nr.sampling.min_tokens, nr.request_id
                )
                # The grammar compiles on the compiler's thread; only a replay waits for it here.
                if outs and not st.grammar.advance(outs):
                    st.grammar_error = f"structured output: {st.grammar.error}"
            except ValueError as e:
                st.grammar_error = f"structured output: {e}"

    # ------------------------------------------------------------------ batch
    def _build_batch(
        self, entries: list[ScheduledEntry]
    ) -> tuple[BatchInput, list[list[int]], list[tuple[str, int, int]]]:
        ib = self.input_batch
        rows = self._rows(entries)
        ids: list[int] = []
        starts: list[int] = []
        query_lens: list[int] = []
        num_logits: list[int] = []
        drafts_used: list[list[int]] = []
        last = ib.ints["last_sampled"][rows].tolist()
        rejected = ib.ints["rejected"][rows].tolist()
        for e, last_token, rej in zip(entries, last, rejected):
            toks = [self._last_sampled(e.request_id, last_token)] if e.use_last_sampled else e.token_ids
            drafts = self._drafts_to_verify(e) if e.num_draft else []
            if e.sample:
                self.states[e.request_id].last_base = self.states[e.request_id].num_outputs
            ids += toks
            ids += drafts
            # Rejections the scheduler had not reconciled when it scheduled this entry.
            starts.append(e.start_pos - (rej - e.rejected_seen))
            query_lens.append(len(toks) + len(drafts))
            num_logits.append(1 + len(drafts) if e.sample else 0)
            drafts_used.append(drafts)
        prompt_rows = self._prompt_rows(entries, starts, query_lens)
        step = StepArrays(
            rows=rows,
            starts=np.array(starts, dtype=np.int64),
            query_lens=np.array(query_lens, dtype=np.int64),
            num_logits=np.array(num_logits, dtype=np.int64),
            input_ids=np.array(ids, dtype=np.int64),
            num_prompt_logits=np.array([m for _, _, m in prompt_rows], dtype=np.int64),
        )
        t = ib.prepare(step)
        batch = BatchInput(
            request_ids=[e.request_id for e in entries],
            input_ids=t.input_ids,
            positions=t.positions,
            query_start_loc=t.query_start_loc,
            seq_lens=t.seq_lens,
            block_tables=t.block_tables,
            slot_mapping=t.slot_mapping,
            logits_indices=t.logits_indices,
            num_logits=num_logits,
            query_start_loc_host=t.query_start_loc_host,
            seq_lens_host=t.seq_lens_host,
            input_ids_host=ids,
        )
        return batch, drafts_used, prompt_rows

    def _drafts_to_verify(self, e: ScheduledEntry) -> list[int]:
        """The drafts ``e`` verifies.

        Rejection sampling emits tokens that depend on how many drafts each step verifies, and near
        a request's output limit (``max_tokens`` or the context length) the scheduler caps
        ``num_draft`` from the outputs it has seen, which under async scheduling lag by the step in
        flight. A rejection-sampled request therefore verifies at most ``room - k_max - 2`` drafts,
        ``room`` counted from the outputs before its previous sampling step: the previous step
        emitted at most ``1 + k_max`` tokens, so neither strategy's cap is below this one, and sync
        and async verify the same drafts and emit the same tokens."""
        st = self.states[e.request_id]
        k = e.num_draft
        if st.rejection_sampled and st.draft_probs is not None and st.last_base is not None:
            assert self.info is not None
            room = self.info.max_model_len - st.num_prompt - st.last_base
            if st.sampling.max_tokens is not None:
                room = min(room, st.sampling.max_tokens - st.last_base)
            k = max(0, min(k, room - self.info.max_draft_tokens - 2))
        return st.drafts[:k]

    def _prompt_rows(
        self, entries: list[ScheduledEntry], starts: list[int], query_lens: list[int]
    ) -> list[tuple[str, int, int]]:
        """Per entry ``(request id, first position, m)``: the entry's first ``m`` rows are prompt
        positions whose next token is a prompt token, for requests that ask for prompt logprobs."""
        out = []
        for e, start, q in zip(entries, starts, query_lens):
            st = self.states[e.request_id]
            wants = st.sampling.prompt_logprobs is not None and not e.use_last_sampled
            out.append((e.request_id, start, max(0, min(start + q, st.num_prompt - 1) - start) if wants else 0))
        return out

    def _split_prompt_rows(
        self, batch: BatchInput, logits: torch.Tensor, prompt_rows: list[tuple[str, int, int]]
    ) -> tuple[torch.Tensor, dict[str, tuple[int, list[dict[int, float]]]] | str]:
        """The sampled rows of ``logits``, and the prompt logprobs of the prompt rows before them:
        request id -> (index of the first prompt token they score, one entry per token). An executor
        that returns the sampled rows only gives the reason instead: those requests fail alone."""
        if not any(m for _, _, m in prompt_rows):
            return logits, {}
        total = sum(m for _, _, m in prompt_rows) + sum(batch.num_logits)
        if logits.shape[0] == sum(batch.num_logits):
            return logits, f"{type(self.executor).__name__} returns no logits for prompt rows: no prompt logprobs"
        if logits.shape[0] != total:
            raise RuntimeError(
                f"{type(self.executor).__name__}.execute returned {logits.shape[0]} logits rows for {total} "
                "logits_indices; prompt logprobs need one row per index"
            )
        sampled: list[int] = []
        scored: list[int] = []
        targets: list[int] = []
        tops: list[int] = []
        at = 0
        for (rid, start, m), n in zip(prompt_rows, batch.num_logits):
            st = self.states[rid]
            scored += range(at, at + m)
            sampled += range(at + m, at + m + n)
            targets += st.history[start + 1 : start + 1 + m]
            tops += [st.sampling.prompt_logprobs or 0] * m
            at += m + n
        dev = logits.device
        lps = prompt_logprobs(logits.index_select(0, torch.tensor(scored, device=dev)), targets, tops)
        out: dict[str, tuple[int, list[dict[int, float]]]] = {}
        for rid, start, m in prompt_rows:
            if m:
                out[rid] = (start + 1, lps[:m])
                lps = lps[m:]
        return logits.index_select(0, torch.tensor(sampled, dtype=torch.long, device=dev)), out

    def _rows(self, entries: list[ScheduledEntry]) -> npt.NDArray[np.int64]:
        """The batch row of each entry's request."""
        row_of = self.input_batch.row_of
        try:
            return np.array([row_of[e.request_id] for e in entries], dtype=np.int64)
        except KeyError as missing:
            raise RuntimeError(f"the worker has no state for request {missing.args[0]!r}") from None

    @staticmethod
    def _last_sampled(request_id: str, token: int) -> int:
        if token < 0:
            raise MissingSampledTokenError(
                f"request {request_id!r}: decode asks for the last sampled token, but none was sampled"
            )
        return token

    def _append_blocks(self, entries: list[ScheduledEntry]) -> None:
        ib = self.input_batch
        for e, row in zip(entries, self._rows(entries).tolist()):  # every entry names a request here
            ib.append_blocks(row, e.new_block_ids)

    # ------------------------------------------------------------------ sample and verify
    def _rejecting(self, entries: list[ScheduledEntry], drafts_used: list[list[int]]) -> list[int]:
        """The entries whose drafts rejection sampling verifies (their draft probabilities are known)."""
        return [
            i
            for i, (e, d) in enumerate(zip(entries, drafts_used))
            if d and self.states[e.request_id].rejection_sampled and self.states[e.request_id].draft_probs is not None
        ]

    def _start_masks(
        self, entries: list[ScheduledEntry], num_logits: list[int], drafts_used: list[list[int]], rejecting: list[int]
    ) -> Future[HostMask | None] | None:
        """The grammar masks of the rows sampled one by one (every entry but ``rejecting``), filling
        on the mask thread while the forward runs; None when none of those rows is constrained."""
        skip = set(rejecting)
        grammars = [
            (self.states[e.request_id].grammar, num_logits[i], drafts_used[i])
            for i, e in enumerate(entries)
            if i not in skip
        ]
        if not any(g is not None and n for g, n, _ in grammars):
            return None
        # A step whose rows all take their argmax lists fewer rows by id (the sampler checks the
        # argmax of the others); another step's sampler treats those rows as unlisted, as exactly.
        greedy = all(
            self.states[e.request_id].sampling.temperature == 0.0
            for i, e in enumerate(entries)
            if i not in skip and num_logits[i]
        )
        if not self._overlap_masks():
            done: Future[HostMask | None] = Future()
            done.set_result(fill_step_mask(grammars, greedy))
            return done
        if self._mask_thread is None:
            self._mask_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-masks")
        return self._mask_thread.submit(fill_step_mask, grammars, greedy)

    def _overlap_masks(self) -> bool:
        if self.overlap_grammar_masks is not None:
            return self.overlap_grammar_masks
        return self.device.type != "cpu" or (os.cpu_count() or 1) > torch.get_num_threads()

    def _launch_sample(
        self,
        entries: list[ScheduledEntry],
        batch: BatchInput,
        logits: torch.Tensor,
        drafts_used: list[list[int]],
        pending: _Pending,
    ) -> _Sampling:
        """The sampler rows, the verdicts of the entries rejection sampling verifies, and the device
        sample of every other row, queued but not read."""
        params = self._row_params(entries, batch.num_logits, drafts_used)
        if not params:
            return _Sampling(params=params, kept={}, rows=[], device=None)
        starts = np.cumsum([0, *batch.num_logits]).tolist()
        kept = self._verify_rejection(entries, logits, params, starts, drafts_used, pending.rejecting)
        rest = [i for i in range(len(entries)) if i not in kept]
        rows = [r for i in rest for r in range(starts[i], starts[i + 1])]
        device = None
        if rows:
            sub = (
                logits if len(rows) == len(params) else logits.index_select(0, torch.tensor(rows, device=logits.device))
            )
            host = None if pending.masks is None else pending.masks.result()
            grammar = None if host is None else host.to(logits.device)
            dev = sample_on_device(sub, [params[r] for r in rows], grammar)
            device = (dev, packed(dev))
        return _Sampling(params=params, kept=kept, rows=rows, device=device)

    def _finish_sample(self, cmd: StepCommand, work: _Work) -> StepResult:
        """Read the step's sample (its one host read) and verify every entry into a result."""
        result = StepResult(step_id=cmd.step_id)
        s = work.sampling
        if not s.params:
            return result
        out = SampleOutput([], [], {})
        if s.device is not None:
            out = read_sample(*s.device, [s.params[r] for r in s.rows])
        verified = _Verified(out=out, row_at=dict(zip(s.rows, range(len(s.rows)))), kept=s.kept)
        self._verify(cmd.entries, work.batch.num_logits, work.drafts_used, verified, result)
        return result

    def _verify_rejection(
        self,
        entries: list[ScheduledEntry],
        logits: torch.Tensor,
        params: list[RowParams],
        starts: list[int],
        drafts_used: list[list[int]],
        rejecting: list[int],
    ) -> dict[int, list[int] | None]:
        """Entry index -> the tokens rejection sampling keeps for it (None: non-finite logits)."""
        if not rejecting:
            return {}
        rows = [r for i in rejecting for r in range(starts[i], starts[i + 1])]
        dev = logits.device
        sub = logits if len(rows) == len(params) else logits.index_select(0, torch.tensor(rows, device=dev))
        states = [self.states[entries[i].request_id] for i in rejecting]
        q = [
            st.draft_probs.narrow(0, 0, len(drafts_used[i]))
            for i, st in zip(rejecting, states)
            if st.draft_probs is not None
        ]
        spec = [
            SpecRow(seed=st.seed, first_index=st.num_outputs, num_drafts=len(drafts_used[i]), greedy=False)
            for i, st in zip(rejecting, states)
        ]
        drafts = [drafts_used[i] for i in rejecting]
        verdict = verify_sampled(sub, [params[r] for r in rows], drafts, torch.cat(q), spec)
        return dict(zip(rejecting, verdict))

    def _row_params(
        self, entries: list[ScheduledEntry], num_logits: list[int], drafts_used: list[list[int]]
    ) -> list[RowParams]:
        """One sampler row per logits row: row ``j`` of a request follows its first ``j`` drafts."""
        params: list[RowParams] = []
        for e, n, drafts in zip(entries, num_logits, drafts_used):
            st = self.states[e.request_id]
            while len(st.rows) < n:  # built once per request and logits row, then updated in place
                st.rows.append(_row(st))
            base = st.num_outputs
            for j in range(n):
                params.append(_update(st, st.rows[j], base + j, drafts[:j]))
        return params

    def _verify(
        self,
        entries: list[ScheduledEntry],
        num_logits: list[int],
        drafts_used: list[list[int]],
        verified: _Verified,
        result: StepResult,
    ) -> None:
        """Keep each request's accepted tokens, commit them to its state and record them in ``result``."""
        result.num_accepted_per_pos = [0] * max((len(d) for d in drafts_used), default=0)
        committed: tuple[list[int], list[int], list[int], list[int]] = ([], [], [], [])
        row_of = self.input_batch.row_of
        out = verified.out
        row = 0
        for i, (e, n, drafts) in enumerate(zip(entries, num_logits, drafts_used)):
            rows = [verified.row_at.get(r, -1) for r in range(row, row + n)]  # rows of ``out`` (-1: none)
            row += n
            if n == 0:
                continue
            st = self.states[e.request_id]
            err = next((out.errors[r] for r in rows if r in out.errors), st.grammar_error)
            if i in verified.kept:
                err = err or (None if verified.kept[i] is not None else _NON_FINITE)
            if err is not None:
                result.request_errors[e.request_id] = err
                continue
            kept = verified.kept.get(i) or _accept([out.tokens[r] for r in rows], drafts)
            if any(r in out.empty for r in rows[: len(kept)]):  # a discarded row's emptiness does not count
                result.request_errors[e.request_id] = _NOTHING_ALLOWED
                continue
            if st.grammar is not None and not st.grammar.advance(kept):
                result.request_errors[e.request_id] = f"structured output: {st.grammar.error}"
                continue
            for j in range(len(kept) - 1):
                result.num_accepted_per_pos[j] += 1
            result.num_drafted += len(drafts)
            result.num_verify_steps += bool(drafts)
            st.history += kept
            if st.counts is not None:
                st.counts.extend(kept)
            for col, value in zip(committed, (row_of[e.request_id], len(kept), kept[-1])):
                col.append(value)
            committed[3].append(e.num_draft - (len(kept) - 1))
            result.sampled[e.request_id] = kept
            if st.sampling.logprobs is not None:
                result.logprobs[e.request_id] = [out.logprobs[r] or {} for r in rows[: len(kept)]]
        self.input_batch.commit(*committed)


@dataclass(slots=True, kw_only=True)
class _Pending:
    """What a step settles before its forward for its sampling: the entries rejection sampling
    verifies and the grammar masks filling beside the forward."""

    rejecting: list[int]
    masks: Future[HostMask | None] | None


@dataclass(slots=True, kw_only=True)
class _Sampling:
    """A step's sampling between its two parts. ``params`` are the requests' reused sampler rows:
    only a step's own first part updates them, so they still describe this step when it is read."""

    params: list[RowParams]
    kept: dict[int, list[int] | None]  # entry index -> what rejection sampling kept (read already)
    rows: list[int]  # the step rows sampled one by one
    device: tuple[DeviceSample, torch.Tensor] | None  # their device sample and its packed read, queued


@dataclass(slots=True, kw_only=True)
class _Work:
    """A launched step's batch and what its second part needs of the first."""

    batch: BatchInput
    drafts_used: list[list[int]]
    prompt_rows: list[tuple[str, int, int]]
    prompt_lps: dict[str, tuple[int, list[dict[int, float]]]] | str
    sampling: _Sampling


@dataclass(slots=True, kw_only=True)
class LaunchedStep:
    """A step between :meth:`ModelRunner.launch` and :meth:`ModelRunner.finish`: its state is the
    work left for the second part, or the result already (an error, or a step with no entries)."""

    cmd: StepCommand
    seconds: float  # host time of the step's own parts (and its staging) so far
    state: StepResult | _Work


@dataclass(slots=True, kw_only=True)
class _Staged:
    """The next step, staged: the command, its staging time, and what staging raised (if anything)."""

    cmd: StepCommand
    seconds: float
    error: Exception | None


@dataclass(slots=True, kw_only=True)
class _Verified:
    """A step's verification results: the sampler's output of the rows sampled one by one
    (``row_at``: step row -> its row in ``out``) and the tokens rejection sampling kept per entry."""

    out: SampleOutput
    row_at: dict[int, int]
    kept: dict[int, list[int] | None]


_NON_FINITE = "the model produced non-finite logits (NaN or +inf) for this request"

_NOTHING_ALLOWED = (
    "every token is banned for this request: its allowed_token_ids, bad_words, logit_bias and grammar "
    "leave nothing to sample"
)


def _failed(cmd: StepCommand, e: Exception) -> StepResult:
    msg = f"{type(e).__name__}: {e}"
    tb = "".join(traceback.format_exception(e)[-2:])
    return StepResult(step_id=cmd.step_id, error=f"{msg}\n{tb}".strip())


def _fail_prompt_rows(result: StepResult, prompt_rows: list[tuple[str, int, int]], reason: str) -> None:
    """Fail the requests whose prompt logprobs could not be computed; the others keep their tokens."""
    for rid, _, m in prompt_rows:
        if m:
            result.request_errors[rid] = reason
            result.sampled.pop(rid, None)
            result.logprobs.pop(rid, None)


def _row(st: _ReqState) -> RowParams:
    """A request's sampler parameters; :func:`_update` sets the draw and its drafts."""
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
        draw_index=0,
        num_logprobs=sp.logprobs,
        # Penalties read the request's device counts plus each row's drafts: no history copy per step.
        counts=st.counts,
        edits=st.edits,
    )


def _update(st: _ReqState, row: RowParams, draw_index: int, drafts: list[int]) -> RowParams:
    """``row`` set to sample the request's output ``draw_index`` after ``drafts``."""
    row.draw_index = draw_index
    row.banned = _min_tokens_bans(st) if draw_index < st.sampling.min_tokens else ()
    if st.sampling.bad_words:
        row.banned += _bad_word_bans(st.sampling.bad_words, st.history, st.num_prompt, drafts)
    row.drafts = tuple(drafts) if st.counts is not None else ()
    return row


def _min_tokens_bans(st: _ReqState) -> tuple[int, ...]:
    """What a row before ``min_tokens`` bans: the stop token ids, and EOS unless ignored. Under a grammar
    its mask holds EOS back instead (``RequestGrammar``): a complete grammar may be down to EOS, and
    its end is the output's end, so EOS is never banned outright there."""
    banned = st.sampling.min_tokens_banned
    if st.grammar is None:
        return banned
    eos = st.sampling.grammar_eos
    return tuple(t for t in banned if t not in eos)


def _bad_word_bans(
    words: tuple[tuple[int, ...], ...], history: list[int], num_prompt: int, drafts: list[int]
) -> tuple[int, ...]:
    """The last token of every bad word whose other tokens end the output so far (the outputs in
    ``history``, then the ``drafts`` the row follows): sampling it would complete the word. One-token
    words are always banned. Only the words' own lengths of history are read."""
    bans = []
    for w in words:
        need = len(w) - 1  # the word's tokens before its last
        if need > len(history) - num_prompt + len(drafts):
            continue
        before = max(0, need - len(drafts))  # how many of them come before the drafts
        tail = history[len(history) - before :] if before else []
        if list(w[:-1]) == tail + drafts[len(drafts) - (need - before) :]:
            bans.append(w[-1])
    return tuple(bans)


def _ngram_drafter(settings: Any) -> NgramDrafter | None:
    """The core's n-gram drafter when the settings ask for it (the engine checked the executor can verify)."""
    spec = getattr(settings, "speculative_config", None)
    if spec is None or spec.method != "ngram":
        return None
    return NgramDrafter(
        num_speculative_tokens=spec.num_speculative_tokens,
        prompt_lookup_min=spec.prompt_lookup_min,
        prompt_lookup_max=spec.prompt_lookup_max,
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
