"""``torch_p2p``: KV blocks over ``torch.distributed`` point-to-point (gloo, nccl or hccl).

The producer (a prefill engine's worker) hosts a ``TCPStore`` at ``kv_ip:kv_port``: the control
channel. A consumer (a decode engine's worker) connects once per producer: it reads the producer's
backend from the store (a different one than its own fails the pull before any group forms), takes a
connection number from the store, and both sides form a two-rank group over a prefix of the store
(producer rank 0, consumer rank 1). A pull then is: the consumer writes the transfer id under the
connection's next sequence number; the producer answers with the offer's size and layout (or why
there is none), sends the packed blocks with ``send`` tagged by the sequence number, and waits for
the consumer's ``done``. An offer still growing (:meth:`TorchP2PConnector.publish_part`, a prefill
in progress) goes in parts: each part's ack and buffer as its blocks are published, the last marked
final, and the consumer answers ``done`` only after that one (a withdrawal in between ends the pull
with an error part); only then does it report ``sent``, so a producer frees nothing a consumer
still reads. A connection that fails is dropped (the next pull forms a new one) and fails only the
transfer in flight on it. A consumer runs its pulls on ``pull_threads`` threads, each over connections
of its own (one per producer), so a slow producer holds up only its thread's queue.

The KV bytes travel only through the group; the store carries the small JSON control messages. The
backend (``kv_connector_extra_config.backend``) is chosen at :meth:`TorchP2PConnector.start` from the
caches' device unless given: ``ProcessGroupNCCL`` for CUDA caches and torch_npu's
``ProcessGroupHCCL`` for Ascend ones, which send and receive buffers on the caches' device with
nothing staged through host memory, and ``ProcessGroupGloo`` for any other device, which moves host
tensors (caches on an accelerator are then staged through host memory). A backend that cannot serve
the caches is refused with the reason, never replaced. Neither device group has run on a GPU or NPU:
the NCCL path is tested on the CPU with a gloo group standing in for it, the HCCL one only in its
choice and refusals.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import queue
import socket
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, TCPStore  # type: ignore[attr-defined]

from ..hookspecs import KVConnectorSpec, hookimpl
from ..kv_transfer import (
    KVCaches,
    KVConnector,
    KVTransferConfig,
    Offer,
    Offers,
    TransferEvent,
    blocks_nbytes,
    gather_blocks,
    layout_digest,
    scatter_blocks,
)

__all__ = ["TorchP2PConnector", "make_connector", "pypto_serving_register_kv_connectors"]

# Store keys are polled (a blocking ``wait`` logs a warning at each timeout): 1 ms at first, backing
# off to 10 ms while nothing comes, so an idle connection costs ~100 round trips a second.
_POLL_MIN_S, _POLL_MAX_S = 0.001, 0.01
# A pull may reach the producer before its publish does: the engine process answers the prefill
# request once it has sent the publish down the worker's pipe, and the worker's relay thread hands it
# on a moment later (longer on a loaded host, and with tensor parallelism for every rank). The
# producer waits that long for an offer it has not seen; one it has ended fails at once.
_PUBLISH_GRACE_S = 5.0
_BACKENDS = ("auto", "gloo", "nccl", "hccl")
# The device-direct backend of each accelerator kind ("auto" picks it), and the other way round.
_DEVICE_BACKENDS = {"cuda": "nccl", "npu": "hccl"}
_BACKEND_DEVICES = {"nccl": "cuda", "hccl": "npu"}


class TransferError(RuntimeError):
    """A transfer failed; the message says why."""


@dataclass(slots=True)
class _Conn:
    """One consumer -> producer connection: the store, the two-rank group, the next sequence number."""

    store: Any
    group: Any
    number: int
    seq: int = 0


@dataclass(slots=True)
class _Pull:
    transfer_id: str
    source: dict[str, Any]
    blocks: dict[str, list[int]] = field(default_factory=dict)


def _wait_key(store: Any, key: str, timeout: float, closed: threading.Event) -> bytes:
    """The value of ``key`` once it is set; TransferError after ``timeout`` or on close."""
    deadline, pause = time.monotonic() + timeout, _POLL_MIN_S
    while not store.check([key]):
        if closed.is_set():
            raise TransferError("the connector is closing")
        if time.monotonic() > deadline:
            raise TransferError(f"no answer within {timeout:.0f}s (the peer stopped answering)")
        time.sleep(pause)
        pause = min(2 * pause, _POLL_MAX_S)
    value: bytes = store.get(key)
    return value


def _caches_device(caches: KVCaches) -> torch.device:
    """The device of the caches (of their first tensor; the CPU when there is none)."""
    for tensors in caches.values():
        for tensor in tensors:
            return tensor.device
    return torch.device("cpu")


def _nccl_available() -> bool:
    return bool(dist.is_nccl_available())


def _torch_npu_error() -> str | None:
    """Why torch_npu cannot be imported; None: it can (the import registers ``torch.npu`` and HCCL)."""
    try:
        importlib.import_module("torch_npu")
    except Exception as e:  # a broken vendor stack fails in many ways; each is a reason to refuse hccl
        return f"{type(e).__name__}: {e}"
    return None


def _refusal(backend: str, device_type: str) -> str | None:
    """Why ``backend`` cannot move caches on ``device_type``; None: it can."""
    if backend == "gloo":
        return None  # any device: the blocks are staged through host memory
    kind = _BACKEND_DEVICES[backend]
    if device_type != kind:
        return f"{backend} sends {kind} buffers but the KV caches are on {device_type} (use 'gloo' or 'auto')"
    if backend == "nccl" and not _nccl_available():
        return "this torch build has no NCCL (use 'gloo' to stage the KV through host memory)"
    if backend == "hccl" and (error := _torch_npu_error()) is not None:
        return f"hccl needs torch_npu, which cannot be imported ({error})"
    return None


def _select_backend(requested: str, device_type: str) -> str:
    """The backend for caches on ``device_type``: ``requested``, or for "auto" the device's own
    (gloo for any device without one). ValueError: it cannot serve them."""
    backend = _DEVICE_BACKENDS.get(device_type, "gloo") if requested == "auto" else requested
    why = _refusal(backend, device_type)
    if why is not None:
        chosen = f" ({backend} for caches on {device_type})" if requested == "auto" else ""
        raise ValueError(f"kv_connector_extra_config.backend={requested!r}{chosen}: {why}")
    return backend


def _buffer_device(backend: str, device: torch.device) -> torch.device:
    """Where a transfer's packed buffer lives: host memory for gloo, else the caches' own device."""
    return torch.device("cpu") if backend == "gloo" else device


def _set_device(device: torch.device) -> None:
    getattr(torch, device.type).set_device(device.index or 0)


def _synchronize(device: torch.device) -> None:
    getattr(torch, device.type).synchronize(device)


def _gloo_group(store: Any, rank: int, timeout: timedelta) -> Any:
    return dist.ProcessGroupGloo(store, rank, 2, timeout)


def _nccl_group(store: Any, rank: int, timeout: timedelta) -> Any:
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, 2, options)


def _hccl_group(store: Any, rank: int, timeout: timedelta) -> Any:
    # Imported here: only a host with torch_npu has it (start() refused hccl where the import fails).
    group_class = importlib.import_module("torch_npu._C._distributed_c10d").ProcessGroupHCCL
    options = group_class.Options()
    options._timeout = timeout
    return group_class(store, rank, 2, options)


def _group(store: Any, number: int, rank: int, timeout: float, backend: str, device: torch.device) -> Any:
    """The connection's two-rank ``backend`` group over a prefix of the store."""
    prefixed, span = PrefixStore(f"pg{number}/", store), timedelta(seconds=timeout)
    if backend == "gloo":
        return _gloo_group(prefixed, rank, span)
    # NCCL and HCCL bind the communicator to the current device, which is per thread: the thread that
    # forms the group is the one that sends or receives on it.
    _set_device(device)
    if backend == "nccl":
        return _nccl_group(prefixed, rank, span)
    return _hccl_group(prefixed, rank, span)


