"""Data parallelism: ``data_parallel_size`` engine replicas behind one server.

Each replica is a whole :class:`AsyncLLM` (its own engine core, worker and KV cache, supervised and
restarted on its own). :class:`DataParallelLLM` offers the same surface the HTTP layer uses and routes
each new request to one replica:

* ``least_tokens`` (default): the replica with the fewest outstanding tokens, counted as each
  in-flight request's prompt plus its token budget (``max_tokens``, or the context length) times
  ``n``, released when the request finishes, fails or is aborted; ties go to the lowest index.
* ``prefix_affinity``: requests whose prompts share their first ``block_size`` tokens go to the same
  replica (a stable hash picks it), so its prefix cache gets the hits; a replica that is not
  healthy is skipped, and a prompt shorter than a block routes by least tokens.

Aborts follow the request to its replica. Engine statistics are summed over the replicas, and each
replica's own snapshot (with its outstanding tokens and whether it is down for good) is kept under
``replicas``; the Prometheus metrics show both, the per-replica series labelled ``replica``.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import struct
import threading
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import torch

from ..config import ServingSettings
from ..devices import device_kind
from ..lora import LoraError
from ..metrics import ServerMetrics
from ..plugins import PluginManager
from ..request import RequestOutput, SamplingParams
from ..tokenizer import Tokenizer
from ..worker import resolve_cpu_binds
from .async_llm import AsyncLLM, stream_outputs

__all__ = ["DataParallelLLM", "ServingLLM", "make_llm", "replica_settings"]

logger = logging.getLogger(__name__)

_SUMMED = (
    "num_running",
    "num_waiting",
    "num_preemptions",
    "prefix_cache_queries",
    "prefix_cache_hits",
    "kv_offload_bytes_down",
    "kv_offload_bytes_up",
    "kv_offload_loads",
    "kv_offload_load_seconds",
    "kv_offload_load_failed",
    "spec_drafted",
    "spec_accepted",
    "spec_verify_steps",
    "num_steps",
)


def make_llm(
    settings: ServingSettings, plugins: PluginManager | None = None, *, on_fatal: Callable[[str], None] | None = None
) -> AsyncLLM | DataParallelLLM:
    """One engine, or ``data_parallel_size`` replicas behind a router."""
    if settings.data_parallel_size == 1:
        return AsyncLLM(replica_settings(settings, 1)[0], plugins, on_fatal=on_fatal)
    return DataParallelLLM(settings, plugins, on_fatal=on_fatal)


def replica_settings(settings: ServingSettings, count: int) -> list[ServingSettings]:
    """Each of ``count`` replicas' settings, every ``auto`` core choice made a list here
    (:func:`~pypto_serving.worker.resolve_cpu_binds`). On the CPU with ``worker_cpu_bind = "auto"``
    every replica alone would pin its worker to the same last ``worker_threads`` cores; instead replica
    ``i`` gets its own slice of the last ``count x worker_threads`` cores this process may use (an
    explicit list, in order), and where they do not all fit none is pinned (``"off"``: the OS spreads
    them) rather than all on the same cores; ``engine_cpu_bind = "auto"`` gives the server and the
    engine cores what the workers leave. Other devices, tensor parallelism and an explicit
    ``worker_cpu_bind`` keep their workers' cores."""
    return resolve_cpu_binds(_replica_workers(settings, count))


def _replica_workers(settings: ServingSettings, count: int) -> list[ServingSettings]:
    if settings.worker_cpu_bind != "auto" or settings.tensor_parallel_size > 1 or count == 1:
        return [settings] * count
    if device_kind(settings.device) != "cpu":
        return [settings] * count
    threads = settings.worker_threads or torch.get_num_threads()
    allowed = sorted(os.sched_getaffinity(0))
    if count * threads > len(allowed):
        logger.info(
            "%d replicas x %d worker threads exceed the %d cores this process may use: no worker is pinned "
            "(set worker_threads to split the cores between the replicas)",
            count, threads, len(allowed),
        )  # fmt: skip
        return [settings.with_overrides(worker_cpu_bind="off")] * count
    cores = allowed[-count * threads :]
    slices = [cores[i * threads : (i + 1) * threads] for i in range(count)]
    return [settings.with_overrides(worker_cpu_bind=",".join(map(str, part))) for part in slices]


