"""ModelRunner: the worker side of a step.

It keeps one :class:`WorkerRequest` per request it holds (sampling parameters, token history and
penalty counts, last sampled token, rejected draft positions, drafts, grammar) beside the
:class:`~pypto_serving.input_batch.InputBatch`, the row allocator that holds each request's block
tables on the device; both change by the step message's diffs. It turns a :class:`StepCommand` into
one flat :class:`BatchInput` on the executor's device, calls the executor, samples, verifies drafts
and returns a :class:`StepResult`. A step runs in two parts: :meth:`ModelRunner.launch` queues the
forward and the sampler's device work without reading anything back, :meth:`ModelRunner.finish`
makes the step's host read and the rest; between them the worker may stage the next step's
admissions and blocks (:meth:`ModelRunner.stage`). One :class:`LaunchedStep` carries the step from
the first part to the second, with one :class:`StepRow` per scheduled entry.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .executor import BatchInput, Executor, ExecutorInfo, LoopDraw, StepInterrupt
from .input_batch import InputBatch, StepArrays
from .messages import LoadLora, NewRequestData, ScheduledEntry, StepCommand, StepResult, WireSampling
from .profiler import phase
from .sampler import (
    NON_FINITE,
    DeviceSample,
    DrawKernel,
    LogitEdits,
    RowParams,
    SampleOutput,
    TokenCounts,
    packed,
    plain_greedy,
    prompt_logprobs,
    read_maxima,
    read_sample,
    sample_on_device,
)
from .spec_decode import DraftRow, DraftSampler, NgramDrafter, SpecRow, verify_sampled
from .speculative import drafts_for
from .structured import GRAMMAR_FAILED, GrammarCompiler, HostMask, RequestGrammar, fill_step_mask

__all__ = ["LaunchedStep", "MissingSampledTokenError", "ModelRunner", "StepRow", "WorkerRequest"]


class MissingSampledTokenError(RuntimeError):
    """A decode asked for the last sampled token of a request that has none."""


def _shared(cls: type) -> tuple[str, ...]:
    """The fields of dataclass ``cls`` that :class:`WireSampling` has too: copied by name."""
    return tuple(f.name for f in dataclasses.fields(cls) if f.name in WireSampling.__struct_fields__)


_ROW_KNOBS = _shared(RowParams)  # temperature, the filters and the penalties
_DRAFT_KNOBS = _shared(DraftRow)  # temperature and the filters


class WorkerRequest:
    """Everything the worker keeps of one request: its sampling parameters (the wire struct), token
    history (prompt and the outputs sampled here) and penalty counts, last sampled token, draft
    positions given back, next step's drafts, reused sampler rows and grammar. Its block tables lie
    in the :class:`~pypto_serving.input_batch.InputBatch` row of its id."""

    __slots__ = (
        "counts",
        "draft_probs",
        "drafts",
        "edits",
        "grammar",
        "grammar_error",
        "history",
        "last_base",
        "last_sampled",
        "num_prompt",
        "rejected",
        "request_id",
        "rows",
        "sampling",
        "seed",
    )

    def __init__(self, nr: NewRequestData) -> None:
        self.request_id = nr.request_id
        self.sampling = sp = nr.sampling
        self.seed = nr.seed
        self.num_prompt = len(nr.prompt_token_ids)
        self.history = [*nr.prompt_token_ids, *nr.output_token_ids]  # prompt + outputs sampled here
        # Penalties read the request's device counts plus each row's drafts: no history copy per step.
        self.counts = (
            TokenCounts(prompt=list(nr.prompt_token_ids), outputs=list(nr.output_token_ids))
            if sp.has_penalties
            else None
        )
        has_edits = sp.logit_bias or sp.allowed_token_ids is not None
        self.edits = LogitEdits(bias=sp.logit_bias, allowed=sp.allowed_token_ids) if has_edits else None
        self.last_sampled: int | None = nr.output_token_ids[-1] if nr.output_token_ids else None
        self.rejected = 0  # draft positions given back so far (the scheduler reconciles them later)
        self.drafts: list[int] = []
        self.draft_probs: torch.Tensor | None = None  # [len(drafts), V] q of sampled drafts, on the device
        self.last_base: int | None = None  # outputs before the last step that sampled for this request
        self.rows: list[RowParams] = []  # the sampler's rows of this request, reused across steps
        self.grammar: RequestGrammar | None = None  # structured output: the grammar's state
        self.grammar_error: str | None = None  # the grammar could not be built: the request fails

    @property
    def num_outputs(self) -> int:
        return len(self.history) - self.num_prompt

    @property
    def rejection_sampled(self) -> bool:
        """Whether drafts of this request are verified by rejection sampling. Greedy requests
        keep the argmax comparison. Requests with logprobs, a grammar, logit_bias or allowed_token_ids
        keep sample-and-compare: the sampler reports logprobs of the tokens it draws (not of a
        residual draw), a grammar advances and masks per drafted prefix on the host, and allowed
        tokens with bans can leave a row nothing to sample, an error only the sampler's path reports.
        Requests with a user ``seed`` keep it too: sample-and-compare draws each output token from the
        target law with the request's seeded stream, whatever was drafted (a draft only decides how
        many tokens one step keeps), so a seeded request gives the same tokens with or without
        speculation, in any batch and at any drafting depth; a rejection-sampled token depends on the
        drafts verified, which a timing-driven policy (``adaptive``) chooses."""
        sp = self.sampling
        return (
            sp.temperature > 0 and not sp.seeded and sp.logprobs is None and self.grammar is None and self.edits is None
        )


@dataclass(slots=True, kw_only=True)
class StepRow:
    """One scheduled entry of a step, from :meth:`ModelRunner.launch` to :meth:`ModelRunner.finish`."""

    req: WorkerRequest
    entry: ScheduledEntry
    tokens: list[int]  # its input tokens before the drafts
    drafts: list[int]  # the drafts it verifies
    start: int  # position of its first token (rejections the scheduler had not seen subtracted)
    num_logits: int  # its sampled logits rows: 0, or 1 + drafts
    num_prompt_rows: int = 0  # its first rows score prompt tokens (prompt logprobs)
    prompt_rows: int = 0  # its first rows are prompt tokens (BatchInput.prompt_rows)
    first_logit: int = 0  # its first row among the step's sampled logits rows
    rejects: bool = False  # rejection sampling verifies its drafts (at launch)
    kept: list[int] | None = None  # what rejection sampling kept (None there: non-finite logits)


@dataclass(slots=True, kw_only=True)
class LaunchedStep:
    """A step between :meth:`ModelRunner.launch` and :meth:`ModelRunner.finish`: its rows, batch and
    queued sample, or ``result`` already (an error, or a step with no entries)."""

    cmd: StepCommand
    seconds: float = 0.0  # host time of the step's own parts (and its staging) so far
    result: StepResult | None = None
    rows: list[StepRow] = field(default_factory=list)
    batch: BatchInput | None = None
    params: list[RowParams] = field(default_factory=list)  # one per sampled logits row (reused rows)
    sampled_rows: list[int] = field(default_factory=list)  # logits rows sampled one by one
    device: tuple[DeviceSample, torch.Tensor] | None = None  # their device sample and its packed read
    host_maxima: tuple[torch.Tensor, torch.Tensor] | None = None  # instead: tokens taken, in host memory
    prompt_lps: dict[str, tuple[int, list[dict[int, float]]]] | str = field(default_factory=dict)


@dataclass(slots=True, kw_only=True)
class _Staged:
    """The next step, staged: the command, its staging time, and what staging raised (if anything)."""

    cmd: StepCommand
    seconds: float
    error: Exception | None


class LoraReads:
    """LoRA adapters the executor reads in a background thread while steps run (``ReadLora``),
    kept until the ``LoadLora`` that installs them takes them; :meth:`done` names the reads that
    ended since its previous call, for the step result."""

    def __init__(self, executor: Executor) -> None:
        self.executor = executor
        self._pool: ThreadPoolExecutor | None = None  # made at the first read
        self._reads: dict[str, Future[Any]] = {}
        self._reported: set[str] = set()

    def start(self, key: str, path: str) -> None:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="pypto-lora-read")
        self._reads[key] = self._pool.submit(self.executor.read_lora, key, path)

    def done(self) -> list[str]:
        ended = [k for k, f in self._reads.items() if f.done() and k not in self._reported]
        self._reported.update(ended)
        return ended

    def take(self, key: str, path: str) -> Any:
        """The adapter read for ``key`` (its read's error raised), or read now when none was started."""
        read = self._reads.pop(key, None)
        self._reported.discard(key)
        return self.executor.read_lora(key, path) if read is None else read.result()

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)


