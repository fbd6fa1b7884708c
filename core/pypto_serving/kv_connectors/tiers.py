"""The worker's half of the KV offload tiers (docs/kv_tiers.md): the bytes of prefix-cache blocks in
host memory and on disk, moved to and from the device caches on the KV-transfer contract.

The engine owns each tier's index (which keys it holds, LRU, byte bounds: :mod:`pypto_serving.kv_tiers`);
this connector only does what it is told, in the order it is told, on one thread of its own, so a
load issued after a store or a move of the same key finds the bytes where the engine's index says:

* ``("tier_store", id, entries, tier)``: copy each ``(group, block, key)`` block into ``tier``; a
  ``sent`` event follows once no device block is read any more (the engine holds them until then).
* :meth:`TierConnector.pull` with ``source = {"tier_load": [(group, key, tier), ...]}``: copy each
  entry into the next block of its group; ``pulled`` follows. An entry missing, torn or corrupt stops
  the load there: the event's ``detail`` says how many entries arrived (``good``) and which keys are
  bad, so the engine keeps the intact prefix and recomputes the rest.
* ``("tier_move", key, src, dst)``: spill a host entry to disk (``dst = "disk"``) or drop it (None).

A disk file holds one block of one group: a header line (JSON: key, group, fingerprint, payload size
and sha256) and the payload. It is written to a temporary name and renamed into place, so a reader
sees a whole file or none; a file torn by a crash or changed on disk fails its hash on load. The
fingerprint binds the file to the checkpoint and the cache layout: a restart with another model or
layout ignores the files.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..kv_transfer import KVCaches, KVConnector, TransferEvent, gather_blocks, layout_digest, scatter_blocks

__all__ = [
    "DiskFile",
    "TierConnector",
    "TierSpec",
    "make_tier_connector",
    "read_block_file",
    "read_header",
    "write_block_file",
]

_MAGIC = b"PYPTO-KV-BLOCK 1\n"
_SUFFIX = ".kvb"


@dataclass(frozen=True, slots=True)
class TierSpec:
    """What the worker needs of the tier settings (pickled into the worker process).

    :param host: whether the host-memory tier is on.
    :param disk_path: the disk tier's directory, or None.
    :param identity: the engine's part of the fingerprint (checkpoint, block size, dtypes, hash).
    """

    host: bool
    disk_path: str | None
    identity: str


def make_tier_connector(spec: TierSpec, _transfer: Any = None) -> TierConnector:
    """The runner's connector factory (``factory(kv_transfer_config)``) with the spec bound first."""
    return TierConnector(spec)


@dataclass(frozen=True, slots=True)
class DiskFile:
    """A block file's header."""

    key: str
    group: str
    fingerprint: str
    nbytes: int
    sha256: str


def write_block_file(path: Path, header: DiskFile, payload: bytes) -> None:
    """Write a block file atomically: a temporary file in the same directory, renamed into place."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    meta: dict[str, Any] = {"key": header.key, "group": header.group, "fingerprint": header.fingerprint}
    meta |= {"nbytes": header.nbytes, "sha256": header.sha256}
    with open(tmp, "wb") as f:
        f.write(_MAGIC + json.dumps(meta).encode() + b"\n")
        f.write(payload)
    os.replace(tmp, path)


def read_header(path: Path) -> DiskFile | None:
    """The header of a block file; None when it is not one (or unreadable)."""
    try:
        with open(path, "rb") as f:
            if f.read(len(_MAGIC)) != _MAGIC:
                return None
            meta = json.loads(f.readline(4096))
        return DiskFile(meta["key"], meta["group"], meta["fingerprint"], int(meta["nbytes"]), meta["sha256"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def read_block_file(path: Path, key: str, fingerprint: str) -> bytes:
    """The verified payload of the block file for ``key``.

    :raises ValueError: missing, torn, for another key or model, or its payload fails its hash."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ValueError(f"unreadable: {e}") from None
    if not data.startswith(_MAGIC) or b"\n" not in data[len(_MAGIC) :]:
        raise ValueError("not a block file")
    line_end = data.index(b"\n", len(_MAGIC))
    header = read_header(path)
    if header is None or header.key != key or header.fingerprint != fingerprint:
        raise ValueError("header of another block or model")
    payload = data[line_end + 1 :]
    if len(payload) != header.nbytes or hashlib.sha256(payload).hexdigest() != header.sha256:
        raise ValueError("payload torn or corrupt (size or sha256 differs)")
    return payload