class DataParallelLLM:
    """Routes requests over replica :class:`AsyncLLM` engines (see the module docstring)."""

    def __init__(
        self,
        settings: ServingSettings,
        plugins: PluginManager | None = None,
        *,
        on_fatal: Callable[[str], None] | None = None,
        replicas: list[AsyncLLM] | None = None,
    ) -> None:
        self.plugins = plugins or PluginManager()
        count = settings.data_parallel_size
        self.replicas = replicas or [
            AsyncLLM(each, self.plugins, on_fatal=on_fatal) for each in replica_settings(settings, count)
        ]
        self.settings = self.replicas[0].settings
        self.routing = self.settings.data_parallel_routing
        self._lock = threading.Lock()  # owners and loads change on the event loop and engine threads
        self._owner: dict[str, tuple[int, int]] = {}  # request id -> (replica, outstanding tokens)
        self._load = [0] * len(self.replicas)
        self._metrics: ServerMetrics | None = None
        for replica in self.replicas:
            replica.on_finished = self._release

    # ------------------------------------------------------------------ lifecycle and state
    def start(self) -> None:
        for r in self.replicas:
            r.start()

    def wait_ready(self, timeout: float | None = None) -> Any:
        """Wait for every replica (each re-raises its own start-up error); returns the first's engine."""
        engines = [r.wait_ready(timeout) for r in self.replicas]
        return engines[0]

    def shutdown(self, timeout: float = 30.0) -> None:
        for r in self.replicas:
            r.shutdown(timeout)

    def fail_streams(self, reason: str) -> int:
        return sum(r.fail_streams(reason) for r in self.replicas)

    @property
    def metrics(self) -> ServerMetrics | None:
        return self._metrics

    @metrics.setter
    def metrics(self, value: ServerMetrics | None) -> None:
        self._metrics = value
        for i, r in enumerate(self.replicas):
            r.metrics = None if value is None else _ReplicaMetrics(value, self, i)

    @property
    def ready(self) -> bool:
        return all(r.ready for r in self.replicas)

    @property
    def healthy(self) -> bool:
        return all(r.healthy for r in self.replicas)

    @property
    def draining(self) -> bool:
        return any(r.draining for r in self.replicas)

    def drain(self) -> None:
        for r in self.replicas:
            r.drain()

    def has_open_requests(self) -> bool:
        return any(r.has_open_requests() for r in self.replicas)

    @property
    def stalled(self) -> str | None:
        return next((f"replica {i}: {why}" for i, r in enumerate(self.replicas) if (why := r.stalled)), None)

    @property
    def dead_reason(self) -> str | None:
        return next((f"replica {i}: {r.dead_reason}" for i, r in enumerate(self.replicas) if r.dead_reason), None)

    @property
    def restarting(self) -> str | None:
        return next((f"replica {i}: {r.restarting}" for i, r in enumerate(self.replicas) if r.restarting), None)

    @property
    def engine(self) -> Any:
        return self.replicas[0].engine

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.replicas[0].tokenizer

    @property
    def max_model_len(self) -> int:
        return min(r.max_model_len for r in self.replicas)

    @property
    def vocab_size(self) -> int:
        return self.replicas[0].vocab_size

    def profile(self, start: bool, path: str) -> None:
        """Each replica's profile (replica ``i`` writes ``<path>-r<i>.engine.json`` and ``.worker.json``)."""
        for i, r in enumerate(self.replicas):
            r.profile(start, f"{path}-r{i}")

    def num_waiting(self) -> int:
        return sum(r.num_waiting() for r in self.replicas)

    async def load_lora(self, name: str, path: str) -> None:
        """The adapter into every replica, or none: a replica that refuses it (or fails) has the
        replicas that loaded it before unload it again, and its error is raised."""
        loaded: list[AsyncLLM] = []
        try:
            for replica in self.replicas:
                await replica.load_lora(name, path)
                loaded.append(replica)
        except BaseException:
            for replica in loaded:
                with contextlib.suppress(Exception):
                    await replica.unload_lora(name)
            raise

    async def unload_lora(self, name: str) -> None:
        """The adapter out of every replica that serves it; LoraError (404) when none does."""
        refused: list[LoraError] = []
        for replica in self.replicas:
            try:
                await replica.unload_lora(name)
            except LoraError as e:
                refused.append(e)
        if len(refused) == len(self.replicas):
            raise refused[0]

    @property
    def stats(self) -> dict[str, Any]:
        """The replicas' engine statistics summed (KV usage averaged), with each one's own snapshot."""
        snaps = [dict(r.stats) for r in self.replicas]
        out: dict[str, Any] = {key: sum(s.get(key, 0) for s in snaps) for key in _SUMMED}
        out["kv_usage"] = sum(s.get("kv_usage", 0.0) for s in snaps) / len(snaps)
        groups = [s.get("kv_usage_per_group", {}) for s in snaps]
        out["kv_usage_per_group"] = {g: sum(u.get(g, 0.0) for u in groups) / len(snaps) for g in groups[0]}
        per_pos = [s.get("spec_accepted_per_pos", []) for s in snaps]
        out["spec_accepted_per_pos"] = [sum(col) for col in zip(*per_pos)] if all(per_pos) else []
        steps = out["spec_verify_steps"]
        out["spec_mean_accepted_length"] = out["spec_accepted"] / steps if steps else 0.0
        for key in ("spec_method", "spec_policy", "spec_k"):
            out[key] = snaps[0].get(key)
        # Every replica serves the same adapters (loads and unloads go to all): the first that says.
        out["lora_adapters"] = next((s["lora_adapters"] for s in snaps if "lora_adapters" in s), None)
        with self._lock:
            loads = list(self._load)
        dead = [r.dead_reason is not None for r in self.replicas]
        out["replicas"] = [{**s, "outstanding_tokens": n, "dead": d} for s, n, d in zip(snaps, loads, dead)]
        return out

    # ------------------------------------------------------------------ requests
    def route(self, prompt: list[int], params: SamplingParams) -> int:
        """The replica a new request goes to (see the module docstring)."""
        healthy = [i for i, r in enumerate(self.replicas) if r.healthy] or list(range(len(self.replicas)))
        block = self.settings.block_size
        if self.routing == "prefix_affinity" and len(prompt) >= block:
            digest = hashlib.sha256(struct.pack(f"<{block}q", *prompt[:block])).digest()
            start = int.from_bytes(digest[:8], "little") % len(self.replicas)
            for step in range(len(self.replicas)):
                if (start + step) % len(self.replicas) in healthy:
                    return (start + step) % len(self.replicas)
        with self._lock:
            return min(healthy, key=lambda i: (self._load[i], i))

    async def add_request(self, request_id: str, prompt: list[int], params: SamplingParams) -> Any:
        index = self.route(prompt, params)
        budget = params.max_tokens if params.max_tokens is not None else self.max_model_len
        cost = (len(prompt) + budget) * params.n
        with self._lock:
            if request_id in self._owner:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._owner[request_id] = (index, cost)
            self._load[index] += cost
        try:
            return await self.replicas[index].add_request(request_id, prompt, params)
        except BaseException:
            self._release(request_id)
            raise

    def abort(self, request_id: str) -> None:
        with self._lock:
            owner = self._owner.get(request_id)
        if owner is not None:
            self.replicas[owner[0]].abort(request_id)

    def generate(self, request_id: str, prompt: list[int], params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """As :meth:`AsyncLLM.generate`, on the replica the request is routed to."""
        return stream_outputs(lambda: self.add_request(request_id, prompt, params), lambda: self.abort(request_id))

    def _release(self, request_id: str) -> None:
        """A request ended on its replica (finished, failed or aborted): its tokens are no longer outstanding."""
        with self._lock:
            owner = self._owner.pop(request_id, None)
            if owner is not None:
                self._load[owner[0]] -= owner[1]

    def replica_of(self, request_id: str) -> int | None:
        with self._lock:
            owner = self._owner.get(request_id)
        return None if owner is None else owner[0]


class _ReplicaMetrics(ServerMetrics):
    """Replica ``index``'s view of the server's metrics. A finished request and a restart are recorded
    overall and for the replica; an engine snapshot from one replica refreshes the metrics from the
    router's data-parallel snapshot (the sum, and every replica's own), whose counters track each
    replica's totals apart, so a replica's restart adds to the sums instead of looking like a drop."""

    def __init__(self, shared: ServerMetrics, router: DataParallelLLM, index: int) -> None:
        self.shared, self.router, self.index = shared, router, index

    def observe_finished(self, out: RequestOutput) -> None:
        self.shared.observe_replica_finished(self.index, out)

    def observe_output(self, out: RequestOutput) -> None:
        self.shared.observe_output(out)

    def observe_restart(self) -> None:
        self.shared.observe_replica_restart(self.index)

    def update_engine(self, stats: Mapping[str, Any], dead: bool) -> None:
        self.shared.update_engine(self.router.stats, self.router.dead_reason is not None)

    def render(self) -> bytes:
        return self.shared.render()


ServingLLM = AsyncLLM | DataParallelLLM
"""What the HTTP layer serves from: one engine, or replicas behind a router."""
