"""BlockPool and KVCacheManager: allocation, ref counts, LRU reuse, prefix caching, cache groups."""

from __future__ import annotations

import hashlib
import os
import struct
import subprocess
import sys
from collections.abc import Callable
from typing import Any, get_args

import pytest

from pypto_serving.executor import CacheGroupSpec
from pypto_serving.kv_cache import BlockPool, KVCacheManager, NoFreeBlocksError
from pypto_serving.request import Request, SamplingParams

MakeReq = Callable[..., Request]


@pytest.fixture
def make_req() -> MakeReq:
    counter = iter(range(10**6))

    def make(tokens: list[int], rid: str | None = None) -> Request:
        return Request(rid or f"r{next(counter)}", list(tokens), SamplingParams(max_tokens=4))

    return make


@pytest.fixture
def kv() -> KVCacheManager:
    """One plain KV group, 4 tokens per block, 8 blocks."""
    return KVCacheManager([CacheGroupSpec("kv", 4, 64)], {"kv": 8})


# ----------------------------------------------------------------------------- BlockPool


def test_pool_allocate_and_release_counts() -> None:
    pool = BlockPool(4)
    a = pool.allocate(3)
    assert sorted(a) == [0, 1, 2] and pool.num_free == 1
    assert all(pool.ref_cnt[b] == 1 for b in a)
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(2)
    assert pool.num_free == 1  # a failed allocation takes nothing
    pool.release(a)
    assert pool.num_free == 4 and pool.ref_cnt == [0, 0, 0, 0]


def test_pool_shared_block_is_freed_at_last_release() -> None:
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.publish(b, 123)
    pool.take_cached(b)
    assert pool.ref_cnt[b] == 2
    pool.release([b])
    assert pool.ref_cnt[b] == 1 and b not in pool.free
    pool.release([b])
    assert pool.ref_cnt[b] == 0 and b in pool.free
    with pytest.raises(AssertionError, match="released twice"):
        pool.release([b])


def test_pool_lru_order_and_eviction_of_hashes() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(4)
    for i, b in enumerate(blocks):
        pool.publish(b, 100 + i)
    # release() walks each list tail-first; the free queue is least recently freed first.
    pool.release([blocks[0], blocks[1]])
    pool.release([blocks[3]])
    pool.release([blocks[2]])
    assert list(pool.free) == [blocks[1], blocks[0], blocks[3], blocks[2]]
    (first,) = pool.allocate(1)
    assert first == blocks[1]
    assert 101 not in pool.cached and pool.block_hash[first] is None  # its content is evicted
    assert pool.cached == {100: blocks[0], 102: blocks[2], 103: blocks[3]}


def test_pool_revives_cached_free_block() -> None:
    pool = BlockPool(3)
    (b,) = pool.allocate(1)
    pool.publish(b, 7)
    pool.release([b])
    assert pool.num_free == 3
    pool.take_cached(b)
    assert pool.num_free == 2 and pool.ref_cnt[b] == 1 and b not in pool.free
    assert pool.cached[7] == b


def test_pool_publish_keeps_the_first_copy() -> None:
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    pool.publish(a, 5)
    pool.publish(b, 5)  # identical content elsewhere: not cached twice
    assert pool.cached == {5: a} and pool.block_hash[b] is None
    pool.publish(a, 6)  # already published: unchanged
    assert pool.cached == {5: a}


# ----------------------------------------------------------------------------- KVCacheManager


def test_allocate_grows_and_free_returns_everything(kv: KVCacheManager, make_req: MakeReq) -> None:
    r = make_req(list(range(10)))
    assert kv.allocate(r, 10)
    assert len(r.kv.block_ids["kv"]) == 3
    assert kv.allocate(r, 12)
    assert len(r.kv.block_ids["kv"]) == 3  # still fits
    assert kv.allocate(r, 13)
    assert len(r.kv.block_ids["kv"]) == 4
    kv.check_invariants([r])
    other = make_req(list(range(20)))
    assert not kv.allocate(other, 20)  # 5 blocks needed, 4 free: nothing taken
    assert "kv" not in other.kv.block_ids
    kv.check_invariants([r, other])
    kv.free(r)
    assert r.kv.block_ids == {} and kv.pools["kv"].num_free == 8
    kv.check_invariants([])
    assert kv.usage == 0.0