class TierConnector(KVConnector):
    """Host-memory and disk stores of prefix-cache blocks, driven by the engine's tier ledger."""

    def __init__(self, spec: TierSpec) -> None:
        self.spec = spec
        self.host: dict[str, tuple[str, torch.Tensor]] = {}  # key -> (group, bytes)
        self._caches: KVCaches = {}
        self._jobs: queue.Queue[tuple[Any, ...] | None] = queue.Queue()
        self._events: queue.Queue[TransferEvent] = queue.Queue()
        self._thread: threading.Thread | None = None
        self.fingerprint = ""
        self._pin = torch.cuda.is_available()

    # -- the contract
    def start(self, caches: KVCaches) -> dict[str, Any]:
        """Take the caches; scan the disk tier. Returns each group's bytes per block and the disk
        tier's usable files (oldest first) for the engine's index."""
        self._caches = caches
        self.fingerprint = hashlib.sha256(f"{self.spec.identity}|{layout_digest(caches)}".encode()).hexdigest()[:32]
        block_bytes = {g: sum(t[0].numel() * t.element_size() for t in ts) for g, ts in caches.items()}
        found, ignored = self._scan() if self.spec.disk_path is not None else ([], 0)
        self._thread = threading.Thread(target=self._run, name="kv-tiers", daemon=True)
        self._thread.start()
        return {"block_bytes": block_bytes, "disk": found, "disk_ignored": ignored}

    def _scan(self) -> tuple[list[tuple[str, str, int]], int]:
        """The disk tier's files of this fingerprint as ``(key, group, bytes)``, least recently
        written first; files of another model or layout (or no block file) are counted and left."""
        assert self.spec.disk_path is not None
        root = Path(self.spec.disk_path)
        root.mkdir(parents=True, exist_ok=True)
        found: list[tuple[float, str, str, int]] = []
        ignored = 0
        for path in root.iterdir():
            if path.name.endswith(".tmp"):  # a write that a crash cut short
                with contextlib.suppress(OSError):
                    path.unlink()
                continue
            header = read_header(path) if path.suffix == _SUFFIX else None
            if header is None or header.fingerprint != self.fingerprint or path.stem != header.key:
                ignored += 1
                continue
            found.append((path.stat().st_mtime, header.key, header.group, header.nbytes))
        found.sort()
        return [(k, g, n) for _, k, g, n in found], ignored

    def publish(self, transfer_id: str, blocks: dict[str, list[int]]) -> None:
        raise NotImplementedError("the tier connector serves no peer engine (it stores with tier_store)")

    def withdraw(self, transfer_id: str) -> None:
        raise NotImplementedError("the tier connector serves no peer engine")

    def pull(self, transfer_id: str, source: dict[str, Any], blocks: dict[str, list[int]]) -> None:
        self._jobs.put(("load", transfer_id, source["tier_load"], blocks))

    def message(self, msg: tuple[Any, ...]) -> None:
        self._jobs.put(msg)

    def poll(self) -> list[TransferEvent]:
        out = []
        while True:
            try:
                out.append(self._events.get_nowait())
            except queue.Empty:
                return out

    def close(self) -> None:
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join(timeout=10)

    # -- the connector's thread: one job at a time, in the order sent
    def wait_idle(self) -> None:
        """Wait until every job sent so far is done (tests; the engine never waits)."""
        self._jobs.join()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                self._do(job)
            except Exception as e:  # a job that fails reports it; the thread serves the next one
                if job[0] in ("tier_store", "load"):
                    kind = "sent" if job[0] == "tier_store" else "pulled"
                    self._events.put(TransferEvent(job[1], kind, f"{type(e).__name__}: {e}"))  # type: ignore[arg-type]
            finally:
                self._jobs.task_done()

    def _do(self, job: tuple[Any, ...]) -> None:
        kind = job[0]
        if kind == "tier_store":
            self._store(job[1], job[2], job[3])
        elif kind == "load":
            self._load(job[1], job[2], job[3])
        elif kind == "tier_move":
            self._move(job[1], job[2], job[3])

    def _store(self, transfer_id: str, entries: list[tuple[str, int, str]], tier: str) -> None:
        copies = [(group, key, self._gather(group, block)) for group, block, key in entries]
        self._sync()
        # The device blocks are read: the engine may reuse them while the copies go to disk.
        self._events.put(TransferEvent(transfer_id, "sent", None, {"bytes": sum(c.numel() for _, _, c in copies)}))
        for group, key, copy in copies:
            if tier == "host":
                self.host[key] = (group, copy)
            else:
                self._write(group, key, copy)

    def _gather(self, group: str, block: int) -> torch.Tensor:
        flat = gather_blocks(self._caches, {group: [block]})
        if flat.device.type == "cpu":
            return flat
        buf = torch.empty(flat.numel(), dtype=torch.uint8, pin_memory=self._pin)
        buf.copy_(flat, non_blocking=self._pin)
        return buf

    def _sync(self) -> None:
        """Wait for this thread's copies on an accelerator (``torch.cuda`` or ``torch.npu``; a no-op
        on the CPU), so an event never precedes the bytes it reports."""
        device = next((t.device for ts in self._caches.values() for t in ts), None)
        if device is not None and device.type != "cpu":
            getattr(torch, device.type).synchronize(device)

    def _write(self, group: str, key: str, payload: torch.Tensor) -> None:
        assert self.spec.disk_path is not None
        data = payload.numpy().tobytes()
        header = DiskFile(key, group, self.fingerprint, len(data), hashlib.sha256(data).hexdigest())
        write_block_file(self._path(key), header, data)

    def _path(self, key: str) -> Path:
        assert self.spec.disk_path is not None
        return Path(self.spec.disk_path) / f"{key}{_SUFFIX}"

    def _load(self, transfer_id: str, entries: list[tuple[str, str, str]], blocks: dict[str, list[int]]) -> None:
        nbytes, good, bad = 0, 0, []
        for (group, key, tier), block in zip(entries, _targets(entries, blocks)):
            payload = self._fetch(key, tier)
            if payload is None:
                bad.append(key)
                break
            scatter_blocks(self._caches, {group: [block]}, payload)
            nbytes += payload.numel()
            good += 1
        self._sync()
        error = None if good == len(entries) else f"tier block {bad[0]} missing or corrupt"
        self._events.put(TransferEvent(transfer_id, "pulled", error, {"good": good, "bad": bad, "bytes": nbytes}))

    def _fetch(self, key: str, tier: str) -> torch.Tensor | None:
        """A block's bytes from ``tier``; None when missing or (on disk) failing verification."""
        if tier == "host":
            entry = self.host.get(key)
            return None if entry is None else entry[1]
        try:
            data = read_block_file(self._path(key), key, self.fingerprint)
        except ValueError:
            with contextlib.suppress(OSError):
                self._path(key).unlink()  # a bad file is never read again
            return None
        return torch.frombuffer(bytearray(data), dtype=torch.uint8)

    def _move(self, key: str, src: str, dst: str | None) -> None:
        if src == "host":
            entry = self.host.pop(key, None)
            if entry is not None and dst == "disk":
                self._write(entry[0], key, entry[1])
        else:
            with contextlib.suppress(OSError):
                self._path(key).unlink()


def _targets(entries: list[tuple[str, str, str]], blocks: dict[str, list[int]]) -> Iterator[int]:
    """Each entry's device block: the next unused one of its group, in order."""
    at = dict.fromkeys(blocks, 0)
    for group, _, _ in entries:
        yield blocks[group][at[group]]
        at[group] += 1
