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
from dataclasses import asdict, dataclass, field

from .executor import ExecutorInfo, NewRequestData, ScheduledEntry, StepCommand, StepResult
from .kv_cache import KVCacheManager
from .request import Request, RequestStatus, SamplingParams
from .speculative import SpecPolicy

__all__ = ["Scheduler", "SchedulerConfig", "SchedulerOutput", "SchedulerStats"]


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096
    long_prefill_token_threshold: int = 0
    enable_chunked_prefill: bool = True


@dataclass(slots=True)
class _Scheduled:
    """Scheduler-side memo of one entry, used when its result comes back."""

    request: Request
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


class Scheduler:
    """Owns every live request and the KV block accounting."""

    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        executor_info: ExecutorInfo,
        spec_policy: SpecPolicy,
        *,
        on_token: Callable[[Request, int], bool] | None = None,
    ) -> None:
        self.config = config
        self.kv = kv
        self.info = executor_info
        self.spec_policy = spec_policy
        # on_token(request, token) -> True when a stop string matched (set by the engine's detokenizer)
        self.on_token = on_token
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.finished_ids: list[str] = []  # to tell the worker on the next step
        self.failed_while_scheduling: list[Request] = []  # for the engine to report
        self._sent_to_worker: set[str] = set()
        self._epoch: dict[str, int] = {}
        self._rejected: dict[str, int] = {}  # reclaimed draft positions per request
        self._confirmed: dict[str, int] = {}  # tokens whose KV a finished step confirmed
        self._awaiting_prefill: set[str] = set()  # terminal prefill in flight (barrier)
        self._has_sampled: set[str] = set()  # sampled since (re)admission: the worker may hold drafts
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
        self._epoch[request.request_id] = 0
        self.waiting.append(request)

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

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def live_requests(self) -> list[Request]:
        return [*self.running, *self.waiting]

    # ------------------------------------------------------------------ schedule
    def schedule(self) -> SchedulerOutput:
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        items: list[_Scheduled] = []
        entries: list[ScheduledEntry] = []
        new_reqs: list[NewRequestData] = []
        kind: bool | None = None  # uniform batches: True = prefill step, False = decode step
        preempted = False

        def take(req: Request, num_new: int, k: int) -> None:
            nonlocal budget
            sample = req.num_computed_tokens + num_new == req.num_tokens + req.num_output_placeholders
            use_last = req.num_output_placeholders > 0
            start = req.num_computed_tokens
            tokens = [] if use_last else req.token_slice(start, start + num_new)
            if req.request_id not in self._sent_to_worker:
                self._sent_to_worker.add(req.request_id)
                sp = req.sampling_params
                new_reqs.append(
                    NewRequestData(
                        req.request_id,
                        req.prompt_token_ids,
                        list(req.output_token_ids),
                        _sampling_dict(sp, req.eos_token_ids),
                        req.sample_seed,
                    )
                )
            entries.append(
                ScheduledEntry(
                    req.request_id,
                    tokens,
                    use_last,
                    k,
                    req.num_computed_tokens,
                    self._rejected.get(req.request_id, 0),
                    req.block_ids,  # encoded (process) or consumed (inproc) at submit, before any change
                    sample,
                )
            )
            items.append(_Scheduled(req, self._epoch[req.request_id], num_new, k, sample))
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = time.monotonic()
            req.num_computed_tokens += num_new + k
            if sample:
                self._has_sampled.add(req.request_id)
                req.num_output_placeholders += 1 + k
                if num_new > 1 or req.num_computed_tokens - k <= req.num_prompt_tokens:
                    self._awaiting_prefill.add(req.request_id)
            budget -= num_new + k

        # 1. running requests, oldest first
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            i += 1
            pending = req.num_tokens + req.num_output_placeholders
            num_new = pending - req.num_computed_tokens
            if num_new <= 0 or self._at_limit(req):
                continue
            if self.info.prefill_barrier and req.request_id in self._awaiting_prefill:
                continue
            is_decode = num_new == 1 and req.num_output_placeholders + len(req.output_token_ids) > 0
            if self.info.uniform_batches:
                if kind is None:
                    kind = not is_decode
                elif kind == is_decode:
                    continue
            num_new = self._chunk(num_new, budget, is_decode)
            if num_new == 0:
                continue
            k = 0
            # Drafts exist only after a step of this request sampled (not for the last token of a
            # recompute after preemption), so only then is reserving k slots of use.
            if is_decode and self.info.max_draft_tokens and req.request_id in self._has_sampled:
                k = self.spec_policy(req, True, self._max_k(req, budget - num_new))
            while not self.kv.allocate(req, req.num_computed_tokens + num_new + k):
                if self.running == [req]:
                    self.failed_while_scheduling += self.fail(
                        [req.request_id], "the KV cache is too small for this request alone"
                    )
                    i -= 1
                    break
                victim = max(self.running, key=lambda r: r.arrival_index)
                if self.running.index(victim) < i:
                    i -= 1  # keep pointing after the current request
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                continue
            take(req, num_new, k)

        # 2. waiting requests, first come first served (preempted ones are at the front)
        while self.waiting and budget > 0 and len(self.running) < cfg.max_num_seqs and not preempted:
            req = self.waiting[0]
            if self.info.uniform_batches and kind is False:
                break
            if req.num_computed_tokens == 0 and not req.block_ids:
                hit = self.kv.find_cached_prefix(req)
                req.num_computed_tokens = hit
                req.num_cached_tokens = hit
                req.metrics.num_cached_tokens = hit
                self._confirmed[req.request_id] = hit
            num_new = self._chunk(req.num_tokens - req.num_computed_tokens, budget, False)
            if num_new == 0 or not self.kv.allocate(req, req.num_computed_tokens + num_new):
                if req.block_ids:  # give back the prefix hit; it is looked up again next time
                    self.kv.cancel_prefix_hit(req, req.num_cached_tokens)
                    req.num_computed_tokens = 0
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            kind = True if self.info.uniform_batches else kind
            take(req, num_new, 0)

        cmd = StepCommand(next(self._step_ids), new_reqs, entries, self.finished_ids)
        self.finished_ids = []
        self.stats.num_steps += 1
        return SchedulerOutput(cmd, items, cfg.max_num_batched_tokens - budget)

    def _chunk(self, num_new: int, budget: int, is_decode: bool) -> int:
        if is_decode:
            return min(num_new, budget)
        cap = budget
        if self.config.long_prefill_token_threshold > 0:
            cap = min(cap, self.config.long_prefill_token_threshold)
        if num_new > cap and not self.config.enable_chunked_prefill:
            return 0
        return min(num_new, cap)

    def _at_limit(self, req: Request) -> bool:
        """No more tokens can be produced once pending results are applied."""
        produced = len(req.output_token_ids) + req.num_output_placeholders
        sp = req.sampling_params
        if sp.max_tokens is not None and produced >= sp.max_tokens:
            return True
        return req.num_tokens + req.num_output_placeholders >= self.config.max_model_len

    def _max_k(self, req: Request, budget_left: int) -> int:
        produced = len(req.output_token_ids) + req.num_output_placeholders
        room = self.config.max_model_len - (req.num_tokens + req.num_output_placeholders)
        if req.sampling_params.max_tokens is not None:
            room = min(room, req.sampling_params.max_tokens - produced)
        return max(0, min(self.info.max_draft_tokens, budget_left, room - 1))

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_output_placeholders = 0
        req.metrics.num_preemptions += 1
        self._epoch[req.request_id] += 1  # results of steps in flight are now stale
        self._rejected[req.request_id] = 0
        self._confirmed[req.request_id] = 0
        self._awaiting_prefill.discard(req.request_id)
        self._has_sampled.discard(req.request_id)
        self._forget_worker_state(req.request_id)
        self.stats.num_preemptions += 1
        self.waiting.appendleft(req)

    def _forget_worker_state(self, rid: str) -> None:
        if rid in self._sent_to_worker:
            self._sent_to_worker.discard(rid)
            self.finished_ids.append(rid)

    # ------------------------------------------------------------------ update
    def update(self, out: SchedulerOutput, result: StepResult) -> list[Request]:
        """Apply one step's result; returns the requests that produced tokens or finished."""
        touched: list[Request] = []
        self.stats.num_drafted += result.num_drafted
        self.stats.num_verify_steps += result.num_verify_steps
        for pos, n in enumerate(result.num_accepted_per_pos):
            if pos < len(self.stats.accepted_per_pos):
                self.stats.accepted_per_pos[pos] += n
            self.stats.num_accepted += n
        for item in out.items:
            req = item.request
            rid = req.request_id
            if req.is_finished or self._epoch.get(rid) != item.epoch:
                continue  # aborted, failed or preempted while in flight: discard
            if rid in result.request_errors:
                req.error = result.request_errors[rid]
                self._finish(req, RequestStatus.FINISHED_ERROR)
                touched.append(req)
                continue
            if not item.sample:
                self._confirm(req, item.num_new)
                continue
            self._awaiting_prefill.discard(rid)
            tokens = result.sampled.get(rid, [])
            req.num_output_placeholders -= 1 + item.num_draft
            accepted = max(0, len(tokens) - 1)
            rejected = item.num_draft - accepted
            if rejected:
                req.num_computed_tokens -= rejected
                self._rejected[rid] = self._rejected.get(rid, 0) + rejected
            self._confirm(req, item.num_new + accepted)
            lps = result.logprobs.get(rid)
            for j, tok in enumerate(tokens):
                req.output_token_ids.append(tok)
                if lps is not None and j < len(lps):
                    req.output_logprobs.append(lps[j])
                status = self._stop_status(req, tok)
                if status is not None:
                    self._finish(req, status)
                    break
            touched.append(req)
        return touched

    def _confirm(self, req: Request, n: int) -> None:
        rid = req.request_id
        self._confirmed[rid] = self._confirmed.get(rid, 0) + n
        self.kv.publish(req, self._confirmed[rid])

    def _stop_status(self, req: Request, tok: int) -> RequestStatus | None:
        sp = req.sampling_params
        n_out = len(req.output_token_ids)
        if n_out >= sp.min_tokens:
            if not sp.ignore_eos and tok in req.eos_token_ids:
                req.stop_reason = None
                return RequestStatus.FINISHED_EOS
            if tok in sp.stop_token_ids:
                req.stop_reason = tok
                return RequestStatus.FINISHED_STOP
        if self.on_token is not None and self.on_token(req, tok) and n_out >= sp.min_tokens:
            return RequestStatus.FINISHED_STOP
        if sp.max_tokens is not None and n_out >= sp.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if req.num_tokens >= self.config.max_model_len:
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
        rid = req.request_id
        self._forget_worker_state(rid)
        for d in (self._epoch, self._rejected, self._confirmed):
            d.pop(rid, None)
        self._awaiting_prefill.discard(rid)
        self._has_sampled.discard(rid)
        del self.requests[rid]


def _sampling_dict(sp: SamplingParams, eos: tuple[int, ...]) -> dict[str, object]:
    d: dict[str, object] = asdict(sp)
    d["eos_token_ids"] = list(eos)
    return d
