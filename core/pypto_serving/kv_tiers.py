"""KV offload tiers under the device prefix cache: the engine's index of the host-memory and disk
tiers, and the block bookkeeping of copies to and from them (docs/kv_tiers.md).

The engine decides every hit, so it owns each tier's index: which block keys (the prefix cache's
sha256 chain keys) the tier holds, least recently used first, and their bytes against the tier's
bound. The bytes live in the worker, in the tier connector (:mod:`pypto_serving.kv_connectors.tiers`),
which does what this ledger sends, in order, on its own thread.

Copying down is write-through: a block the device cache publishes (full, keyed, its KV final) whose
key no tier holds is stored in the top tier. Its device block cannot be written again before the
copy reads it: from publication until the connector's ``sent`` event this ledger holds a reference
on it, so it never joins the free queue, is never handed out again, and a cached block is only read
(a computation starts after the blocks it hits). A host tier over its bound spills its least recently
used blocks to the disk tier (or drops them); the disk tier drops its own. A key lives in one tier.

Loading is like the decode side of disaggregated serving (:mod:`pypto_serving.kv_ledger`): a fresh
request whose prompt continues past its device hit in the tiers takes the device hit, gets blocks
for the rest, and waits outside the scheduler (others keep running) while the connector fills them;
then the blocks that arrived join the device cache, the request gives its blocks back and enters the
scheduler, whose prefix lookup hits them. (Waiting in the queue it holds no block, so it never keeps
the requests ahead of it from fitting.) A missing or corrupt block ends the hit there: the request
computes the rest itself, so a tier never yields wrong KV, only a shorter hit.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .kv_cache import KVCacheManager
from .kv_transfer import TransferEvent
from .request import Request, RequestStatus

__all__ = ["TierIndex", "TierLedger", "tier_identity"]

logger = logging.getLogger(__name__)

Send = Callable[[tuple[Any, ...]], None]


@dataclass(slots=True)
class TierIndex:
    """One tier's keys, least recently used first, with their group and bytes."""

    name: str
    capacity: int
    entries: OrderedDict[bytes, tuple[str, int]] = field(default_factory=OrderedDict)
    used: int = 0

    def add(self, key: bytes, group: str, nbytes: int) -> None:
        self.entries[key] = (group, nbytes)
        self.used += nbytes

    def pop(self, key: bytes) -> tuple[str, int] | None:
        entry = self.entries.pop(key, None)
        if entry is not None:
            self.used -= entry[1]
        return entry

    def over(self) -> list[tuple[bytes, str, int]]:
        """Take the least recently used entries until the tier is within its bound."""
        out = []
        while self.used > self.capacity and self.entries:
            key, (group, nbytes) = self.entries.popitem(last=False)
            self.used -= nbytes
            out.append((key, group, nbytes))
        return out


@dataclass(slots=True)
class _Load:
    request: Request
    device_hit: int  # tokens hit on the device before the tiers' part
    tiers: list[str]  # per loaded block position, the tier it comes from
    started: float
    aborted: bool = False


