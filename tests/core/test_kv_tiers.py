"""The KV offload tiers' bookkeeping (kv_tiers.py) over the real tier connector (kv_connectors/tiers.py)
on small CPU caches: the bytes a load brings back are the bytes a store took, the device blocks a
store reads stay owned until it has read them, the tiers stay within their bounds, and a missing,
torn, corrupt or foreign disk file is a shorter hit, never other bytes."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch

from pypto_serving.config import ServingSettings
from pypto_serving.executor import CacheGroupSpec
from pypto_serving.kv_cache import KVCacheManager
from pypto_serving.kv_connectors.tiers import DiskFile, TierConnector, TierSpec, read_header, write_block_file
from pypto_serving.kv_ledger import _dispatch
from pypto_serving.kv_tiers import TierLedger
from pypto_serving.request import Request, RequestStatus, SamplingParams

TPB = 4  # tokens per block
NUM_BLOCKS = 8
BLOCK_BYTES = 2 * TPB * 2 * 4  # two float32 tensors of (TPB, 2) per block


@pytest.fixture(autouse=True)
def _close_connectors(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Every connector a test starts is closed, passing or failing (its thread must not outlive it)."""
    started: list[TierConnector] = []
    start = TierConnector.start

    def tracked(self: TierConnector, caches: Any) -> dict[str, Any]:
        started.append(self)
        return start(self, caches)

    monkeypatch.setattr(TierConnector, "start", tracked)
    yield
    for conn in started:
        conn.close()


class Tiers:
    """A KV manager, its caches, a tier connector on them and the ledger driving it (no worker)."""

    def __init__(self, host: int, disk: int, path: Path | None, identity: str = "model-a") -> None:
        self.kv = KVCacheManager([CacheGroupSpec("kv", TPB, BLOCK_BYTES)], {"kv": NUM_BLOCKS})
        self.caches = {"kv": [torch.zeros(NUM_BLOCKS, TPB, 2), torch.zeros(NUM_BLOCKS, TPB, 2)]}
        spec = TierSpec(host > 0, None if path is None else str(path), identity)
        self.conn = TierConnector(spec)
        self.address = self.conn.start(self.caches)
        self.ledger = TierLedger(
            self.kv, lambda m: _dispatch(self.conn, m), self.address, host_bytes=host, disk_bytes=disk
        )
        self.ended: list[tuple[Request | None, bool]] = []

    def settle(self) -> None:
        """Send the pending stores and apply events until no store or load is in flight."""
        self.ledger.flush()
        deadline = time.monotonic() + 10
        while self.ledger.storing or self.ledger.loads:
            for event in self.conn.poll():
                self.ended.append(self.ledger.on_event(event))
            assert time.monotonic() < deadline, "the tier connector did not answer"
            time.sleep(0.001)
        self.conn.wait_idle()  # the moves (spills, drops) that follow are done too

    def compute(self, rid: str, tokens: list[int]) -> Request:
        """A request that computed ``tokens``: its blocks hold values derived from its tokens, published."""
        req = Request(rid, tokens, SamplingParams(max_tokens=1))
        assert self.kv.allocate(req, len(tokens))
        for i, block in enumerate(req.kv.block_ids["kv"]):
            for j, t in enumerate(self.caches["kv"]):
                t[block] = float(j * 1000 + sum(tokens[: (i + 1) * TPB]))
        self.kv.publish(req, len(tokens))
        return req

    def evict_device(self) -> None:
        """Hand every device block out (dropping the device cache) and scribble over them."""
        filler = Request("filler", [0] * (NUM_BLOCKS * TPB), SamplingParams(max_tokens=1))
        assert self.kv.allocate(filler, NUM_BLOCKS * TPB)
        for t in self.caches["kv"]:
            t.fill_(-1.0)
        self.kv.free(filler)
        assert not self.kv.pools["kv"].cached

    def block_values(self, req: Request) -> list[float]:
        return [float(self.caches["kv"][0][b, 0, 0]) for b in req.kv.block_ids["kv"]]

    def check(self, live: list[Request]) -> None:
        self.kv.check_invariants(live + self.ledger.owners(), self.ledger.held())
        for tier in self.ledger.tiers.values():
            assert tier.used == sum(n for _, n in tier.entries.values()) <= tier.capacity

    def close(self) -> None:
        self.conn.close()


PROMPT = list(range(1, 18))  # 17 tokens: 4 full blocks, a hit covers at most 16


def _expected(tokens: list[int], blocks: int) -> list[float]:
    return [float(sum(tokens[: (i + 1) * TPB])) for i in range(blocks)]


def _load(t: Tiers, rid: str, tokens: list[int]) -> tuple[Request, int]:
    req = Request(rid, tokens, SamplingParams(max_tokens=1))
    assert t.ledger.start(req)
    t.settle()
    assert t.ended[-1] == (req, True) and not req.kv.num_entries  # to the scheduler, holding nothing
    return req, t.kv.find_cached_prefix(req)  # the scheduler's lookup: the loaded blocks are cached


