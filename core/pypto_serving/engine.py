"""EngineCore (one step loop driven by a scheduling strategy plugin) and LLM (the offline API)."""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import random
import shutil
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from functools import partial
from pathlib import Path
from typing import Any

import msgspec

from .config import ServingSettings, SettingsError
from .devices import cpu_kv_cache_memory, device_kind
from .executor import CacheGroupSpec, ExecutorInfo, StepInterrupt
from .hookspecs import SchedulerSpec
from .kv_cache import KVCacheManager
from .kv_ledger import KVLinks, KVTransferLedger
from .kv_tiers import TierLedger, tier_identity
from .lora import LoraError, LoraRegistry
from .messages import InitDone, LoadLora, ReadLora, StepResult
from .model_files import check_max_model_len, sampling_defaults
from .plugins import PluginError, PluginManager
from .profiler import ProfileControl, TraceProfiler, phase
from .request import CompletionOutput, OutputState, Request, RequestOutput, RequestStatus, SamplingParams
from .scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from .speculative import CORE_DRAFTERS, SpecPolicy
from .strategy import StepStrategy
from .tokenizer import IncrementalDetokenizer, Tokenizer, load_tokenizer
from .worker import WorkerClient, WorkerDiedError

__all__ = ["LLM", "EngineCore", "EngineDeadError"]

logger = logging.getLogger(__name__)
PromptType = str | list[int]


class EngineDeadError(RuntimeError):
    """The worker died or the engine failed; no more requests can be served."""


def _output(choices: list[Request]) -> RequestOutput:
    """A user request's output so far, from its choices (``Request.out.choices``)."""
    head = choices[0]
    outs = [
        CompletionOutput(
            index=i,
            token_ids=list(c.output_token_ids),
            text=_text(c),
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
            logprobs=list(c.output_logprobs) if c.sampling_params.logprobs is not None else None,
            error=c.error,
        )
        for i, c in enumerate(choices)
    ]
    finished = all(c.is_finished for c in choices)
    if finished and not head.out.logged:
        # Logged with the final output, once (a finished output can be built again): an offline
        # caller has no other record of why it failed.
        head.out.logged = True
        for c in choices:
            if c.error is not None:
                logger.error("request %s failed: %s", c.request_id, c.error)
    return RequestOutput(
        head.out.user_request_id,
        head.out.prompt,
        head.prompt_token_ids,
        outs,
        finished=finished,
        num_cached_tokens=head.num_cached_tokens,
        metrics=head.metrics,
        prompt_logprobs=_prompt_logprobs(head),
        kv_transfer_params=head.out.kv_transfer_params,
    )


def _text_waits(req: Request) -> bool:
    """Whether ``req``'s text is left to its end: a final-only request still running (its stop
    strings, if any, are checked token by token as they are committed, so this defers no stop)."""
    return bool(req.out.choices) and req.out.choices[0].out.final_only and not req.is_finished


def _prompt_logprobs(req: Request) -> list[dict[int, float] | None] | None:
    if req.sampling_params.prompt_logprobs is None:
        return None
    return [None, *req.prompt_logprobs]


MAX_KV_BLOCKS_PER_GROUP = 2**20
"""The most blocks the planner gives one cache group. The engine keeps per-block Python state (free
list, reference counts, prefix hashes), and 2**20 blocks of 16 tokens already hold 16M tokens: a
larger plan comes from a mistake (an executor declaring a tiny ``bytes_per_block``, a huge
``num_kv_blocks``), so it is refused rather than built."""
#: ``num_scheduler_steps`` unset, on the CPU: decodes get up to ``AUTO_STEPS`` forwards a command,
#: as many as fit in ``AUTO_STEPS_WITHIN_S`` while every running request is past its prompt (their
#: tokens stream that many at a time). An arrival ends such a command after its current forward
#: (``EngineCore.step_interrupt``); where the worker cannot (tensor parallelism) it waits for the
#: command, so the window is then ``AUTO_STEPS_UNINTERRUPTED_S``. ``AUTO_STEPS`` is
#: ``num_scheduler_steps``' own largest value, so the window alone bounds a command: each costs the
#: worker about 1.2 ms between its forwards (its runner's batch, the result's send, the loop's
#: set-up; docs/benchmarks.md), which 16 forwards of a small model's 1.4-2.4 ms repaid less than the
#: 20-35 that fit in 50 ms.
AUTO_STEPS = 64
AUTO_STEPS_WITHIN_S = 0.050
AUTO_STEPS_UNINTERRUPTED_S = 0.020

# A priority the scheduler would ignore is refused, as vLLM refuses it (0, the default, is accepted).
PRIORITY_NEEDS_POLICY = "priority={} needs scheduling_policy = 'priority'; this engine schedules 'fcfs'"


