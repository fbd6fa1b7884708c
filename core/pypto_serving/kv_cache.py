"""Paged KV cache accounting: block pools per cache group, ref counts, LRU reuse and prefix caching.

Only bookkeeping lives here; the tensors live in the worker. A block whose ref count drops to zero
goes to the tail of its pool's free queue but keeps its hash, so a later request with the same
prefix can take it back (a prefix-cache hit) until the block is handed out again.

A block's key is a cryptographic digest of its parent block's key and its own token ids, so a hit is
taken without comparing tokens: two different prefixes sharing a key (and so KV) would need a hash
collision. The digest is the same in every process (no ``PYTHONHASHSEED`` dependence).
"""

from __future__ import annotations

import hashlib
import math
import struct
import sys
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from .executor import CacheGroupSpec
from .request import KVState, Request

__all__ = ["BLOCK_HASHES", "FREED", "BlockPool", "KVCacheManager", "NoFreeBlocksError", "block_key", "root_key"]

FREED = -1
"""A request's table entry whose block was given back because it lies wholly outside a sliding
window: the entry keeps its position in the table (later blocks keep their indices) but owns nothing."""

# The prefix_cache_hash setting's choices: collision-resistant digests from the standard library.
BLOCK_HASHES: dict[str, Callable[[bytes], bytes]] = {
    "sha256": lambda data: hashlib.sha256(data).digest(),
    "blake2b": lambda data: hashlib.blake2b(data).digest(),
}


def root_key(hash_name: str, group: str) -> bytes:
    """The parent key of a cache group's first block: groups never share keys."""
    return BLOCK_HASHES[hash_name](group.encode())


def block_key(hash_name: str, parent: bytes, tokens: Sequence[int]) -> bytes:
    """The key of a full block: a digest of its parent's key and its token ids (little-endian int64,
    the range every token id is checked against), so equal keys mean equal prefixes."""
    return BLOCK_HASHES[hash_name](parent + struct.pack(f"<{len(tokens)}q", *tokens))


class NoFreeBlocksError(RuntimeError):
    pass