def test_a_store_holds_its_device_blocks_until_read_and_a_load_brings_the_bytes_back() -> None:
    t = Tiers(host=10 * BLOCK_BYTES, disk=0, path=None)
    req = t.compute("a", PROMPT)
    blocks = req.kv.block_ids["kv"][:4]
    t.kv.free(req)
    # The 4 published blocks are held for their store: none is free to be handed out again.
    assert t.kv.pools["kv"].num_free == NUM_BLOCKS - 4 and t.ledger.held() == [{"kv": blocks}]
    t.check([])
    t.ledger.flush()
    assert t.ledger.held() == [{"kv": blocks}, {}]
    t.check([])
    t.settle()
    assert t.kv.pools["kv"].num_free == NUM_BLOCKS and t.ledger.stats["kv_offload_bytes_down"] == 4 * BLOCK_BYTES
    t.evict_device()
    again, hit = _load(t, "b", PROMPT)
    assert hit == 16 and t.block_values(again) == _expected(PROMPT, 4)
    assert t.ledger.stats["kv_offload_hits_per_tier"] == {"host": 16}
    assert t.ledger.stats["kv_offload_bytes_up"] == 4 * BLOCK_BYTES
    assert len(t.kv.pools["kv"].cached) == 4  # the loaded blocks joined the device cache
    t.check([again])
    t.kv.free(again)
    # Storing the same prompt again moves nothing: the tier has every key.
    t.kv.free(t.compute("c", PROMPT))
    t.settle()
    assert t.ledger.stats["kv_offload_bytes_down"] == 4 * BLOCK_BYTES
    t.check([])
    t.close()


def test_a_load_continues_a_device_hit_and_the_host_spills_to_disk(tmp_path: Path) -> None:
    t = Tiers(host=2 * BLOCK_BYTES, disk=3 * BLOCK_BYTES, path=tmp_path)
    t.kv.free(t.compute("a", PROMPT))
    t.settle()
    host, disk = t.ledger.tiers["host"], t.ledger.tiers["disk"]
    # Write-through to the host tier, whose oldest blocks spill: blocks 0, 1 on disk, 2, 3 in memory.
    keys = t.kv.prefix_keys(Request("k", PROMPT, SamplingParams()), t.kv.groups[0], 16)
    assert list(host.entries) == keys[2:] and list(disk.entries) == keys[:2]
    assert sorted(p.stem for p in tmp_path.iterdir()) == sorted(k.hex() for k in keys[:2])
    t.evict_device()
    again, hit = _load(t, "b", PROMPT)
    assert hit == 16 and t.block_values(again) == _expected(PROMPT, 4)
    assert t.ledger.stats["kv_offload_hits_per_tier"] == {"host": 8, "disk": 8}
    t.kv.free(again)
    # A longer prompt: its first 4 blocks are on the device now, the 5th nowhere: no load.
    longer = [*PROMPT[:16], 99, 98, 97, 96, 95]
    assert not t.ledger.start(Request("c", longer, SamplingParams(max_tokens=1)))
    # Another prompt's 4 blocks push the disk tier past its bound: its oldest files go.
    t.kv.free(t.compute("d", [7] * 17))
    t.settle()
    assert disk.used <= disk.capacity and host.used <= host.capacity
    assert sorted(p.stem for p in tmp_path.iterdir()) == sorted(k.hex() for k in disk.entries)
    t.check([])
    t.close()


def _corrupt(path: Path, kind: str) -> None:
    data = path.read_bytes()
    if kind == "truncated":
        path.write_bytes(data[: len(data) - 5])
    elif kind == "flipped":
        path.write_bytes(data[:-3] + bytes([data[-3] ^ 0x10]) + data[-2:])
    else:  # the same block's bytes, written by another model
        header = read_header(path)
        assert header is not None
        payload = data[data.index(b"\n", 20) + 1 :]
        foreign = DiskFile(header.key, header.group, "0" * 32, header.nbytes, header.sha256)
        write_block_file(path, foreign, payload)


@pytest.mark.parametrize("kind", ["truncated", "flipped", "other_model"])
def test_a_bad_disk_file_cuts_the_hit_there_and_is_counted(tmp_path: Path, kind: str) -> None:
    t = Tiers(host=0, disk=10 * BLOCK_BYTES, path=tmp_path)
    t.kv.free(t.compute("a", PROMPT))
    t.settle()
    keys = t.kv.prefix_keys(Request("k", PROMPT, SamplingParams()), t.kv.groups[0], 16)
    _corrupt(tmp_path / f"{keys[2].hex()}.kvb", kind)
    t.evict_device()
    again, hit = _load(t, "b", PROMPT)
    # Blocks 0 and 1 arrived; block 2 failed its check, so block 3 (intact) is not used either.
    assert hit == 8 and t.block_values(again) == _expected(PROMPT, 2)
    assert t.ledger.stats["kv_offload_load_failed"] == 1
    assert keys[2] not in t.ledger.tiers["disk"].entries and not (tmp_path / f"{keys[2].hex()}.kvb").exists()
    t.check([again])
    t.kv.free(again)
    t.check([])
    t.close()


