"""Scheduler: continuous batching with chunked prefill, prefix caching and preemption by recompute.

``schedule()`` picks this step's work and advances each request *optimistically*: its computed
count moves by the scheduled tokens plus granted drafts, and a sampling entry reserves ``1 + k``
output placeholders. ``update()`` applies the worker's result and gives back what did not happen
(rejected drafts). The sync strategy calls them alternately; the async strategy keeps two steps in
flight, which the placeholders make safe.

The scheduler's state of a request is the request's ``sched`` section (:class:`~.request.SchedState`);
its blocks are the ``kv`` section, which only the KV manager writes. Every entry is built by one
path (``Scheduler._schedule``), every result applied by one loop with one stop rule
(``Scheduler._stop_status``), which asks the engine about stop strings as each token is committed.
"""

from __future__ import annotations

import itertools
import math
import time
from bisect import bisect_left, bisect_right, insort
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from operator import itemgetter
from typing import Literal

from .executor import ExecutorInfo
from .kv_cache import KVCacheManager
from .messages import GrammarCompile, NewRequestData, ScheduledEntry, StepCommand, StepResult, wire_sampling
from .request import Request, RequestStatus, SchedState
from .spec_policy import SpecPolicy, StepObservation

_RUNNING = RequestStatus.RUNNING

__all__ = ["Scheduler", "SchedulerConfig", "SchedulerOutput", "SchedulerStats", "StepKind", "TextStop"]


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096
    long_prefill_token_threshold: int = 0
    enable_chunked_prefill: bool = True
    policy: Literal["fcfs", "priority"] = "fcfs"  # the waiting queue's order (_FcfsQueue, _PriorityQueue)
    priority_max_wait_s: float = 60.0  # under "priority": the age at which a request ranks above every priority
    num_scheduler_steps: int = 1  # forwards a plain decode may run within one command (see Scheduler._steps)
    # Auto: as many forwards a command as the last command's time per forward fits in this, while every
    # running request is past its prompt (None: always the most).
    scheduler_steps_within_s: float | None = None


StepKind = Literal["prefill", "decode"]


@dataclass(slots=True)
class SchedulerOutput:
    """One scheduled step: the command for the worker, and the record of each entry's request
    (``requests[i]`` is ``command.entries[i]``'s), which ``update()`` applies the result to."""

    command: StepCommand
    requests: list[Request]
    num_batched_tokens: int


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

    step_id: int
    budget: int
    uniform: bool  # the executor needs all-prefill or all-decode steps
    steps: int = 1  # forwards a plain decode may run within this command (1: nobody may run several)
    kind: StepKind | None = None
    preempted: bool = False
    requests: list[Request] = field(default_factory=list)
    entries: list[ScheduledEntry] = field(default_factory=list)
    new_requests: list[NewRequestData] = field(default_factory=list)

    def admits(self, kind: StepKind) -> bool:
        """Whether an entry of ``kind`` may join (and, for uniform batches, fix the step's kind)."""
        if not self.uniform:
            return True
        if self.kind is None:
            self.kind = kind
        return self.kind == kind

    def drop(self, req: Request) -> int:
        """Take a request back out of this step (it was preempted after being scheduled), so no
        entry writes KV into blocks that another entry of the same step now owns; returns the
        budget its entry took (0 if it had none)."""
        self.new_requests = [nr for nr in self.new_requests if nr.request_id != req.request_id]
        for i, r in enumerate(self.requests):
            if r is req:
                entry = self.entries[i]
                del self.requests[i], self.entries[i]
                return (len(entry.token_ids) or 1) + entry.num_draft
        return 0


_AGED = -(2**64)  # the rank of a request past priority_max_wait_s: above every priority (an int64)
_KEY = itemgetter(0, 1)  # a queue entry's sort key, without its request (keys are unique: arrival indexes are)