def plan_kv_blocks(
    groups: Sequence[CacheGroupSpec],
    num_kv_blocks: int | None,
    memory: int,
    *,
    max_num_seqs: int = 1,
    max_num_batched_tokens: int = 0,
) -> dict[str, int]:
    """Blocks per cache group: ``num_kv_blocks`` each if set, else split ``memory`` so that every
    group can hold the same number of sequence tokens (a compressed group, whose block covers more
    tokens, gets proportionally fewer blocks). A sliding-window group gets no more than
    :func:`window_group_tokens` worth of blocks, and the memory it leaves goes to the other groups.

    :raises SettingsError: a group would get more than :data:`MAX_KV_BLOCKS_PER_GROUP` blocks.
    """
    if num_kv_blocks is not None:
        plan = {g.name: num_kv_blocks for g in groups}
    else:
        caps = {g.name: window_group_tokens(g, max_num_seqs, max_num_batched_tokens) for g in groups}
        tokens = _plan_tokens(groups, caps, memory)
        plan = {g.name: max(1, int(min(tokens, caps[g.name] or tokens) // g.tokens_per_block)) for g in groups}
    for g in groups:
        if plan[g.name] > MAX_KV_BLOCKS_PER_GROUP:
            if num_kv_blocks is not None:
                why, fix = f"num_kv_blocks={num_kv_blocks} asks for that", "lower num_kv_blocks"
            else:
                why = f"kv_cache_memory={memory} bytes at the executor's bytes_per_block={g.bytes_per_block}"
                fix = "lower kv_cache_memory or set num_kv_blocks (and check the executor's bytes_per_block)"
            raise SettingsError(
                f"KV cache group {g.name!r} would get {plan[g.name]:,} blocks ({why}), more than the "
                f"{MAX_KV_BLOCKS_PER_GROUP:,} per group the engine accepts: {fix}"
            )
    return plan


def window_group_tokens(group: CacheGroupSpec, max_num_seqs: int, max_num_batched_tokens: int) -> int | None:
    """The most tokens a sliding-window group holds at once (``None`` for other groups): each
    running request its window plus two partly filled blocks, and the tokens of two steps in
    flight beyond that."""
    if group.window_tokens is None:
        return None
    return max_num_seqs * (group.window_tokens + 2 * group.tokens_per_block) + 2 * max_num_batched_tokens


def _plan_tokens(groups: Sequence[CacheGroupSpec], caps: dict[str, int | None], memory: int) -> float:
    """The sequence tokens every uncapped group can hold when capped groups take only their cap:
    groups whose cap exceeds the even share drop out of the capped set until it is stable."""
    per_token = {g.name: g.bytes_per_block / g.tokens_per_block for g in groups}
    capped = {name for name, cap in caps.items() if cap is not None}
    while True:
        fixed = sum(per_token[n] * (caps[n] or 0) for n in capped)
        free_rate = sum(per_token[g.name] for g in groups if g.name not in capped)
        if free_rate == 0:  # every group is capped: they share the memory evenly
            return memory / max(sum(per_token.values()), 1e-9)
        tokens = max(0.0, memory - fixed) / free_rate
        too_big = {n for n in capped if (caps[n] or 0) > tokens}
        if not too_big:
            return tokens
        capped -= too_big


def _longest_fitting(kv: KVCacheManager, limit: int) -> int:
    """The longest sequence below ``limit`` one request can hold in ``kv`` (0: none), by bisection."""
    lo, hi = 0, limit  # kv holds lo tokens (0 trivially) and not hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if kv.can_ever_fit(mid) else (lo, mid)
    return lo


def check_kv_cache_dtype(kv_cache_dtype: str, info: ExecutorInfo, executor_name: str) -> None:
    """Refuse a ``kv_cache_dtype`` the loaded executor does not declare in ``kv_cache_dtypes``."""
    if kv_cache_dtype not in info.kv_cache_dtypes:
        raise ValueError(
            f"kv_cache_dtype={kv_cache_dtype!r} is not supported by the {executor_name} executor "
            f"(it supports {', '.join(repr(d) for d in info.kv_cache_dtypes)})"
        )


def check_lora_support(settings: ServingSettings, info: ExecutorInfo, executor_name: str) -> None:
    """Refuse LoRA settings for an executor that does not apply adapters (``supports_lora``): its
    requests naming an adapter would run the base model."""
    if (settings.lora_modules or settings.enable_lora) and not info.supports_lora:
        what = "lora_modules" if settings.lora_modules else "enable_lora"
        raise SettingsError(f"{what} is set, but the {executor_name} executor does not serve LoRA adapters")


def check_kv_offload(settings: ServingSettings, info: ExecutorInfo, executor_name: str) -> None:
    """Offload tiers hold prefix-cache blocks: every cache group must cache prefixes."""
    if settings.kv_offload() and not all(g.prefix_caching for g in info.cache_groups):
        names = ", ".join(g.name for g in info.cache_groups if not g.prefix_caching)
        raise SettingsError(
            f"kv_offload tiers need the prefix cache, which the {executor_name} executor's cache groups "
            f"{names} do not allow; unset kv_offload_host_bytes and kv_offload_disk_path"
        )


def read_architecture(model: str | None) -> str | None:
    if model is None:
        return None
    cfg = Path(model) / "config.json"
    if not Path(model).is_dir():
        raise SettingsError(f"model directory {model!r} does not exist")
    if not cfg.is_file():
        raise SettingsError(f"model directory {model!r} has no config.json")
    archs = json.loads(cfg.read_text()).get("architectures") or []
    return archs[0] if archs else None


class EngineCore:
    """Owns the scheduler, the KV accounting and the worker; a strategy plugin drives the steps."""

    def __init__(self, settings: ServingSettings, plugins: PluginManager | None = None) -> None:
        self.plugins = plugins or PluginManager()
        self.plugins.check_healthy()
        self.settings = settings = self.plugins.resolve_model(settings)
        exec_spec = self.plugins.select_executor(settings.executor, read_architecture(settings.model))
        check_max_model_len(settings)
        # Fails before a model loads when the settings alone rule out every installed strategy; the
        # choice itself needs the loaded executor's supports_pipelining (``_setup``).
        self.plugins.select_scheduler(settings.scheduler, pipelined=settings.async_scheduling)
        if settings.speculative_config is not None:
            self.plugins.select_spec_policy(settings.speculative_config.policy)
        self.plugins.configure(settings)
        self.dead_reason: str | None = None
        self._profiler = TraceProfiler()
        self.worker = WorkerClient(
            exec_spec.factory,
            settings,
            mode=settings.worker_mode,
            timeout=settings.step_timeout,
            kv_factory=self._kv_connector_factory(),
        )
        try:
            self._setup(exec_spec.name)
        except BaseException:
            self.worker.close()
            raise

    def _setup(self, executor_name: str) -> None:
        settings = self.settings
        info = self.info = self.worker.info
        check_kv_cache_dtype(settings.kv_cache_dtype, info, executor_name)
        check_lora_support(settings, info, executor_name)
        check_kv_offload(settings, info, executor_name)
        sched_spec = self._choose_strategy(executor_name)
        self.scheduler_name = sched_spec.name
        # The drafting depth in effect (the executor's, or the core drafter's): the scheduler plans with
        # it, while ``self.info`` stays what the executor reported.
        policy, self.max_draft_tokens = self._choose_policy(executor_name)
        num_blocks = plan_kv_blocks(
            info.cache_groups,
            settings.num_kv_blocks,
            self._kv_cache_memory(),
            max_num_seqs=settings.max_num_seqs,
            max_num_batched_tokens=settings.max_num_batched_tokens,
        )
        self.worker.init_kv_cache(num_blocks)
        self.kv = KVCacheManager(
            info.cache_groups,
            num_blocks,
            enable_prefix_caching=settings.enable_prefix_caching,
            prefix_cache_hash=settings.prefix_cache_hash,
            max_step_tokens=settings.max_num_batched_tokens,
        )
        self.max_model_len = self._fit_max_model_len(num_blocks)
        self.tokenizer: Tokenizer | None = load_tokenizer(
            settings.tokenizer or settings.model, self.plugins.chat_encoder(settings.model)
        )
        self.scheduler = self._new_scheduler(policy)
        self.eos_token_ids = tuple(info.eos_token_ids) or (
            (self.tokenizer.eos_token_id,) if self.tokenizer and self.tokenizer.eos_token_id is not None else ()
        )
        # The engine's one map: a user request's id to its choices (the scheduler's ``requests`` is
        # the other map keyed by request id in the engine process; every other per-request fact
        # lives on the Request).
        self._users: dict[str, list[Request]] = {}
        self._rng = random.Random(settings.seed)
        self._changed: list[Request] = []  # heads (choices[0]) of user requests with an output due
        self._setup_kv_transfer()
        self.loras = LoraRegistry.of(settings)
        self.strategy: StepStrategy = sched_spec.factory(self)
        logger.info("engine ready: executor=%s scheduler=%s kv blocks=%s", executor_name, sched_spec.name, num_blocks)

    def _kv_connector_factory(self) -> Any:
        """The KV connector's factory when this engine has a ``kv_role`` (disaggregated serving) or
        offload tiers (the tier connector, docs/kv_tiers.md)."""
        cfg, s = self.settings.kv_transfer(), self.settings
        if s.kv_offload():
            if cfg is not None:
                raise SettingsError("kv_offload tiers with a kv_role are not supported yet; unset one of them")
            if s.tensor_parallel_size > 1:
                raise SettingsError("kv_offload tiers with tensor_parallel_size > 1 are not supported yet")
            from .kv_connectors.tiers import TierSpec, make_tier_connector

            spec = TierSpec(s.kv_offload_host_bytes > 0, s.kv_offload_disk_path, tier_identity(s))
            return partial(make_tier_connector, spec)
        if cfg is None:
            return None
        if self.settings.nnodes > 1:
            # Every rank's connector talks to the engine over its own pipe: ranks on other hosts have none.
            raise SettingsError(
                "kv_role with nnodes > 1 is not supported: every tensor-parallel rank of a prefill or decode "
                "engine must run on the engine's host (nnodes=1)"
            )
        return self.plugins.kv_connectors.get(cfg.kv_connector).factory

    def _setup_tiers(self) -> None:
        """The offload tiers' ledger, over the tier connector the worker just started."""
        self.tiers: TierLedger | None = None
        s, conn = self.settings, self._kv_conn
        if not s.kv_offload() or conn is None:
            return
        if not conn.poll(60):
            raise RuntimeError("the worker's KV tier connector did not start within 60s")
        kind, address = conn.recv()
        assert kind == "address", kind
        self.tiers = tiers = TierLedger(
            self.kv, conn.send, address, host_bytes=s.kv_offload_host_bytes, disk_bytes=s.kv_offload_disk_bytes
        )
        self.scheduler.kv_in_transit = lambda: bool(tiers.storing or tiers.loads or any(tiers.held()))

    def _setup_kv_transfer(self) -> None:
        """The ledger of disaggregated serving, over the connector the worker just started."""
        cfg, conns = self.settings.kv_transfer(), getattr(self.worker, "kv_conns", None)
        self.kvx: KVTransferLedger | None = None
        # The tiers' pipe: tiers run without a kv_role and with one rank, so rank 0's is the only one.
        self._kv_conn = conns[0] if conns and cfg is None else None
        self._kv_links = KVLinks(conns) if conns and cfg is not None else None
        self._setup_tiers()
        if cfg is None or self._kv_links is None:
            return
        if cfg.kv_role in ("prefill", "both") and self.kv.hit_aligned and not self.kv.prefix_caching:
            # Its offers are prefix-cache hits on the request's own blocks (window blocks given back
            # during the prefill are taken again from the cache).
            raise SettingsError(
                "kv_role 'prefill' on an executor with sliding-window or snapshot cache groups needs "
                "enable_prefix_caching (and every cache group caching prefixes)"
            )
        address = self._kv_links.start(timeout=60)
        self.kvx = KVTransferLedger(cfg, self.kv, self._kv_links.send, address)
        self.kvx.seats = self._pull_seats
        self.scheduler.hold_kv = self.kvx.hold

    def _poll_kv(self) -> None:
        """Apply the KV connector's events: free held blocks, fail or admit pulled requests. While only
        pulls are pending it waits a few ms for an event instead of spinning."""
        kvx, links = self.kvx, self._kv_links
        if self.tiers is not None:
            self._poll_tiers()
        if kvx is None or links is None:
            return
        kvx.tick()
        wait = 0.005 if kvx.pulls and not self.scheduler.has_unfinished() else 0.0
        try:
            events = links.events(wait)
        except (EOFError, OSError):
            return  # the worker is gone: check_worker reports it
        for event in events:
            req, ok = kvx.on_event(event)
            if req is not None and ok:
                self._admit_pulled(req)
            elif req is not None:
                self._touch([req])

    def _poll_tiers(self) -> None:
        """Send the offload tiers' stores; apply the tier connector's events (admit loaded requests)."""
        tiers, conn = self.tiers, self._kv_conn
        assert tiers is not None and conn is not None
        tiers.flush()
        wait = 0.005 if tiers.loads and not self.scheduler.has_unfinished() else 0.0
        try:
            while conn.poll(wait):
                wait = 0.0
                req, schedule = tiers.on_event(conn.recv())
                if req is not None and schedule:
                    self._admit_loaded(req)
                elif req is not None:
                    self._touch([req])
        except (EOFError, OSError):
            return  # the worker is gone: check_worker reports it

    def _admit_loaded(self, req: Request) -> None:
        """A request whose tier blocks arrived (they are in the device cache now): first in line, so its
        lookup takes them before anything evicts them. Its id may have been taken meanwhile by a choice
        of another request ("r-1"): then it fails alone (it holds no block)."""
        try:
            self.scheduler.add_request(req, first=True)
        except ValueError as e:
            req.status, req.error = RequestStatus.FINISHED_ERROR, str(e)
            req.metrics.finished_time = time.monotonic()
            self._touch([req])

    def _pull_seats(self) -> int:
        """Requests that may still take blocks through a pull: ``max_num_seqs`` less the running and the
        waiting ones (waiting pulled requests hold their prompt's blocks; the others arrived first)."""
        return self.settings.max_num_seqs - len(self.scheduler.running) - self.scheduler.num_waiting

    def _admit_pulled(self, req: Request) -> None:
        """A decode request whose prompt KV arrived: it enters the scheduler as a prefix hit of it."""
        hit = int((req.sampling_params.kv_transfer_params or {})["num_tokens"])
        self.scheduler.add_request(req)
        req.num_computed_tokens = req.num_cached_tokens = req.metrics.num_cached_tokens = hit
        req.sched.confirmed = hit

    def kv_transfer_params(self, request_id: str) -> dict[str, Any] | None:
        """A live prefill request's offer, for a decode engine: with ``stream_kv`` from the moment it is
        added (the decode engine pulls while the prefill computes), else None until it finishes."""
        req = self.scheduler.requests.get(request_id)
        return None if req is None else req.out.kv_transfer_params

    def _new_scheduler(self, policy: SpecPolicy) -> Scheduler:
        """The scheduler over this engine's KV manager, planning with the drafting depth in effect."""
        settings = self.settings
        steps = self._scheduler_steps()
        config = SchedulerConfig(
            max_num_seqs=settings.max_num_seqs,
            max_num_batched_tokens=settings.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            long_prefill_token_threshold=settings.long_prefill_token_threshold,
            enable_chunked_prefill=settings.enable_chunked_prefill,
            policy=settings.scheduling_policy,
            priority_max_wait_s=settings.priority_max_wait_s,
            num_scheduler_steps=steps,
            scheduler_steps_within_s=self._auto_steps_within(),
        )
        info = replace(self.info, max_draft_tokens=self.max_draft_tokens)
        return Scheduler(config, self.kv, info, policy, text_stop=self._detokenize)

    def _auto_steps_within(self) -> float | None:
        """The time a command's forwards fit in with ``num_scheduler_steps`` unset (None where set)."""
        if self.settings.num_scheduler_steps is not None:
            return None
        return AUTO_STEPS_UNINTERRUPTED_S if self.step_interrupt is None else AUTO_STEPS_WITHIN_S

    @property
    def step_interrupt(self) -> StepInterrupt | None:
        """The count of arrivals that ends the worker's commands of several forwards scheduled before
        one after their current forward (None where the worker cannot end one early: tensor
        parallelism). Whoever hands this engine requests from another thread or process counts each
        after queuing it (``arrive``) and takes the count before each read of that queue (``take``);
        the worker stamps each command with the count taken. The engine itself does neither."""
        return getattr(self.worker, "interrupt", None)

    def _scheduler_steps(self) -> int:
        """The most forwards a decode may run within one command (``num_scheduler_steps``). Auto: on the
        CPU ``AUTO_STEPS``, as many as fit in ``AUTO_STEPS_WITHIN_S`` beside no prompt in chunks (a
        command costs its token's engine, pipe and runner work and a forward after it that starts
        with cold caches: about 1 ms on the small shape of docs/benchmarks.md, worth saving of a
        5 ms forward, not of a 70 ms one); one elsewhere (an accelerator's host work runs beside its
        device work) and with drafts or uniform batches."""
        steps = self.settings.num_scheduler_steps
        if steps is None:
            cpu = device_kind(self.settings.device) == "cpu"
            return AUTO_STEPS if cpu and not (self.max_draft_tokens or self.info.uniform_batches) else 1
        if steps > 1 and (self.max_draft_tokens or self.info.uniform_batches):
            why = "speculative decoding drafts" if self.max_draft_tokens else "its executor needs uniform batches"
            raise ValueError(f"num_scheduler_steps={steps} cannot run: {why}; set num_scheduler_steps = 1")
        return steps

    def _kv_cache_memory(self) -> int:
        """``kv_cache_memory``; with ``gpu_memory_utilization`` (and neither explicit override) what the
        worker's memory profile leaves for the cache; unset on the CPU, what the running requests can
        use (:func:`~pypto_serving.devices.cpu_kv_cache_memory`)."""
        s = self.settings
        explicit = s.num_kv_blocks is not None or s.source_of("kv_cache_memory") != "default"
        if explicit:
            return s.kv_cache_memory
        if s.gpu_memory_utilization is None:
            return self._cpu_kv_cache_memory() if device_kind(s.device) == "cpu" else s.kv_cache_memory
        profile = self.worker.profile_memory(s.max_num_batched_tokens)
        budget = int(s.gpu_memory_utilization * profile.total_bytes)
        free = budget - profile.used_bytes - profile.peak_bytes
        why = (
            f"gpu_memory_utilization={s.gpu_memory_utilization} of {profile.total_bytes / 2**30:.2f} GiB = "
            f"{budget / 2**30:.2f} GiB, minus {profile.used_bytes / 2**30:.2f} GiB in use after loading and "
            f"{profile.peak_bytes / 2**30:.2f} GiB peak of a {s.max_num_batched_tokens}-token forward"
        )
        if free <= 0:
            raise SettingsError(f"no memory left for the KV cache: {why}; raise gpu_memory_utilization")
        logger.info("KV cache memory %.2f GiB: %s", free / 2**30, why)
        return free

    def _cpu_kv_cache_memory(self) -> int:
        s, info = self.settings, self.info
        per_token = sum(g.bytes_per_block / g.tokens_per_block for g in info.cache_groups)
        length = min(s.max_model_len or info.max_model_len, info.max_model_len)
        ranks = s.tensor_parallel_size * s.data_parallel_size // max(1, s.nnodes)
        size, why = cpu_kv_cache_memory(
            per_token, max_num_seqs=s.max_num_seqs, max_model_len=length, floor=s.kv_cache_memory, ranks=ranks
        )
        logger.info("KV cache memory %.2f GiB (kv_cache_memory unset on the CPU: %s)", size / 2**30, why)
        return size

    def _fit_max_model_len(self, num_blocks: dict[str, int]) -> int:
        """The context length: the setting (refused if a cache sized from memory cannot hold one request
        that long), else the executor's, lowered with a warning to what such a cache holds for one
        request. An explicit ``num_kv_blocks`` is taken as given: a request that cannot fit fails alone."""
        info, asked = self.info, self.settings.max_model_len
        want = min(asked or info.max_model_len, info.max_model_len)
        if self.settings.num_kv_blocks is not None or self.kv.can_ever_fit(want):
            return want
        fits = _longest_fitting(self.kv, want)
        blocks = ", ".join(f"{g}: {n}" for g, n in num_blocks.items())
        if asked is not None or fits == 0:
            raise SettingsError(
                f"max_model_len={want} does not fit the KV cache ({blocks} blocks of {self.settings.block_size} "
                f"tokens): one request of that length cannot be held; lower max_model_len or give the cache more "
                f"memory (kv_cache_memory, gpu_memory_utilization, num_kv_blocks)"
            )
        logger.warning(
            "max_model_len lowered from the model's %d to %d tokens, what the KV cache (%s blocks) holds for one "
            "request; set max_model_len or give the cache more memory",
            want,
            fits,
            blocks,
        )
        return fits

    def _choose_strategy(self, executor_name: str) -> SchedulerSpec:
        pipelines = self.info.supports_pipelining
        spec = self.plugins.select_scheduler(
            self.settings.scheduler, pipelined=self.settings.async_scheduling, executor_pipelines=pipelines
        )
        if spec.pipelined and not pipelines:
            raise PluginError(
                f"scheduler {spec.name!r} pipelines steps, but executor {executor_name!r} cannot; "
                "choose a non-pipelined scheduler (async_scheduling = false)"
            )
        return spec

    def _choose_policy(self, executor_name: str) -> tuple[SpecPolicy, int]:
        """The speculative-token policy and the drafting depth in effect (0: no speculation)."""
        spec_cfg = self.settings.speculative_config
        if spec_cfg is None:
            return self.plugins.select_spec_policy("none").factory(self.settings), 0
        depth = self.info.max_draft_tokens
        if spec_cfg.method in CORE_DRAFTERS:
            if not self.info.can_verify_drafts:
                raise PluginError(
                    f"executor {executor_name!r} cannot verify drafts (ExecutorInfo.can_verify_drafts), so "
                    f"speculative_config.method={spec_cfg.method!r} cannot run on it; unset speculative_config"
                )
            depth = spec_cfg.num_speculative_tokens
        if depth < 1:
            raise PluginError(f"executor {executor_name!r} cannot draft tokens; unset speculative_config")
        return self.plugins.select_spec_policy(spec_cfg.policy).factory(self.settings), depth

    # ------------------------------------------------------------------ requests
    def add_request(
        self, request_id: str, prompt: PromptType, params: SamplingParams, *, final_only: bool = False
    ) -> None:
        """Validate and queue a user request. ``final_only``: :meth:`step` reports it once, finished
        (vLLM's ``RequestOutputKind.FINAL_ONLY``, as ``LLM.generate`` reads it), not after every step."""
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        if request_id in self._users:
            raise ValueError(f"request id {request_id!r} is already in use")
        text: str | None = None
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer.json in the model directory; pass token ids")
            text, ids = prompt, self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("the prompt is empty")
        vocab = self.info.vocab_size
        if any(t < 0 or t >= vocab for t in ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        params.check_vocab(vocab)
        params = self.loras.select(params)  # the adapter's key, which the worker and the prefix cache know
        if params.priority and self.settings.scheduling_policy != "priority":
            raise ValueError(PRIORITY_NEEDS_POLICY.format(params.priority))
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer.json in the model directory")
        if params.structured is not None:  # a bad grammar is the caller's error, not a failed request
            from .structured import check_spec

            check_spec(params.structured)
        if params.max_tokens is not None and len(ids) + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                f"max_model_len ({self.max_model_len})"
            )
        _check_encodable(ids, params)
        children = self._choices(request_id, text, ids, params)
        children[0].out.final_only = final_only
        self._enqueue(children)
        self._users[request_id] = children

    def _enqueue(self, children: list[Request]) -> None:
        """Into the scheduler, or first through a KV pull (a decode engine's ``do_remote_prefill``)."""
        head = children[0]
        if self.tiers is not None and len(children) == 1:
            self.scheduler.check_request(head)
            if self.tiers.start(head):
                return
        if self.kvx is not None:
            self.kvx.check(head, len(children))
            if (head.sampling_params.kv_transfer_params or {}).get("do_remote_prefill") and self.kvx.start_pull(head):
                return
        elif head.sampling_params.kv_transfer_params:
            raise ValueError("kv_transfer_params needs an engine with a kv_role (this one serves co-located)")
        try:
            for req in children:
                self.scheduler.add_request(req)  # validates; nothing is admitted until the next step
        except ValueError:  # a choice's id is taken ("r-1" by another request): none of them runs
            self.scheduler.abort([c.request_id for c in children if self.scheduler.requests.get(c.request_id) is c])
            raise
        if self.kvx is not None and (head.sampling_params.kv_transfer_params or {}).get("stream_kv"):
            self.kvx.open_stream(head)  # its kv_transfer_params are known now: a decode engine may pull
            self._touch([head])  # an output carries them at once (a streamed response's first chunk)

    def _choices(self, request_id: str, text: str | None, ids: list[int], params: SamplingParams) -> list[Request]:
        """The ``n`` sequences of a user request, sharing one ``choices`` list (their ``out`` section)."""
        children: list[Request] = []
        created = time.time()
        # The prompt's logprobs are the same for every choice: the first child computes them (the
        # output reads them from it), the others do not repeat the work n - 1 times.
        unscored = params if params.prompt_logprobs is None else replace(params, prompt_logprobs=None)
        for i in range(params.n):
            child_id = request_id if params.n == 1 else f"{request_id}-{i}"
            seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
            if i and params.seed is not None:
                seed = (seed * 0x9E3779B1 + i) % 2**63
            req = Request(child_id, ids, params if i == 0 else unscored, self.eos_token_ids, sample_seed=seed)
            req.out = OutputState(user_request_id=request_id, prompt=text, created=created, choices=children)
            if self.tokenizer is not None:
                req.out.detokenizer = IncrementalDetokenizer(
                    self.tokenizer, ids, params.stop, params.skip_special_tokens
                )
            children.append(req)
        return children

    def load_lora(self, name: str, path: str, on_outputs: Callable[[list[RequestOutput]], None] | None = None) -> float:
        """Load the PEFT adapter directory ``path`` as ``name`` into a free slot. The worker reads it
        in the background while this keeps stepping the running requests (their outputs go to
        ``on_outputs``; without it the steps wait for the read); they stand still only while it is
        copied into the slot between two steps. Returns those seconds.
        :raises LoraError: refused (its ``status`` says why); EngineDeadError: the engine died
        meanwhile (the live requests fail with it)."""
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        adapter = self.loras.plan_load(name, path)
        self.worker.read_lora(ReadLora(adapter.key, path))
        self.loras.reading.add(adapter.key)
        # Without on_outputs nobody would see the outputs of steps run now: they wait for the read.
        while on_outputs is not None and adapter.key in self.loras.reading and self.has_unfinished():
            on_outputs(self.step())
            if self.dead_reason is not None:
                break
        self.loras.reading.discard(adapter.key)
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        stalled, done = self._install_lora(LoadLora(adapter.key, path, adapter.slot))
        if not done.ok:
            error = done.error or "unknown error"
            refused = error.startswith("ValueError: ")
            raise LoraError(400 if refused else 500, error.removeprefix("ValueError: "))
        self.loras.commit(name, adapter)
        logger.info("LoRA adapter %r loaded into slot %d; steps stood still %.1f ms", name, adapter.slot, stalled * 1e3)
        return stalled

    def _install_lora(self, cmd: LoadLora) -> tuple[float, InitDone]:
        """The worker installs a read adapter between steps (the ones in flight are applied first)."""
        started = time.monotonic()
        try:
            self.strategy.drain()
            done = self.worker.install_lora(cmd)
        except Exception as e:
            self._die(f"loading a LoRA adapter failed: {type(e).__name__}: {e}")
            raise EngineDeadError(str(self.dead_reason)) from None
        return time.monotonic() - started, done

    def unload_lora(self, name: str) -> None:
        """Stop serving adapter ``name``: new requests naming it are refused at once, those that
        selected it before run to their end, then its slot is free (:meth:`_release_loras`).
        :raises LoraError: (404) no such adapter is served."""
        self.loras.unload(name)
        self._release_loras()

    def _release_loras(self) -> None:
        if self.loras.unloading:
            self.loras.release({r.sampling_params.lora for r in self.scheduler.live_requests()})

    def abort(self, request_id: str) -> None:
        choices = self._users.get(request_id)
        if choices is None:
            return
        self.scheduler.abort([c.request_id for c in choices])
        for c in choices:
            if self.kvx is not None:
                self.kvx.abort(c.request_id)
            if self.tiers is not None:
                self.tiers.abort(c.request_id)
        self._touch(choices)

    def has_unfinished(self) -> bool:
        return bool(self._users)

    # ------------------------------------------------------------------ steps (used by strategies)
    def step(self) -> list[RequestOutput]:
        """One strategy step; returns the outputs of user requests that changed. A dead worker or an
        unexpected error inside the step marks the engine dead (``dead_reason``) and fails every live
        request instead of raising: the owner replaces a dead engine with a fresh one."""
        if self.dead_reason is None:
            self._poll_kv()
            try:
                self.strategy.step()
            except WorkerDiedError as e:
                self._die(str(e))
            except Exception as e:
                logger.exception("engine step failed")
                self._die(f"engine step failed: {type(e).__name__}: {e}")
        return self._collect()

    def check_worker(self) -> list[RequestOutput]:
        """Notice a worker that died while no step was running; returns the outputs of the requests
        this fails (none while the worker lives)."""
        if self.dead_reason is None:
            reason = self.worker.check_alive()
            if reason is not None:
                self._die(reason)
            else:
                self._poll_kv()
        return self._collect()

    def schedule(self) -> SchedulerOutput | None:
        preemptions = self.scheduler.stats.num_preemptions
        with phase("schedule"):
            out = self.scheduler.schedule()
        self._touch(self.scheduler.take_failed())
        if out is not None:
            self._note_step(out, preemptions != self.scheduler.stats.num_preemptions)
        return out

    def _note_step(self, out: SchedulerOutput, preempted: bool) -> None:
        """The timeline events of a scheduled step: each prefill chunk (an entry over prompt positions,
        or over several tokens: a recompute after preemption), and the preemptions it made."""
        now = time.monotonic()
        for req, entry in zip(out.requests, out.command.entries):
            n = len(entry.token_ids)
            if n > 1 or (n and entry.start_pos < req.num_prompt_tokens):
                req.metrics.note("prefill_chunk", now, entry.start_pos, n)
        if preempted:  # rare: only then are the waiting requests looked at
            for req in self.scheduler.waiting:
                events = req.metrics.events
                if req.status is RequestStatus.PREEMPTED and (not events or events[-1][0] != "preempted"):
                    req.metrics.note("preempted", now)

    def submit(self, out: SchedulerOutput) -> None:
        self.worker.submit(out.command)

    def wait_result(self) -> StepResult:
        return self.worker.get_result()

    def apply(self, out: SchedulerOutput, result: StepResult) -> None:
        """Apply a step result; a failed step fails the requests it carried."""
        with phase("apply"):
            self._apply(out, result)
            if self.kvx is not None and self.kvx.streams and result.error is None:  # the chunks' KV is written
                ends = [e.start_pos + len(e.token_ids) for e in out.command.entries]
                self.kvx.publish_computed(out.requests, ends)

    def _apply(self, out: SchedulerOutput, result: StepResult) -> None:
        self.scheduler.grammars_compiled(result.grammars_ready)
        self.loras.reading.difference_update(result.loras_read)
        if result.error is not None:
            failed = self.scheduler.fail([r.request_id for r in out.requests], f"step failed: {result.error}")
            logger.error("step %d failed: %s", result.step_id, result.error)
            self._touch(failed)
            return
        for rid, (first, entries) in result.prompt_logprobs.items():  # before update can drop the request
            req = self.scheduler.requests.get(rid)
            skip = len(req.prompt_logprobs) + 1 - first if req is not None else -1
            if req is not None and skip >= 0:  # a recomputed prompt (preemption) scores known tokens again
                req.prompt_logprobs += entries[skip:]
        touched = self.scheduler.update(out, result)
        now = time.monotonic()
        for req in touched:
            # The text of tokens the stop-string check did not already see; a final-only request's
            # waits for its end (:meth:`_touch`): nobody reads its text before.
            if req.status is not RequestStatus.FINISHED_ERROR and not _text_waits(req):
                self._detokenize(req)
            if req.output_token_ids:
                if req.metrics.first_token_time is None:
                    req.metrics.first_token_time = now
                req.metrics.last_token_time = now
        self._touch(touched)

    def _detokenize(self, req: Request) -> str | None:
        """Feed the output tokens the request's detokenizer has not seen to it; returns the stop
        string that ended in them (checked once ``min_tokens`` outputs exist). The scheduler calls
        it as each token of a request with stop strings is committed (:data:`scheduler.TextStop`),
        so the token that ends the text is the last one committed; ``apply`` feeds the rest."""
        detok = req.out.detokenizer
        if detok is None:
            return None
        min_tokens = req.sampling_params.min_tokens
        while detok.num_outputs < len(req.output_token_ids):
            n = detok.num_outputs + 1
            if detok.append(req.output_token_ids[n - 1], check_stop=n >= min_tokens):
                return str(detok.stopped_at)
        return None

    def _touch(self, reqs: Sequence[Request]) -> None:
        """An output is due for these requests' user requests (reported by the next ``_collect``)."""
        for r in reqs:
            head = r.out.choices[0] if r.out.choices else None
            if head is None or head.out.changed:
                continue
            if head.out.final_only:
                if not all(c.is_finished for c in head.out.choices):
                    continue  # nobody reads its partial outputs: none is built
                for c in head.out.choices:  # the text of every output token, once
                    self._detokenize(c)
            head.out.changed = True
            self._changed.append(head)

    def _die(self, reason: str) -> None:
        logger.error("engine failed: %s", reason)
        self.dead_reason = reason
        live = [r.request_id for r in self.scheduler.live_requests()]
        self._touch(self.scheduler.fail(live, reason))
        if self.kvx is not None:
            self._touch(self.kvx.fail_pulls(reason))
        if self.tiers is not None:
            self._touch(self.tiers.fail_loads(reason))

    def _collect(self) -> list[RequestOutput]:
        """The outputs due, oldest user request first; a finished user request is dropped after it."""
        self._release_loras()
        outs = []
        changed, self._changed = self._changed, []
        for head in sorted(changed, key=lambda r: r.out.created):
            head.out.changed = False
            out = _output(head.out.choices)
            outs.append(out)
            if out.finished:
                self._users.pop(head.out.user_request_id, None)
        return outs

    def profile(self, start: bool, path: str) -> None:
        """Start a profile of this process and the worker, or stop both: this process's Chrome trace
        goes to ``<path>.engine.json``, the worker's to ``<path>.worker.json`` (see profiler.py)."""
        engine, worker = (
            ProfileControl(start, "" if start else f"{path}.{part}.json") for part in ("engine", "worker")
        )
        if self.worker.mode == "inproc":  # one process, one profiler (the worker's): one trace, both names
            self.worker.profile(worker)
            if not start:  # written whole, then renamed: /stop_profile answers once the name exists
                partial = f"{engine.path}.partial"
                shutil.copyfile(worker.path, partial)
                os.replace(partial, engine.path)
            return
        self.worker.profile(worker)
        self._profiler.control(engine)

    def stats(self) -> dict[str, Any]:
        s = self.scheduler.stats
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_preemptions": s.num_preemptions,
            "kv_usage": self.kv.usage,
            "kv_usage_per_group": {
                name: 1.0 - pool.num_free / pool.num_blocks if pool.num_blocks else 0.0
                for name, pool in self.kv.pools.items()
            },
            "prefix_cache_queries": self.kv.prefix_queries,
            "prefix_cache_hits": self.kv.prefix_hits,
            "prefix_cache_hits_per_group": dict(self.kv.group_hits),
            "spec_drafted": s.num_drafted,
            "spec_accepted": s.num_accepted,
            "spec_accepted_per_pos": list(s.accepted_per_pos),
            "spec_verify_steps": s.num_verify_steps,
            "spec_mean_accepted_length": s.num_accepted / s.num_verify_steps if s.num_verify_steps else 0.0,
            **self._spec_config_stats(),
            "num_steps": s.num_steps,
            **(self.kvx.stats if self.kvx is not None else {}),
            **(self.tiers.snapshot() if self.tiers is not None else {}),
            "lora_adapters": self.loras.names,
        }

    def _spec_config_stats(self) -> dict[str, Any]:
        spec = self.settings.speculative_config
        if spec is None:
            return {"spec_method": None, "spec_policy": None, "spec_k": 0}
        return {"spec_method": spec.method, "spec_policy": spec.policy, "spec_k": spec.num_speculative_tokens}

    def shutdown(self) -> None:
        if self.dead_reason is None:
            with contextlib.suppress(Exception):  # shutting down anyway
                self.strategy.drain()
        if self.tiers is not None and self._kv_conn is not None:
            with contextlib.suppress(OSError):
                self.tiers.flush()  # the connector finishes what it was sent before it closes
                self._kv_conn.send(("close",))
        if self._kv_links is not None:
            self._kv_links.close()
        self.worker.close()


def _text(req: Request) -> str:
    """A sequence's text: with ``include_stop_str_in_output`` the stop string that ended it stays in."""
    detok = req.out.detokenizer
    if detok is None:
        return ""
    keep = req.sampling_params.include_stop_str_in_output and detok.stopped_at
    return str(detok.text + detok.stopped_at) if keep else str(detok.text)


def _check_encodable(ids: list[int], params: SamplingParams) -> None:
    """A request whose values cannot cross the process boundary fails here, alone, rather than in
    the step that would carry it (and every request batched with it)."""
    try:
        _wire_check.encode((ids, asdict(params)))
    except (OverflowError, TypeError, ValueError, UnicodeError, msgspec.EncodeError) as e:
        raise ValueError(f"the request cannot be sent to the worker: {e}") from None


_wire_check = msgspec.msgpack.Encoder()


def _per_prompt(
    num_prompts: int,
    sampling_params: SamplingParams | Sequence[SamplingParams],
    priority: Sequence[int] | None,
    lora: str | Sequence[str | None] | None = None,
) -> list[SamplingParams]:
    """``LLM.generate``'s parameters of each prompt, with its priority when ``priority`` is given and
    its LoRA adapter when ``lora`` is (one name for all, or one name or None per prompt)."""
    if isinstance(sampling_params, SamplingParams):
        params = [sampling_params] * num_prompts
    else:
        params = list(sampling_params)
    if len(params) != num_prompts:
        raise ValueError(f"got {len(params)} sampling params for {num_prompts} prompts")
    if priority is not None:
        if len(priority) != num_prompts:
            raise ValueError(f"got {len(priority)} priorities for {num_prompts} prompts")
        params = [replace(sp, priority=p) for sp, p in zip(params, priority)]
    if lora is None:
        return params
    loras = [lora] * num_prompts if isinstance(lora, str) else list(lora)
    if len(loras) != num_prompts:
        raise ValueError(f"got {len(loras)} LoRA adapters for {num_prompts} prompts")
    return [replace(sp, lora=name) for sp, name in zip(params, loras)]


class LLM:
    """Offline generation: ``LLM(model=dir, **settings).generate(prompts, SamplingParams(...))``."""

    def __init__(
        self,
        model: str | None = None,
        *,
        settings: ServingSettings | None = None,
        plugins: PluginManager | None = None,
        **overrides: Any,
    ) -> None:
        if model is not None:
            overrides["model"] = str(model)
        if settings is not None and overrides:
            settings = settings.with_overrides(**overrides)
        self._plugins = plugins or PluginManager()
        # A named model (or none: the default one) becomes its directory here, so ``settings`` says what runs.
        self.settings = self._plugins.resolve_model(
            settings if settings is not None else ServingSettings.load(**overrides)
        )
        self.engine: EngineCore | None = EngineCore(self.settings, plugins)
        self._ids = 0
        self_ref = weakref.ref(self)
        self._atexit = lambda: (lambda s: s.shutdown() if s is not None else None)(self_ref())
        atexit.register(self._atexit)

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self._engine().tokenizer

    def _engine(self) -> EngineCore:
        if self.engine is None:
            raise EngineDeadError("this LLM was shut down")
        return self.engine

    def _live_engine(self) -> EngineCore:
        """The engine, replaced by a fresh one (new worker, model reloaded) if its worker died."""
        engine = self._engine()
        if engine.dead_reason is None:
            return engine
        logger.warning("starting a new worker; the previous one failed: %s", engine.dead_reason)
        self.engine = None
        engine.shutdown()
        # The adapters served now, run-time loads included, are the new engine's lora_modules.
        self.settings = self.settings.with_overrides(
            lora_modules=engine.loras.entries(), enable_lora=engine.loras.enabled
        )
        self.engine = EngineCore(self.settings, self._plugins)
        return self.engine

    def load_lora(self, name: str, path: str) -> None:
        """Serve the PEFT adapter directory ``path`` as ``name`` (see :meth:`EngineCore.load_lora`;
        no request runs between ``generate`` calls)."""
        self._live_engine().load_lora(name, path)

    def unload_lora(self, name: str) -> None:
        """Stop serving adapter ``name`` (see :meth:`EngineCore.unload_lora`)."""
        self._live_engine().unload_lora(name)

    def default_sampling_params(self) -> SamplingParams:
        """``SamplingParams()`` with the checkpoint's ``generation_config.json`` defaults applied."""
        return SamplingParams(**sampling_defaults(self._engine().info.generation_defaults))

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        lora: str | Sequence[str | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); outputs come back in input order.
        ``priority``: one per prompt (vLLM's), for ``scheduling_policy = "priority"``. ``lora``: the
        adapter (a ``lora_modules`` name) of every prompt, or one per prompt (None: the base model).

        Raises :class:`EngineDeadError` if the worker dies meanwhile; the next call starts a new one."""
        engine = self._live_engine()
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompt_list = list(prompts)  # type: ignore[arg-type]
        if sampling_params is None:
            sampling_params = self.default_sampling_params()
        params = _per_prompt(len(prompt_list), sampling_params, priority, lora)
        ids = self._add_all(engine, prompt_list, params)
        results: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm and len(ids) > 1:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="generating", unit="req")
        try:
            while len(results) < len(ids):
                for out in engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
                if engine.dead_reason is not None:
                    raise EngineDeadError(f"{engine.dead_reason}; the next generate() starts a new worker")
        finally:
            if bar is not None:
                bar.close()
        return [results[i] for i in ids]

    def _add_all(self, engine: EngineCore, prompts: list[PromptType], params: list[SamplingParams]) -> list[str]:
        """Add every prompt, or none: a prompt that fails validation takes back the ones added before
        it, so no orphan request runs into the next ``generate``."""
        ids: list[str] = []
        try:
            for p, sp in zip(prompts, params):
                rid = f"gen-{self._ids}"
                self._ids += 1
                engine.add_request(rid, p, sp, final_only=True)  # only finished outputs are read below
                ids.append(rid)
        except BaseException:
            for rid in ids:
                engine.abort(rid)
            while engine.has_unfinished() and engine.dead_reason is None:
                engine.step()
            raise
        return ids

    def chat(
        self,
        messages: list[dict[str, Any]] | Sequence[list[dict[str, Any]]],
        sampling_params: SamplingParams | None = None,
        *,
        use_tqdm: bool = True,
        **template_kwargs: Any,
    ) -> list[RequestOutput]:
        """Render each conversation with the checkpoint's chat template and generate."""
        tok = self.tokenizer
        if tok is None:
            raise ValueError("chat needs a tokenizer.json with a chat template in the model directory")
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts: list[PromptType] = [
            tok.encode(tok.apply_chat_template(c, add_generation_prompt=True, **template_kwargs))  # type: ignore[arg-type]
            for c in convs
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def shutdown(self) -> None:
        """Stop the worker process and free its memory (also on context exit and interpreter exit)."""
        if self.engine is not None:
            engine, self.engine = self.engine, None
            engine.shutdown()
        atexit.unregister(self._atexit)

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
