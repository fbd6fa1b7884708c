"""The ``mooncake`` KV connector: KV blocks moved by the Mooncake transfer engine.

The KV bytes move only through Mooncake's ``TransferEngine`` (TCP on a CPU machine, RDMA or Ascend
where the machine and the installed wheel have them): each worker registers the memory of its cache
tensors with its engine, and a decode engine's worker *reads* the offered blocks straight from the
prefill engine's caches into its own, one entry per run of consecutive blocks, with no packing on
either side. The engines find each other with Mooncake's peer-to-peer handshake (``P2PHANDSHAKE``: no
etcd or metadata server), unless ``metadata_server`` names one.

The control channel is a TCP socket of newline-separated JSON messages to the prefill worker's
``kv_ip:kv_port``; a decode worker's pull thread keeps one connection per prefill engine. One pull is:

1. consumer -> ``{"transfer_id": id}``;
2. producer -> the offer's first part: its block ids per group, whether it is the final part, where
   each cache tensor lies in the producer's memory (base address and bytes between blocks), the layout
   digest; or ``{"error": why}``. The offer is now busy: it is not freed while the pull runs. A whole
   offer (:meth:`MooncakeConnector.publish`) is one final part; one still growing
   (:meth:`MooncakeConnector.publish_part`, a ``stream_kv`` prefill in progress) goes out part by
   part, ``{"blocks": ..., "final": ...}`` as its blocks are published, or ``{"error": why}`` when it
   is withdrawn before its final part (which ends the pull);
3. the consumer checks layout and block counts of each part and reads its blocks with one batch of
   the transfer engine as it comes; after the final part it answers ``{"done": "ok"}`` (or the error);
4. producer -> ``{"ok": true}``, and only then does it report ``sent``: the consumer reports its
   ``pulled`` without an error only after this confirmation, so a producer that gave up waiting
   (``timeout``) and freed the blocks can never leave a decode engine computing on what it read.

A pull can reach the producer before the engine's publish has reached the connector (the engine
answers a request once the publish is on its way to the worker): the producer waits a moment for an
offer it has not seen; one it has ended is refused at once.

A consumer runs its pulls on ``pull_threads`` threads, each over connections of its own (one per
prefill engine): a pull holds its thread until it ends (a streamed one until the prefill's final
part), so with more threads other pulls go on meanwhile. A connection that breaks (a peer died,
stopped answering within ``timeout``, or sent nonsense) is closed and fails only the transfer in
flight on it; that thread's next pull opens a new one.
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
from pypto_serving.kv_transfer import (
    KVCaches,
    KVConnector,
    KVTransferConfig,
    Offer,
    Offers,
    TransferEvent,
    layout_digest,
)

__all__ = ["MooncakeConnector", "make_connector", "pypto_serving_register_kv_connectors"]

# Settings of ``kv_connector_extra_config`` and their defaults.
DEFAULTS: dict[str, Any] = {
    "protocol": "tcp",  # Mooncake's transport: "tcp", "rdma", "ascend", ... (what the wheel was built with)
    "device_name": "",  # RDMA/Ascend devices to use, comma-separated; "" lets Mooncake choose
    "metadata_server": "P2PHANDSHAKE",  # or an etcd / HTTP metadata server's address
    "local_hostname": None,  # the address this worker's transfer engine advertises; None: kv_ip
    # Seconds a control answer (or a streamed offer's next part) may take. The read itself ends when
    # Mooncake's transport ends it (its MC_TRANSFER_TIMEOUT, default 30 s): a read is never abandoned
    # here while it may still write.
    "timeout": 30.0,
    # Pulls in flight at once on a decode worker, each thread over connections of its own.
    "pull_threads": 1,
}


# How long the producer waits for an offer it has not seen (see the module docstring).
_PUBLISH_GRACE_S = 5.0


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


def _drop(conns: dict[tuple[str, int], _Lines], address: tuple[str, int]) -> None:
    """Close and forget a pull thread's connection to ``address`` (it broke)."""
    lines = conns.pop(address, None)
    if lines is not None:
        lines.close()


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

    streams = True

    def __init__(self, config: KVTransferConfig) -> None:
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
        self.pull_threads = extra["pull_threads"]
        if not isinstance(self.pull_threads, int) or isinstance(self.pull_threads, bool) or self.pull_threads < 1:
            raise ValueError(f"kv_connector_extra_config.pull_threads={self.pull_threads!r}: give a count >= 1")
        self._engine: Any = None
        self._registered: list[int] = []
        self._regions: Regions = {}
        self._layout = ""
        self._lock = threading.Lock()
        self._events: list[TransferEvent] = []
        self._offers = Offers()  # under the lock
        self._grown = threading.Condition(self._lock)  # an offer was published, grew or was withdrawn
        self._closed = threading.Event()
        self._pulls: queue.Queue[_Pull | None] = queue.Queue()
        self._conns: list[dict[tuple[str, int], _Lines]] = []  # per pull thread, by producer address
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
        for i in range(self.pull_threads):
            self._conns.append({})
            self._spawn(self._pull_loop, f"kv-pull-{i}", self._conns[-1])
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
            "streams": True,
        }

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
        for lines in [*(c for conns in self._conns for c in conns.values()), *self._served]:
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

    def _event(self, transfer_id: str, kind: Any, error: str | None, parts: int = 0) -> None:
        with self._lock:
            self._events.append(TransferEvent(transfer_id, kind, error, {"parts": parts} if parts else None))

    # -- producer
    def publish(self, transfer_id: str, blocks: dict[str, list[int]]) -> None:
        with self._lock:
            self._offers.publish(transfer_id, blocks)
            self._grown.notify_all()

    def publish_part(self, transfer_id: str, blocks: dict[str, list[int]], final: bool) -> None:
        with self._lock:
            self._offers.publish_part(transfer_id, blocks, final)
            self._grown.notify_all()

    def withdraw(self, transfer_id: str) -> None:
        with self._lock:
            if self._offers.withdraw(transfer_id):
                self._end_offer(transfer_id, "withdrawn before a decode engine pulled it")
            self._grown.notify_all()  # wakes a pull in flight: it reports the end (an open offer's at once)

    def _end_offer(self, transfer_id: str, error: str | None, parts: int = 0) -> None:
        """Drop an offer and report its end (under the lock)."""
        self._offers.end(transfer_id)
        self._events.append(TransferEvent(transfer_id, "sent", error, {"parts": parts} if parts else None))

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

    def _take_offer(self, transfer_id: str) -> Offer | None:
        """The offer, marked busy; None when it ended, is busy, or is not published within the grace."""
        deadline = time.monotonic() + min(_PUBLISH_GRACE_S, self.timeout)
        with self._lock:
            while True:
                offer = self._offers.take(transfer_id)
                left = deadline - time.monotonic()
                if offer is not None or self._offers.known(transfer_id) or left <= 0 or self._closed.is_set():
                    return offer
                self._grown.wait(min(left, 0.2))

    def _serve_one(self, lines: _Lines, transfer_id: str) -> None:
        """Offer one transfer's blocks part by part and hold them until the consumer's ``done``; a
        broken connection raises after the ``sent`` event is recorded."""
        offer = self._take_offer(transfer_id)
        if offer is None:
            why = (
                f"the prefill engine holds no KV for transfer {transfer_id!r} "
                "(already pulled, or freed after kv_transfer_timeout)"
            )
            lines.send({"error": why})
            return
        error: str | None = "the connection to the decode engine broke"
        parts = 0
        try:
            parts = self._send_parts(lines, offer)
            done = lines.recv(self.timeout)
            error = None if done.get("done") == "ok" else str(done.get("done"))
            lines.send({"ok": True})
        except _Refused as e:  # the consumer was told (an error part): the connection stays in step
            error = str(e)
        finally:
            with self._lock:
                self._end_offer(transfer_id, error, parts)

    def _send_parts(self, lines: _Lines, offer: Offer) -> int:
        """Send the offer's blocks as they are published, the first part with where the caches lie;
        returns the parts sent. _Refused: the offer was withdrawn, or did not grow within the
        timeout (the consumer got that as an error part)."""
        sent: dict[str, int] = {}
        part, final = 0, False
        while not final:
            try:
                blocks, final = self._next_part(offer, sent)
            except _Refused as e:
                lines.send({"error": str(e)})
                raise
            message: dict[str, Any] = {"blocks": blocks, "final": final}
            if part == 0:
                message.update(regions=self._regions, layout=self._layout)
            lines.send(message)
            part += 1
        return part

    def _next_part(self, offer: Offer, sent: dict[str, int]) -> tuple[dict[str, list[int]], bool]:
        """:meth:`Offer.next_part`, waiting up to the timeout for an open offer to grow."""
        deadline = time.monotonic() + self.timeout
        with self._lock:
            while True:
                if offer.withdrawn and not offer.final:
                    raise _Refused("the prefill engine withdrew the offer before its prefill completed")
                part = offer.next_part(sent)
                if part is not None:
                    return part
                left = deadline - time.monotonic()
                if self._closed.is_set():
                    raise _Refused("the connector is closing")
                if left <= 0:
                    raise _Refused(f"the prefill engine published no KV within {self.timeout:.0f}s")
                self._grown.wait(min(left, 0.2))

    # -- consumer
    def pull(self, transfer_id: str, source: dict[str, Any], blocks: dict[str, list[int]]) -> None:
        self._pulls.put(_Pull(transfer_id, source, {g: list(b) for g, b in blocks.items()}))

    def _pull_loop(self, conns: dict[tuple[str, int], _Lines]) -> None:
        """One pull thread: the next queued pull, over this thread's connection to its producer."""
        while True:
            item = self._pulls.get()
            if item is None:
                return
            address = (str(item.source.get("remote_host")), int(item.source.get("remote_port", 0)))
            try:
                lines = conns.get(address) or self._connect(*address)
                conns[address] = lines
                parts = self._pull_one(lines, item)
            except _Refused as e:  # the producer answered: the connection stays in step
                self._event(item.transfer_id, "pulled", str(e))
            except TransferError as e:
                _drop(conns, address)
                self._event(item.transfer_id, "pulled", f"{address[0]}:{address[1]}: {e}")
            except Exception as e:  # the connection broke: the next pull opens a new one
                _drop(conns, address)
                self._event(
                    item.transfer_id,
                    "pulled",
                    f"the KV transfer from {address[0]}:{address[1]} failed: {type(e).__name__}: {e}",
                )
            else:
                self._event(item.transfer_id, "pulled", None, parts)

    def _connect(self, host: str, port: int) -> _Lines:
        sock = socket.create_connection((host, port), timeout=min(self.timeout, 5.0))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return _Lines(sock, self._closed)

    def _pull_one(self, lines: _Lines, item: _Pull) -> int:
        """Pull one offer, reading each part's blocks as it comes; returns the parts. _Refused: it
        failed, and the producer was told (or told us)."""
        lines.send({"transfer_id": item.source.get("transfer_id")})
        got = {g: 0 for g in item.blocks}
        first: dict[str, Any] = {}
        problem: str | None = None
        part, final = 0, False
        while not final:
            # A streamed part waits for the prefill to compute it: longer than the producer waits for
            # it, so the producer's verdict (an error part) comes first.
            wait = self.timeout + (_PUBLISH_GRACE_S if part or item.source.get("kv_streamed") else 0.0)
            message = lines.recv(wait)
            if "error" in message:
                raise _Refused(str(message["error"]))
            first = first or message
            problem = problem or self._read_part(item, first, message["blocks"], got)  # parts taken all the same
            part, final = part + 1, bool(message["final"])
        expected = {g: len(b) for g, b in item.blocks.items()}
        if problem is None and got != expected:
            problem = f"the prefill engine offers blocks {got}, the decode engine expects {expected}"
        lines.send({"done": "ok" if problem is None else problem})
        lines.recv(self.timeout)  # the producer held the blocks throughout the reads
        if problem is not None:
            raise _Refused(problem)
        return part

    def _read_part(
        self, item: _Pull, first: dict[str, Any], remote: dict[str, list[int]], got: dict[str, int]
    ) -> str | None:
        """Read one part's blocks into the next of ``item.blocks`` (``got`` per group filled so far,
        advanced here); returns why it cannot, or None."""
        problem = self._mismatch(first, remote, item.blocks, got)
        if problem is not None:
            return problem
        local = {g: item.blocks[g][got[g] : got[g] + len(b)] for g, b in remote.items()}
        for g, b in remote.items():
            got[g] += len(b)
        if not any(remote.values()):
            return None
        plan = read_plan(self._regions, first["regions"], local, remote)
        rc = self._engine.batch_transfer_sync_read(str(item.source.get("engine")), *plan)
        if rc != 0:
            return f"Mooncake's {self.protocol} read of the blocks failed (code {rc}); its log says why"
        return None

    def _mismatch(
        self, first: dict[str, Any], remote: dict[str, list[int]], blocks: dict[str, list[int]], got: dict[str, int]
    ) -> str | None:
        """Why a part cannot fill the next of ``blocks``; None: it can."""
        if first.get("layout") != self._layout:
            return "the prefill and decode engines' KV caches differ in layout (model, dtype or block_size)"
        counts = {g: len(b) for g, b in remote.items()}
        room = {g: len(b) - got[g] for g, b in blocks.items()}
        if any(g not in room or n > room[g] for g, n in counts.items()):
            return f"the prefill engine offers blocks {counts} more, the decode engine expects {room} more"
        return None


def make_connector(config: KVTransferConfig) -> KVConnector:
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