class _FcfsQueue(deque[Request]):
    """The waiting queue under ``fcfs``: arrival order, and a preempted request goes back first (it
    was admitted before everything that waits). An admission preempts nobody."""

    preempts_for_admission = False

    def add(self, req: Request) -> None:
        self.append(req)

    def requeue(self, req: Request) -> None:
        self.appendleft(req)

    def age(self) -> None:
        """Nothing ages: arrival order alone bounds every wait."""

    @staticmethod
    def victim_key(req: Request) -> tuple[int, int]:
        """Preemption takes the running request with the highest key: the latest arrival."""
        return 0, req.sched.arrival_index


class _PriorityQueue:
    """The waiting queue under ``priority``: by rank, then arrival, where the rank is the request's
    priority (lower first), or :data:`_AGED` once it is ``max_wait`` seconds past its arrival (aged
    requests go first, oldest first, so none starves). A preempted request goes back to its place
    by the same key, and an admission may preempt running requests of a lower rank. A sorted list
    (an insertion is a bisection and a memmove), plus the requests not aged yet by arrival time,
    whose head is the next to age."""

    preempts_for_admission = True
    __slots__ = ("_clock", "_cutoff", "_max_wait", "_order", "_young")

    def __init__(self, max_wait: float, clock: Callable[[], float]) -> None:
        self._order: list[tuple[int, int, Request]] = []  # (rank, arrival index, request), sorted
        self._young: list[tuple[float, int, Request]] = []  # (arrival time, arrival index, request), sorted
        self._max_wait, self._clock = max_wait, clock
        self._cutoff = -math.inf  # requests that arrived at or before this are aged

    def __len__(self) -> int:
        return len(self._order)

    def __iter__(self) -> Iterator[Request]:
        return (entry[2] for entry in self._order)

    def __getitem__(self, at: int) -> Request:
        return self._order[at][2]

    def __delitem__(self, at: int) -> None:
        rank, index, req = self._order.pop(at)
        if rank != _AGED:
            del self._young[bisect_left(self._young, (req.metrics.arrival_time, index), key=_KEY)]

    def __contains__(self, req: object) -> bool:
        return any(entry[2] is req for entry in self._order)

    def remove(self, req: Request) -> None:
        del self[next(i for i, entry in enumerate(self._order) if entry[2] is req)]

    def add(self, req: Request) -> None:
        index, arrived = req.sched.arrival_index, req.metrics.arrival_time
        if arrived <= self._cutoff:
            insort(self._order, (_AGED, index, req), key=_KEY)
        else:
            insort(self._order, (req.sampling_params.priority, index, req), key=_KEY)
            insort(self._young, (arrived, index, req), key=_KEY)

    requeue = add

    def age(self) -> None:
        """Move the requests now ``max_wait`` past their arrival to the top rank (once per step)."""
        self._cutoff = cutoff = self._clock() - self._max_wait
        young, order = self._young, self._order
        n = bisect_right(young, (cutoff, math.inf), key=_KEY)
        for _, index, req in young[:n]:
            del order[bisect_left(order, (req.sampling_params.priority, index), key=_KEY)]
            insort(order, (_AGED, index, req), key=_KEY)
        del young[:n]

    def victim_key(self, req: Request) -> tuple[int, int]:
        """Preemption takes the running request with the highest key: the lowest rank (an aged
        request ranks top), then the latest arrival."""
        aged = req.metrics.arrival_time <= self._cutoff
        return (_AGED if aged else req.sampling_params.priority), req.sched.arrival_index


TextStop = Callable[[Request], "str | None"]
"""The engine's stop-string check: feeds the request's detokenizer the output tokens it has not
seen (the last one was just committed) and returns the stop string that ended in them, if any."""


