"""Scheduler: continuous batching with chunked prefill, prefix caching and preemption by recompute.

``schedule()`` picks this step's work and advances each request *optimistically*: its computed
count moves by the scheduled tokens plus granted drafts, and a sampling entry reserves ``1 + k``
output placeholders. ``update()`` applies the worker's result and gives back what did not happen
(rejected drafts). The sync strategy calls them alternately; the async strategy keeps two steps in
flight, which the placeholders make safe.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Literal

import msgspec

from .executor import ExecutorInfo
from .kv_cache import KVCacheManager
from .messages import GrammarCompile, NewRequestData, ScheduledEntry, StepCommand, StepResult, wire_sampling
from .request import Request, RequestStatus
from .spec_policy import SpecPolicy, StepObservation

_RUNNING = RequestStatus.RUNNING

__all__ = ["Scheduler", "SchedulerConfig", "SchedulerOutput", "SchedulerStats", "StepKind"]


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096
    long_prefill_token_threshold: int = 0
    enable_chunked_prefill: bool = True


StepKind = Literal["prefill", "decode"]


@dataclass(slots=True)
class _Tracked:
    """The scheduler's own per-request state. Preemption resets it; finishing drops it."""

    epoch: int = 0  # bumped by preemption: results of steps in flight before it are stale
    rejected: int = 0  # draft positions given back so far (the worker corrects positions by it)
    confirmed: int = 0  # tokens whose KV a finished step confirmed (publishable to the prefix cache)
    awaiting_prefill: bool = False  # a terminal prefill is in flight (for executors with a barrier)
    has_sampled: bool = False  # sampled since (re)admission: only then can the worker hold drafts
    sent_to_worker: bool = False  # the worker holds state for it (to be released on finish/preempt)
    blocks_sent: dict[str, int] = field(default_factory=dict)  # per group: table length the worker holds
    # Derived once from the sampling parameters, for the plain-decode fast paths: the output count
    # at which the request ends by length (max_tokens or the context length), and the tokens that end
    # it once ``min_tokens`` outputs exist (stop token ids, and EOS unless ignored).
    output_limit: int = 0
    stop_ids: frozenset[int] = frozenset()
    min_tokens: int = 0
    grammar_eos: frozenset[int] = frozenset()  # stop even before min_tokens: a grammar's end (see _stop_status)
    # False while the worker compiles the request's grammar: admission passes it over (see
    # _schedule_waiting). Preemption keeps it: the worker keeps the compile for the request's life.
    grammar_ready: bool = True
    # With one cache group: a decode at a position below this is plain (its block is held and the
    # worker has it, and the request is below its length limit); zero while the worker holds nothing.
    plain_end: int = 0
    plain_memo: _Scheduled | None = None  # the memo of this epoch's plain decodes, shared by their steps
    publish_at: int = 0  # confirmed tokens from which KVCacheManager.publish() can publish a block

    def reset_for_recompute(self) -> None:
        self.epoch += 1
        self.rejected = self.confirmed = self.publish_at = 0
        self.awaiting_prefill = self.has_sampled = False
        self.plain_memo = None


class _Scheduled(msgspec.Struct):
    """Scheduler-side memo of one entry, used when its result comes back (a C-initialised struct:
    one per entry, but plain decodes share one per epoch). It refers to its request's record, which
    may refer back to it (``plain_memo``): finishing breaks that cycle, and the garbage collector
    sees it (so a scheduler dropped with live requests is freed)."""

    request: Request
    tracked: _Tracked  # the request's record when it was scheduled (preemption bumps its epoch)
    epoch: int
    num_new: int
    num_draft: int
    sample: bool


@dataclass(slots=True)
class SchedulerOutput:
    command: StepCommand
    items: list[_Scheduled]
    num_batched_tokens: int

    @property
    def is_empty(self) -> bool:
        return not self.items


@dataclass(slots=True)
class SchedulerStats:
    num_preemptions: int = 0
    num_drafted: int = 0
    num_verify_steps: int = 0
    num_accepted: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    num_steps: int = 0


