"""Exact prefix hits on hybrid caches shaped like DeepSeek-V4's groups: a hit at ``p`` needs only the
cached blocks that the computation from ``p`` reads, in every group; the hit is the longest ``p``
every group serves. Expected hits and tables are worked out by hand from the group shapes below."""

from __future__ import annotations

import pytest

from pypto_serving.executor import CacheGroupSpec
from pypto_serving.kv_cache import FREED, KVCacheManager
from pypto_serving.request import Request, SamplingParams

# DeepSeek-V4's groups at block size 4, sliding window 8, CSA rate 2, HCA rate 4, one MTP depth:
#   swa        4 tokens a block, a hit at p reads positions p-7..p-1
#   csa_kv     8 tokens a block (4 entries of 2), every block before p
#   csa_index  the indexer keys, the same shape
#   csa_state  one compressor snapshot a CSA block (8 tokens), the one ending at p
#   hca_kv     16 tokens a block (4 entries of 4), every block before p
#   mtp0       4 entries a block, position i at entry i + 1 (its KV depends on token i + 1), window
#              12; a hit at p reads entries p-7..p-1 (positions p-8..p-2)
#   mtp_state  one MTP input snapshot a hit unit (16 tokens), the one ending at p
# The hit unit is lcm(4, 8, 16) = 16 tokens.
GROUPS = [
    CacheGroupSpec("swa", 4, 1, window_tokens=8),
    CacheGroupSpec("csa_kv", 4, 1, tokens_per_entry=2),
    CacheGroupSpec("csa_index", 4, 1, tokens_per_entry=2),
    CacheGroupSpec("csa_state", 1, 1, tokens_per_entry=8, hit_lookback_tokens=1),
    CacheGroupSpec("hca_kv", 4, 1, tokens_per_entry=4),
    CacheGroupSpec("mtp0", 4, 1, window_tokens=12, hit_lookback_tokens=7, slot_shift=1),
    CacheGroupSpec("mtp_state", 1, 1, tokens_per_entry=16, hit_lookback_tokens=1),
]
PROMPT = list(range(1, 54))  # 53 tokens: a hit covers at most 48 (the last token is computed)


def _served() -> tuple[KVCacheManager, dict[str, list[int]]]:
    """A manager where request ``a`` computed PROMPT, published it, slid its windows to the end and
    finished: every published block is cached in a free queue. Returns a's tables."""
    kv = KVCacheManager(GROUPS, {g.name: 16 for g in GROUPS})
    a = Request("a", PROMPT, SamplingParams())
    assert kv.allocate(a, 53)
    tables = {name: list(blocks) for name, blocks in a.kv.block_ids.items()}
    kv.publish(a, 53)
    kv.release_outside_window(a, 53)
    kv.free(a)
    kv.check_invariants([])
    return kv, tables


def _evict(kv: KVCacheManager, group: str, block: int) -> None:
    """What the pool does when it hands a cached free block out again: its content is gone."""
    pool = kv.pools[group]
    key = pool.block_hash[block]
    assert key is not None and pool.ref_cnt[block] == 0
    del pool.cached[key]
    pool.block_hash[block] = None


def test_what_is_published_per_group() -> None:
    kv, a = _served()
    cached = {g.name: sorted(kv.pools[g.name].cached.values()) for g in GROUPS}
    # Full blocks of 53 tokens: 13 swa, 6 of each CSA group, 6 snapshots, 3 HCA, 13 MTP (entries
    # 0..51: a block ending at entry e holds positions up to e - 1, a function of the tokens before
    # e), 3 MTP snapshots; a's table of 53 tokens has 14 MTP blocks (entry 53 is position 52's).
    assert cached == {
        "swa": sorted(a["swa"][:13]),
        "csa_kv": sorted(a["csa_kv"][:6]),
        "csa_index": sorted(a["csa_index"][:6]),
        "csa_state": sorted(a["csa_state"][:6]),
        "hca_kv": sorted(a["hca_kv"][:3]),
        "mtp0": sorted(a["mtp0"][:13]),
        "mtp_state": sorted(a["mtp_state"][:3]),
    }
    assert len(a["mtp0"]) == 14