class ModelRunner:
    #: Fill a step's grammar masks on a thread while its forward runs (llguidance and numpy release
    #: the GIL) rather than before it; the masks are the same either way. None: when the forward
    #: leaves a core free, i.e. it runs on an accelerator, or on the CPU with fewer intra-op threads
    #: than cores (a fill beside a forward on every core slows both: benchmarks/structured.py).
    overlap_grammar_masks: bool | None = None

    def __init__(self, executor: Executor, settings: Any) -> None:
        self.executor = executor
        self.settings = settings
        self.states: dict[str, WorkerRequest] = {}
        self.info: ExecutorInfo | None = None
        self._input_batch: InputBatch | None = None
        self._ngram = _ngram_drafter(settings)
        self._drafts_for = drafts_for(settings)  # the requests the policy can give drafts: only they draft
        # Only an executor that runs greedy loops is offered them (no batch built for one that cannot).
        self._greedy_loops = type(executor).greedy_steps is not Executor.greedy_steps
        self._sampled_loops = type(executor).sampled_steps is not Executor.sampled_steps
        self._grammars = GrammarCompiler(getattr(settings, "tokenizer", None) or getattr(settings, "model", None))
        self.lora_reads = LoraReads(executor)
        self._mask_thread: ThreadPoolExecutor | None = None  # made by the first constrained step
        self._staged: _Staged | None = None  # the next step's admissions and blocks, taken early
        self._compiles_of: StepCommand | None = None  # the last command whose grammars were taken
        self.kv_link: tuple[Callable[[Any], Any], Any] | None = None  # a KV connector's factory and pipe
        self.kv_rank = 0  # this worker's tensor-parallel rank: its connector listens on kv_port + kv_rank
        self._kv_thread: threading.Thread | None = None
        # A plain greedy step whose tokens the executor took, in host memory, reads them as they are
        # (sampler.read_maxima) instead of through the device sample and its packed read.
        self.host_greedy_reads = True
        self.draw: DrawKernel | None = None  # the executor's draw of sampled rows, asked after load
        # Counts the engine's arrivals while a command of several forwards runs: one it had not taken
        # when it scheduled the command ends the command after the forward running (set by the worker
        # where the engine can count them).
        self.interrupt: StepInterrupt | None = None

    def load(self) -> ExecutorInfo:
        self.info = self.executor.load()
        try:
            self.device = self.executor.device
        except AttributeError:
            raise TypeError(
                f"{type(self.executor).__name__}.load() must set self.device (a torch.device): "
                "the runner places every BatchInput tensor there"
            ) from None
        self.draw = self.executor.draw_kernel()
        return self.info

    def init_kv_cache(self, num_blocks: dict[str, int]) -> None:
        self.executor.init_kv_cache(num_blocks)
        if self.kv_link is not None:
            self._start_kv_service(*self.kv_link)

    def _start_kv_service(self, factory: Callable[[Any], Any], conn: Any) -> None:
        """Disaggregated serving: the KV connector over the caches just allocated (kv_ledger.py)."""
        from .kv_ledger import start_kv_service

        caches = self.executor.kv_cache_blocks()
        if caches is None:
            raise TypeError(
                f"{type(self.executor).__name__} cannot move its KV cache (kv_cache_blocks() is None), so it "
                "cannot serve a kv_role or offload tiers; unset kv_role, kv_offload_host_bytes and kv_offload_disk_path"
            )
        config = self.settings.kv_transfer()
        if config is not None and config.kv_port and self.kv_rank:  # each rank listens on a port of its own
            config = config.model_copy(update={"kv_port": config.kv_port + self.kv_rank})
        self._kv_thread = start_kv_service(factory(config), caches, conn)

    def install_lora(self, cmd: LoadLora) -> None:
        """Install an adapter between steps: the one read in the background for its key (waiting for
        the read if it still runs), or read now."""
        self.executor.install_lora(cmd.key, self.lora_reads.take(cmd.key, cmd.path), cmd.slot)

    def shutdown(self) -> None:
        if self._kv_thread is not None:  # the engine closed the connector before this: let it finish
            self._kv_thread.join(timeout=10)
        self.lora_reads.shutdown()
        if self._mask_thread is not None:
            self._mask_thread.shutdown(wait=True)
        self.executor.shutdown()

    @property
    def input_batch(self) -> InputBatch:
        """The row allocator, made on first use (the executor's info and device are known by then)."""
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
        with phase("launch"):
            launched = self.launch(cmd)
        with phase("finish"):
            return self.finish(launched)

    def launch(self, cmd: StepCommand) -> LaunchedStep:
        """A step's first part: finished requests leave, new requests and blocks enter (unless
        :meth:`stage` took them), the batch is built, the forward and the sampler's device work are
        queued. Nothing the device computes for the sampled rows is read, so on an accelerator this
        returns while the device still works (steps with prompt logprobs or rejection-sampled drafts
        read their scores here); :meth:`finish` makes the step's host read."""
        t0 = time.perf_counter()
        if self.interrupt is not None:  # its forwards stop at an arrival after the count it was scheduled after
            self.interrupt.seen = cmd.arrivals_seen
        staged, self._staged = self._staged, None
        assert staged is None or staged.cmd is cmd, "a staged step runs next, before any other"
        step = LaunchedStep(cmd=cmd)
        looped = None
        try:
            self._take_grammars(cmd)
            self._enter(cmd, staged)
            if not cmd.entries:
                step.result = StepResult(step_id=cmd.step_id)
            elif (looped := self._greedy_command(cmd)) is None:
                self._forward(step)
            else:
                step.result = looped
        except Exception as e:
            step.result = _failed(cmd, e)
        step.seconds = time.perf_counter() - t0 + (0.0 if staged is None else staged.seconds)
        if looped is not None:
            looped.execute_seconds = step.seconds
        return step

    def _greedy_command(self, cmd: StepCommand) -> StepResult | None:
        """Run a command of plain decodes whole, its first forward too, as one executor loop
        (:meth:`_greedy_run`), where every entry decodes one token over several forwards, or the one
        request alone over one or more on the CPU, and its request takes the argmax of its logits as
        they come (a lone request's one forward on the host is then the executor's one call without the
        interpreter between its kernels: Qwen3-0.6B's concurrency-1 token 4-5 % shorter on the CPU of
        docs/benchmarks.md, whose 50 ms of forwards a command hold one of its forwards; an
        accelerator's forward is device work queued, which a loop does not shorten). Returns the result
        of the forwards the loop ran (:meth:`finish` runs whatever it left), or None where it ran none
        (declined, raised, or stopped before the first): the command then runs as ever and meets what
        stopped the loop."""
        alone = len(cmd.entries) == 1 and self.device.type == "cpu"
        if not all((e.num_steps > 1 or alone) and e.sample and not e.num_draft and _one_input(e) for e in cmd.entries):
            return None
        result = StepResult(step_id=cmd.step_id)
        if not self._greedy_run({e.request_id: e for e in cmd.entries}, 0, result):
            return None
        return result

    def finish(self, step: LaunchedStep) -> StepResult:
        """A step's second part: its one host read of the sampled tokens, then verification, the
        requests' states, next step's drafts and the result, with the requests whose grammar
        finished compiling meanwhile (failed steps too: readiness is not the step's)."""
        result = self._finish(step)
        if result.error is None and any(e.num_steps > 1 for e in step.cmd.entries):
            self._run_steps(step.cmd, result)
        result.grammars_ready = self._grammars.compiled()
        result.loras_read = self.lora_reads.done()
        return result

    def _finish(self, step: LaunchedStep) -> StepResult:
        if step.result is not None:
            return step.result
        t0 = time.perf_counter()
        try:
            result = self._finish_sample(step)
            if isinstance(step.prompt_lps, str):  # the executor returned the sampled rows only
                _fail_prompt_rows(result, step.rows, step.prompt_lps)
            else:
                result.prompt_logprobs = step.prompt_lps
            t_draft = time.perf_counter()
            self._draft(step, result)
            result.draft_seconds = time.perf_counter() - t_draft
        except Exception as e:
            return _failed(step.cmd, e)
        result.execute_seconds = step.seconds + time.perf_counter() - t0
        return result

    def _run_steps(self, cmd: StepCommand, result: StepResult) -> None:
        """The further forwards of ``cmd``'s multi-step decodes (``ScheduledEntry.num_steps``) after
        the ``result.num_forwards`` run so far, one after another, each a step of its own over the
        requests still going: the same rows, positions and sampler draws as that many one-step
        commands, so the tokens are theirs. A request stops at
        a token that ends it (its stop ids, and EOS unless ignored: the tokens that cannot be sampled
        before ``min_tokens``) and at an error, which the forwards after the first do not report: the
        next command computes that position again and meets it there. Each request's positions not
        computed are counted as given back, as the scheduler counts them. Where every request takes
        the argmax of its logits as they come, the executor may run the forwards as one loop
        (:meth:`_greedy_run`); the forwards it leaves run here one by one. An arrival after the
        command's scheduling (:attr:`interrupt`) ends it after the forward running."""
        done, fuse = result.num_forwards, True
        going = {e.request_id: e for e in cmd.entries if e.num_steps > done and self._goes_on(e.request_id, result)}
        while going and not (self.interrupt is not None and self.interrupt.is_set()):
            ran = self._greedy_run(going, done, result) if fuse else None
            fuse = ran is not None
            if not ran:
                ran = self._one_forward(cmd.step_id, going, done, result)
            if not ran:
                break
            done += ran
        for e in cmd.entries:
            if e.num_steps > 1 and e.request_id in result.sampled:
                self.states[e.request_id].rejected += e.num_steps - len(result.sampled[e.request_id])

    def _one_forward(self, step_id: int, going: dict[str, ScheduledEntry], done: int, result: StepResult) -> int:
        """Forward ``done + 1`` of the multi-step decodes in ``going`` as a step of its own, its tokens
        added to ``result``; requests that end or reach their forwards leave ``going``. Returns 1, or 0
        where the forward failed (its error left to the next command)."""
        entries = [_next_forward(e, done) for e in going.values()]
        sub = LaunchedStep(cmd=StepCommand(step_id, [], entries, []))
        t0 = time.perf_counter()
        try:
            self._forward(sub)
        except Exception:
            return 0
        sub.seconds = time.perf_counter() - t0  # the forward's time, counted in the command's
        more = self._finish(sub)
        if more.error is not None:
            return 0
        result.execute_seconds += more.execute_seconds
        result.num_forwards = done + 1
        for e in entries:
            rid = e.request_id
            if rid in more.sampled:
                result.sampled[rid] += more.sampled[rid]
                if rid in more.logprobs:
                    result.logprobs[rid] += more.logprobs[rid]
            if not self._goes_on(rid, more) or going[rid].num_steps <= done + 1:
                del going[rid]
        return 1

    def _greedy_run(self, going: dict[str, ScheduledEntry], done: int, result: StepResult) -> int | None:
        """Forwards ``done + 1`` on of the multi-step decodes in ``going`` as one executor loop
        (:meth:`Executor.greedy_steps`), up to the fewest forwards any of them has left, where every
        request takes the argmax of its logits as they come (:func:`_loop_draw` None), or through
        :meth:`Executor.sampled_steps` where some request samples them and reads nothing else
        (:func:`_loop_draw`): the tokens are those of the forwards one by one, committed here forward
        by forward. Returns the forwards run (0 where the loop stopped before its first: that forward
        then runs on its own and meets what stopped it), or None where the executor did not take the
        run or raised (the command's other forwards then run one by one)."""
        if not self._greedy_loops or self._ngram is not None:
            return None
        draws = [_loop_draw(self.states[rid]) for rid in going]
        if any(d is False for d in draws) or (not self._sampled_loops and any(draws)):
            return None
        # The command's own entries for its first forward (their input tokens as scheduled).
        entries = [_next_forward(e, done) if done else e for e in going.values()]
        steps = min(e.num_steps for e in going.values()) - done
        stops = [frozenset(self.states[e.request_id].sampling.min_tokens_banned) for e in entries]
        t0 = time.perf_counter()
        try:
            batch, _ = self._build_batch(entries)
            batch.greedy_maxima = batch.maxima_only = True
            batch.interrupt = self.interrupt
            if any(draws):
                loop = [d if isinstance(d, LoopDraw) else None for d in draws]
                forwards = self.executor.sampled_steps(batch, steps, stops, loop)
            else:
                forwards = self.executor.greedy_steps(batch, steps, stops)
        except Exception:
            return None  # the forwards one by one meet the error as ever (or run where only the loop failed)
        if forwards is None:
            return None
        if len(forwards) > steps or any(len(tokens) != len(entries) for tokens in forwards):
            raise RuntimeError(
                f"{type(self.executor).__name__}'s loop gave {[len(t) for t in forwards]} tokens for "
                f"{len(entries)} requests and at most {steps} forwards"
            )
        for tokens in forwards:
            for e, token in zip(entries, tokens):
                rid = e.request_id
                if rid not in result.sampled or self._goes_on(rid, result):  # nothing after a token that ends it
                    _commit_greedy(self.states[rid], int(token), result)
        result.execute_seconds += time.perf_counter() - t0
        if forwards:
            result.num_forwards = done + len(forwards)
        for e in entries:
            if not self._goes_on(e.request_id, result) or going[e.request_id].num_steps <= done + len(forwards):
                del going[e.request_id]
        return len(forwards)

    def _goes_on(self, rid: str, result: StepResult) -> bool:
        """Whether a multi-step decode of ``rid`` runs another forward after ``result``: it sampled,
        and not a token that ends it."""
        tokens = result.sampled.get(rid)
        if not tokens:
            return False
        return tokens[-1] not in self.states[rid].sampling.min_tokens_banned

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

    def _forward(self, step: LaunchedStep) -> None:
        """Build the batch, run the forward, queue the sampling: everything before the host read."""
        step.batch, step.rows = self._build_batch(step.cmd.entries)
        step.batch.greedy_maxima = _greedy_maxima(step.rows)
        step.params = self._row_params(step.rows)
        masks = self._start_masks(step.rows)
        step.batch.maxima_only = step.batch.greedy_maxima and masks is None and plain_greedy(step.params)
        try:
            with phase("forward"):
                logits = self.executor.execute(step.batch)
                maxima = self._logits_maxima(step.batch, logits)
            logits = self._split_prompt_rows(step, logits)
            with phase("sample"):
                self._launch_sample(step, logits, masks, maxima)
        finally:
            if masks is not None:
                masks.exception()  # the fill is done before anything else touches the grammars

    def _logits_maxima(self, batch: BatchInput, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The executor's maxima of the step's logits rows, where it asked for them and took them."""
        maxima = self.executor.logits_maxima() if batch.greedy_maxima else None
        if maxima is not None and not all(t.shape == logits.shape[:1] for t in maxima):
            shapes = [tuple(t.shape) for t in maxima]
            raise RuntimeError(f"{type(self.executor).__name__}.logits_maxima gave {shapes} for {logits.shape[0]} rows")
        if logits.shape[-1] == 0 and logits.shape[0] and (maxima is None or not batch.maxima_only):
            raise RuntimeError(
                f"{type(self.executor).__name__}.execute returned logits of no columns for a step that reads them"
            )
        return maxima

    def _admit(self, nr: NewRequestData) -> None:
        self.input_batch.add(nr.request_id)
        st = self.states[nr.request_id] = WorkerRequest(nr)
        spec = nr.sampling.structured
        if spec is not None:
            try:  # a request resuming after preemption replays its outputs through its grammar
                st.grammar = self._grammars.matcher(
                    spec, nr.sampling.grammar_eos, nr.sampling.min_tokens, nr.request_id
                )
                # The grammar compiles on the compiler's thread; only a replay waits for it here.
                if nr.output_token_ids and not st.grammar.advance(list(nr.output_token_ids)):
                    st.grammar_error = f"{GRAMMAR_FAILED}{st.grammar.error}"
            except ValueError as e:
                st.grammar_error = f"{GRAMMAR_FAILED}{e}"

    def _append_blocks(self, entries: list[ScheduledEntry]) -> None:
        ib = self.input_batch
        for e, row in zip(entries, self._batch_rows(entries)):  # every entry names a request here
            ib.append_blocks(row, e.new_block_ids)

    # ------------------------------------------------------------------ batch
    def _build_batch(self, entries: list[ScheduledEntry]) -> tuple[BatchInput, list[StepRow]]:
        """The step's rows and its flat batch on the executor's device."""
        batch_rows = self._batch_rows(entries)
        rows = [self._step_row(e) for e in entries]
        ids: list[int] = []
        for r in rows:
            ids += r.tokens
            ids += r.drafts
        query_lens = [len(r.tokens) + len(r.drafts) for r in rows]
        num_logits = [r.num_logits for r in rows]
        num_prompt = [r.num_prompt_rows for r in rows]
        step = StepArrays(
            rows=np.array(batch_rows, dtype=np.int64),
            starts=np.array([r.start for r in rows], dtype=np.int64),
            query_lens=np.array(query_lens, dtype=np.int64),
            num_logits=np.array(num_logits, dtype=np.int64),
            input_ids=np.array(ids, dtype=np.int64),
            num_prompt_logits=np.array(num_prompt, dtype=np.int64),
            one_token_each=len(rows) == query_lens.count(1) == num_logits.count(1) and not any(num_prompt),
        )
        t = self.input_batch.prepare(step)
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
            loras=_batch_loras(self.states, entries),
            prompt_rows=[r.prompt_rows for r in rows],
        )
        return batch, rows

    def _step_row(self, e: ScheduledEntry) -> StepRow:
        """What entry ``e`` computes this step: its input tokens, drafts, positions and logits rows."""
        st = self.states[e.request_id]
        tokens = [_last_sampled(st)] if e.use_last_sampled else e.token_ids
        drafts = self._drafts_to_verify(st, e) if e.num_draft else []
        if e.sample:
            st.last_base = st.num_outputs
        # Rejections the scheduler had not reconciled when it scheduled this entry.
        start = e.start_pos - (st.rejected - e.rejected_seen)
        row = StepRow(
            req=st,
            entry=e,
            tokens=tokens,
            drafts=drafts,
            start=start,
            num_logits=1 + len(drafts) if e.sample else 0,
            rejects=bool(drafts) and self._rejects(st),
            prompt_rows=max(0, min(len(tokens), st.num_prompt - start)),
        )
        if st.sampling.prompt_logprobs is not None and not e.use_last_sampled:
            # Its first rows are prompt positions whose next token is a prompt token.
            end = start + len(tokens) + len(drafts)
            row.num_prompt_rows = max(0, min(end, st.num_prompt - 1) - start)
        return row

    def _rejects(self, st: WorkerRequest) -> bool:
        """Whether rejection sampling verifies ``st``'s drafts: its sampling allows it, and the
        drafts' distribution is known: the executor drafter's ``q``, or a point mass for n-gram drafts."""
        return st.rejection_sampled and (st.draft_probs is not None or self._ngram is not None)

    def _drafts_to_verify(self, st: WorkerRequest, e: ScheduledEntry) -> list[int]:
        """The drafts ``e`` verifies.

        Rejection sampling emits tokens that depend on how many drafts each step verifies, and near
        a request's output limit (``max_tokens`` or the context length) the scheduler caps
        ``num_draft`` from the outputs it has seen, which under async scheduling lag by the step in
        flight. A rejection-sampled request therefore verifies at most ``room - k_max - 2`` drafts,
        ``room`` counted from the outputs before its previous sampling step: the previous step
        emitted at most ``1 + k_max`` tokens, so neither strategy's cap is below this one, and sync
        and async verify the same drafts and emit the same tokens."""
        k = e.num_draft
        if self._rejects(st) and st.last_base is not None:
            assert self.info is not None
            room = self.info.max_model_len - st.num_prompt - st.last_base
            if st.sampling.max_tokens is not None:
                room = min(room, st.sampling.max_tokens - st.last_base)
            k_max = self.info.max_draft_tokens if self._ngram is None else self._ngram.num_speculative_tokens
            k = max(0, min(k, room - k_max - 2))
        return st.drafts[:k]

    def _split_prompt_rows(self, step: LaunchedStep, logits: torch.Tensor) -> torch.Tensor:
        """The sampled rows of ``logits``; the prompt logprobs of the prompt rows before them go to
        ``step.prompt_lps`` (request id -> (index of the first prompt token they score, one entry per
        token)). An executor that returns the sampled rows only gives the reason instead: those
        requests fail alone."""
        num_prompt = sum(r.num_prompt_rows for r in step.rows)
        if not num_prompt:
            return logits
        num_sampled = sum(r.num_logits for r in step.rows)
        if logits.shape[0] == num_sampled:
            step.prompt_lps = f"{type(self.executor).__name__} returns no logits for prompt rows: no prompt logprobs"
            return logits
        if logits.shape[0] != num_prompt + num_sampled:
            raise RuntimeError(
                f"{type(self.executor).__name__}.execute returned {logits.shape[0]} logits rows for "
                f"{num_prompt + num_sampled} logits_indices; prompt logprobs need one row per index"
            )
        sampled: list[int] = []
        scored: list[int] = []
        targets: list[int] = []
        tops: list[int] = []
        at = 0
        for r in step.rows:
            m = r.num_prompt_rows
            scored += range(at, at + m)
            sampled += range(at + m, at + m + r.num_logits)
            targets += r.req.history[r.start + 1 : r.start + 1 + m]
            tops += [r.req.sampling.prompt_logprobs or 0] * m
            at += m + r.num_logits
        dev = logits.device
        lps = prompt_logprobs(logits.index_select(0, torch.tensor(scored, device=dev)), targets, tops)
        out: dict[str, tuple[int, list[dict[int, float]]]] = {}
        for r in step.rows:
            if r.num_prompt_rows:
                out[r.req.request_id] = (r.start + 1, lps[: r.num_prompt_rows])
                lps = lps[r.num_prompt_rows :]
        step.prompt_lps = out
        return logits.index_select(0, torch.tensor(sampled, dtype=torch.long, device=dev))

    def _batch_rows(self, entries: list[ScheduledEntry]) -> list[int]:
        """The allocator's row of each entry's request."""
        row_of = self.input_batch.row_of
        try:
            return [row_of[e.request_id] for e in entries]
        except KeyError as missing:
            raise RuntimeError(f"the worker has no state for request {missing.args[0]!r}") from None

    # ------------------------------------------------------------------ drafts
    def _draft(self, step: LaunchedStep, result: StepResult) -> None:
        """Next step's drafts of every request that sampled: the core's n-gram drafter over the token
        histories when ``speculative_config.method`` is ``ngram``, else the executor's own drafter;
        at most ``cmd.draft_depth`` of them where the policy set a drafting depth."""
        assert step.batch is not None
        depth = step.cmd.draft_depth
        step.batch.draft_depth = depth
        step.batch.num_drafts = [r.entry.num_propose for r in step.rows]
        if self._ngram is not None:
            sampled = [r for r in step.rows if r.req.request_id in result.sampled]
            drafting = [r.req for r in sampled if r.entry.num_propose != 0] if depth != 0 else []
            proposed = self._ngram.propose([st.history for st in drafting]) if drafting else []
            drafted = {st.request_id: drafts for st, drafts in zip(drafting, proposed)}
            for r in sampled:
                r.req.drafts = _capped(drafted.get(r.req.request_id, []), depth, r.entry.num_propose)
                r.req.draft_probs = None
            return
        # Only requests the policy can give drafts get accepted tokens: the executor drafts for no other row.
        accepted = [
            result.sampled.get(r.req.request_id, []) if self._drafts_for(r.req.sampling) else [] for r in step.rows
        ]
        sampler = self._draft_sampler(step.rows, result)
        proposals = (
            self.executor.propose_drafts(step.batch, accepted)
            if sampler is None
            else self.executor.propose_sampled_drafts(step.batch, accepted, sampler)
        )
        for i, (r, drafts) in enumerate(zip(step.rows, proposals)):
            if r.req.request_id in result.sampled:
                r.req.drafts = _capped(drafts, depth, r.entry.num_propose)
                r.req.draft_probs = None if sampler is None else sampler.probs(i, len(r.req.drafts))

    def _draft_sampler(self, rows: list[StepRow], result: StepResult) -> DraftSampler | None:
        """The sampler of the executor's drafts: requests verified by rejection sampling draw theirs;
        None when there is none (every draft is an argmax)."""
        draws: dict[int, DraftRow] = {}
        for i, r in enumerate(rows):
            st = r.req
            if st.request_id in result.sampled and st.rejection_sampled and r.entry.num_propose != 0:
                knobs = {name: getattr(st.sampling, name) for name in _DRAFT_KNOBS}
                draws[i] = DraftRow(**knobs, seed=st.seed, first_index=st.num_outputs)
        return DraftSampler(draws) if draws else None

    # ------------------------------------------------------------------ sample and verify
    def _start_masks(self, rows: list[StepRow]) -> Future[HostMask | None] | None:
        """The grammar masks of the rows sampled one by one (every row rejection sampling does not
        verify), filling on the mask thread while the forward runs; None when none of them is constrained."""
        grammars = [(r.req.grammar, r.num_logits, r.drafts) for r in rows if not r.rejects]
        if not any(g is not None and n for g, n, _ in grammars):
            return None
        # A step whose rows all take their argmax lists fewer rows by id (the sampler checks the
        # argmax of the others); another step's sampler treats those rows as unlisted, as exactly.
        greedy = all(r.req.sampling.temperature == 0.0 for r in rows if not r.rejects and r.num_logits)
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
        step: LaunchedStep,
        logits: torch.Tensor,
        masks: Future[HostMask | None] | None,
        maxima: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """The sampler rows, the verdicts of the rows rejection sampling verifies, and the device
        sample of every other logits row (``maxima``: the executor's of every logits row), queued
        but not read (``step.params``: the rows' parameters, set before the forward)."""
        if not step.params:
            return
        self._verify_rejection(step, logits)
        step.sampled_rows = [
            j for r in step.rows if not r.rejects for j in range(r.first_logit, r.first_logit + r.num_logits)
        ]
        rows = step.sampled_rows
        if rows:
            every = len(rows) == len(step.params)
            at = None if every else torch.tensor(rows, device=logits.device)
            sub = logits if at is None else logits.index_select(0, at)
            if maxima is not None and at is not None:
                maxima = (maxima[0].index_select(0, at), maxima[1].index_select(0, at))
            if self._reads_maxima(logits, maxima, masks, every, step.params):
                step.host_maxima = maxima
                return
            host = None if masks is None else masks.result()
            grammar = None if host is None else host.to(logits.device)
            dev = sample_on_device(sub, [step.params[j] for j in rows], grammar, maxima, self.draw)
            step.device = (dev, packed(dev))

    def _reads_maxima(
        self,
        logits: torch.Tensor,
        maxima: tuple[torch.Tensor, torch.Tensor] | None,
        masks: Future[HostMask | None] | None,
        every: bool,
        params: list[RowParams],
    ) -> bool:
        """Whether the step's sample is the executor's maxima, read from host memory: every logits row
        sampled, each plain greedy, no grammar, on the CPU (:func:`~pypto_serving.sampler.read_maxima`)."""
        on_host = logits.device.type == "cpu" and self.host_greedy_reads
        return on_host and maxima is not None and masks is None and every and plain_greedy(params)

    def _verify_rejection(self, step: LaunchedStep, logits: torch.Tensor) -> None:
        """Rejection-sample the drafts of the rows that take it: ``q`` of the executor drafter's
        sampled drafts, or a point mass at each n-gram draft. Sets each such row's ``kept``."""
        rejecting = [r for r in step.rows if r.rejects]
        if not rejecting:
            return
        rows = [j for r in rejecting for j in range(r.first_logit, r.first_logit + r.num_logits)]
        every = len(rows) == len(step.params)
        sub = logits if every else logits.index_select(0, torch.tensor(rows, device=logits.device))
        q: torch.Tensor | None = None
        if self._ngram is None:
            probs = [r.req.draft_probs for r in rejecting]
            q = torch.cat([p.narrow(0, 0, len(r.drafts)) for p, r in zip(probs, rejecting) if p is not None])
        spec = [
            SpecRow(seed=r.req.seed, first_index=r.req.num_outputs, num_drafts=len(r.drafts), greedy=False)
            for r in rejecting
        ]
        params = [step.params[j] for j in rows]
        for r, kept in zip(rejecting, verify_sampled(sub, params, [r.drafts for r in rejecting], q, spec)):
            r.kept = kept

    def _row_params(self, rows: list[StepRow]) -> list[RowParams]:
        """One sampler row per logits row: row ``j`` of a request follows its first ``j`` drafts."""
        params: list[RowParams] = []
        for r in rows:
            st = r.req
            r.first_logit = len(params)
            while len(st.rows) < r.num_logits:  # built once per request and logits row, then updated in place
                st.rows.append(_row(st))
            base = st.num_outputs
            for j in range(r.num_logits):
                params.append(_update(st, st.rows[j], base + j, r.drafts[:j]))
        return params

    def _finish_sample(self, step: LaunchedStep) -> StepResult:
        """Read the step's sample (its one host read) and verify every row into a result."""
        result = StepResult(step_id=step.cmd.step_id)
        if not step.params:
            return result
        out = SampleOutput([], [], {})
        if step.host_maxima is not None:
            out = read_maxima(step.host_maxima)
        elif step.device is not None:
            out = read_sample(*step.device, [step.params[j] for j in step.sampled_rows])
        at = {j: i for i, j in enumerate(step.sampled_rows)}  # logits row -> its row in ``out``
        result.num_accepted_per_pos = [0] * max((len(r.drafts) for r in step.rows), default=0)
        for r in step.rows:
            if r.num_logits:
                self._commit(
                    r, out, [at.get(j, -1) for j in range(r.first_logit, r.first_logit + r.num_logits)], result
                )
        return result

    def _commit(self, r: StepRow, out: SampleOutput, rows: list[int], result: StepResult) -> None:
        """Keep the tokens ``r`` accepts (``rows``: its rows of ``out``, -1 where rejection sampling
        verified it), commit them to its request and record them in ``result``."""
        st = r.req
        rid = st.request_id
        err = next((out.errors[j] for j in rows if j in out.errors), st.grammar_error)
        if r.rejects and r.kept is None:
            err = err or NON_FINITE
        if err is not None:
            result.request_errors[rid] = err
            return
        kept = r.kept if r.kept is not None else _accept([out.tokens[j] for j in rows], r.drafts)
        if any(j in out.empty for j in rows[: len(kept)]):  # a discarded row's emptiness does not count
            result.request_errors[rid] = _NOTHING_ALLOWED
            return
        if st.grammar is not None and not st.grammar.advance(kept):
            result.request_errors[rid] = f"{GRAMMAR_FAILED}{st.grammar.error}"
            return
        for j in range(len(kept) - 1):
            result.num_accepted_per_pos[j] += 1
        result.num_drafted += len(r.drafts)
        result.num_verify_steps += bool(r.drafts)
        st.history += kept
        if st.counts is not None:
            st.counts.extend(kept)
        st.last_sampled = kept[-1]
        st.rejected += r.entry.num_draft - (len(kept) - 1)
        result.sampled[rid] = kept
        if st.sampling.logprobs is not None:
            result.logprobs[rid] = [out.logprobs[j] or {} for j in rows[: len(kept)]]


_NOTHING_ALLOWED = (
    "every token is banned for this request: its allowed_token_ids, bad_words, logit_bias and grammar "
    "leave nothing to sample"
)


def _greedy_maxima(rows: list[StepRow]) -> bool:
    """Whether the maxima of a step's logits rows serve its sampler: some row is greedy, and every
    logits row is a sampled one (no prompt logprobs rows beside them)."""
    greedy = any(r.num_logits and r.req.sampling.temperature == 0.0 for r in rows)
    return greedy and not any(r.num_prompt_rows for r in rows)


def _failed(cmd: StepCommand, e: Exception) -> StepResult:
    msg = f"{type(e).__name__}: {e}"
    tb = "".join(traceback.format_exception(e)[-2:])
    return StepResult(step_id=cmd.step_id, error=f"{msg}\n{tb}".strip())


def _fail_prompt_rows(result: StepResult, rows: list[StepRow], reason: str) -> None:
    """Fail the requests whose prompt logprobs could not be computed; the others keep their tokens."""
    for r in rows:
        if r.num_prompt_rows:
            rid = r.req.request_id
            result.request_errors[rid] = reason
            result.sampled.pop(rid, None)
            result.logprobs.pop(rid, None)


def _next_forward(e: ScheduledEntry, done: int) -> ScheduledEntry:
    """Forward ``done + 1`` of multi-step decode ``e``: one token, the request's last sampled one."""
    return ScheduledEntry(
        request_id=e.request_id,
        token_ids=[],
        use_last_sampled=True,
        num_draft=0,
        start_pos=e.start_pos + done,
        rejected_seen=e.rejected_seen,
        new_block_ids={},
        sample=True,
        num_propose=0,
    )


def _one_input(e: ScheduledEntry) -> bool:
    """Whether ``e`` computes one input token: the request's last sampled one or one it names."""
    return e.use_last_sampled or len(e.token_ids) == 1


def _reads_only_its_draw(st: WorkerRequest) -> bool:
    """Whether every further forward of ``st`` reads nothing of its logits but its token's draw: no
    logprobs, nothing that edits its logits (penalties, logit bias, allowed tokens, bad words, the
    ``min_tokens`` bans while they last) and no grammar."""
    sp = st.sampling
    plain = sp.logprobs is None and st.counts is None and st.edits is None
    unbanned = not sp.bad_words_token_ids and st.num_outputs >= sp.min_tokens
    return plain and unbanned and st.grammar is None and st.grammar_error is None


def _loop_draw(st: WorkerRequest) -> LoopDraw | bool | None:
    """How a loop of forwards (:meth:`ModelRunner._greedy_run`) draws ``st``'s tokens: None where it
    takes their argmax (greedy) and reads nothing else of its logits (:func:`_reads_only_its_draw`),
    its :class:`LoopDraw` where it samples them and reads nothing else, False where neither."""
    if not _reads_only_its_draw(st):
        return False
    if st.sampling.temperature == 0.0:
        return None
    knobs = {name: getattr(st.sampling, name) for name in _DRAFT_KNOBS}
    return LoopDraw(**knobs, seed=st.seed, first_index=st.num_outputs)


def _commit_greedy(st: WorkerRequest, token: int, result: StepResult) -> None:
    """Commit one forward's ``token`` of a :meth:`ModelRunner._greedy_run` to its request and ``result``,
    as :meth:`ModelRunner._commit` commits a sampled token without drafts."""
    st.last_base = st.num_outputs
    st.history.append(token)
    st.last_sampled = token
    result.sampled.setdefault(st.request_id, []).append(token)


def _last_sampled(st: WorkerRequest) -> int:
    if st.last_sampled is None:
        raise MissingSampledTokenError(
            f"request {st.request_id!r}: decode asks for the last sampled token, but none was sampled"
        )
    return st.last_sampled


def _capped(drafts: list[int], depth: int | None, num_propose: int) -> list[int]:
    """``drafts`` cut to the step's drafting depth and to the entry's ``num_propose`` (-1: no cap):
    the request's next decode verifies at most that many."""
    cap = len(drafts) if depth is None else depth
    return list(drafts[: cap if num_propose < 0 else min(cap, num_propose)])


def _row(st: WorkerRequest) -> RowParams:
    """A request's sampler parameters, copied by name from its wire struct; :func:`_update` sets
    the draw and its drafts."""
    sp = st.sampling
    knobs = {name: getattr(sp, name) for name in _ROW_KNOBS}
    return RowParams(**knobs, seed=st.seed, draw_index=0, num_logprobs=sp.logprobs, counts=st.counts, edits=st.edits)


def _update(st: WorkerRequest, row: RowParams, draw_index: int, drafts: list[int]) -> RowParams:
    """``row`` set to sample the request's output ``draw_index`` after ``drafts``."""
    row.draw_index = draw_index
    row.banned = _min_tokens_bans(st) if draw_index < st.sampling.min_tokens else ()
    if st.sampling.bad_words_token_ids:
        row.banned += _bad_word_bans(st.sampling.bad_words_token_ids, st.history, st.num_prompt, drafts)
    row.drafts = tuple(drafts) if st.counts is not None else ()
    return row


def _min_tokens_bans(st: WorkerRequest) -> tuple[int, ...]:
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


def _batch_loras(states: dict[str, WorkerRequest], entries: list[ScheduledEntry]) -> list[str | None] | None:
    """Each entry's LoRA adapter in batch order, or None when every request runs the base model."""
    loras = [states[e.request_id].sampling.lora for e in entries]
    return loras if any(name is not None for name in loras) else None
