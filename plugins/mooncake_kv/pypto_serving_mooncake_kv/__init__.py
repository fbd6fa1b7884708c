"""The ``mooncake`` KV connector: KV blocks moved by the Mooncake transfer engine.

The KV bytes move only through Mooncake's ``TransferEngine`` (TCP on a CPU machine, RDMA or Ascend
where the machine and the installed wheel have them): each worker registers the memory of its cache
tensors with its engine, and a decode engine's worker *reads* the offered blocks straight from the
prefill engine's caches into its own, one entry per run of consecutive blocks, with no packing on
either side. The engines find each other with Mooncake's peer-to-peer handshake (``P2PHANDSHAKE``: no
etcd or metadata server), unless ``metadata_server`` names one.

The control channel is a TCP socket of newline-separated JSON messages to the prefill worker's
``kv_ip:kv_port``; a decode worker keeps one connection per prefill engine. One pull is:

1. consumer -> ``{"transfer_id": id}``;
2. producer -> the offer: its block ids per group, where each cache tensor lies in the producer's
   memory (base address and bytes between blocks), the layout digest; or ``{"error": why}``. The offer
   is now busy: it is not withdrawn or freed while the read runs;
3. the consumer checks layout and block counts, reads every block with one batch of the transfer
   engine, and answers ``{"done": "ok"}`` (or the error);
4. producer -> ``{"ok": true}``, and only then does it report ``sent``: the consumer reports its
   ``pulled`` without an error only after this confirmation, so a producer that gave up waiting
   (``timeout``) and freed the blocks can never leave a decode engine computing on what it read.

A connection that breaks (a peer died, stopped answering within ``timeout``, or sent nonsense) is
closed and fails only the transfer in flight on it; the next pull opens a new one.
"""

from __future__ import annotations

import contextlib
import json
import queue
import socket
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from pypto_serving import KVConnectorSpec, hookimpl
from pypto_serving.kv_transfer import KVCaches, KVConnector, TransferEvent, layout_digest

__all__ = ["MooncakeConnector", "make_connector", "pypto_serving_register_kv_connectors"]

# Settings of ``kv_connector_extra_config`` and their defaults.
DEFAULTS: dict[str, Any] = {
    "protocol": "tcp",  # Mooncake's transport: "tcp", "rdma", "ascend", ... (what the wheel was built with)
    "device_name": "",  # RDMA/Ascend devices to use, comma-separated; "" lets Mooncake choose
    "metadata_server": "P2PHANDSHAKE",  # or an etcd / HTTP metadata server's address
    "local_hostname": None,  # the address this worker's transfer engine advertises; None: kv_ip
    # Seconds a control answer may take. The read itself ends when Mooncake's transport ends it (its
    # MC_TRANSFER_TIMEOUT, default 30 s): a read is never abandoned here while it may still write.
    "timeout": 30.0,
}


class TransferError(RuntimeError):
    """A transfer failed; the message says why."""


class _Refused(TransferError):
    """The producer answered but holds no such offer: the connection stays usable."""


def _load_engine_class() -> Any:
    try:
        from mooncake.engine import TransferEngine
    except ImportError as e:
        raise RuntimeError(
            "the 'mooncake' KV connector needs Mooncake's transfer engine: pip install "
            "'pypto-serving-mooncake-kv[cpu]' (or [cuda]); importing mooncake.engine failed: "
            f"{e} (the wheels also need the system's libibverbs.so.1: apt-get install libibverbs1)"
        ) from e
    return TransferEngine


