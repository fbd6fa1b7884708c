"""The tensor-parallel group of worker processes, on torch.distributed.

With ``tensor_parallel_size = N`` the engine's worker is N rank processes, spread evenly over
``nnodes`` hosts (``N / nnodes`` each). Node 0 runs the engine, whose :class:`~.worker.WorkerClient`
starts node 0's ranks; every other node runs ``pypto-serving worker``, which starts its own. Every rank
joins torch.distributed's default process group (gloo on the CPU, nccl on CUDA, hccl on Ascend) from
``master_addr:master_port`` (torchrun's conventions) before the executor is built, so executors find
their rank through :class:`~.parallel.ParallelContext`. A second, gloo group carries the control
traffic on host tensors whatever the device: rank 0 broadcasts every command's bytes to the other
ranks, and the ranks gather small payloads (settings, load results, memory profiles, a digest of
each step's sampled tokens) for rank 0 to check and combine.

This module holds the pieces without a runner: where ranks live (:class:`RankLayout`), the settings
checks, the group itself (:class:`RankGroup`), and what the ranks must agree on.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import msgspec
import torch
import torch.distributed as dist

from .config import SettingsError
from .devices import auto_device_kind
from .executor import ExecutorInfo
from .messages import MemoryProfile, StepResult

__all__ = [
    "AGREED_SETTINGS",
    "RANK_LOST_EXIT",
    "RANK_REFUSED_EXIT",
    "RankGroup",
    "RankLayout",
    "check_parallel_settings",
    "combine_profiles",
    "die_with_parent",
    "free_port",
    "info_mismatch",
    "join_group",
    "rank_device",
    "settings_mismatch",
    "step_digest",
]

# Exit code of a rank whose group failed (a peer died or stopped answering): the engine names it.
RANK_LOST_EXIT = 87
# Exit code of a rank that the group refused at start-up (settings or loaded models differ): starting
# it again cannot help, so ``pypto-serving worker`` gives up at once.
RANK_REFUSED_EXIT = 88

# The settings the ranks' executors and runners read: they must be equal on every rank. Paths may
# differ between hosts (a different model directory must still load the same model: the loaded
# ExecutorInfo is compared too), and what only node 0's engine reads (scheduling, KV sizing, the
# server) is not compared.
AGREED_SETTINGS = (
    "executor",
    "executor_options",
    "dtype",
    "device",
    "tensor_parallel_size",
    "enable_expert_parallel",
    "nnodes",
    "block_size",
    "max_model_len",
    "max_num_seqs",
    "speculative_config",
    "seed",
    "max_loras",
    "max_lora_rank",
    "enable_lora",
    "lora_modules",
)

_BACKENDS = {"cpu": "gloo", "cuda": "nccl", "npu": "hccl"}


@dataclass(frozen=True, slots=True)
class RankLayout:
    """Which global ranks live on which node: node ``k`` holds ``k * per_node .. (k + 1) * per_node - 1``."""

    world_size: int
    nnodes: int
    node_rank: int

    @classmethod
    def of(cls, settings: Any) -> RankLayout:
        return cls(world_size=settings.tensor_parallel_size, nnodes=settings.nnodes, node_rank=settings.node_rank)

    @property
    def per_node(self) -> int:
        return self.world_size // self.nnodes

    @property
    def local_ranks(self) -> range:
        """The global ranks this node runs."""
        return range(self.node_rank * self.per_node, (self.node_rank + 1) * self.per_node)

    def local_index(self, rank: int) -> int:
        """A rank's index among its node's ranks (its device index there)."""
        return rank % self.per_node


def check_parallel_settings(settings: Any, *, engine: bool) -> None:
    """Refuse tensor-parallel settings that cannot form a group, naming the fix.

    :param engine: True on node 0 (the engine), False in ``pypto-serving worker`` (other nodes).
    :raises SettingsError: on the first problem found.
    """
    tp, nnodes, node = settings.tensor_parallel_size, settings.nnodes, settings.node_rank
    if tp > 1 and engine and settings.worker_mode == "inproc":
        raise SettingsError(
            f"tensor_parallel_size={tp} needs worker_mode='process': every rank is a process of its own"
        )
    if node >= nnodes:
        raise SettingsError(f"node_rank={node} must be below nnodes={nnodes}")
    if tp % nnodes:
        raise SettingsError(
            f"tensor_parallel_size={tp} does not divide evenly over nnodes={nnodes}: every node runs "
            "tensor_parallel_size / nnodes ranks"
        )
    if engine and node != 0:
        raise SettingsError(
            f"node_rank={node}: the engine (serve, LLM) runs on node 0; run 'pypto-serving worker' here"
        )
    if not engine and node == 0:
        raise SettingsError("'pypto-serving worker' serves nodes 1 and up (node_rank >= 1); node 0 runs the engine")
    if nnodes > 1 and settings.master_port == 0:
        raise SettingsError(f"nnodes={nnodes} needs master_port: every node connects to node 0 there")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (bound to port 0, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def rank_device(device: str, local_index: int) -> str:
    """The device of the rank at ``local_index`` on its node: the CPU for every rank, else one
    accelerator each, counted from the setting's index (``cuda:2`` with 2 local ranks: ``cuda:2``,
    ``cuda:3``)."""
    kind, _, index = device.strip().lower().partition(":")
    if kind == "auto":
        kind = auto_device_kind()
    if kind == "cpu":
        return "cpu"
    return f"{kind}:{(int(index) if index else 0) + local_index}"


def die_with_parent(interval: float = 0.5) -> None:
    """End this process (exit :data:`RANK_LOST_EXIT`) within ``interval`` seconds of its parent's
    death, seen as a change of ``getppid()`` (the orphan is re-parented). A watchdog thread rather than
    Linux's ``PR_SET_PDEATHSIG``: that signal fires when the *thread* that spawned the process ends,
    and the engine may start a worker from a short-lived thread."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval)
        os._exit(RANK_LOST_EXIT)

    threading.Thread(target=watch, daemon=True, name="pypto-parent-watch").start()