def test_a_restart_finds_the_disk_tier_of_the_same_model_only(tmp_path: Path) -> None:
    first = Tiers(host=0, disk=10 * BLOCK_BYTES, path=tmp_path)
    first.kv.free(first.compute("a", PROMPT))
    first.settle()
    first.close()
    (tmp_path / ".half-written.kvb.1.2.tmp").write_bytes(b"torn")  # a write a crash cut short
    (tmp_path / "notes.txt").write_text("not a block")
    other = Tiers(host=0, disk=10 * BLOCK_BYTES, path=tmp_path, identity="model-b")
    assert other.address["disk"] == [] and other.address["disk_ignored"] == 5  # 4 blocks + notes.txt
    assert not other.ledger.start(Request("b", PROMPT, SamplingParams(max_tokens=1)))
    other.close()
    again = Tiers(host=0, disk=10 * BLOCK_BYTES, path=tmp_path)
    assert len(again.address["disk"]) == 4 and not (tmp_path / ".half-written.kvb.1.2.tmp").exists()
    req, hit = _load(again, "c", PROMPT)
    assert hit == 16 and again.block_values(req) == _expected(PROMPT, 4)
    assert again.ledger.stats["kv_offload_hits_per_tier"] == {"disk": 16}
    again.close()


def test_an_abort_during_a_load_frees_its_blocks_when_the_load_ends() -> None:
    t = Tiers(host=10 * BLOCK_BYTES, disk=0, path=None)
    t.kv.free(t.compute("a", PROMPT))
    t.settle()
    t.evict_device()
    req = Request("b", PROMPT, SamplingParams(max_tokens=1))
    assert t.ledger.start(req)
    t.ledger.abort("b")
    t.check([])  # the load still owns its blocks
    t.settle()
    assert t.ended[-1] == (req, False) and req.status is RequestStatus.FINISHED_ABORTED
    assert t.kv.pools["kv"].num_free == NUM_BLOCKS
    t.check([])
    t.close()


@pytest.mark.parametrize(
    ("settings", "error"),
    [
        ({"kv_offload_disk_path": "/tmp/x"}, "kv_offload_disk_path needs kv_offload_disk_bytes"),
        ({"kv_offload_disk_bytes": 10}, "kv_offload_disk_bytes needs kv_offload_disk_path"),
        ({"kv_offload_host_bytes": 10, "enable_prefix_caching": False}, "need enable_prefix_caching"),
    ],
)
def test_tier_settings_are_checked_together(settings: dict[str, Any], error: str) -> None:
    with pytest.raises(ValueError, match=error):
        ServingSettings(**settings)


@pytest.mark.parametrize(
    ("settings", "error"),
    [
        ({}, "cannot move its KV cache"),  # the fake executor exposes no cache tensors
        ({"kv_role": "decode"}, "with a kv_role are not supported yet"),
    ],
)
def test_engines_the_tiers_cannot_serve_refuse_to_start(
    make_llm: Any, settings: dict[str, Any], error: str, tmp_path: Path
) -> None:
    with pytest.raises((ValueError, TypeError), match=error):
        make_llm(kv_offload_disk_path=str(tmp_path), kv_offload_disk_bytes=1 << 20, **settings)


def test_an_executor_whose_groups_refuse_prefix_caching_refuses_the_tiers() -> None:
    from pypto_serving.config import SettingsError
    from pypto_serving.engine import check_kv_offload
    from pypto_serving.executor import ExecutorInfo

    groups = [CacheGroupSpec("kv", 4, 64), CacheGroupSpec("state", 1, 64, prefix_caching=False)]
    info = ExecutorInfo(cache_groups=groups, vocab_size=8, max_model_len=64)
    check_kv_offload(ServingSettings(), info, "toy")  # no tiers: nothing to refuse
    with pytest.raises(SettingsError, match="cache groups state do not allow"):
        check_kv_offload(ServingSettings(kv_offload_host_bytes=1 << 20), info, "toy")


def test_lora_blocks_stay_on_the_device(tmp_path: Path) -> None:
    """An adapter's chain keys name its load in this process; a restart could give another adapter
    the same key, so no tier (the disk survives restarts) holds or serves a LoRA request's blocks."""
    t = Tiers(host=10 * BLOCK_BYTES, disk=10 * BLOCK_BYTES, path=tmp_path)
    req = Request("l", PROMPT, SamplingParams(max_tokens=1, lora="adapter#1"))
    assert t.kv.allocate(req, len(PROMPT))
    t.kv.publish(req, len(PROMPT))
    assert len(t.kv.pools["kv"].cached) == 4 and t.ledger.held() == [{}]
    t.kv.free(req)
    t.kv.free(t.compute("a", PROMPT))  # the same tokens without the adapter: stored
    t.settle()
    assert len(t.ledger.tiers["host"].entries) == 4
    t.evict_device()
    assert not t.ledger.start(Request("m", PROMPT, SamplingParams(max_tokens=1, lora="adapter#1")))
    t.check([])