@dataclass(slots=True)
class BlockPool:
    """One group's blocks. ``free`` is ordered least recently freed first (evicted first)."""

    num_blocks: int
    ref_cnt: list[int] = field(init=False)
    block_hash: list[bytes | None] = field(init=False)
    free: OrderedDict[int, None] = field(init=False)
    cached: dict[bytes, int] = field(default_factory=dict)  # block key -> block id

    def __post_init__(self) -> None:
        self.ref_cnt = [0] * self.num_blocks
        self.block_hash = [None] * self.num_blocks
        self.free = OrderedDict.fromkeys(range(self.num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self.free):
            raise NoFreeBlocksError(f"need {n} blocks, {len(self.free)} free")
        out = []
        for _ in range(n):
            block, _ = self.free.popitem(last=False)
            h = self.block_hash[block]
            if h is not None:  # evict its cached content
                del self.cached[h]
                self.block_hash[block] = None
            self.ref_cnt[block] = 1
            out.append(block)
        return out

    def take_cached(self, block: int) -> None:
        """A prefix hit: share a cached block (reviving it from the free queue if unreferenced)."""
        if self.ref_cnt[block] == 0:
            del self.free[block]
        self.ref_cnt[block] += 1

    def release(self, blocks: Sequence[int], *, tail_first: bool = True) -> None:
        """Give back ``blocks``; unreferenced ones join the free queue. Tail-first by default, so a
        request's last blocks are evicted before its shared prefix."""
        for block in reversed(blocks) if tail_first else blocks:
            self.ref_cnt[block] -= 1
            assert self.ref_cnt[block] >= 0, f"block {block} released twice"
            if self.ref_cnt[block] == 0:
                self.free[block] = None

    def publish(self, block: int, h: bytes) -> bool:
        """Cache ``block`` under key ``h``; False when an identical block already is (or this one)."""
        if h in self.cached or self.block_hash[block] is not None:
            return False
        self.block_hash[block] = h
        self.cached[h] = block
        return True


class KVCacheManager:
    """Block accounting for every cache group of the executor."""

    def __init__(
        self,
        groups: Sequence[CacheGroupSpec],
        num_blocks: dict[str, int],
        *,
        enable_prefix_caching: bool = True,
        prefix_cache_hash: str = "sha256",
        max_step_tokens: int | None = None,
    ) -> None:
        """``max_step_tokens``: the most tokens one step computes for a request (the token budget),
        which bounds what a sliding-window group holds for it; ``None``: unbounded."""
        if prefix_cache_hash not in BLOCK_HASHES:
            raise ValueError(f"prefix_cache_hash={prefix_cache_hash!r}: use one of {', '.join(BLOCK_HASHES)}")
        self.hash_name = prefix_cache_hash
        self.groups = list(groups)
        self.pools = {g.name: BlockPool(num_blocks[g.name]) for g in self.groups}
        # A hit must be restorable in every group, so one group without exact caching disables it.
        self.prefix_caching = enable_prefix_caching and all(g.prefix_caching for g in self.groups)
        self._hash_unit = math.lcm(*(g.tokens_per_block for g in self.groups))
        self.windowed = [g for g in self.groups if g.window_tokens is not None]
        self._max_step_tokens = max_step_tokens
        self._min_tpb = min(g.tokens_per_block for g in self.groups)
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # of those, found cached
        # Per group: the prompt tokens that group alone could have served (a hit is the longest
        # prefix every group serves, so these show which group caps it).
        self.group_hits = dict.fromkeys((g.name for g in self.groups), 0)
        self._publishing = [g for g in self.groups if g.hit_lookback != 0]
        # Told of every block newly cached, as (request, group, block, key): the offload tiers copy it down.
        self.on_publish: Callable[[Request, str, int, bytes], None] | None = None

    # -- capacity
    def blocks_needed(self, group: CacheGroupSpec, num_tokens: int) -> int:
        # ceil(ceil(n / per_entry) / block_size) == ceil(n / tokens_per_block), in integers; a
        # shifted group's entries run ``slot_shift`` past the tokens.
        return -(-(num_tokens + group.slot_shift) // group.tokens_per_block)

    @property
    def usage(self) -> float:
        total = sum(p.num_blocks for p in self.pools.values())
        return 1.0 - sum(p.num_free for p in self.pools.values()) / total if total else 0.0

    def can_ever_fit(self, num_tokens: int) -> bool:
        return all(self._most_held(g, num_tokens) <= self.pools[g.name].num_blocks for g in self.groups)

    def _most_held(self, group: CacheGroupSpec, num_tokens: int) -> int:
        """Blocks of ``group`` a request of ``num_tokens`` holds at its peak: all of them, or for a
        sliding window its window and two steps' tokens (blocks before it are given back)."""
        need = self.blocks_needed(group, num_tokens)
        if group.window_tokens is None or self._max_step_tokens is None:
            return need
        span = group.window_tokens + 2 * self._max_step_tokens + 2 * group.tokens_per_block
        return min(need, math.ceil(span / group.tokens_per_block))

    # -- prefix cache
    def _root(self, request: Request, group: CacheGroupSpec) -> bytes:
        """The chain's seed: the group, and the request's LoRA adapter, whose K/V differ from the base
        model's for the same tokens, so a cached prefix is never shared across adapters."""
        lora = request.sampling_params.lora
        return root_key(self.hash_name, group.name if lora is None else f"{group.name}\0lora:{lora}")

    def _chain_hashes(self, request: Request, group: CacheGroupSpec, num_tokens: int) -> list[bytes]:
        """Chained keys of the request's full blocks covering its first ``num_tokens`` tokens."""
        known = request.kv.hashes.setdefault(group.name, [])
        tpb = group.tokens_per_block
        full = num_tokens // tpb
        if len(known) < full:
            tokens = request.token_slice(len(known) * tpb, full * tpb)
            parent = known[-1] if known else self._root(request, group)
            for i in range(0, len(tokens), tpb):
                parent = block_key(self.hash_name, parent, tokens[i : i + tpb])
                known.append(parent)
        # ``known`` may hold more (a prefix lookup hashes the whole prompt): only full blocks
        # within ``num_tokens`` may be returned, or publish() would cache unwritten blocks.
        return known if len(known) == full else known[:full]

    def hit_limit(self, request: Request) -> int:
        """The longest prefix a hit may cover: whole hash units, never the last token."""
        return (request.num_tokens - 1) // self._hash_unit * self._hash_unit

    def prefix_keys(self, request: Request, group: CacheGroupSpec, num_tokens: int) -> list[bytes]:
        """The chain keys of ``group``'s full blocks within the request's first ``num_tokens`` tokens."""
        return self._chain_hashes(request, group, num_tokens)

    def servable_hit(self, found: dict[str, list[int | None]], limit: int) -> int:
        """The longest hit up to ``limit`` (a multiple of the hash unit) that every group serves from
        ``found`` (per group, per full block: an available block, or None)."""
        serves = [self._servable(g, found[g.name]) for g in self.groups]
        return next((p for p in range(limit, 0, -self._hash_unit) if all(ok(p) for ok in serves)), 0)

    def needed_blocks(self, group: CacheGroupSpec, hit: int) -> range:
        """The table positions of ``group`` that a hit at ``hit`` needs cached."""
        return range(self._first_needed(group, hit), hit // group.tokens_per_block)

    def find_cached_prefix(self, request: Request) -> int:
        """Take the longest cached prefix for a fresh request; returns the tokens it covers.

        A hit at ``p`` needs, in each group, only the cached blocks that the computation from ``p``
        reads (:attr:`CacheGroupSpec.hit_lookback`: a sliding window's last blocks, every block of a
        full group, none of a group the executor rebuilds); the hit is the longest ``p`` that every
        group serves. The keys still chain from block 0 (they come from the tokens, not the cache).
        The hit never covers the last prompt token, so the first output is always computed."""
        if not self.prefix_caching or request.kv.num_entries:
            return 0
        limit = self.hit_limit(request)
        self.prefix_queries += request.num_prompt_tokens
        hit, by_group = self.take_prefix(request, limit)
        for name, best in by_group.items():
            self.group_hits[name] += best
        request.kv.group_hits = by_group
        self.prefix_hits += hit
        return hit

    def take_prefix(self, request: Request, limit: int) -> tuple[int, dict[str, int]]:
        """Take the cached blocks of the longest hit up to ``limit`` (a multiple of the hash unit)
        for a request holding none; returns the hit and, per group, the hit that group alone serves."""
        unit = self._hash_unit
        found = {g.name: self._cached_blocks(request, g, limit) for g in self.groups}
        serves = {g.name: self._servable(g, found[g.name]) for g in self.groups}
        candidates = range(limit, 0, -unit)
        by_group = {name: next((p for p in candidates if ok(p)), 0) for name, ok in serves.items()}
        hit = next((p for p in candidates if all(ok(p) for ok in serves.values())), 0)
        if hit == 0:
            return 0, by_group
        for g in self.groups:
            lo, end = self._first_needed(g, hit), hit // g.tokens_per_block
            blocks = [b for b in found[g.name][lo:end] if b is not None]
            for b in blocks:
                self.pools[g.name].take_cached(b)
            request.kv.block_ids[g.name] = [FREED] * lo + blocks
            if lo:
                request.kv.window_freed[g.name] = lo
        self._tables_grew(request.kv)
        # The request computes from ``hit`` on, so a window group's hit blocks before that window
        # go back at once: held until the first step confirms, they could take the whole pool and
        # leave the request unable to grow (never admitted, or failed as too big for the cache).
        self.release_outside_window(request, hit)
        return hit, by_group

    # -- KV transfer (disaggregated serving)
    @property
    def hit_aligned(self) -> bool:
        """Whether a computation may start only at a multiple of the hash unit: some group's state
        at ``p`` is not the plain prefix of its blocks (a window, a snapshot, a rebuilt group)."""
        return any(g.hit_lookback is not None for g in self.groups)

    @property
    def hit_unit(self) -> int:
        return self._hash_unit

    def transfer_tokens(self, num_tokens: int) -> int:
        """The longest prefix of ``num_tokens`` tokens that a request can start computing after."""
        return num_tokens // self._hash_unit * self._hash_unit if self.hit_aligned else num_tokens

    def restrict_to_hit(self, request: Request, hit: int) -> None:
        """Give back the blocks a computation from ``hit`` never reads (the entries before each
        group's :meth:`_first_needed`), as :meth:`take_prefix` leaves a hit's tables."""
        for g in self.groups:
            blocks = request.kv.block_ids.get(g.name, [])
            lo = min(self._first_needed(g, hit), len(blocks))
            if lo:
                self.pools[g.name].release([b for b in blocks[:lo] if b != FREED], tail_first=False)
                blocks[:lo] = [FREED] * lo
                request.kv.window_freed[g.name] = lo

    def blocks_before(self, request: Request, hit: int) -> dict[str, list[int]]:
        """Per group, the blocks a request holds for the entries before a hit at ``hit``, in table
        order: what a transfer of that hit moves (a shifted group's table runs past them)."""
        out = {}
        for g in self.groups:
            table = request.kv.block_ids.get(g.name, [])[: hit // g.tokens_per_block]
            out[g.name] = [b for b in table if b != FREED]
        return out

    def _cached_blocks(self, request: Request, group: CacheGroupSpec, limit: int) -> list[int | None]:
        """Per full block of the request's first ``limit`` tokens, the cached block with its key."""
        if group.hit_lookback == 0:  # the group needs no cached block (nor publishes any)
            return [None] * (limit // group.tokens_per_block)
        cached = self.pools[group.name].cached
        return [cached.get(h) for h in self._chain_hashes(request, group, limit)]

    def _first_needed(self, group: CacheGroupSpec, hit: int) -> int:
        """The first block of ``group`` that a hit at ``hit`` needs (earlier entries stay FREED)."""
        back = group.hit_lookback
        return 0 if back is None else max(0, hit - back) // group.tokens_per_block

    def _servable(self, group: CacheGroupSpec, blocks: list[int | None]) -> Callable[[int], bool]:
        """Whether ``group`` serves a hit at ``p`` (a multiple of its block's tokens): every block
        from :meth:`_first_needed` to the hit is cached."""
        runs: list[int] = []  # runs[i]: consecutive cached blocks ending at block i
        for b in blocks:
            runs.append(runs[-1] + 1 if runs and b is not None else int(b is not None))

        def serves(p: int) -> bool:
            end = p // group.tokens_per_block
            need = end - self._first_needed(group, p)
            return need <= 0 or runs[end - 1] >= need

        return serves

    def cancel_prefix_hit(self, request: Request, hit: int) -> None:
        """Undo :meth:`find_cached_prefix` for a request that could not be admitted after all, so
        the retry neither holds blocks meanwhile nor counts twice in the hit-rate statistics."""
        for name, best in request.kv.group_hits.items():
            self.group_hits[name] -= best
        self.free(request)
        self.prefix_queries -= request.num_prompt_tokens
        self.prefix_hits -= hit

    def publish(self, request: Request, num_tokens: int) -> int:
        """Make the full blocks among the request's first ``num_tokens`` (confirmed) tokens reusable.
        Returns the confirmed count from which a call can publish more: calls below it return at
        once, so a caller may skip them (until the request's blocks are freed)."""
        if not self.prefix_caching:
            return sys.maxsize
        state = request.kv
        if num_tokens // self._min_tpb <= state.published:
            # No new full block since the last call: the common decode step (and clamping cannot add one).
            return (state.published + 1) * self._min_tpb
        num_tokens = min(num_tokens, request.num_tokens)
        # Only the blocks that became full since the last call: the earlier ones are published.
        done = state.published * self._min_tpb
        published = state.published = num_tokens // self._min_tpb
        for g in self._publishing:
            blocks = state.block_ids.get(g.name, [])
            pool, tpb = self.pools[g.name], g.tokens_per_block
            keys = self._chain_hashes(request, g, num_tokens)
            for i in range(done // tpb, min(len(blocks), len(keys))):
                if blocks[i] != FREED and pool.publish(blocks[i], keys[i]) and self.on_publish is not None:
                    self.on_publish(request, g.name, blocks[i], keys[i])
        return (published + 1) * self._min_tpb

    def release_outside_window(self, request: Request, first_pos: int) -> None:
        """Give back each windowed group's blocks that lie wholly before the window of position
        ``first_pos``, the lowest position any step of ``request`` still computes. Their table
        entries become :data:`FREED`."""
        freed = request.kv.window_freed
        for g in self.windowed:
            assert g.window_tokens is not None
            blocks = request.kv.block_ids.get(g.name)
            if not blocks:
                continue
            start = freed.get(g.name, 0)
            end = min(len(blocks), max(0, first_pos - g.window_tokens + 1) // g.tokens_per_block)
            if end > start:
                # Head-first: a window's earliest blocks serve only the shortest hits, so they go first.
                self.pools[g.name].release([b for b in blocks[start:end] if b != FREED], tail_first=False)
                blocks[start:end] = [FREED] * (end - start)
                freed[g.name] = end

    # -- allocation
    def allocate(self, request: Request, num_tokens: int) -> bool:
        """Grow the request's blocks so it can hold ``num_tokens`` tokens; all groups or none."""
        state = request.kv
        if num_tokens <= state.capacity:  # most steps need no new block
            return True
        need = {}
        for g in self.groups:
            have = len(state.block_ids.get(g.name, []))
            need[g.name] = max(0, self.blocks_needed(g, num_tokens) - have)
            if need[g.name] > self.pools[g.name].num_free:
                return False
        for g in self.groups:
            if need[g.name]:
                state.block_ids.setdefault(g.name, []).extend(self.pools[g.name].allocate(need[g.name]))
        self._tables_grew(state)
        return True

    def _tables_grew(self, state: KVState) -> None:
        """Recompute what the tables cover (a table's FREED entries keep their positions)."""
        lengths = [len(state.block_ids.get(g.name, [])) for g in self.groups]
        state.capacity = min(n * g.tokens_per_block - g.slot_shift for n, g in zip(lengths, self.groups))
        state.num_entries = sum(lengths)

    def free(self, request: Request) -> None:
        """Give back every block of the request and forget its keys (a fresh :class:`KVState`)."""
        for g in self.groups:
            self.pools[g.name].release([b for b in request.kv.block_ids.get(g.name, []) if b != FREED])
        request.kv = KVState()

    # -- invariants
    def check_invariants(self, live: Sequence[Request], held: Sequence[Mapping[str, Sequence[int]]] = ()) -> None:
        """free + in use == total; ref counts equal owners; no freed block owned. ``held``: blocks
        owned outside any request (per group; the offload tiers' stores in flight)."""
        for g in self.groups:
            pool = self.pools[g.name]
            owners = [0] * pool.num_blocks
            tables = [r.kv.block_ids.get(g.name, []) for r in live] + [h.get(g.name, []) for h in held]
            for table in tables:
                for b in table:
                    if b != FREED:
                        owners[b] += 1
            assert owners == pool.ref_cnt, f"group {g.name}: ref counts {pool.ref_cnt} != owners {owners}"
            in_use = sum(1 for c in pool.ref_cnt if c > 0)
            assert in_use + pool.num_free == pool.num_blocks, f"group {g.name}: free + in use != total"
            assert all(pool.ref_cnt[b] == 0 for b in pool.free), f"group {g.name}: a free block is owned"
            for h, b in pool.cached.items():
                assert pool.block_hash[b] == h, f"group {g.name}: cache map out of sync at block {b}"