class TorchP2PConnector(KVConnector):
    """See the module docstring. ``kv_connector_extra_config``: ``timeout`` (seconds a control answer or
    a transfer may take, default 30), ``pull_threads`` (a consumer's pulls in flight at once, each
    thread on its own connections, default 1), ``backend`` (``auto``, ``gloo``, ``nccl`` or ``hccl``,
    default ``auto``). :attr:`backend` is the one asked for until :meth:`start` resolves it."""

    streams = True

    def __init__(self, config: KVTransferConfig) -> None:
        self.config = config
        extra = config.kv_connector_extra_config
        self.timeout = float(extra.get("timeout", 30.0))
        self.pull_threads = extra.get("pull_threads", 1)
        if not isinstance(self.pull_threads, int) or isinstance(self.pull_threads, bool) or self.pull_threads < 1:
            raise ValueError(f"kv_connector_extra_config.pull_threads={self.pull_threads!r}: give a count >= 1")
        self.backend: str = extra.get("backend", "auto")
        if self.backend not in _BACKENDS:
            raise ValueError(f"kv_connector_extra_config.backend={self.backend!r}: give one of {', '.join(_BACKENDS)}")
        self._device = torch.device("cpu")  # the caches', set at start
        self._buffer_device = torch.device("cpu")
        self._caches: KVCaches = {}
        self._lock = threading.Lock()
        self._events: list[TransferEvent] = []
        self._offers = Offers()  # under the lock
        self._closed = threading.Event()
        self._pulls: queue.Queue[_Pull | None] = queue.Queue()
        self._conns: list[dict[tuple[str, int], _Conn]] = []  # per pull thread, by producer address
        self._store: Any = None
        self._threads: list[threading.Thread] = []

    # -- lifecycle
    def start(self, caches: KVCaches) -> dict[str, Any]:
        # Chosen before anything starts, so a refusal leaves no thread or store behind.
        self._device = _caches_device(caches)
        self.backend = _select_backend(self.backend, self._device.type)
        self._buffer_device = _buffer_device(self.backend, self._device)
        self._caches = caches
        for i in range(self.pull_threads):
            self._conns.append({})
            self._spawn(self._pull_loop, f"kv-pull-{i}", self._conns[-1])
        if self.config.kv_role == "decode":
            return {}
        cfg = self.config
        self._store = TCPStore(
            cfg.kv_ip, cfg.kv_port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=self.timeout)
        )
        self._store.set("backend", self.backend)  # before the address is out: every consumer reads it first
        self._spawn(self._accept_loop, "kv-accept")
        port, layout = int(self._store.port), layout_digest(caches)
        return {"remote_host": cfg.kv_ip, "remote_port": port, "layout": layout, "streams": True}

    def _spawn(self, target: Any, name: str, *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        self._threads.append(thread)
        thread.start()

    def close(self) -> None:
        self._closed.set()
        for _ in self._conns:
            self._pulls.put(None)
        for thread in self._threads:
            thread.join(timeout=5)
        for conn in (c for conns in self._conns for c in conns.values()):  # the producers end their side
            with contextlib.suppress(Exception):
                conn.store.set(f"c{conn.number}/req/{conn.seq}", json.dumps({"bye": True}))
        # Destroyed here, not at interpreter exit, where gloo's and the store's threads may outlive them.
        self._conns.clear()
        self._store = None

    def poll(self) -> list[TransferEvent]:
        with self._lock:
            events, self._events = self._events, []
        return events

    def _event(self, transfer_id: str, kind: Any, error: str | None, parts: int = 0) -> None:
        with self._lock:
            self._events.append(TransferEvent(transfer_id, kind, error, {"parts": parts}))

    # -- producer
    def publish(self, transfer_id: str, blocks: dict[str, list[int]]) -> None:
        with self._lock:
            self._offers.publish(transfer_id, blocks)

    def publish_part(self, transfer_id: str, blocks: dict[str, list[int]], final: bool) -> None:
        with self._lock:
            self._offers.publish_part(transfer_id, blocks, final)

    def withdraw(self, transfer_id: str) -> None:
        with self._lock:
            if self._offers.withdraw(transfer_id):  # else a send in flight reports the end
                self._end_offer(transfer_id, "withdrawn before a decode engine pulled it")

    def _accept_loop(self) -> None:
        number = 0
        while not self._closed.is_set():
            if self._store.check([f"conn/{number}"]):
                self._spawn(self._serve_conn, f"kv-serve-{number}", number)
                number += 1
            else:
                time.sleep(0.01)

    def _serve_conn(self, number: int) -> None:
        try:
            group = _group(self._store, number, 0, self.timeout, self.backend, self._device)
        except Exception:
            return  # the consumer went away before the group formed: its pull failed on its side
        seq, pause = 0, _POLL_MIN_S
        while not self._closed.is_set():
            key = f"c{number}/req/{seq}"
            if not self._store.check([key]):
                time.sleep(pause)
                pause = min(2 * pause, _POLL_MAX_S)
                continue
            pause = _POLL_MIN_S
            message = json.loads(self._store.get(key))
            if message.get("bye"):
                return  # the consumer closed this connection
            transfer_id = message["transfer_id"]
            if not self._serve_one(group, number, seq, transfer_id):
                return  # the connection broke: the consumer forms a new one
            seq += 1

    def _end_offer(self, transfer_id: str, error: str | None, parts: int = 0) -> None:
        """Drop an offer and report its end (under the lock)."""
        self._offers.end(transfer_id)
        self._events.append(TransferEvent(transfer_id, "sent", error, {"parts": parts}))

    def _take_offer(self, transfer_id: str) -> Offer | None:
        """The offer, marked busy; None when it ended, is busy, or is not published within the grace."""
        deadline, pause = time.monotonic() + min(_PUBLISH_GRACE_S, self.timeout), _POLL_MIN_S
        while True:
            with self._lock:
                offer = self._offers.take(transfer_id)
                if offer is not None or self._offers.known(transfer_id):
                    return offer
            if time.monotonic() > deadline or self._closed.is_set():
                return None
            time.sleep(pause)
            pause = min(2 * pause, _POLL_MAX_S)

    def _serve_one(self, group: Any, number: int, seq: int, transfer_id: str) -> bool:
        """Send one offer, part by part as it grows; False when the connection broke."""
        offer = self._take_offer(transfer_id)
        if offer is None:
            why = (
                f"the prefill engine holds no KV for transfer {transfer_id!r} "
                "(already pulled, or freed after kv_transfer_timeout)"
            )
            self._store.set(f"c{number}/ack/{seq}", json.dumps({"error": why}))
            return True
        error: str | None = None
        broken, parts = False, 0
        try:
            parts = self._send_parts(group, number, seq, offer)
            done = _wait_key(self._store, f"c{number}/done/{seq}", self.timeout, self._closed).decode()
            error = None if done == "ok" else done
        except TransferError as e:  # the consumer was told (an error part): the stream stays in step
            error = str(e)
        except Exception as e:
            error, broken = f"sending the KV failed: {type(e).__name__}: {e}", True
        with self._lock:
            self._end_offer(transfer_id, error, parts)
        return not broken

    def _send_parts(self, group: Any, number: int, seq: int, offer: Offer) -> int:
        """Send the offer's blocks as they are published, each part announced by an ack (part 0 at
        ``ack/seq``, part p at ``ack/seq/p``); returns the parts sent. TransferError: the offer was
        withdrawn, or did not grow within the timeout (the consumer got that as an error part)."""
        sent: dict[str, int] = {}
        part, final = 0, False
        while not final:
            key = f"c{number}/ack/{seq}" + (f"/{part}" if part else "")
            try:
                blocks, final = self._next_part(offer, sent)
            except TransferError as e:
                self._store.set(key, json.dumps({"error": str(e)}))
                raise
            buf = gather_blocks(self._caches, blocks, self._buffer_device)
            counts = {g: len(b) for g, b in blocks.items()}
            ack = {"nbytes": buf.numel(), "layout": layout_digest(self._caches), "counts": counts, "final": final}
            self._store.set(key, json.dumps(ack))
            if buf.numel():
                group.send([buf], 1, seq).wait()
            part += 1
        return part

    def _next_part(self, offer: Offer, sent: dict[str, int]) -> tuple[dict[str, list[int]], bool]:
        """:meth:`Offer.next_part`, waiting up to the timeout for an open offer to grow."""
        deadline, pause = time.monotonic() + self.timeout, _POLL_MIN_S
        while True:
            with self._lock:
                if offer.withdrawn and not offer.final:
                    raise TransferError("the prefill engine withdrew the offer before its prefill completed")
                part = offer.next_part(sent)
            if part is not None:
                return part
            if self._closed.is_set():
                raise TransferError("the connector is closing")
            if time.monotonic() > deadline:
                raise TransferError(f"the prefill engine published no KV within {self.timeout:.0f}s")
            time.sleep(pause)
            pause = min(2 * pause, _POLL_MAX_S)

    # -- consumer
    def pull(self, transfer_id: str, source: dict[str, Any], blocks: dict[str, list[int]]) -> None:
        self._pulls.put(_Pull(transfer_id, source, {g: list(b) for g, b in blocks.items()}))

    def _pull_loop(self, conns: dict[tuple[str, int], _Conn]) -> None:
        """One pull thread: the next queued pull, over this thread's connection to its producer."""
        while True:
            item = self._pulls.get()
            if item is None:
                return
            address = (str(item.source.get("remote_host")), int(item.source.get("remote_port", 0)))
            try:
                conn = conns.get(address) or self._connect(*address)
                conns[address] = conn
                parts = self._pull_one(conn, item)
            except TransferError as e:
                self._event(item.transfer_id, "pulled", str(e))
            except Exception as e:  # the connection broke: the next pull forms a new one
                conns.pop(address, None)
                self._event(
                    item.transfer_id,
                    "pulled",
                    f"the KV transfer from {address[0]}:{address[1]} failed: {type(e).__name__}: {e}",
                )
            else:
                self._event(item.transfer_id, "pulled", None, parts)

    def _connect(self, host: str, port: int) -> _Conn:
        # A refused connection fails at once; TCPStore's client would retry for its whole timeout.
        with socket.create_connection((host, port), timeout=min(self.timeout, 5.0)):
            pass
        store = TCPStore(host, port, is_master=False, timeout=timedelta(seconds=self.timeout))
        self._check_backend(store, host, port)  # before the connection is registered: no group half-formed
        number = int(store.add("conns", 1)) - 1
        store.set(f"conn/{number}", "1")
        return _Conn(store, _group(store, number, 1, self.timeout, self.backend, self._device), number)

    def _check_backend(self, store: Any, host: str, port: int) -> None:
        """TransferError: the producer moves KV over another backend (the groups would never meet)."""
        theirs = _wait_key(store, "backend", self.timeout, self._closed).decode()
        if theirs != self.backend:
            raise TransferError(
                f"the prefill engine's torch_p2p connector at {host}:{port} moves KV over {theirs}, this "
                f"decode engine's over {self.backend}: set kv_connector_extra_config.backend alike on both"
            )

    def _pull_one(self, conn: _Conn, item: _Pull) -> int:
        """Pull one offer, part by part, into ``item.blocks``; returns the parts. TransferError: it
        failed (the producer was told, or told us)."""
        seq, conn.seq = conn.seq, conn.seq + 1
        conn.store.set(f"c{conn.number}/req/{seq}", json.dumps({"transfer_id": item.source.get("transfer_id")}))
        got = {g: 0 for g in item.blocks}
        problem: str | None = None
        part, final = 0, False
        while not final:
            key = f"c{conn.number}/ack/{seq}" + (f"/{part}" if part else "")
            # A streamed part waits for the prefill to compute it: longer than the producer waits for
            # it, so the producer's verdict (an error part) comes first.
            wait = self.timeout + (_PUBLISH_GRACE_S if part or item.source.get("kv_streamed") else 0.0)
            ack = json.loads(_wait_key(conn.store, key, wait, self._closed))
            if "error" in ack:
                raise TransferError(ack["error"])
            buf = torch.empty(int(ack["nbytes"]), dtype=torch.uint8, device=self._buffer_device)
            if buf.numel():
                conn.group.recv([buf], 0, seq).wait()  # taken whatever follows, so the stream stays in step
            problem = problem or self._mismatch(ack, item.blocks, got)
            if problem is None:
                counts: dict[str, int] = ack["counts"]
                scatter_blocks(self._caches, {g: item.blocks[g][got[g] : got[g] + n] for g, n in counts.items()}, buf)
                for g, n in counts.items():
                    got[g] += n
            part, final = part + 1, bool(ack["final"])
        expected = {g: len(b) for g, b in item.blocks.items()}
        if problem is None and got != expected:
            problem = f"the prefill engine offers blocks {got}, the decode engine expects {expected}"
        if self.backend != "gloo":
            # A device group's receive and the scatter after it are only queued on the device; the
            # engine may read the blocks on another stream once the pull is reported, and the producer
            # frees its blocks once it has our done: both wait until the bytes have landed.
            _synchronize(self._device)
        conn.store.set(f"c{conn.number}/done/{seq}", "ok" if problem is None else problem)
        if problem is not None:
            raise TransferError(problem)
        return part

    def _mismatch(self, ack: dict[str, Any], blocks: dict[str, list[int]], got: dict[str, int]) -> str | None:
        """Why a part cannot fill the next of ``blocks`` (``got`` of each group filled so far); None: it can."""
        if ack["layout"] != layout_digest(self._caches):
            return "the prefill and decode engines' KV caches differ in layout (model, dtype or block_size)"
        counts: dict[str, int] = ack["counts"]
        room = {g: len(b) - got[g] for g, b in blocks.items()}
        if any(g not in room or n > room[g] for g, n in counts.items()):
            return f"the prefill engine offers blocks {counts} more, the decode engine expects {room} more"
        part = {g: blocks[g][got[g] : got[g] + n] for g, n in counts.items()}
        if int(ack["nbytes"]) != blocks_nbytes(self._caches, part):
            return f"the prefill engine sends {ack['nbytes']} bytes for blocks {counts}"
        return None


def make_connector(config: KVTransferConfig) -> KVConnector:
    """Module-level factory: the worker process imports it by reference."""
    return TorchP2PConnector(config)


@hookimpl
def pypto_serving_register_kv_connectors() -> list[KVConnectorSpec]:
    return [
        KVConnectorSpec(
            name="torch_p2p",
            factory=make_connector,
            description="KV blocks over torch.distributed point-to-point (gloo, nccl or hccl), control over a TCPStore",
        )
    ]