def test_can_ever_fit(kv: KVCacheManager) -> None:
    assert kv.can_ever_fit(32)
    assert not kv.can_ever_fit(33)


def test_prefix_hit_via_chained_hashes(kv: KVCacheManager, make_req: MakeReq) -> None:
    prompt = list(range(1, 14))  # 13 tokens: 3 full blocks
    a = make_req(prompt)
    assert kv.find_cached_prefix(a) == 0
    assert kv.allocate(a, 13)
    kv.publish(a, 13)
    b = make_req(prompt)
    assert kv.find_cached_prefix(b) == 12
    assert b.kv.block_ids["kv"] == a.kv.block_ids["kv"][:3]
    assert kv.prefix_hits == 12
    kv.check_invariants([a, b])
    assert all(kv.pools["kv"].ref_cnt[x] == 2 for x in b.kv.block_ids["kv"])
    # Same second block but a different first block: the chain breaks at block 0.
    c = make_req([99, *prompt[1:]])
    assert kv.find_cached_prefix(c) == 0
    # Same first block, different second block: only the first block hits.
    d = make_req([*prompt[:4], 50, *prompt[5:]])
    assert kv.find_cached_prefix(d) == 4
    kv.check_invariants([a, b, c, d])
    for r in (a, b, c, d):
        kv.free(r)
    kv.check_invariants([])
    assert kv.pools["kv"].num_free == 8


@pytest.mark.parametrize("length", [4, 8, 12])
def test_hit_never_covers_the_last_prompt_token(kv: KVCacheManager, make_req: MakeReq, length: int) -> None:
    prompt = list(range(length))
    a = make_req(prompt)
    kv.allocate(a, length)
    kv.publish(a, length)
    b = make_req(prompt)
    hit = kv.find_cached_prefix(b)
    assert hit == length - 4  # block-aligned and strictly below the prompt length
    assert hit < b.num_prompt_tokens
    kv.free(a)
    kv.free(b)
    kv.check_invariants([])


def test_hit_after_owner_finished_revives_freed_blocks(kv: KVCacheManager, make_req: MakeReq) -> None:
    prompt = list(range(9))
    a = make_req(prompt)
    kv.allocate(a, 9)
    kv.publish(a, 9)
    blocks = list(a.kv.block_ids["kv"])
    kv.free(a)
    assert kv.pools["kv"].num_free == 8
    b = make_req(prompt)
    assert kv.find_cached_prefix(b) == 8
    assert b.kv.block_ids["kv"] == blocks[:2]
    assert kv.pools["kv"].num_free == 6
    kv.check_invariants([b])
    kv.free(b)


def test_eviction_drops_prefix_entries(make_req: MakeReq) -> None:
    kv = KVCacheManager([CacheGroupSpec("kv", 4, 64)], {"kv": 3})
    a = make_req(list(range(9)))
    kv.allocate(a, 9)
    kv.publish(a, 9)
    kv.free(a)
    # Taking every block evicts every cached prefix block.
    filler = make_req([70] * 12)
    assert kv.allocate(filler, 12)
    assert kv.pools["kv"].cached == {}
    kv.free(filler)
    b = make_req(list(range(9)))
    assert kv.find_cached_prefix(b) == 0
    kv.check_invariants([])


def test_partial_eviction_keeps_the_shared_prefix_longest(make_req: MakeReq) -> None:
    kv = KVCacheManager([CacheGroupSpec("kv", 4, 64)], {"kv": 4})
    a = make_req(list(range(13)))
    kv.allocate(a, 13)
    kv.publish(a, 13)
    kv.free(a)  # 4 blocks free, released tail-first: block 3, 2, 1, 0
    x = make_req([80, 81, 82])
    assert kv.allocate(x, 3)  # evicts a's last block (unpublished) first
    y = make_req([90, 91, 92])
    assert kv.allocate(y, 3)  # then a's third block
    b = make_req(list(range(13)))
    assert kv.find_cached_prefix(b) == 8  # the first two blocks survived
    kv.check_invariants([x, y, b])
    for r in (x, y, b):
        kv.free(r)
    kv.check_invariants([])