@dataclass(slots=True)
class RankGroup:
    """This process's place in the group and the control channel (a gloo group on host tensors)."""

    rank: int
    world_size: int
    control: Any  # collectives time out after step_timeout: the step loop
    setup: Any  # collectives wait as long as loading may take: start-up agreement

    @property
    def is_driver(self) -> bool:
        """Rank 0 reads the engine's commands and answers them."""
        return self.rank == 0

    def broadcast_bytes(self, data: bytes = b"") -> bytes:
        """Rank 0's ``data`` on every rank (the others pass nothing): its length, then its bytes."""
        size = torch.tensor([len(data)], dtype=torch.int64)
        dist.broadcast(size, src=0, group=self.control)
        n = int(size.item())
        if n == 0:
            return b""
        buf = (
            torch.frombuffer(bytearray(data), dtype=torch.uint8)
            if self.is_driver
            else torch.empty(n, dtype=torch.uint8)
        )
        dist.broadcast(buf, src=0, group=self.control)
        return data if self.is_driver else buf.numpy().tobytes()

    def all_gather_bytes(self, data: bytes, *, setup: bool = False) -> list[bytes]:
        """Every rank's ``data``, in rank order, on every rank (``setup``: with the load timeout)."""
        group = self.setup if setup else self.control
        size = torch.tensor([len(data)], dtype=torch.int64)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.world_size)]
        dist.all_gather(sizes, size, group=group)
        lengths = [int(s.item()) for s in sizes]
        buf = torch.zeros(max(1, *lengths), dtype=torch.uint8)
        if data:
            buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        parts = [torch.empty_like(buf) for _ in range(self.world_size)]
        dist.all_gather(parts, buf, group=group)
        return [p[:n].numpy().tobytes() for p, n in zip(parts, lengths)]

    def all_gather_digest(self, digest: bytes) -> list[bytes]:
        """Every rank's ``digest`` (the same length on every rank) in one collective."""
        mine = torch.frombuffer(bytearray(digest), dtype=torch.uint8)
        parts = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(parts, mine, group=self.control)
        return [p.numpy().tobytes() for p in parts]

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def join_group(settings: Any, rank: int) -> RankGroup:
    """Join the default process group as ``rank`` (the backend follows the rank's device) and make
    the gloo groups. The control group's collectives time out after ``step_timeout`` seconds; the
    default and setup groups wait as long as loading may take (``step_timeout``, at least 600 s),
    since ranks load at their own pace."""
    layout = RankLayout.of(settings)
    kind = settings.device.partition(":")[0]
    if kind == "npu":
        import torch_npu  # noqa: F401 - registers torch.npu and the hccl backend
    if kind in ("cuda", "npu"):
        getattr(torch, kind).set_device(int(settings.device.partition(":")[2] or 0))
    load_timeout = timedelta(seconds=max(settings.step_timeout, 600.0))
    dist.init_process_group(
        _BACKENDS[kind],
        init_method=f"tcp://{settings.master_addr}:{settings.master_port}",
        rank=rank,
        world_size=layout.world_size,
        timeout=load_timeout,
    )
    setup = dist.new_group(backend="gloo", timeout=load_timeout)
    control = dist.new_group(backend="gloo", timeout=timedelta(seconds=settings.step_timeout))
    return RankGroup(rank=rank, world_size=layout.world_size, control=control, setup=setup)