class Scheduler:
    """Owns every live request and the KV block accounting.

    Each step: running requests first, oldest admission first (their next token, or the next chunk
    of their prefill, plus draft slots); then waiting requests in the waiting queue's order (first
    come first served, or by priority: ``SchedulerConfig.policy``), while the token budget and
    ``max_num_seqs`` allow. When the KV cache runs out for a running request, the latest-arrived
    running request (under ``priority``, the lowest priority first) is preempted (its blocks freed,
    recomputed later) until it fits; a step that preempted admits nobody new. Under ``priority`` an
    admission may preempt running requests it outranks, and is then the step's last. Every entry,
    a decode, a prefill chunk or an admission, is built by one path (:meth:`_schedule`), and every
    result is applied by one loop (:meth:`update`) with one stop rule (:meth:`_stop_status`).

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
        text_stop: TextStop | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``text_stop``: the engine's stop-string check (see :data:`TextStop`); without it, stop
        strings are not checked (the scheduler alone knows only token ids). ``clock``: the time of
        ``RequestMetrics.arrival_time``, which ages requests under the ``priority`` policy."""
        self.config = config
        self.kv = kv
        self.info = executor_info
        self.spec_policy = spec_policy
        self._text_stop = text_stop
        self._observe: Callable[[StepObservation], None] | None = getattr(spec_policy, "observe", None)
        self._draft_depth: Callable[[], int | None] | None = getattr(spec_policy, "draft_depth", None)
        self._drafts: SpecPolicy = getattr(spec_policy, "drafts", spec_policy)
        self._rejections = 0  # requests whose drafts were rejected, since the last observation
        self.waiting: _FcfsQueue | _PriorityQueue = (
            _FcfsQueue() if config.policy == "fcfs" else _PriorityQueue(config.priority_max_wait_s, clock)
        )
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}  # every live request by id
        self._finished_ids: list[str] = []  # to tell the worker with the next command
        self._failed: list[Request] = []  # failed while scheduling, for the engine to report
        self._compiles: list[GrammarCompile] = []  # grammars of requests added since the last command
        self._forget: list[str] = []  # structured requests finished since the last command
        self._next_step = 0  # the id of the next command (ids grow by one per command sent)
        self._arrivals = itertools.count()
        # Disaggregated serving: keeps a finished request's blocks for a decode engine (True) instead
        # of freeing them (kv_ledger.py); None: every finished request's blocks are freed.
        self.hold_kv: Callable[[Request], bool] | None = None
        # Whether blocks are held outside the scheduler for a while (the offload tiers' copies): a
        # request alone that cannot grow then waits for them instead of failing as too big.
        self.kv_in_transit: Callable[[], bool] = lambda: False
        self.stats = SchedulerStats(accepted_per_pos=[0] * max(1, executor_info.max_draft_tokens))
        self._forward_s = 0.0  # the worker's time per forward in the last command applied

    # ------------------------------------------------------------------ requests
    def add_request(self, request: Request, *, first: bool = False) -> None:
        """Queue a request (``first``: ahead of the waiting ones, as a preempted one is)."""
        self.check_request(request)
        request.status = RequestStatus.WAITING
        request.sched = self._new_state(request)
        self.requests[request.request_id] = request
        if first:
            self.waiting.requeue(request)
        else:
            self.waiting.add(request)
        spec = request.sampling_params.structured
        if spec is not None:
            self._compiles.append(
                GrammarCompile(request_id=request.request_id, spec=spec, eos=tuple(request.eos_token_ids))
            )

    def check_request(self, request: Request) -> None:
        """Refuse a request this scheduler can never run (ValueError), before it is queued."""
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

    def _new_state(self, request: Request) -> SchedState:
        """A fresh record, with the stop rule's inputs derived once from the sampling parameters."""
        sp = request.sampling_params
        limit = self.config.max_model_len - request.num_prompt_tokens
        output_limit = limit if sp.max_tokens is None else min(limit, sp.max_tokens)
        grammar_eos = frozenset(request.eos_token_ids if sp.structured is not None else ())
        eos_ids = grammar_eos | frozenset(() if sp.ignore_eos else request.eos_token_ids)
        return SchedState(
            arrival_index=next(self._arrivals),
            grammar_ready=sp.structured is None,
            pending_limit=request.num_prompt_tokens + output_limit,
            output_limit=output_limit,
            stop_ids=eos_ids | frozenset(sp.stop_token_ids),
            eos_ids=eos_ids,
            grammar_eos=grammar_eos,
            min_tokens=sp.min_tokens,
            check_text=bool(sp.stop) and self._text_stop is not None,
        )

    def grammars_compiled(self, request_ids: Iterable[str]) -> None:
        """The worker compiled these requests' grammars (``StepResult.grammars_ready``): they are
        admitted like any other. Ids of requests finished meanwhile are ignored."""
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is not None:
                req.sched.grammar_ready = True

    def abort(self, request_ids: Iterable[str]) -> list[Request]:
        return self.fail(request_ids, None)

    def fail(self, request_ids: Iterable[str], error: str | None) -> list[Request]:
        """Finish the live ones among these requests: failed with ``error``, or aborted (``None``)."""
        out = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None:
                continue
            req.error = error
            self._finish(req, RequestStatus.FINISHED_ABORTED if error is None else RequestStatus.FINISHED_ERROR)
            out.append(req)
        return out

    def take_failed(self) -> list[Request]:
        """The requests that failed while scheduling (the cache cannot hold one alone) since the last call."""
        failed, self._failed = self._failed, []
        return failed

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def live_requests(self) -> list[Request]:
        return [*self.running, *self.waiting]

    # ------------------------------------------------------------------ schedule
    def schedule(self) -> SchedulerOutput | None:
        """The next step, or ``None`` when nothing is runnable now; what the worker is to be told
        (finished requests, grammars) then waits for the next step that runs."""
        step = _StepBuilder(self._next_step, self.config.max_num_batched_tokens, self.info.uniform_batches)
        self.waiting.age()
        if not self.waiting:  # several forwards a command only while nobody waits for them to end
            step.steps = self._forwards_a_command()
        self._schedule(step, list(self.running))
        if not step.preempted:
            self._schedule_waiting(step)
        if not step.entries:
            return None
        self._next_step += 1
        cmd = StepCommand(
            step.step_id,
            step.new_requests,
            step.entries,
            self._finished_ids,
            self._draft_depth() if self._draft_depth is not None else None,
            compile_grammars=self._compiles,
            forget_grammars=self._forget,
        )
        self._finished_ids, self._compiles, self._forget = [], [], []
        self.stats.num_steps += 1
        return SchedulerOutput(cmd, step.requests, self.config.max_num_batched_tokens - step.budget)

    def _forwards_a_command(self) -> int:
        """The most forwards a decode runs in the next command: ``num_scheduler_steps``, or with
        ``scheduler_steps_within_s`` (auto) as many as fit in that time at the last command's time
        per forward (one before any is known), while every running request is past its prompt. Short
        forwards are where the engine's and the pipe's work a command is a large share of a token
        (a 64-stream decode of a small model on a 2-core CPU: 1.06-1.08x the tokens a second at two or
        three forwards a command); an arrival ends the command after its current forward
        (``StepCommand.arrivals_seen``; where the worker cannot, with tensor parallelism, the engine
        gives a shorter window), and a request that ends leaves the command's later forwards, so
        neither waits for the command; a prompt still being computed in chunks would (its next chunk
        goes in the next command), so beside one a command runs one forward."""
        most, within = self.config.num_scheduler_steps, self.config.scheduler_steps_within_s
        if within is None:
            return most
        if self._forward_s <= 0 or any(r.num_computed_tokens < r.num_prompt_tokens for r in self.running):
            return 1
        return max(1, min(most, int(within / self._forward_s)))

    def _schedule(self, step: _StepBuilder, reqs: list[Request], admitting: bool = False) -> None:
        """The one path of every entry: each request's decode (plus draft slots) or next prefill chunk
        (``admitting``: its first), while the budget lasts, with blocks (see :meth:`_blocks_for`)."""
        barrier, plain = self.info.prefill_barrier, not (step.uniform or self.info.max_draft_tokens or admitting)
        add_entry, add_request, budget = step.entries.append, step.requests.append, step.budget
        for req in reqs:
            if budget <= 0:
                break
            if req.status is not _RUNNING and not admitting:
                continue  # preempted earlier in this step
            s, start, prompt = req.sched, req.num_computed_tokens, req.num_prompt_tokens
            held, outputs = req.num_output_placeholders, req.output_token_ids
            pending = prompt + len(outputs) + held  # tokens once results in flight are applied
            if pending >= s.pending_limit or (barrier and s.awaiting_prefill):
                continue
            decode = pending == start + 1 and start >= prompt
            if decode and plain:
                num_new, k, steps = 1, 0, self._steps(req, step.steps, pending)
            else:
                (num_new, k), steps = self._shape(step, req, pending - start, decode and not admitting, budget), 1
                if num_new <= 0:
                    continue
            end = start + num_new + k + steps - 1
            fits, given_back = self._blocks_for(step, req, end, admitting) if end > req.kv.capacity else (True, 0)
            budget += given_back
            if not fits:
                continue
            sample = decode or start + num_new == pending  # a decode's one token is always the last
            add_entry(
                ScheduledEntry(
                    request_id=req.request_id,
                    token_ids=[] if held else outputs[-1:] if decode else req.token_slice(start, start + num_new),
                    use_last_sampled=held > 0,
                    num_draft=k,
                    start_pos=start,
                    rejected_seen=s.rejected,
                    new_block_ids=self._send(step, req) if req.kv.num_entries != s.entries_sent else {},
                    sample=sample,
                    num_propose=0 if plain or not sample else self._proposal(req),
                    num_steps=steps,
                )
            )
            add_request(req)
            budget -= num_new + k
            req.num_computed_tokens = end
            if sample:  # a sampling entry reserves 1 + k (or its steps') output placeholders
                req.num_output_placeholders = held + steps + k
                if not decode:
                    s.awaiting_prefill = True  # a terminal prefill chunk
        step.budget = budget

    def _shape(self, step: _StepBuilder, req: Request, num_new: int, decode: bool, budget: int) -> tuple[int, int]:
        """Tokens and draft slots of an entry that is not a plain decode (a prefill chunk, an
        admission, a decode with drafts, or any entry of a uniform batch); 0 tokens: none this step."""
        if num_new <= 0:
            return 0, 0
        if decode:
            if step.uniform and not step.admits("decode"):
                return 0, 0
            # At most the drafts the worker was asked to propose after the request's last sample (none
            # before one since its admission: drafts exist only after a step sampled).
            max_k = min(self._max_k(req, budget - 1), req.sched.proposed)
            return 1, self.spec_policy(req, max_k) if max_k > 0 else 0
        if step.uniform and not step.admits("prefill"):
            return 0, 0
        return self._chunk(num_new, budget), 0

    def _steps(self, req: Request, most: int, pending: int) -> int:
        """The forwards a plain decode of ``req`` runs in this command (``num_scheduler_steps``): up to
        ``most``, never past its output limit, one for a request with a grammar (the worker masks its
        tokens step by step against the engine's record), and one unless the blocks for all of them
        are free now: they are taken without preempting anyone."""
        if most <= 1:
            return 1
        n = min(most, req.sched.pending_limit - pending)
        if n <= 1 or req.sampling_params.structured is not None:
            return 1
        return n if self.kv.allocate(req, req.num_computed_tokens + n) else 1

    def _blocks_for(self, step: _StepBuilder, req: Request, num_tokens: int, admitting: bool) -> tuple[bool, int]:
        """Blocks for ``num_tokens``: a running request preempts the latest arrival (under ``priority``
        the lowest priority first) until they fit (not when ``req`` itself was preempted, or failed
        because the cache cannot hold it alone); an admission takes free blocks, and under
        ``priority`` those of running requests it outranks. Returns whether they fit and the budget
        that the preempted requests' entries in this step gave back."""
        given_back = 0
        while not self.kv.allocate(req, num_tokens):
            if admitting:
                outranked = self._outranked(req)
                if outranked is None:
                    return False, given_back
                given_back += self._preempt(outranked, step)
                continue
            if self.running == [req] and not self.kv_in_transit():
                self._failed += self.fail([req.request_id], "the KV cache is too small for this request alone")
                return False, given_back
            victim = max(self.running, key=self.waiting.victim_key)
            given_back += self._preempt(victim, step)
            if victim is req:
                return False, given_back
        return True, given_back

    def _schedule_waiting(self, step: _StepBuilder) -> None:
        """Admit waiting requests in the queue's order (first come first served, or by priority),
        passing over those whose grammar is not compiled yet; one of those only when nothing runs
        and nothing else was admitted. An admission that preempted (``priority``) is the last."""
        at = 0
        while at < len(self.waiting):
            if not self.waiting[at].sched.grammar_ready:
                at += 1  # the worker compiles its grammar: the requests behind it go first
                continue
            if not self._room(step, self.waiting[at]) or not self._admit(step, at) or step.preempted:
                return  # in order: nobody behind a request that does not fit
        if not self.running and self.waiting and self._room(step, self.waiting[0]):
            self._admit(step, 0)  # only requests whose grammar compiles wait: the first of them runs

    def _room(self, step: _StepBuilder, req: Request) -> bool:
        """Whether the step can take ``req`` from the waiting queue; under ``priority`` a full batch
        (``max_num_seqs``) makes room by preempting a running request that ``req`` outranks."""
        if (step.uniform and step.kind == "decode") or step.budget <= 0:
            return False
        if len(self.running) < self.config.max_num_seqs:
            return True
        outranked = self._outranked(req)
        if outranked is None:
            return False
        step.budget += self._preempt(outranked, step)
        return True

    def _outranked(self, req: Request) -> Request | None:
        """The running request that an admission of ``req`` may preempt: under ``priority``, the
        lowest ranked one if it ranks below ``req``; never under ``fcfs``."""
        if not self.waiting.preempts_for_admission or not self.running:
            return None
        key = self.waiting.victim_key
        victim = max(self.running, key=key)
        return victim if key(victim) > key(req) else None

    def _admit(self, step: _StepBuilder, at: int) -> bool:
        """Admit ``self.waiting[at]`` with its first prefill chunk; False when it does not fit."""
        req = self.waiting[at]
        if req.num_computed_tokens == 0 and not req.kv.num_entries:
            # Prompt logprobs need every prompt position computed: such a request skips the prefix cache.
            hit = 0 if req.sampling_params.prompt_logprobs is not None else self.kv.find_cached_prefix(req)
            req.num_computed_tokens = req.num_cached_tokens = req.metrics.num_cached_tokens = hit
            req.sched.confirmed = hit
        self._schedule(step, [req], admitting=True)
        if not step.requests or step.requests[-1] is not req:
            if req.kv.num_entries:  # give back the prefix hit; it is looked up again next time
                self.kv.cancel_prefix_hit(req, req.num_cached_tokens)
                req.num_computed_tokens = 0
            return False
        assert self.waiting[at] is req  # preemptions requeue their victims behind it (they rank lower)
        del self.waiting[at]
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        if req.metrics.first_scheduled_time is None:
            req.metrics.first_scheduled_time = time.monotonic()
        return True

    def _chunk(self, num_new: int, budget: int) -> int:
        """A prefill's next chunk within the budget (and ``long_prefill_token_threshold``); 0 when
        the prompt does not fit and chunked prefill is off."""
        cap = budget
        if self.config.long_prefill_token_threshold > 0:
            cap = min(cap, self.config.long_prefill_token_threshold)
        if num_new > cap and not self.config.enable_chunked_prefill:
            return 0
        return min(num_new, cap)

    def _proposal(self, req: Request) -> int:
        """The drafts the worker proposes for ``req`` after a sampling entry: the policy's decision
        for its next decode (its ``drafts`` method where it has one, else the policy itself), within
        the drafting depth. Recorded, since that decode verifies at most these. Not capped by the
        request's room: that depends on the outputs seen, which under async scheduling lag by the step
        in flight, and rejection-sampled tokens depend on the drafts proposed (the worker caps what it
        verifies near the end the same way in both strategies, ``ModelRunner._drafts_to_verify``)."""
        cap = self.info.max_draft_tokens
        req.sched.proposed = self._drafts(req, cap) if cap > 0 else 0
        return req.sched.proposed

    def _max_k(self, req: Request, budget_left: int) -> int:
        room = req.sched.pending_limit - (req.num_tokens + req.num_output_placeholders)
        return max(0, min(self.info.max_draft_tokens, budget_left, room - 1))

    def _preempt(self, req: Request, step: _StepBuilder) -> int:
        """Free ``req``'s blocks and queue it first to be recomputed; results of steps in flight
        for it are discarded (``valid_from``), and its entry in this step is taken back (returns
        the budget that gives back)."""
        self.running.remove(req)
        self.kv.free(req)
        given_back = step.drop(req)
        step.preempted = True
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_output_placeholders = 0
        req.metrics.num_preemptions += 1
        s = req.sched
        s.valid_from = step.step_id
        s.rejected = s.confirmed = s.publish_at = 0
        s.awaiting_prefill, s.proposed = False, 0
        self._release_worker_state(req)
        self.stats.num_preemptions += 1
        self.waiting.requeue(req)
        return given_back

    def _release_worker_state(self, req: Request) -> None:
        s = req.sched
        if s.sent_to_worker:
            s.sent_to_worker = False
            s.blocks_sent.clear()
            s.entries_sent = 0
            self._finished_ids.append(req.request_id)

    @staticmethod
    def _send(step: _StepBuilder, req: Request) -> dict[str, list[int]]:
        """The blocks of each group the worker does not hold yet (tables only grow while it holds
        them), and the request itself when the worker does not hold it (then it holds no blocks of
        it, and the request has some: the entry's work is allocated)."""
        if not req.sched.sent_to_worker:
            req.sched.sent_to_worker = True
            step.new_requests.append(_new_request_data(req))
        new: dict[str, list[int]] = {}
        sent = req.sched.blocks_sent
        for group, blocks in req.kv.block_ids.items():
            n = sent.get(group, 0)
            if len(blocks) > n:
                new[group] = blocks[n:]
                sent[group] = len(blocks)
        req.sched.entries_sent = req.kv.num_entries
        return new

    # ------------------------------------------------------------------ update
    def update(self, out: SchedulerOutput, result: StepResult) -> list[Request]:
        """Apply one step's result; returns the requests that produced tokens or finished. Each
        token is committed and then checked by the stop rule (:meth:`_stop_status`: EOS, stop token
        ids, length, and the engine's stop strings), so nothing after the token that ends a request
        is committed."""
        self._count_drafts(result)
        if result.error is None:
            self._forward_s = result.execute_seconds / max(1, result.num_forwards)
        touched: list[Request] = []
        kv, windowed, step_id = self.kv, bool(self.kv.windowed), out.command.step_id
        sampled, errors, logprobs = result.sampled, result.request_errors, result.logprobs
        for req, entry in zip(out.requests, out.command.entries):
            s = req.sched
            if req.status is not _RUNNING or step_id < s.valid_from:
                continue  # finished, or preempted, while in flight: discard
            if errors and req.request_id in errors:
                self._fail_entry(req, errors[req.request_id], touched)
                continue
            confirmed = len(entry.token_ids) or 1  # tokens whose KV the step wrote, before drafts
            tokens: Sequence[int] = ()
            if entry.sample:
                tokens = sampled.get(req.request_id, ())
                s.awaiting_prefill = False
                req.num_output_placeholders -= entry.num_steps + entry.num_draft
                if entry.num_draft:
                    confirmed += self._reconcile_drafts(req, entry.num_draft, len(tokens))
                elif entry.num_steps > 1:
                    confirmed += self._reconcile_steps(req, entry.num_steps, len(tokens))
                touched.append(req)
            confirmed = s.confirmed = s.confirmed + confirmed
            if confirmed >= s.publish_at:
                s.publish_at = kv.publish(req, confirmed)
            if windowed:  # no step still to run reads blocks wholly before the window of `confirmed`
                kv.release_outside_window(req, confirmed)
            outputs = req.output_token_ids
            before = len(outputs)
            for tok in tokens:  # committed one by one until the stop rule ends the request
                outputs.append(tok)
                n_out = len(outputs)
                if n_out >= s.output_limit or tok in s.stop_ids or s.check_text:  # cheap test first
                    status = self._stop_status(req, tok, n_out)
                    if status is not None:
                        self._finish(req, status)
                        break
            if logprobs and req.request_id in logprobs:
                req.output_logprobs += logprobs[req.request_id][: len(outputs) - before]
        self._observe_step(out, result)
        return touched

    def _fail_entry(self, req: Request, error: str, touched: list[Request]) -> None:
        req.error = error
        self._finish(req, RequestStatus.FINISHED_ERROR)
        touched.append(req)

    def _reconcile_drafts(self, req: Request, num_draft: int, num_sampled: int) -> int:
        """Count a verified entry's drafts and give back the rejected positions; returns the accepted."""
        accepted = max(0, num_sampled - 1)
        rejected = num_draft - accepted
        req.spec_drafted += num_draft
        req.spec_accepted += accepted
        if rejected:
            self._rejections += 1
            req.num_computed_tokens -= rejected
            req.sched.rejected += rejected
        return accepted

    @staticmethod
    def _reconcile_steps(req: Request, num_steps: int, num_sampled: int) -> int:
        """Give back the positions of a multi-step decode's forwards the worker did not run (it
        stopped at a token that ends the request, or before an error the next command meets);
        returns the tokens after the first whose KV it wrote."""
        ran = max(1, num_sampled)
        if ran < num_steps:
            req.num_computed_tokens -= num_steps - ran
            req.sched.rejected += num_steps - ran
        return ran - 1

    def _stop_status(self, req: Request, tok: int, n_out: int) -> RequestStatus | None:
        """The stop rule, for ``tok`` just committed as output number ``n_out``: a stop string that
        ends in its text (once ``min_tokens`` outputs exist: the engine's check), else EOS or a stop
        token id once ``min_tokens`` outputs exist (a grammar's EOS, its end, at any count: before
        ``min_tokens`` the worker lets it through only where the grammar allows nothing else), else
        the length limit. Sets ``stop_reason``."""
        s = req.sched
        if s.check_text:
            assert self._text_stop is not None
            text = self._text_stop(req)
            if text is not None:
                req.stop_reason = text
                return RequestStatus.FINISHED_STOP
        if tok in s.stop_ids and (n_out >= s.min_tokens or tok in s.grammar_eos):
            req.stop_reason = None if tok in s.eos_ids else tok
            return RequestStatus.FINISHED_EOS if tok in s.eos_ids else RequestStatus.FINISHED_STOP
        return RequestStatus.FINISHED_LENGTH if n_out >= s.output_limit else None

    def _count_drafts(self, result: StepResult) -> None:
        self.stats.num_drafted += result.num_drafted
        self.stats.num_verify_steps += result.num_verify_steps
        for pos, n in enumerate(result.num_accepted_per_pos):
            if pos < len(self.stats.accepted_per_pos):
                self.stats.accepted_per_pos[pos] += n
            self.stats.num_accepted += n

    def _observe_step(self, out: SchedulerOutput, result: StepResult) -> None:
        """Tell the speculative policy what the step cost and yielded (if it observes)."""
        if self._observe is not None:
            self._observe(
                StepObservation(
                    num_tokens=out.num_batched_tokens,
                    num_decodes=sum(e.sample for e in out.command.entries),
                    num_drafted=result.num_drafted,
                    num_accepted=sum(result.num_accepted_per_pos),
                    seconds=result.execute_seconds,
                    draft_seconds=result.draft_seconds,
                    draft_depth=out.command.draft_depth,
                    num_rejections=self._rejections,
                )
            )
        self._rejections = 0

    def _finish(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        req.metrics.finished_time = time.monotonic()
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if self.hold_kv is None or not self.hold_kv(req):
            self.kv.free(req)
        req.num_output_placeholders = 0
        self._release_worker_state(req)
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
