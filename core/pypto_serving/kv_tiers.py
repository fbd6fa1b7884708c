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

Loading is like the decode side of disaggregated serving (:mod:`pypto_serving.kv_ledger`): for a
fresh request, the longest hit counting the tiers' blocks as cached (per cache group only the blocks
a computation from the hit reads: a sliding window's last blocks, a snapshot at the hit, no block of
a rebuilt group) is compared with the device's own; when longer, the hit's device blocks are held,
blocks are allocated for the ones only a tier has, and the request waits outside the scheduler
(others keep running) while the connector fills them. Then the blocks that arrived join the device
cache, the load's blocks go back and the request enters the scheduler first in line, whose prefix
lookup takes them. (Waiting in the queue it holds no block, so it never keeps the requests ahead of
it from fitting.) A missing or corrupt block is never published: the request's hit is what the
device cache then serves, and it computes the rest itself, so a tier never yields wrong KV.
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
    entries: list[tuple[str, int, bytes, str]]  # (group, device block, key, tier) in the order sent
    held: dict[str, list[int]]  # every device block the load holds: the hit's cached ones and the filled ones
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
        self._tokens_per_block = {g.name: g.tokens_per_block for g in kv.groups}
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
    def on_publish(self, req: Request, group: str, block: int, key: bytes) -> None:
        """A block the device cache just published: hold it for a store unless a tier has its key.
        A LoRA request's blocks stay on the device: their keys name the adapter by its load in this
        process, which a restart (and so the disk tier) would reuse for whatever adapter it loads."""
        if not self.tiers or req.sampling_params.lora is not None:
            return
        if key in self._pending_keys or any(key in t.entries for t in self.tiers.values()):
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
        """Begin a fresh request whose longest hit grows when the tiers' blocks count: hold the
        hit's device blocks, allocate the missing ones and ask the connector to fill them. False:
        it goes to the scheduler as usual (the tiers add nothing, or no room for the blocks now)."""
        if not self.tiers or not self.kv.prefix_caching or req.kv.num_entries:
            return False
        if req.sampling_params.prompt_logprobs is not None or req.sampling_params.lora is not None:
            return False  # every prompt position is computed; no LoRA block is in a tier
        plan = self._plan(req)
        if plan is None:
            return False
        cached, missing = plan
        pools = self.kv.pools
        for group, blocks in cached.items():
            for b in blocks:
                pools[group].take_cached(b)  # out of the free queue: no allocation below evicts it
        if any(len(keys) > pools[group].num_free for group, keys in missing.items()):
            for group, blocks in cached.items():
                pools[group].release(blocks)
            return False
        filled = {group: pools[group].allocate(len(keys)) for group, keys in missing.items()}
        entries = [(g, b, k, t) for g, keys in missing.items() for b, (k, t) in zip(filled[g], keys)]
        held = {g: cached.get(g, []) + filled.get(g, []) for g in {*cached, *filled}}
        self.loads[req.request_id] = _Load(req, entries, held, self._clock())
        for _, _, key, tier in entries:
            self.tiers[tier].entries.move_to_end(key)
        source = {"tier_load": [(g, k.hex(), t) for g, _, k, t in entries]}
        self._send(("pull", req.request_id, source, filled))
        return True

    def _plan(self, req: Request) -> tuple[dict[str, list[int]], dict[str, list[tuple[bytes, str]]]] | None:
        """The longest hit counting the tiers' blocks, if longer than the device's alone: per group,
        the cached device blocks it needs and the ``(key, tier)`` of those a tier holds. Each group
        needs only the blocks a computation from the hit reads (:meth:`KVCacheManager.needed_blocks`)."""
        kv, limit = self.kv, self.kv.hit_limit(req)
        keys = {g.name: kv.prefix_keys(req, g, limit) if g.hit_lookback != 0 else [] for g in kv.groups}
        device = {g.name: [kv.pools[g.name].cached.get(k) for k in keys[g.name]] for g in kv.groups}
        tier = {name: [self._tier_of(k) for k in ks] for name, ks in keys.items()}
        either = {
            name: [d if d is not None else (-1 if t else None) for d, t in zip(device[name], tier[name])]
            for name in keys
        }
        for g in kv.groups:  # a group that needs no block (rebuilt) serves every hit
            if g.hit_lookback == 0:
                device[g.name] = either[g.name] = [None] * (limit // g.tokens_per_block)
        hit = kv.servable_hit(either, limit)
        if hit <= kv.servable_hit(device, limit):
            return None
        cached: dict[str, list[int]] = {}
        missing: dict[str, list[tuple[bytes, str]]] = {}
        for g in kv.groups:
            for i in kv.needed_blocks(g, hit):
                block, where = device[g.name][i], tier[g.name][i]
                if block is not None:
                    cached.setdefault(g.name, []).append(block)
                elif where is not None:
                    missing.setdefault(g.name, []).append((keys[g.name][i], where))
        return cached, missing

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
        """A load ended: the blocks that arrived intact join the device cache, the load's blocks go
        back, and the request goes to the scheduler, whose lookup takes its hit from the device cache.
        Waiting there it holds nothing, so it never blocks the requests ahead of it."""
        req = load.request
        for key in detail.get("bad", []):
            for tier in self.tiers.values():
                tier.pop(bytes.fromhex(key))
        good = len(load.entries) if event.error is None else int(detail.get("good", 0))
        if not load.aborted:
            for group, block, key, name in load.entries[:good]:
                self.kv.pools[group].publish(block, key)
                self.stats["kv_offload_hits_per_tier"][name] += self._tokens_per_block[group]
        for group, blocks in load.held.items():
            self.kv.pools[group].release(blocks)
        if load.aborted:
            _finish(req, RequestStatus.FINISHED_ABORTED)
            return False
        if event.error is not None:
            self.stats["kv_offload_load_failed"] += 1
            logger.warning("KV offload load for %s cut short: %s", req.request_id, event.error)
        self.stats["kv_offload_loads"] += 1
        self.stats["kv_offload_load_seconds"] += self._clock() - load.started
        self.stats["kv_offload_bytes_up"] += int(detail.get("bytes", 0))
        return True

    def fail_loads(self, reason: str) -> list[Request]:
        """The engine died: every loading request fails (the worker and its blocks are gone)."""
        failed = [load.request for load in self.loads.values()]
        for req in failed:
            _finish(req, RequestStatus.FINISHED_ERROR, reason)
        self.loads.clear()
        return failed

    def owners(self) -> list[Request]:
        """Requests holding blocks outside the scheduler (for the KV invariants): none, a load holds
        its blocks itself (:meth:`held`)."""
        return []

    def held(self) -> list[dict[str, list[int]]]:
        """The device blocks that stores (pending or in flight) hold (for the KV invariants)."""
        pending: dict[str, list[int]] = {}
        for group, block, _ in self._pending:
            pending.setdefault(group, []).append(block)
        return [*self.storing.values(), *(load.held for load in self.loads.values()), pending]

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


def _available(block: int | None, tier: str | None) -> int | None:
    """A block position's availability for a hit: its device block, -1 when only a tier has it."""
    return block if block is not None else (-1 if tier is not None else None)


def _finish(req: Request, status: RequestStatus, error: str | None = None) -> None:
    req.status = status
    req.error = error
    req.metrics.finished_time = time.monotonic()