def _agreed_settings(settings: Any) -> dict[str, Any]:
    """The settings every rank must share (:data:`AGREED_SETTINGS`), as JSON values."""
    dumped: dict[str, Any] = settings.model_dump(mode="json", include=set(AGREED_SETTINGS))
    # The device kind must agree; the index is each rank's own.
    dumped["device"] = settings.device.partition(":")[0]
    # Every rank loads the same adapters into the same slots; each host reads them from its own path.
    dumped["lora_modules"] = [entry.partition("=")[0] for entry in settings.lora_modules]
    return dumped


def settings_mismatch(group: RankGroup, settings: Any) -> str | None:
    """Why the ranks' settings disagree (each differing setting with every rank's value), or None.
    Collective: every rank calls it and gets the same answer."""
    mine = json.dumps(_agreed_settings(settings), sort_keys=True).encode()
    every = [json.loads(raw) for raw in group.all_gather_bytes(mine, setup=True)]
    names = sorted({k for s in every for k in s if any(s.get(k) != every[0].get(k) for s in every)})
    if not names:
        return None
    parts = [f"{n} ({', '.join(f'rank {r}: {s.get(n)!r}' for r, s in enumerate(every))})" for n in names]
    return "the tensor-parallel ranks were started with different settings: " + "; ".join(parts)


def info_mismatch(infos: list[ExecutorInfo]) -> str | None:
    """Why the ranks' loaded executors disagree (cache groups, vocabulary, ...), or None."""
    every = [msgspec.to_builtins(i) for i in infos]
    names = sorted(k for k in every[0] if any(e.get(k) != every[0][k] for e in every))
    if not names:
        return None
    parts = [f"{n} ({', '.join(f'rank {r}: {e.get(n)!r}' for r, e in enumerate(every))})" for n in names]
    return "the tensor-parallel ranks loaded different models: " + "; ".join(parts)


def step_digest(result: StepResult) -> bytes:
    """What every rank's copy of a step must agree on: the sampled tokens and whether each request
    (and the step) failed. Ranks hold the same logits, so they sample the same tokens."""
    payload = msgspec.msgpack.encode([result.sampled, sorted(result.request_errors), result.error is None])
    return hashlib.blake2b(payload, digest_size=16).digest()


def combine_profiles(profiles: list[MemoryProfile], utilization: float, ranks_per_host: int) -> MemoryProfile:
    """The profile the engine sizes the KV cache with: the rank with the least memory left, since
    every rank allocates the same number of blocks.

    On the CPU a host's ranks share its memory: each rank's totals are device-wide, so they are
    divided by the ranks on the host (each rank's own peak stays whole, since all of them run the
    profile step at once).
    """
    failed = next((p for p in profiles if not p.ok), None)
    if failed is not None:
        return failed
    shared = [
        MemoryProfile(
            ok=True,
            total_bytes=p.total_bytes // ranks_per_host,
            used_bytes=p.used_bytes // ranks_per_host,
            peak_bytes=p.peak_bytes,
        )
        for p in profiles
    ]
    return min(shared, key=lambda p: utilization * p.total_bytes - p.used_bytes - p.peak_bytes)
