"""Exact prefix-cache hits on DeepSeek-V4's hybrid caches through the whole engine, with MTP.

A shared system prompt is computed once; an unrelated request then evicts the first ``swa`` (sliding
window) blocks of its chain. Requests sharing the system prompt still hit: a hit needs only the
window before it, every compressed entry and indexer key, the CSA compressor snapshot at the hit,
each MTP depth's window and the MTP input snapshot at the hit. Their outputs, greedy and seeded
sampling, equal a run with prefix caching off, under the sync and async strategies, and no block of
any group is leaked (one request is aborted mid-run, some are preempted). Requests whose prompt ends
just past the hit draft, and have drafts accepted, from their first decode step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from pypto_serving import LLM, SamplingParams
from pypto_serving.kv_cache import block_key, root_key

from .conftest import VARIANTS
from .helpers import build_checkpoint, make_predictable, plugin_manager

pytestmark = pytest.mark.requires_plugin("sync_sched")

# mixed_yarn at block size 4: swa (window 4) 4 tokens a block, CSA groups and the compressor
# snapshots 8, HCA 16; the hit unit is 16 tokens.
BLOCKS = 24  # per group
SYSTEM_LEN, TAIL_LEN, NEW = 40, 6, 12
HIT = 32  # (40 + 6 - 1) // 16 * 16: the longest hit that leaves the last prompt token to compute
SHORT, SHORT_SEED = 2, 40  # tokens past the hit of the prompts that decode right after it, their seed
SCHEDULERS = ["sync", "async"]


def _tokens(seed: int, n: int) -> list[int]:
    return torch.randint(3, 96, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


SYSTEM = _tokens(0, SYSTEM_LEN)
FILLER = _tokens(99, 40)  # with its output, it takes the 9 swa blocks a left unused, then a's first


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    p = build_checkpoint(Path(tmp_path_factory.mktemp("prefix_hits")), **VARIANTS["mixed_yarn"]).path
    make_predictable(p, layer_scale=0.05)  # drafts are often right: acceptance after a hit shows
    return p


def _params(i: int) -> SamplingParams:
    if i % 2:
        return SamplingParams(temperature=0.8, top_p=0.9, seed=100 + i, max_tokens=NEW, ignore_eos=True)
    return SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)


def _run(path: Path, scheduler: str, prefix_caching: bool) -> dict[str, Any]:
    llm = LLM(
        model=str(path),
        plugins=plugin_manager(),
        dtype="float32",
        device="cpu",
        worker_mode="inproc",
        scheduler=scheduler,
        block_size=4,
        max_num_batched_tokens=16,
        num_kv_blocks=BLOCKS,
        enable_prefix_caching=prefix_caching,
        speculative_config={"method": "mtp", "num_speculative_tokens": 2, "policy": "fixed"},
    )
    engine = llm.engine
    assert engine is not None
    out: dict[str, Any] = {"tokens": {}}

    first_decode: dict[str, tuple[int, int]] = {}  # request -> (drafted, accepted) at its first decode result

    def drain(abort_at: int = -1) -> None:
        steps = 0
        while engine.has_unfinished():
            for o in engine.step():
                if o.finished and o.request_id != "gone":
                    out["tokens"][o.request_id] = list(o.outputs[0].token_ids)
            for req in engine.scheduler.live_requests():
                if len(req.output_token_ids) > 1 and req.request_id not in first_decode:
                    first_decode[req.request_id] = (req.spec_drafted, req.spec_accepted)
            engine.kv.check_invariants(engine.scheduler.live_requests())
            steps += 1
            if steps == abort_at:
                engine.abort("gone")

    try:
        engine.add_request("a", [*SYSTEM, *_tokens(1, TAIL_LEN)], _params(0))
        drain()
        engine.add_request("filler", FILLER, SamplingParams(temperature=0.0, max_tokens=1))
        drain()
        first = block_key("sha256", root_key("sha256", "swa"), SYSTEM[:4])
        out["first_swa_block_cached"] = first in engine.kv.pools["swa"].cached
        before = engine.stats()["prefix_cache_hits"]
        for i in range(1, 5):
            engine.add_request(f"q{i}", [*SYSTEM, *_tokens(1 + i, TAIL_LEN)], _params(i))
        engine.add_request("gone", [*SYSTEM, *_tokens(9, TAIL_LEN)], _params(0))  # aborted mid-run
        drain(abort_at=3)
        for i in range(2):  # the hit's 32 tokens, then 2 more to compute: no MTP position past the hit
            engine.add_request(f"short{i}", [*SYSTEM[:HIT], *_tokens(SHORT_SEED + i, SHORT)], _params(i))
        drain()
        out["first_decode"] = {rid: v for rid, v in first_decode.items() if rid.startswith("short")}
        stats = engine.stats()
        out["hits"] = stats["prefix_cache_hits"] - before
        out["per_group"] = stats["prefix_cache_hits_per_group"]
        out["accepted"] = stats["spec_accepted"]
        out["preemptions"] = stats["num_preemptions"]
        engine.kv.check_invariants([])
        out["leaked"] = {
            name: p.num_blocks - p.num_free for name, p in engine.kv.pools.items() if p.num_free != p.num_blocks
        }
    finally:
        llm.shutdown()
    return out


@pytest.mark.parametrize("scheduler", SCHEDULERS)
def test_hits_past_evicted_window_blocks_equal_recomputation(path: Path, scheduler: str) -> None:
    if scheduler == "async":
        pytest.importorskip("pypto_serving_async_sched")
    cached, cold = _run(path, scheduler, True), _run(path, scheduler, False)
    assert cached["tokens"] == cold["tokens"]
    assert set(cached["tokens"]) == {"a", "filler", "q1", "q2", "q3", "q4", "short0", "short1"}
    # The shared prefix's first window block is gone, yet each of the four requests hits 32 tokens
    # (a hit needing the whole swa chain from block 0, as before, would have been 0); a request
    # preempted (the four do not fit together) hits again on its way back, its outputs included.
    assert not cached["first_swa_block_cached"]
    assert cached["hits"] >= 7 * HIT  # q1..q4, the aborted request and the two short ones
    assert cached["hits"] == 7 * HIT or cached["preemptions"] > 0
    # Per group, what it alone could serve, over every lookup of the run (a's and the filler's
    # included): never below the hits. The MTP windows (their entries shifted by d + 1) and the MTP
    # snapshot are cached like the others: a's prefix serves the hits, the filler's none.
    per_group = cached["per_group"]
    groups = {"swa", "csa_kv", "csa_index", "csa_state", "hca_kv", "mtp0", "mtp1", "mtp_state"}
    assert set(per_group) == groups
    assert all(v >= cached["hits"] for v in per_group.values())
    assert cached["leaked"] == {} and cold["leaked"] == {}
    # The short requests start at the hit with their MTP state from the cache: their first decode
    # step already verifies both depths' drafts (rebuilding the MTP KV instead drafts nothing for 3
    # positions per depth past the hit), as many accepted as computing the whole prompt gets.
    assert cached["first_decode"] == cold["first_decode"]
    assert cached["first_decode"]["short0"] == (2, 2) and cached["first_decode"]["short1"][0] == 2


def test_after_a_hit_drafts_are_the_full_recompute_ones_once_exact(checkpoints: Any) -> None:
    """The executor alone, a hit laid out by hand: request b starts at position 32 over request a's
    blocks (every group but MTP). Its greedy tokens equal b computed from scratch (the CSA rings come
    back from the snapshot at 32), and every draft it proposes is the full-recompute reference's:
    with window 4, depth d drafts only once the last committed position is 32 + 3 * (d + 1) or more."""
    from .helpers import FakeCore, greedy_generate, make_executor
    from .test_mtp import reference_drafts

    ckpt = checkpoints["mixed_yarn"]
    a_prompt, k = _tokens(7, 37), 2
    b_prompt = [*a_prompt[:32], 5, 6]
    cold = greedy_generate(FakeCore(*make_executor(ckpt.path, k=k)), {"b": b_prompt}, 14, k=k)

    core = FakeCore(*make_executor(ckpt.path, k=k))
    greedy_generate(core, {"a": a_prompt}, 3, k=k)  # a's blocks stay in the fake core's tables
    core.blocks["b"] = {name: [] for name in core.groups}
    for name, g in core.groups.items():
        core.blocks["b"][name] = core.blocks["a"][name][: 32 // g.tokens_per_block]
    drafted: list[tuple[int, int]] = []  # (last committed position, drafts)

    def check(batch: Any, histories: dict[str, list[int]], drafts: list[list[int]]) -> None:
        for rid, dr in zip(batch.request_ids, drafts):
            n = len(histories[rid]) - 1
            drafted.append((n, len(dr)))
            if dr:
                assert dr == reference_drafts(ckpt, histories[rid], k)[: len(dr)], (n, dr)
            assert len(dr) == k, (n, dr)

    hit = greedy_generate(core, {"b": b_prompt}, 14, k=k, start={"b": 32}, on_step=check)
    assert hit == cold
    assert drafted[0] == (34, k)  # both depths draft exactly right after the hit