def test_publish_only_covers_confirmed_full_blocks(kv: KVCacheManager, make_req: MakeReq) -> None:
    a = make_req(list(range(10)))
    kv.allocate(a, 10)
    kv.publish(a, 6)  # only one full block confirmed
    assert len(kv.pools["kv"].cached) == 1
    kv.publish(a, 10)
    assert len(kv.pools["kv"].cached) == 2
    kv.free(a)


def test_publish_returns_the_count_below_which_calls_do_nothing(kv: KVCacheManager, make_req: MakeReq) -> None:
    """publish() returns the confirmed count from which a call can add a block: every call below it
    leaves the cache as it is (so the scheduler skips them), and the call at it adds one (here every
    block of 4 is new), also after a call whose count ran past the request's tokens (drafts)."""
    a = make_req(list(range(14)))
    kv.allocate(a, 16)
    cached = kv.pools["kv"].cached
    assert kv.publish(a, 0) == 4
    for confirmed in range(1, 15):
        before = dict(cached)
        threshold = kv.publish(a, confirmed)
        if confirmed % 4 == 0:
            assert len(cached) == len(before) + 1  # the call at the previous threshold added a block
        else:
            assert cached == before
        assert threshold == (confirmed // 4 + 1) * 4
    kv.free(a)
    b = make_req(list(range(100, 106)))  # 6 tokens; a step with drafts confirms up to 9
    kv.allocate(b, 9)
    held = len(cached)  # a's blocks stay cached after it is freed
    assert kv.publish(b, 9) == 8  # clamped to the 6 tokens that exist: one block, and 8 may add one
    assert len(cached) == held + 1
    b.output_token_ids += [106, 107]
    assert kv.publish(b, 9) == 12 and len(cached) == held + 2
    off = KVCacheManager([CacheGroupSpec("kv", 4, 64)], {"kv": 8}, enable_prefix_caching=False)
    c = make_req(list(range(9)))
    off.allocate(c, 9)
    assert off.publish(c, 9) == sys.maxsize  # nothing is ever published: no call needs making


def test_prefix_caching_can_be_disabled(make_req: MakeReq) -> None:
    kv = KVCacheManager([CacheGroupSpec("kv", 4, 64)], {"kv": 8}, enable_prefix_caching=False)
    a = make_req(list(range(9)))
    kv.allocate(a, 9)
    kv.publish(a, 9)
    assert kv.pools["kv"].cached == {}
    assert kv.find_cached_prefix(make_req(list(range(9)))) == 0
    kv.free(a)
    kv.check_invariants([])


# ----------------------------------------------------------------------------- several groups


@pytest.fixture
def multi() -> KVCacheManager:
    """Plain KV (4 tokens/block) + compressed KV (2 entries/block, 4 tokens/entry = 8 tokens/block)."""
    return KVCacheManager(
        [CacheGroupSpec("kv", 4, 64), CacheGroupSpec("ckv", 2, 32, tokens_per_entry=4)],
        {"kv": 10, "ckv": 4},
    )


def test_multi_group_blocks_needed(multi: KVCacheManager, make_req: MakeReq) -> None:
    kv_g, c_g = multi.groups
    assert multi.blocks_needed(kv_g, 9) == 3
    assert multi.blocks_needed(c_g, 9) == 2  # ceil(9/4)=3 entries -> 2 blocks
    assert multi.blocks_needed(c_g, 8) == 1
    r = make_req(list(range(17)))
    assert multi.allocate(r, 17)
    assert len(r.kv.block_ids["kv"]) == 5 and len(r.kv.block_ids["ckv"]) == 3
    multi.check_invariants([r])
    multi.free(r)
    multi.check_invariants([])


def test_multi_group_allocation_is_all_or_nothing(multi: KVCacheManager, make_req: MakeReq) -> None:
    r = make_req(list(range(30)))
    # kv needs 8 of 10 (fits), ckv needs 4 of 4 (fits)
    assert multi.allocate(r, 30)
    s = make_req(list(range(5)))
    # kv has 2 free (needs 2, fits) but ckv has 0 free: nothing is taken from kv either
    assert not multi.allocate(s, 5)
    assert s.kv.block_ids == {}
    assert multi.pools["kv"].num_free == 2
    multi.check_invariants([r, s])
    multi.free(r)


def test_multi_group_prefix_hit_aligned_to_lcm(multi: KVCacheManager, make_req: MakeReq) -> None:
    prompt = list(range(21))  # hash unit lcm(4, 8) = 8
    a = make_req(prompt)
    multi.allocate(a, 21)
    multi.publish(a, 21)
    b = make_req(prompt)
    hit = multi.find_cached_prefix(b)
    assert hit == 16
    assert b.kv.block_ids["kv"] == a.kv.block_ids["kv"][:4]
    assert b.kv.block_ids["ckv"] == a.kv.block_ids["ckv"][:2]
    multi.check_invariants([a, b])
    multi.free(a)
    multi.free(b)
    multi.check_invariants([])


def test_group_without_prefix_caching_disables_it(make_req: MakeReq) -> None:
    kv = KVCacheManager(
        [CacheGroupSpec("kv", 4, 64), CacheGroupSpec("state", 1, 8, prefix_caching=False)],
        {"kv": 8, "state": 4},
    )
    assert not kv.prefix_caching
    a = make_req(list(range(9)))
    kv.allocate(a, 9)
    kv.publish(a, 9)
    assert all(p.cached == {} for p in kv.pools.values())
    assert kv.find_cached_prefix(make_req(list(range(9)))) == 0
    kv.free(a)
    kv.check_invariants([])


def test_check_invariants_detects_corruption(kv: KVCacheManager, make_req: MakeReq) -> None:
    r = make_req(list(range(5)))
    kv.allocate(r, 5)
    kv.check_invariants([r])
    with pytest.raises(AssertionError, match="ref counts"):
        kv.check_invariants([])  # the owner is missing
    kv.pools["kv"].ref_cnt[r.kv.block_ids["kv"][0]] += 1
    with pytest.raises(AssertionError):
        kv.check_invariants([r])
    kv.pools["kv"].ref_cnt[r.kv.block_ids["kv"][0]] -= 1
    kv.free(r)
    kv.check_invariants([])


def test_publish_after_a_missed_lookup_only_covers_confirmed_blocks(kv: KVCacheManager, make_req: MakeReq) -> None:
    """The lookup hashes every full prompt block; publishing must still stop at the confirmed ones
    (else a later request would hit a block whose KV was never written)."""
    prompt = list(range(13))
    a = make_req(prompt)
    assert kv.find_cached_prefix(a) == 0  # hashes 3 blocks of the prompt
    kv.allocate(a, 13)
    kv.publish(a, 5)  # one full block computed so far
    assert len(kv.pools["kv"].cached) == 1
    b = make_req(prompt)
    assert kv.find_cached_prefix(b) == 4
    kv.free(a)
    kv.free(b)
    kv.check_invariants([])


def test_plan_kv_blocks_gives_every_group_the_same_token_capacity() -> None:
    from pypto_serving.engine import plan_kv_blocks

    groups = [
        CacheGroupSpec("kv", block_size=4, bytes_per_block=400),  # 100 bytes per token
        CacheGroupSpec("compressed", block_size=4, bytes_per_block=200, tokens_per_entry=4),  # 12.5 per token
    ]
    plan = plan_kv_blocks(groups, None, memory=112_500)  # 1000 tokens at 112.5 bytes per token
    assert plan == {"kv": 250, "compressed": 62}
    assert sum(plan[g.name] * g.bytes_per_block for g in groups) <= 112_500
    assert plan_kv_blocks(groups, 7, memory=1) == {"kv": 7, "compressed": 7}


# ----------------------------------------------------------------------------- block keys

_KEYS_SCRIPT = """
from pypto_serving import CacheGroupSpec
from pypto_serving.kv_cache import KVCacheManager
from pypto_serving.request import Request, SamplingParams
kv = KVCacheManager([CacheGroupSpec("kv", 4, 64)], {"kv": 8})
req = Request("r", list(range(100, 113)), SamplingParams())
print([k.hex() if isinstance(k, bytes) else k for k in kv._chain_hashes(req, kv.groups[0], 12)])
"""


def _keys(kv: KVCacheManager, tokens: list[int], rid: str = "k") -> list[Any]:
    return kv._chain_hashes(Request(rid, tokens, SamplingParams()), kv.groups[0], len(tokens))


@pytest.mark.parametrize("name", ["sha256", "blake2b"])
def test_block_keys_are_a_digest_of_the_parent_key_and_the_tokens(name: str) -> None:
    """Written from the definition, not from the code: key(block i) = H(key(block i-1) + its token ids
    as little-endian int64), with H(group name) before the first block."""
    digest = {"sha256": hashlib.sha256, "blake2b": hashlib.blake2b}[name]
    kv = KVCacheManager([CacheGroupSpec("kv", 4, 64)], {"kv": 8}, prefix_cache_hash=name)
    tokens = [7, 2**40, 0, 5, 9, 9, 9, 9, 1]
    parent = digest(b"kv").digest()
    expected = []
    for i in range(2):
        parent = digest(parent + struct.pack("<4q", *tokens[4 * i : 4 * i + 4])).digest()
        expected.append(parent)
    assert _keys(kv, tokens) == expected


def test_block_keys_depend_on_the_whole_chain_and_nothing_else(kv: KVCacheManager) -> None:
    base = list(range(1, 13))
    keys = _keys(kv, base, "a")
    assert _keys(kv, list(base), "b") == keys  # same prefix, same keys
    changed_last = _keys(kv, [*base[:11], 99], "c")
    assert changed_last[:2] == keys[:2] and changed_last[2] != keys[2]
    changed_first = _keys(kv, [99, *base[1:]], "d")
    assert all(x != y for x, y in zip(changed_first, keys))  # every later key has a new parent
    moved = _keys(kv, [*base[4:8], *base[4:8]], "e")
    assert moved[0] != keys[1] and moved[1] != keys[1]  # the same tokens under another parent
    other_group = KVCacheManager([CacheGroupSpec("other", 4, 64)], {"other": 8})
    assert set(_keys(other_group, base, "f")).isdisjoint(keys)
    assert len(set(keys)) == len(keys)


def test_block_keys_are_the_same_in_every_process(kv: KVCacheManager) -> None:
    """Keys hash no Python ``hash()`` (seeded per process for strings): another interpreter with
    another hash seed computes the same keys for the same prefix."""
    here = [k.hex() if isinstance(k, bytes) else k for k in _keys(kv, list(range(100, 113)), "r")[:3]]
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run(
            [sys.executable, "-c", _KEYS_SCRIPT], env=env, capture_output=True, text=True, check=True, timeout=120
        )
        assert out.stdout.strip() == str(here), out.stderr


def test_prefix_cache_hash_setting_selects_the_digest(make_llm: Callable[..., Any]) -> None:
    from pypto_serving import ServingSettings
    from pypto_serving.config import SettingsError
    from pypto_serving.kv_cache import BLOCK_HASHES

    assert get_args(ServingSettings.model_fields["prefix_cache_hash"].annotation) == tuple(BLOCK_HASHES)
    assert ServingSettings().prefix_cache_hash == "sha256"
    with pytest.raises(SettingsError, match="prefix_cache_hash"):
        ServingSettings.load(prefix_cache_hash="md5")
    with pytest.raises(ValueError, match="prefix_cache_hash"):
        KVCacheManager([CacheGroupSpec("kv", 4, 64)], {"kv": 8}, prefix_cache_hash="md5")
    llm = make_llm(block_size=4, num_kv_blocks=32, prefix_cache_hash="blake2b")
    assert llm.engine.kv.hash_name == "blake2b"
    params = SamplingParams(max_tokens=3, temperature=0)
    first = llm.generate(list(range(1, 10)), params, use_tqdm=False)[0]
    again = llm.generate(list(range(1, 10)), params, use_tqdm=False)[0]
    assert again.num_cached_tokens == 8 and again.outputs[0].token_ids == first.outputs[0].token_ids
    expected = hashlib.blake2b(hashlib.blake2b(b"kv").digest() + struct.pack("<4q", 1, 2, 3, 4)).digest()
    assert expected in llm.engine.kv.pools["kv"].cached