@dataclass(slots=True)
class _StepBuilder:
    """Collects one step's entries while the scheduler walks its queues."""

    budget: int
    uniform: bool  # the executor needs all-prefill or all-decode steps
    kind: StepKind | None = None
    preempted: bool = False
    items: list[_Scheduled] = field(default_factory=list)
    entries: list[ScheduledEntry] = field(default_factory=list)
    new_requests: list[NewRequestData] = field(default_factory=list)

    def admits(self, kind: StepKind) -> bool:
        """Whether an entry of ``kind`` may join (and, for uniform batches, fix the step's kind)."""
        if not self.uniform:
            return True
        if self.kind is None:
            self.kind = kind
        return self.kind == kind

    def drop(self, request_id: str) -> None:
        """Take a request back out of this step (it was preempted after being scheduled), so no
        entry writes KV into blocks that another entry of the same step now owns."""
        for i, item in enumerate(self.items):
            if item.request.request_id == request_id:
                self.budget += item.num_new + item.num_draft
                del self.items[i], self.entries[i]
                break
        self.new_requests = [nr for nr in self.new_requests if nr.request_id != request_id]


class Scheduler:
    """Owns every live request and the KV block accounting.

    Each step: running requests first, oldest admission first (their next token, or the next chunk
    of their prefill, plus draft slots); then waiting requests, first come first served, while the
    token budget and ``max_num_seqs`` allow. When the KV cache runs out for a running request, the
    latest-arrived running request is preempted (its blocks freed, recomputed later) until it fits;
    a step that preempted admits nobody new.

    A structured request's grammar goes to the worker with the first command after the request is
    added, and the request is not ready until a result says the worker compiled it: admission
    passes over a request that is not ready (the requests behind it are admitted in its place, it
    keeps its place in the queue), so no step waits on a compile. When nothing runs and nothing
    else can be admitted it is admitted anyway: its step waits on the compile, but no other request
    does, and no empty step is needed to poll for the compile.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        executor_info: ExecutorInfo,
        spec_policy: SpecPolicy,
        *,
        decode_fast_path: bool = True,
    ) -> None:
        """``decode_fast_path``: schedule and apply plain decodes (one token, no drafts, blocks held)
        inline; off, every request takes the general path (the same steps, more slowly)."""
        self.config = config
        self.kv = kv
        self.info = executor_info
        self.spec_policy = spec_policy
        self._observe: Callable[[StepObservation], None] | None = getattr(spec_policy, "observe", None)
        self._draft_depth: Callable[[], int | None] | None = getattr(spec_policy, "draft_depth", None)
        self._rejections = 0  # requests whose drafts were rejected, since the last observation
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.finished_ids: list[str] = []  # to tell the worker on the next step
        self.failed_while_scheduling: list[Request] = []  # for the engine to report
        self._compiles: list[GrammarCompile] = []  # grammars of requests added since the last command
        self._forget: list[str] = []  # structured requests finished since the last command
        self._tracked: dict[str, _Tracked] = {}
        self._fast = decode_fast_path
        self._step_ids = itertools.count()
        self._arrivals = itertools.count()
        self.stats = SchedulerStats(accepted_per_pos=[0] * max(1, executor_info.max_draft_tokens))

    # ------------------------------------------------------------------ requests
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        limit = self.config.max_model_len
        if request.num_prompt_tokens >= limit:
            raise ValueError(
                f"prompt has {request.num_prompt_tokens} tokens; the context length max_model_len is {limit}, "
                "and at least one token must be generated"
            )
        if not self.config.enable_chunked_prefill and request.num_prompt_tokens > self.config.max_num_batched_tokens:
            raise ValueError(
                f"prompt has {request.num_prompt_tokens} tokens, more than max_num_batched_tokens="
                f"{self.config.max_num_batched_tokens} with chunked prefill disabled"
            )
        if not self.kv.can_ever_fit(request.num_prompt_tokens + 1):
            raise ValueError(f"prompt of {request.num_prompt_tokens} tokens does not fit in the whole KV cache")
        request.arrival_index = next(self._arrivals)
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self._tracked[request.request_id] = self._new_tracked(request)
        self.waiting.append(request)
        spec = request.sampling_params.structured
        if spec is not None:
            self._compiles.append(
                GrammarCompile(request_id=request.request_id, spec=spec, eos=tuple(request.eos_token_ids))
            )

    def _new_tracked(self, request: Request) -> _Tracked:
        """A fresh record, with the limits the plain-decode paths read derived once."""
        sp = request.sampling_params
        limit = self.config.max_model_len - request.num_prompt_tokens
        grammar_eos = frozenset(request.eos_token_ids if sp.structured is not None else ())
        stop = [*sp.stop_token_ids, *(() if sp.ignore_eos else request.eos_token_ids), *grammar_eos]
        return _Tracked(
            output_limit=limit if sp.max_tokens is None else min(limit, sp.max_tokens),
            stop_ids=frozenset(stop),
            min_tokens=sp.min_tokens,
            grammar_eos=grammar_eos,
            grammar_ready=sp.structured is None,
        )

    def grammars_compiled(self, request_ids: Iterable[str]) -> None:
        """The worker compiled these requests' grammars (``StepResult.grammars_ready``): they are
        admitted like any other. Ids of requests finished meanwhile are ignored."""
        for rid in request_ids:
            st = self._tracked.get(rid)
            if st is not None:
                st.grammar_ready = True

    def abort(self, request_ids: Iterable[str]) -> list[Request]:
        out = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None or req.is_finished:
                continue
            self._finish(req, RequestStatus.FINISHED_ABORTED)
            out.append(req)
        return out

    def fail(self, request_ids: Iterable[str], error: str) -> list[Request]:
        out = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None or req.is_finished:
                continue
            req.error = error
            self._finish(req, RequestStatus.FINISHED_ERROR)
            out.append(req)
        return out

    def stop(self, req: Request, num_output_tokens: int, stop_reason: str) -> None:
        """Finish ``req`` because a stop string ended at output token ``num_output_tokens`` (found by
        the engine's detokenizer): later tokens of the same step are dropped, and a stop string
        wins over an EOS or length finish that came later in the same step."""
        del req.output_token_ids[num_output_tokens:]
        del req.output_logprobs[num_output_tokens:]
        req.stop_reason = stop_reason
        if req.is_finished:
            req.status = RequestStatus.FINISHED_STOP
        else:
            self._finish(req, RequestStatus.FINISHED_STOP)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def live_requests(self) -> list[Request]:
        return [*self.running, *self.waiting]

    # ------------------------------------------------------------------ schedule
    def schedule(self) -> SchedulerOutput:
        step = _StepBuilder(budget=self.config.max_num_batched_tokens, uniform=self.info.uniform_batches)
        self._schedule_running(step)
        if not step.preempted:
            self._schedule_waiting(step)
        depth = self._draft_depth() if self._draft_depth is not None else None
        cmd = StepCommand(
            next(self._step_ids),
            step.new_requests,
            step.entries,
            self.finished_ids,
            depth,
            compile_grammars=self._compiles,
            forget_grammars=self._forget,
        )
        self.finished_ids, self._compiles, self._forget = [], [], []
        self.stats.num_steps += 1
        return SchedulerOutput(cmd, step.items, self.config.max_num_batched_tokens - step.budget)

    def take_back(self, cmd: StepCommand) -> None:
        """``cmd`` is not sent (its step is empty): what it tells the worker goes with the next one."""
        self.finished_ids[:0] = cmd.finished_ids
        self._compiles[:0] = cmd.compile_grammars
        self._forget[:0] = cmd.forget_grammars

    def _schedule_running(self, step: _StepBuilder) -> None:
        """Each running request's next step, oldest admission first: a plain decode (one token, no
        drafts, its block held and sent) inline, the rest by the general path (which agrees on plain ones)."""
        tracked, entries, items = self._tracked, step.entries, step.items
        fast = self._fast and self.kv.single_group is not None
        no_drafts, no_barrier = not self.info.max_draft_tokens, not self.info.prefill_barrier
        budget = step.budget  # the general path reads and writes step.budget: kept in step around it
        for req in list(self.running):
            if budget <= 0:
                break
            if req.status is not _RUNNING:
                continue  # preempted earlier in this step
            st = tracked[req.request_id]
            held = req.num_output_placeholders
            outputs = req.output_token_ids
            start = req.num_computed_tokens
            prompt = req.num_prompt_tokens
            if not (
                fast
                and prompt + len(outputs) + held == start + 1  # one token to compute
                and prompt <= start < st.plain_end  # past the prompt, block held and sent, below the limit
                and (no_drafts or not st.has_sampled)
                and (no_barrier or not st.awaiting_prefill)
                and (not step.uniform or step.admits("decode"))
            ):
                step.budget = budget
                self._schedule_one(step, req, st)
                budget = step.budget
                continue
            entries.append(
                ScheduledEntry(
                    request_id=req.request_id,
                    token_ids=[] if held else outputs[-1:],
                    use_last_sampled=held > 0,
                    num_draft=0,
                    start_pos=start,
                    rejected_seen=st.rejected,
                    new_block_ids={},
                    sample=True,
                )
            )
            memo = st.plain_memo
            if memo is None:
                memo = st.plain_memo = _Scheduled(req, st, st.epoch, 1, 0, True)
            items.append(memo)
            budget -= 1
            req.num_computed_tokens = start + 1
            req.num_output_placeholders = held + 1
            st.has_sampled = True
        step.budget = budget

    def _schedule_one(self, step: _StepBuilder, req: Request, st: _Tracked) -> None:
        """A running request's next token or prefill chunk, plus draft slots (the general path)."""
        pending = req.num_tokens + req.num_output_placeholders  # tokens once results are applied
        num_new = pending - req.num_computed_tokens
        if num_new <= 0 or self._at_limit(req, pending) or (self.info.prefill_barrier and st.awaiting_prefill):
            return
        is_decode = num_new == 1 and pending > req.num_prompt_tokens
        if step.uniform and not step.admits("decode" if is_decode else "prefill"):
            return
        k = 0
        if is_decode:  # one token, and the budget is positive
            # Drafts exist only after a step of this request sampled (not for the last token of
            # a recompute after preemption), so only then is reserving k slots of use.
            if self.info.max_draft_tokens and st.has_sampled:
                k = self.spec_policy(req, self._max_k(req, step.budget - 1))
        else:
            num_new = self._chunk(num_new, step.budget, False)
            if num_new == 0:
                return
        num_tokens = req.num_computed_tokens + num_new + k
        if self.kv.allocate(req, num_tokens) or self._preempt_until_fits(req, num_tokens, step):
            self._take(step, req, num_new, k)

    def _preempt_until_fits(self, req: Request, num_tokens: int, step: _StepBuilder) -> bool:
        """Blocks for ``num_tokens``, preempting the latest arrival until they fit. False when
        ``req`` itself was preempted, or failed because the cache cannot hold it alone."""
        while not self.kv.allocate(req, num_tokens):
            if self.running == [req]:
                self.failed_while_scheduling += self.fail(
                    [req.request_id], "the KV cache is too small for this request alone"
                )
                return False
            victim = max(self.running, key=lambda r: r.arrival_index)
            self._preempt(victim)
            step.drop(victim.request_id)
            step.preempted = True
            if victim is req:
                return False
        return True

    def _schedule_waiting(self, step: _StepBuilder) -> None:
        """Admit waiting requests first come first served, passing over those whose grammar is not
        compiled yet; one of those only when nothing runs and nothing else was admitted."""
        at = 0
        while at < len(self.waiting) and self._room(step):
            if not self._tracked[self.waiting[at].request_id].grammar_ready:
                at += 1  # the worker compiles its grammar: the requests behind it go first
                continue
            if not self._admit(step, at):
                return  # first come first served: nobody behind a request that does not fit
        if not self.running and self.waiting and self._room(step):
            self._admit(step, 0)  # only requests whose grammar compiles wait: the first of them runs

    def _room(self, step: _StepBuilder) -> bool:
        """Whether the step can take another waiting request."""
        if step.uniform and step.kind == "decode":
            return False
        return step.budget > 0 and len(self.running) < self.config.max_num_seqs

    def _admit(self, step: _StepBuilder, at: int) -> bool:
        """Admit ``self.waiting[at]`` with its first prefill chunk; False when it does not fit."""
        req = self.waiting[at]
        st = self._tracked[req.request_id]
        if req.num_computed_tokens == 0 and not req.block_ids:
            # Prompt logprobs need every prompt position computed: such a request skips the prefix cache.
            hit = 0 if req.sampling_params.prompt_logprobs is not None else self.kv.find_cached_prefix(req)
            req.num_computed_tokens = req.num_cached_tokens = req.metrics.num_cached_tokens = hit
            st.confirmed = hit
        num_new = self._chunk(req.num_tokens - req.num_computed_tokens, step.budget, False)
        if num_new == 0 or not self.kv.allocate(req, req.num_computed_tokens + num_new):
            if req.block_ids:  # give back the prefix hit; it is looked up again next time
                self.kv.cancel_prefix_hit(req, req.num_cached_tokens)
                req.num_computed_tokens = 0
            return False
        del self.waiting[at]
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        step.admits("prefill")
        self._take(step, req, num_new, 0)
        return True

    def _take(self, step: _StepBuilder, req: Request, num_new: int, k: int) -> None:
        """Put ``num_new`` tokens (and ``k`` draft slots) of ``req`` into the step and advance the
        request optimistically: a sampling entry reserves ``1 + k`` output placeholders."""
        st = self._tracked[req.request_id]
        start = req.num_computed_tokens
        sample = start + num_new == req.num_tokens + req.num_output_placeholders
        use_last = req.num_output_placeholders > 0
        if not st.sent_to_worker:
            st.sent_to_worker = True
            step.new_requests.append(_new_request_data(req))
        step.entries.append(
            ScheduledEntry(
                request_id=req.request_id,
                token_ids=[] if use_last else req.token_slice(start, start + num_new),
                use_last_sampled=use_last,
                num_draft=k,
                start_pos=start,
                rejected_seen=st.rejected,
                new_block_ids=self._new_blocks(req, st),
                sample=sample,
            )
        )
        if self.kv.single_group is not None:
            name, tokens_per_block = self.kv.single_group
            last = req.num_prompt_tokens + st.output_limit - 1  # the position of the last output's input
            st.plain_end = min(st.blocks_sent.get(name, 0) * tokens_per_block, last)
        step.items.append(_Scheduled(req, st, st.epoch, num_new, k, sample))
        step.budget -= num_new + k
        if req.metrics.first_scheduled_time is None:
            req.metrics.first_scheduled_time = time.monotonic()
        req.num_computed_tokens += num_new + k
        if sample:
            st.has_sampled = True
            req.num_output_placeholders += 1 + k
            if num_new > 1 or req.num_computed_tokens - k <= req.num_prompt_tokens:
                st.awaiting_prefill = True

    def _chunk(self, num_new: int, budget: int, is_decode: bool) -> int:
        if is_decode:
            return min(num_new, budget)
        cap = budget
        if self.config.long_prefill_token_threshold > 0:
            cap = min(cap, self.config.long_prefill_token_threshold)
        if num_new > cap and not self.config.enable_chunked_prefill:
            return 0
        return min(num_new, cap)

    def _at_limit(self, req: Request, pending: int) -> bool:
        """No more tokens can be produced once pending results are applied (``pending`` tokens)."""
        max_tokens = req.sampling_params.max_tokens
        if max_tokens is not None and pending - req.num_prompt_tokens >= max_tokens:
            return True
        return pending >= self.config.max_model_len

    def _max_k(self, req: Request, budget_left: int) -> int:
        room = self.config.max_model_len - (req.num_tokens + req.num_output_placeholders)
        if req.sampling_params.max_tokens is not None:
            room = min(room, req.sampling_params.max_tokens - req.num_produced)
        return max(0, min(self.info.max_draft_tokens, budget_left, room - 1))

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_output_placeholders = 0
        req.metrics.num_preemptions += 1
        st = self._tracked[req.request_id]
        st.reset_for_recompute()
        self._release_worker_state(req.request_id, st)
        self.stats.num_preemptions += 1
        self.waiting.appendleft(req)

    def _release_worker_state(self, rid: str, st: _Tracked) -> None:
        if st.sent_to_worker:
            st.sent_to_worker = False
            st.blocks_sent.clear()
            st.plain_end = 0
            self.finished_ids.append(rid)

    @staticmethod
    def _new_blocks(req: Request, st: _Tracked) -> dict[str, list[int]]:
        """The blocks of each group the worker does not hold yet (tables only grow while it holds them)."""
        new: dict[str, list[int]] = {}
        for group, blocks in req.block_ids.items():
            sent = st.blocks_sent.get(group, 0)
            if len(blocks) > sent:
                new[group] = blocks[sent:]
                st.blocks_sent[group] = len(blocks)
        return new

    # ------------------------------------------------------------------ update
    def update(self, out: SchedulerOutput, result: StepResult) -> list[Request]:
        """Apply one step's result; returns the requests that produced tokens or finished. Finishes
        on EOS, stop token ids and length; stop strings are the engine's (text is not ours)."""
        self._count_drafts(result)
        touched: list[Request] = []
        kv = self.kv
        # One sampled token without drafts is applied inline, unless the step carries logprobs or
        # errors or a window gives blocks back; publish() is called only when it has a block to add.
        fast = self._fast and not (result.logprobs or result.request_errors or kv.windowed)
        sampled = result.sampled
        for item in out.items:
            req = item.request
            st = item.tracked  # finishing drops the record but marks the request; preemption bumps the epoch
            if st.epoch != item.epoch or req.status.finished:
                continue  # aborted, failed or preempted while in flight: discard
            tokens = sampled.get(req.request_id) if fast and item.sample and not item.num_draft else None
            if tokens is None or len(tokens) != 1:
                self._apply_general(req, st, item, result, touched)
                continue
            st.awaiting_prefill = False
            req.num_output_placeholders -= 1
            confirmed = st.confirmed = st.confirmed + item.num_new
            if confirmed >= st.publish_at:
                st.publish_at = kv.publish(req, confirmed)
            token = tokens[0]
            outputs = req.output_token_ids
            outputs.append(token)
            n_out = len(outputs)
            if n_out >= st.output_limit or (
                token in st.stop_ids and (n_out >= st.min_tokens or token in st.grammar_eos)
            ):
                self._finish_sampled(req, token)
            touched.append(req)
        if self._observe is not None:
            self._observe(
                StepObservation(
                    num_tokens=out.num_batched_tokens,
                    num_decodes=sum(item.sample for item in out.items),
                    num_drafted=result.num_drafted,
                    num_accepted=sum(result.num_accepted_per_pos),
                    seconds=result.execute_seconds,
                    draft_seconds=result.draft_seconds,
                    draft_depth=out.command.draft_depth,
                    num_rejections=self._rejections,
                )
            )
        self._rejections = 0
        return touched

    def _apply_general(
        self, req: Request, st: _Tracked, item: _Scheduled, result: StepResult, touched: list[Request]
    ) -> None:
        """One entry's result by the general path: an error, a prefill chunk, or sampled tokens."""
        error = result.request_errors.get(req.request_id)
        if error is not None:
            req.error = error
            self._finish(req, RequestStatus.FINISHED_ERROR)
            touched.append(req)
        elif not item.sample:
            self._confirm(req, st, item.num_new)
        else:
            self._apply_sampled(req, st, item, result)
            touched.append(req)

    def _finish_sampled(self, req: Request, token: int) -> None:
        """Finish a request whose last token ``token`` reached its length limit or a stop token."""
        status = self._stop_status(req, token)
        assert status is not None, "a length or stop-token finish that _stop_status does not see"
        self._finish(req, status)

    def _count_drafts(self, result: StepResult) -> None:
        self.stats.num_drafted += result.num_drafted
        self.stats.num_verify_steps += result.num_verify_steps
        for pos, n in enumerate(result.num_accepted_per_pos):
            if pos < len(self.stats.accepted_per_pos):
                self.stats.accepted_per_pos[pos] += n
            self.stats.num_accepted += n

    def _apply_sampled(self, req: Request, st: _Tracked, item: _Scheduled, result: StepResult) -> None:
        st.awaiting_prefill = False
        tokens = result.sampled.get(req.request_id, [])
        req.num_output_placeholders -= 1 + item.num_draft
        accepted = max(0, len(tokens) - 1)
        rejected = item.num_draft - accepted
        if item.num_draft:
            req.spec_drafted += item.num_draft
            req.spec_accepted += accepted
            self._rejections += rejected > 0
        if rejected:
            req.num_computed_tokens -= rejected
            st.rejected += rejected
        self._confirm(req, st, item.num_new + accepted)
        lps = result.logprobs.get(req.request_id)
        for j, tok in enumerate(tokens):
            req.output_token_ids.append(tok)
            if lps is not None and j < len(lps):
                req.output_logprobs.append(lps[j])
            status = self._stop_status(req, tok)
            if status is not None:
                self._finish(req, status)
                return

    def _confirm(self, req: Request, st: _Tracked, n: int) -> None:
        """``n`` more tokens have their KV written: publish full blocks to the prefix cache, and give
        back sliding-window blocks that no step still to run can read (every later step starts at or
        after the confirmed count; a step in flight started there too)."""
        st.confirmed += n
        st.publish_at = self.kv.publish(req, st.confirmed)
        if self.kv.windowed:
            self.kv.release_outside_window(req, st.confirmed)

    def _stop_status(self, req: Request, tok: int) -> RequestStatus | None:
        sp = req.sampling_params
        n_out = len(req.output_token_ids)
        # A grammar's EOS is its end and the output's, whatever ignore_eos says; before min_tokens
        # the worker lets it through only where the grammar allows nothing else.
        if sp.structured is not None and tok in req.eos_token_ids:
            req.stop_reason = None
            return RequestStatus.FINISHED_EOS
        if n_out >= sp.min_tokens:
            if not sp.ignore_eos and tok in req.eos_token_ids:
                req.stop_reason = None
                return RequestStatus.FINISHED_EOS
            if tok in sp.stop_token_ids:
                req.stop_reason = tok
                return RequestStatus.FINISHED_STOP
        if sp.max_tokens is not None and n_out >= sp.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if n_out + req.num_prompt_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _finish(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        req.metrics.finished_time = time.monotonic()
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req)
        req.num_output_placeholders = 0
        st = self._tracked.pop(req.request_id)
        st.plain_memo = None
        self._release_worker_state(req.request_id, st)
        if req.sampling_params.structured is not None:
            self._forget_grammar(req.request_id)
        del self.requests[req.request_id]

    def _forget_grammar(self, rid: str) -> None:
        """A structured request finished: its grammar is not sent if it still waits to be, else the
        worker is told to drop it (and to cancel the compile if it has not started)."""
        unsent = [g for g in self._compiles if g.request_id != rid]
        if len(unsent) < len(self._compiles):
            self._compiles = unsent
        else:
            self._forget.append(rid)


def _new_request_data(req: Request) -> NewRequestData:
    """What the worker needs of a request when it (re)enters: sampling state and token history."""
    return NewRequestData(
        request_id=req.request_id,
        prompt_token_ids=req.prompt_token_ids,
        output_token_ids=list(req.output_token_ids),
        sampling=wire_sampling(req.sampling_params, req.eos_token_ids),
        seed=req.sample_seed,
    )