class TierLedger:
    """The tiers' indexes and the device blocks their copies hold."""

    def __init__(
        self,
        kv: KVCacheManager,
        send: Send,
        address: dict[str, Any],
        *,
        host_bytes: int,
        disk_bytes: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.kv = kv
        self._send = send
        self._clock = clock
        self.block_bytes: dict[str, int] = address["block_bytes"]
        self.tiers: dict[str, TierIndex] = {}
        if host_bytes:
            self.tiers["host"] = TierIndex("host", host_bytes)
        if disk_bytes:
            self.tiers["disk"] = TierIndex("disk", disk_bytes)
        self._pending: list[tuple[str, int, bytes]] = []  # published, to store at the next flush
        self._pending_keys: set[bytes] = set()
        self.storing: dict[str, dict[str, list[int]]] = {}  # store id -> the device blocks it holds
        self.loads: dict[str, _Load] = {}  # by request id
        self._next_id = 0
        self.stats: dict[str, Any] = {
            "kv_offload_hits_per_tier": dict.fromkeys(self.tiers, 0),
            "kv_offload_bytes_down": 0,
            "kv_offload_bytes_up": 0,
            "kv_offload_loads": 0,
            "kv_offload_load_seconds": 0.0,
            "kv_offload_load_failed": 0,
            "kv_offload_disk_ignored": int(address.get("disk_ignored", 0)),
            "kv_offload_bytes_per_tier": {},
        }
        self._seed_disk(address.get("disk", []))
        kv.on_publish = self.on_publish

    def _seed_disk(self, found: list[tuple[str, str, int]]) -> None:
        """Index the disk tier's files from an earlier run (oldest first), within its bound."""
        disk = self.tiers.get("disk")
        if disk is None:
            return
        for key, group, nbytes in found:
            if group in self.block_bytes and nbytes == self.block_bytes[group]:
                disk.add(bytes.fromhex(key), group, nbytes)
        self._evict("disk")

    # -- copying down
    def on_publish(self, group: str, block: int, key: bytes) -> None:
        """A block the device cache just published: hold it for a store unless a tier has its key."""
        if not self.tiers or key in self._pending_keys or any(key in t.entries for t in self.tiers.values()):
            return
        self.kv.pools[group].take_cached(block)  # released at the store's ``sent`` event
        self._pending.append((group, block, key))
        self._pending_keys.add(key)

    def flush(self) -> None:
        """Send the stores of the blocks published since the last flush to the top tier."""
        if not self._pending:
            return
        top = next(iter(self.tiers))
        pending, self._pending = self._pending, []
        self._pending_keys.clear()
        sid = self._new_id("store")
        held: dict[str, list[int]] = {}
        for group, block, key in pending:
            held.setdefault(group, []).append(block)
            self.tiers[top].add(key, group, self.block_bytes[group])
        self.storing[sid] = held
        self._send(("tier_store", sid, [(g, b, k.hex()) for g, b, k in pending], top))
        self._evict(top)

    def _new_id(self, kind: str) -> str:
        self._next_id += 1
        return f"{kind}-{self._next_id}"

    def _evict(self, tier: str) -> None:
        """Bring ``tier`` within its bound: host victims spill to the disk tier (or go), disk ones go."""
        disk = self.tiers.get("disk") if tier == "host" else None
        for key, group, nbytes in self.tiers[tier].over():
            spill = disk is not None and nbytes <= disk.capacity
            self._send(("tier_move", key.hex(), tier, "disk" if spill else None))
            if spill:
                assert disk is not None
                disk.add(key, group, nbytes)
        if disk is not None:
            self._evict("disk")

    # -- loading
    def start(self, req: Request) -> bool:
        """Begin a fresh request whose prompt continues past its device hit in the tiers: take the
        device hit, allocate the rest and ask the connector. False: it goes to the scheduler as usual
        (nothing in the tiers, or no room for the blocks now)."""
        if not self.tiers or not self.kv.prefix_caching or req.kv.num_entries:
            return False
        if req.sampling_params.prompt_logprobs is not None:  # every prompt position is computed
            return False
        device, found = self._lookup(req, self.kv.hit_limit(req))
        if not found:
            return False
        unit = self.kv.hit_unit
        hit = self.kv.find_cached_prefix(req)
        if hit != device * unit or not self.kv.allocate(req, (device + len(found)) * unit):
            self.kv.cancel_prefix_hit(req, hit)
            return False
        entries, tiers = [], []
        for position in found:
            tiers.append(position[0][2])
            for group, key, tier in position:
                self.tiers[tier].entries.move_to_end(key)
                entries.append((group, key.hex(), tier))
        blocks = {g.name: req.kv.block_ids[g.name][device:] for g in self.kv.groups}
        self.loads[req.request_id] = _Load(req, hit, tiers, self._clock())
        self._send(("pull", req.request_id, {"tier_load": entries}, blocks))
        return True

    def _lookup(self, req: Request, limit: int) -> tuple[int, list[list[tuple[str, bytes, str]]]]:
        """The request's device hit (in blocks) and, per block position after it that every group
        finds in a tier, each group's ``(group, key, tier)``."""
        chains = [(g.name, self.kv.prefix_keys(req, g, limit)) for g in self.kv.groups]
        device = min(_run(keys, self.kv.pools[name].cached) for name, keys in chains)
        found = []
        for i in range(device, min(len(keys) for _, keys in chains)):
            position = [(name, keys[i], self._tier_of(keys[i])) for name, keys in chains]
            if any(tier is None for _, _, tier in position):
                break
            found.append([(name, key, tier) for name, key, tier in position if tier is not None])
        return device, found

    def _tier_of(self, key: bytes) -> str | None:
        return next((name for name, t in self.tiers.items() if key in t.entries), None)

    def abort(self, request_id: str) -> None:
        """Abort a loading request: it ends when the connector reports the load's end."""
        load = self.loads.get(request_id)
        if load is not None:
            load.aborted = True

    # -- events
    def on_event(self, event: TransferEvent) -> tuple[Request | None, bool]:
        """Apply one connector event; returns a request whose load ended (or None) and whether it
        goes to the scheduler (False: it was aborted, and is finished)."""
        detail = event.detail or {}
        if event.kind == "sent":
            held = self.storing.pop(event.transfer_id, {})
            for group, blocks in held.items():
                self.kv.pools[group].release(blocks)
            if event.error is not None:
                logger.warning("KV offload store %s failed: %s", event.transfer_id, event.error)
            self.stats["kv_offload_bytes_down"] += int(detail.get("bytes", 0))
            return None, False
        load = self.loads.pop(event.transfer_id, None)
        if load is None:
            return None, False
        return load.request, self._loaded(load, event, detail)

    def _loaded(self, load: _Load, event: TransferEvent, detail: dict[str, Any]) -> bool:
        """A load ended: the blocks that arrived intact join the device cache, and the request gives
        back every block and goes to the scheduler, whose lookup takes its hit from the device cache.
        Waiting there it holds nothing, so it never blocks the requests ahead of it."""
        req = load.request
        for key in detail.get("bad", []):
            for tier in self.tiers.values():
                tier.pop(bytes.fromhex(key))
        if load.aborted:
            self.kv.free(req)
            _finish(req, RequestStatus.FINISHED_ABORTED)
            return False
        positions = int(detail.get("good", 0)) // len(self.kv.groups) if event.error else len(load.tiers)
        if event.error is not None:
            self.stats["kv_offload_load_failed"] += 1
            logger.warning("KV offload load for %s cut short: %s", req.request_id, event.error)
        self.stats["kv_offload_loads"] += 1
        self.stats["kv_offload_load_seconds"] += self._clock() - load.started
        self.stats["kv_offload_bytes_up"] += int(detail.get("bytes", 0))
        if positions:
            hit = load.device_hit + positions * self.kv.hit_unit
            self.kv.truncate(req, hit)
            self.kv.publish(req, hit)
        for name in load.tiers[:positions]:
            self.stats["kv_offload_hits_per_tier"][name] += self.kv.hit_unit
        self.kv.cancel_prefix_hit(req, load.device_hit)  # the scheduler looks it up (and counts it) again
        return True

    def fail_loads(self, reason: str) -> list[Request]:
        """The engine died: every loading request fails (the worker and its blocks are gone)."""
        failed = [load.request for load in self.loads.values()]
        for req in failed:
            _finish(req, RequestStatus.FINISHED_ERROR, reason)
        self.loads.clear()
        return failed

    def owners(self) -> list[Request]:
        """Requests holding blocks outside the scheduler (for the KV invariants)."""
        return [load.request for load in self.loads.values()]

    def held(self) -> list[dict[str, list[int]]]:
        """The device blocks that stores (pending or in flight) hold (for the KV invariants)."""
        pending: dict[str, list[int]] = {}
        for group, block, _ in self._pending:
            pending.setdefault(group, []).append(block)
        return [*self.storing.values(), pending]

    def snapshot(self) -> dict[str, Any]:
        """The stats, with each tier's bytes in use now."""
        self.stats["kv_offload_bytes_per_tier"] = {name: t.used for name, t in self.tiers.items()}
        return self.stats


def tier_identity(settings: Any) -> str:
    """The engine's part of the disk tier's fingerprint: what decides the KV of a block's tokens
    besides the cache layout (which the worker adds): the checkpoint's files (names, sizes, change
    times, and config.json's content), the executor and its options, dtypes, block size and hash."""
    parts: list[Any] = [settings.executor, settings.executor_options, settings.dtype, settings.kv_cache_dtype]
    parts += [settings.block_size, settings.prefix_cache_hash]
    model = Path(settings.model) if settings.model else None
    if model is not None and model.is_dir():
        parts.append(sorted((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in model.iterdir() if f.is_file()))
        config = model / "config.json"
        parts.append(hashlib.sha256(config.read_bytes()).hexdigest() if config.is_file() else None)
    else:
        parts.append(settings.model)
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()


def _run(keys: list[bytes], cached: dict[bytes, int]) -> int:
    """How many leading keys are cached."""
    n = 0
    while n < len(keys) and keys[n] in cached:
        n += 1
    return n


def _finish(req: Request, status: RequestStatus, error: str | None = None) -> None:
    req.status = status
    req.error = error
    req.metrics.finished_time = time.monotonic()