class _Lines:
    """Newline-separated JSON messages over a socket; every read is bounded and notices close."""

    def __init__(self, sock: socket.socket, closed: threading.Event) -> None:
        self.sock = sock
        self.closed = closed
        self.buf = b""
        sock.settimeout(0.2)  # the granularity at which a blocked read notices close()

    def send(self, message: dict[str, Any]) -> None:
        self.sock.sendall(json.dumps(message).encode() + b"\n")

    def recv(self, timeout: float | None) -> dict[str, Any]:
        """The next message; TransferError at EOF, after ``timeout`` seconds, or on close."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self.buf:
            if self.closed.is_set():
                raise TransferError("the connector is closing")
            if deadline is not None and time.monotonic() > deadline:
                raise TransferError(f"no answer within {timeout:.0f}s (the peer stopped answering)")
            try:
                chunk = self.sock.recv(65536)
            except TimeoutError:
                continue
            if not chunk:
                raise TransferError("the peer closed the connection (it stopped or died)")
            self.buf += chunk
        line, _, self.buf = self.buf.partition(b"\n")
        message = json.loads(line)
        if not isinstance(message, dict):
            raise TransferError(f"unexpected control message {line[:80]!r}")
        return message

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


@dataclass(slots=True)
class _Offer:
    blocks: dict[str, list[int]]
    busy: bool = False  # a consumer is reading it
    withdrawn: bool = False  # withdraw() came during the read: report once it ends


@dataclass(slots=True)
class _Pull:
    transfer_id: str
    source: dict[str, Any]
    blocks: dict[str, list[int]] = field(default_factory=dict)


Regions = dict[str, list[list[int]]]
"""Per cache group, per tensor: its base address, the bytes between two blocks, the bytes of one block."""


def regions(caches: KVCaches) -> Regions:
    """Where every cache tensor's blocks lie in memory. ValueError when a block's bytes are not
    contiguous (a read copies whole blocks)."""
    out: Regions = {}
    for group in sorted(caches):
        out[group] = []
        for i, t in enumerate(caches[group]):
            if t.dim() == 0 or t.shape[0] == 0 or not t[0].is_contiguous():
                raise ValueError(f"cache group {group!r} tensor {i}: a block's bytes are not contiguous in memory")
            out[group].append([t.data_ptr(), t.stride(0) * t.element_size(), t[0].numel() * t.element_size()])
    return out


def storages(caches: KVCaches) -> list[tuple[int, int]]:
    """The distinct memory allocations behind the cache tensors, ``(address, bytes)``: each is
    registered once with the transfer engine (several tensors may be views of one allocation)."""
    seen: dict[int, int] = {}
    for tensors in caches.values():
        for t in tensors:
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sorted(seen.items())


def _runs(local: list[int], remote: list[int]) -> Iterable[tuple[int, int, int]]:
    """Paired block ids as runs ``(local first, remote first, count)``, consecutive on both sides."""
    i = 0
    while i < len(local):
        n = 1
        while i + n < len(local) and local[i + n] == local[i] + n and remote[i + n] == remote[i] + n:
            n += 1
        yield local[i], remote[i], n
        i += n


def read_plan(
    local: Regions, remote: Regions, local_blocks: dict[str, list[int]], remote_blocks: dict[str, list[int]]
) -> tuple[list[int], list[int], list[int]]:
    """The transfer engine's batch for one pull: local addresses, remote addresses, lengths. Blocks
    consecutive on both sides (and packed without padding) are one entry.

    :param local: this side's :func:`regions`; ``remote``: the producer's, with the same layout.
    :param local_blocks: per group, the block ids to fill, paired in order with ``remote_blocks``'.
    """
    dst: list[int] = []
    src: list[int] = []
    lengths: list[int] = []
    for group in sorted(local_blocks):
        for (lbase, lstride, size), (rbase, rstride, _) in zip(local[group], remote[group]):
            packed = lstride == size == rstride
            for lo, ro, n in _runs(local_blocks[group], remote_blocks[group]):
                for k in range(1 if packed else n):
                    dst.append(lbase + (lo + k) * lstride)
                    src.append(rbase + (ro + k) * rstride)
                    lengths.append(n * size if packed else size)
    return dst, src, lengths


class MooncakeConnector(KVConnector):
    """See the module docstring. ``config`` is the engine's ``KVTransferConfig``; its
    ``kv_connector_extra_config`` takes the keys of :data:`DEFAULTS`."""

    def __init__(self, config: Any) -> None:
        self.config = config
        extra = {**DEFAULTS, **config.kv_connector_extra_config}
        unknown = sorted(set(extra) - set(DEFAULTS))
        if unknown:
            raise ValueError(f"kv_connector_extra_config of 'mooncake': unknown {unknown} (known: {sorted(DEFAULTS)})")
        self.protocol = str(extra["protocol"])
        self.device_name = str(extra["device_name"])
        self.metadata_server = str(extra["metadata_server"])
        self.local_hostname = str(extra["local_hostname"] or config.kv_ip)
        self.timeout = float(extra["timeout"])
        self._engine: Any = None
        self._registered: list[int] = []
        self._regions: Regions = {}
        self._layout = ""
        self._lock = threading.Lock()
        self._events: list[TransferEvent] = []
        self._offers: dict[str, _Offer] = {}
        self._closed = threading.Event()
        self._pulls: queue.Queue[_Pull | None] = queue.Queue()
        self._conns: dict[tuple[str, int], _Lines] = {}
        self._served: list[_Lines] = []
        self._listener: socket.socket | None = None
        self._threads: list[threading.Thread] = []

    # -- lifecycle
    def start(self, caches: KVCaches) -> dict[str, Any]:
        self._regions, self._layout = regions(caches), layout_digest(caches)
        self._engine = _load_engine_class()()
        rc = self._engine.initialize(self.local_hostname, self.metadata_server, self.protocol, self.device_name)
        if rc != 0:
            raise RuntimeError(
                f"Mooncake's transfer engine did not start (code {rc}) with protocol {self.protocol!r} on "
                f"{self.local_hostname!r}, metadata server {self.metadata_server!r}; its log above says why"
            )
        for address, nbytes in storages(caches):
            if self._engine.register_memory(address, nbytes) != 0:
                raise RuntimeError(f"Mooncake's transfer engine refused to register {nbytes} bytes of KV cache")
            self._registered.append(address)
        self._spawn(self._pull_loop, "kv-pull")
        if self.config.kv_role == "decode":
            return {}
        self._listener = socket.create_server((self.config.kv_ip, self.config.kv_port))
        self._listener.settimeout(0.2)
        self._spawn(self._accept_loop, "kv-accept")
        return {
            "remote_host": self.config.kv_ip,
            "remote_port": self._listener.getsockname()[1],
            "engine": f"{self.local_hostname}:{self._engine.get_rpc_port()}",
            "layout": self._layout,
        }

    def _spawn(self, target: Any, name: str, *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        self._threads.append(thread)
        thread.start()

    def close(self) -> None:
        self._closed.set()
        self._pulls.put(None)
        for thread in self._threads:
            thread.join(timeout=5)
        for lines in [*self._conns.values(), *self._served]:
            lines.close()
        if self._listener is not None:
            self._listener.close()
        self._conns.clear()
        if self._engine is not None:
            for address in self._registered:
                self._engine.unregister_memory(address)
            self._registered.clear()
            self._engine = None  # its destructor stops the engine's threads and closes its ports

    def poll(self) -> list[TransferEvent]:
        with self._lock:
            events, self._events = self._events, []
        return events

    def _event(self, transfer_id: str, kind: Any, error: str | None) -> None:
        with self._lock:
            self._events.append(TransferEvent(transfer_id, kind, error))

    # -- producer
    def publish(self, transfer_id: str, blocks: dict[str, list[int]]) -> None:
        with self._lock:
            self._offers[transfer_id] = _Offer({g: list(b) for g, b in blocks.items()})

    def withdraw(self, transfer_id: str) -> None:
        with self._lock:
            offer = self._offers.get(transfer_id)
            if offer is None:
                return
            if offer.busy:
                offer.withdrawn = True  # the read in flight reports the end
                return
            del self._offers[transfer_id]
            self._events.append(TransferEvent(transfer_id, "sent", "withdrawn before a decode engine pulled it"))

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._closed.is_set():
            try:
                sock, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # closed
            lines = _Lines(sock, self._closed)
            self._served.append(lines)
            self._spawn(self._serve_conn, "kv-serve", lines)

    def _serve_conn(self, lines: _Lines) -> None:
        try:
            while True:
                message = lines.recv(None)
                self._serve_one(lines, str(message["transfer_id"]))
        except (TransferError, OSError, ValueError, KeyError):
            pass  # the consumer went away or broke the protocol: its pull failed on its side
        finally:
            lines.close()
            with contextlib.suppress(ValueError):
                self._served.remove(lines)

    def _take_offer(self, transfer_id: str) -> _Offer | None:
        with self._lock:
            offer = self._offers.get(transfer_id)
            if offer is None or offer.busy:
                return None
            offer.busy = True
            return offer

    def _serve_one(self, lines: _Lines, transfer_id: str) -> None:
        """Offer one transfer's blocks and hold them until the consumer's ``done``; a broken
        connection raises after the ``sent`` event is recorded."""
        offer = self._take_offer(transfer_id)
        if offer is None:
            why = (
                f"the prefill engine holds no KV for transfer {transfer_id!r} "
                "(already pulled, or freed after kv_transfer_timeout)"
            )
            lines.send({"error": why})
            return
        error: str | None = "the connection to the decode engine broke"
        try:
            lines.send({"blocks": offer.blocks, "regions": self._regions, "layout": self._layout})
            done = lines.recv(self.timeout)
            error = None if done.get("done") == "ok" else str(done.get("done"))
            lines.send({"ok": True})
        finally:
            with self._lock:
                del self._offers[transfer_id]
                self._events.append(TransferEvent(transfer_id, "sent", error))

    # -- consumer
    def pull(self, transfer_id: str, source: dict[str, Any], blocks: dict[str, list[int]]) -> None:
        self._pulls.put(_Pull(transfer_id, source, {g: list(b) for g, b in blocks.items()}))

    def _pull_loop(self) -> None:
        while True:
            item = self._pulls.get()
            if item is None:
                return
            address = (str(item.source.get("remote_host")), int(item.source.get("remote_port", 0)))
            try:
                lines = self._conns.get(address) or self._connect(*address)
                self._conns[address] = lines
                self._pull_one(lines, item)
            except _Refused as e:  # the producer answered: the connection stays in step
                self._event(item.transfer_id, "pulled", str(e))
            except TransferError as e:
                self._drop(address)
                self._event(item.transfer_id, "pulled", f"{address[0]}:{address[1]}: {e}")
            except Exception as e:  # the connection broke: the next pull opens a new one
                self._drop(address)
                self._event(
                    item.transfer_id,
                    "pulled",
                    f"the KV transfer from {address[0]}:{address[1]} failed: {type(e).__name__}: {e}",
                )
            else:
                self._event(item.transfer_id, "pulled", None)

    def _drop(self, address: tuple[str, int]) -> None:
        lines = self._conns.pop(address, None)
        if lines is not None:
            lines.close()

    def _connect(self, host: str, port: int) -> _Lines:
        sock = socket.create_connection((host, port), timeout=min(self.timeout, 5.0))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return _Lines(sock, self._closed)

    def _pull_one(self, lines: _Lines, item: _Pull) -> None:
        lines.send({"transfer_id": item.source.get("transfer_id")})
        offer = lines.recv(self.timeout)
        if "error" in offer:
            raise _Refused(str(offer["error"]))
        problem = self._mismatch(offer, item.blocks)
        if problem is None:
            plan = read_plan(self._regions, offer["regions"], item.blocks, offer["blocks"])
            rc = self._engine.batch_transfer_sync_read(str(item.source.get("engine")), *plan)
            if rc != 0:
                problem = f"Mooncake's {self.protocol} read of the blocks failed (code {rc}); its log says why"
        lines.send({"done": "ok" if problem is None else problem})
        lines.recv(self.timeout)  # the producer held the blocks throughout the read
        if problem is not None:
            raise _Refused(problem)

    def _mismatch(self, offer: dict[str, Any], blocks: dict[str, list[int]]) -> str | None:
        if offer.get("layout") != self._layout:
            return "the prefill and decode engines' KV caches differ in layout (model, dtype or block_size)"
        counts = {g: len(b) for g, b in blocks.items()}
        offered = {g: len(b) for g, b in offer["blocks"].items()}
        if offered != counts:
            return f"the prefill engine offers blocks {offered}, the decode engine expects {counts}"
        return None


def make_connector(config: Any) -> KVConnector:
    """Module-level factory: the worker process imports it by reference."""
    return MooncakeConnector(config)


@hookimpl
def pypto_serving_register_kv_connectors() -> list[KVConnectorSpec]:
    return [
        KVConnectorSpec(
            name="mooncake",
            factory=make_connector,
            description="KV blocks read by the Mooncake transfer engine (TCP, RDMA, Ascend), control over TCP",
        )
    ]