def test_a_hit_takes_only_the_blocks_it_reads() -> None:
    kv, a = _served()
    b = Request("b", [*PROMPT[:50], 99, 98, 97], SamplingParams())
    assert kv.find_cached_prefix(b) == 48
    assert (
        b.kv.block_ids
        == {
            "swa": [FREED] * 10 + a["swa"][10:12],  # positions 41..47
            "csa_kv": a["csa_kv"][:6],
            "csa_index": a["csa_index"][:6],
            "csa_state": [FREED] * 5 + a["csa_state"][5:6],  # the snapshot at 48
            "hca_kv": a["hca_kv"][:3],
            "mtp0": [FREED] * 10 + a["mtp0"][10:12],  # entries 41..47
            "mtp_state": [FREED] * 2 + a["mtp_state"][2:3],  # the snapshot at 48
        }
    )
    assert kv.group_hits == dict.fromkeys(kv.group_hits, 48)
    kv.check_invariants([b])
    # b grows from its FREED entries on, and gives everything back.
    assert kv.allocate(b, 60)
    assert [len(t) for t in b.kv.block_ids.values()] == [15, 8, 8, 8, 4, 16, 4]
    assert b.kv.capacity == 60  # mtp0's 16 blocks cover entries 0..63, positions 0..62
    kv.check_invariants([b])
    kv.free(b)
    kv.check_invariants([])
    assert all(p.num_free == 16 for p in kv.pools.values())


# (group, a's entries evicted, the hit, why)
CASES = [
    ("swa", range(10), 48, "the early window blocks are not read from 48"),
    ("swa", [10], 32, "48 reads swa 10..11; 32 reads 6..7"),
    ("swa", [6, 10], 16, "32 reads swa 6..7; 16 reads 2..3"),
    ("csa_kv", [4], 32, "every compressed entry before the hit is read"),
    ("csa_index", [1], 0, "every indexer key before the hit is read"),
    ("csa_state", [5], 32, "the snapshot at 48 is gone; 32 needs only the one at 32 (entry 3)"),
    ("csa_state", [0, 1, 2, 3, 4], 48, "48 needs only the snapshot at 48"),
    ("hca_kv", [2], 32, "every HCA entry before the hit is read"),
    ("mtp0", [10], 32, "48 reads mtp0 entries 41..47; 32 reads 25..31 (blocks 6..7)"),
    ("mtp0", range(10), 48, "the early MTP window blocks are not read from 48"),
    ("mtp_state", [2], 32, "the MTP snapshot at 48 is gone; 32 needs only the one at 32"),
]


@pytest.mark.parametrize(("group", "evicted", "hit", "why"), CASES, ids=[f"{c[0]}-{list(c[1])}" for c in CASES])
def test_the_hit_is_the_longest_prefix_every_group_serves(group: str, evicted: list[int], hit: int, why: str) -> None:
    kv, a = _served()
    for entry in evicted:
        _evict(kv, group, a[group][entry])
    r = Request("r", PROMPT, SamplingParams())
    assert kv.find_cached_prefix(r) == hit, why
    # Per group, what it alone serves: the others are untouched (48), this one caps the hit.
    assert kv.group_hits == {**dict.fromkeys(kv.group_hits, 48), group: hit}
    if hit:
        lookback_start = {"swa": (hit - 7) // 4, "csa_state": (hit - 1) // 8, "mtp0": (hit - 7) // 4}
        lookback_start["mtp_state"] = (hit - 1) // 16
        for g in GROUPS:
            lo, end = lookback_start.get(g.name, 0), hit // g.tokens_per_block
            assert r.kv.block_ids[g.name] == [FREED] * lo + a[g.name][lo:end]
    kv.check_invariants([r])
    kv.free(r)
    kv.check_invariants([])


def test_a_window_blocks_released_outside_it_go_head_first() -> None:
    """The window's earliest blocks (needed only by the shortest hits) are the first evicted."""
    kv, a = _served()
    free = list(kv.pools["swa"].free)
    # a released entries 0..10 head-first while it ran, then 13, 12, 11 tail-first when it finished.
    assert free == [14, 15, *a["swa"][:11], a["swa"][13], a["swa"][12], a["swa"][11]]
