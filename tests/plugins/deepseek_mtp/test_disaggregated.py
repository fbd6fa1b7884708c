"""Disaggregated prefill and decode on the embedded tiny DeepSeek-V4 with MTP (k=2).

A decode engine starts a pulled request as a prefix-cache hit (docs/deepseek_mtp.md): the prefill
engine offers the longest hit its prompt allows (``prompt - 1`` rounded down to the hit unit, 64
tokens at block size 4, the ``hca_kv`` block), the blocks every cache group reads from there (the
``swa`` window, every compressed entry and indexer key, the CSA compressor snapshot at the hit, each
MTP depth's window and the MTP input snapshot), and the decode engine computes the rest of the prompt.
The reference is the prefill engine serving the same requests co-located; a prompt shorter than one
hit unit moves nothing and is computed whole.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from pypto_serving import LLM, SamplingParams

from ..qwen.test_disaggregated import _all_blocks, _all_free, _free_blocks

pytestmark = pytest.mark.requires_plugin("sync_sched")

COMMON: dict[str, Any] = {
    "model": "tiny-deepseek-v4",
    "device": "cpu",
    "block_size": 4,
    "num_kv_blocks": 96,
    "max_model_len": 160,
    "scheduler": "sync",
    "speculative_config": {"method": "mtp", "num_speculative_tokens": 2, "policy": "fixed"},
}
UNIT = 64  # the hit unit at block size 4: lcm of the groups' tokens per block


def _tokens(seed: int, n: int) -> list[int]:
    return torch.randint(3, 96, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


PROMPTS = [_tokens(1, 100), _tokens(2, 70), _tokens(3, 20)]  # 64 tokens move twice; 20 < one unit
N_OUT = 8


@pytest.fixture(scope="module")
def prefill() -> Iterator[LLM]:
    llm = LLM(kv_role="prefill", worker_mode="process", **COMMON)
    yield llm
    llm.shutdown()


@contextmanager
def _spec_delta(llm: LLM, into: list[tuple[int, int, int]]) -> Iterator[None]:
    """Append the drafts verified, accepted and the verify steps of the engine's work in the block."""
    keys = ("spec_drafted", "spec_accepted", "spec_verify_steps")
    before = [llm._engine().stats()[k] for k in keys]
    yield
    after = [llm._engine().stats()[k] for k in keys]
    into.append((after[0] - before[0], after[1] - before[1], after[2] - before[2]))


def _params(seeded: bool, **kw: Any) -> SamplingParams:
    if seeded:
        return SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=N_OUT, ignore_eos=True, **kw)
    return SamplingParams(temperature=0, max_tokens=N_OUT, ignore_eos=True, **kw)


@pytest.mark.parametrize("scheduler", ["sync", pytest.param("async", marks=pytest.mark.requires_plugin("async_sched"))])
def test_decode_continues_from_the_transferred_hit(prefill: LLM, scheduler: str) -> None:
    expect = [(len(p) - 1) // UNIT * UNIT for p in PROMPTS]
    assert expect == [64, 64, 0]
    whole_settings = {**COMMON, "scheduler": scheduler, "enable_prefix_caching": False}
    with (
        LLM(kv_role="decode", worker_mode="inproc", **{**COMMON, "scheduler": scheduler}) as decode,
        LLM(worker_mode="inproc", **whole_settings) as whole,
    ):
        for seeded in (False, True):
            offers = [
                o.kv_transfer_params
                for o in prefill.generate(
                    PROMPTS,
                    SamplingParams(temperature=0, max_tokens=1, kv_transfer_params={"do_remote_decode": True}),
                    use_tqdm=False,
                )
            ]
            assert [o["num_tokens"] for o in offers] == expect  # type: ignore[index]
            outs, drafting = [], []
            for p, o in zip(PROMPTS, offers):
                with _spec_delta(decode, drafting):
                    outs.append(decode.generate([p], _params(seeded, kv_transfer_params=o), use_tqdm=False)[0])
            reference = prefill.generate(PROMPTS, _params(seeded), use_tqdm=False)
            ref_drafting: list[tuple[int, int, int]] = []
            for p in PROMPTS:
                with _spec_delta(whole, ref_drafting):
                    whole.generate([p], _params(seeded), use_tqdm=False)
            for ref, out, n in zip(reference, outs, expect):
                assert out.outputs[0].error is None
                assert out.num_cached_tokens == n  # the KV came over, not recomputed
                assert out.outputs[0].token_ids == ref.outputs[0].token_ids, (seeded, n)
            # Each transferred request drafts from its first decode step, exactly as computing the
            # whole prompt under the same strategy does: as many drafts verified and accepted in as
            # many steps (the 70-token prompt computes 6 positions past the hit, too few to rebuild
            # the MTP KV in).
            assert drafting == ref_drafting, seeded
            assert seeded or all(accepted > 0 for _, accepted, _ in drafting[:2]), drafting
        engine = decode._engine()
        assert engine.kvx is not None and engine.kvx.stats["kv_pulled"] == 2 * sum(n > 0 for n in expect)
        engine.kv.check_invariants(engine.scheduler.live_requests())
        assert _free_blocks(decode) == _all_blocks(decode)
    deadline = time.monotonic() + 10
    while prefill._engine().kvx.held and time.monotonic() < deadline:  # type: ignore[union-attr]
        prefill._engine().check_worker()
        time.sleep(0.02)
    assert _free_blocks(prefill) == _all_blocks(prefill)


def _offer(prefill: LLM, prompt: list[int]) -> dict[str, Any]:
    params = SamplingParams(temperature=0, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    offer = prefill.generate([prompt], params, use_tqdm=False)[0].kv_transfer_params
    assert offer is not None and offer["num_tokens"] == UNIT
    return offer


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_a_corrupted_mtp_snapshot_costs_drafts_never_tokens(prefill: LLM, seeded: bool) -> None:
    """The pulled MTP input snapshot (``mtp_state``) is overwritten with NaN before the request's
    first step, as a faulty link or device could deliver it: its drafts are then garbage (fewer
    accepted than from a clean pull of the same offer, so the snapshot was read), and the tokens still
    equal co-located serving, greedy and seeded: drafts only propose, rejection sampling accepts none
    the target model would not give, and nothing of the MTP state reaches the target's KV."""
    from pypto_serving.kv_cache import FREED

    prompt = PROMPTS[1]  # 6 positions past the hit: its MTP windows still reach the snapshot's entry
    want = prefill.generate([prompt], _params(seeded), use_tqdm=False)[0].outputs[0].token_ids
    drafting: list[tuple[int, int, int]] = []
    outs = []
    with LLM(kv_role="decode", worker_mode="inproc", **COMMON) as decode:
        engine = decode._engine()
        assert engine.kvx is not None
        pulled, corrupted = engine.kvx.on_event, []

        def corrupting(event: Any) -> Any:
            req, ok = pulled(event)
            if ok:
                blocks = [b for b in req.kv.block_ids["mtp_state"] if b != FREED]
                engine.worker._runner.executor.model.caches["mtp_state"][:, blocks] = float("nan")
                corrupted.extend(blocks)
            return req, ok

        for corrupt in (False, True):
            engine.kvx.on_event = corrupting if corrupt else pulled
            params = _params(seeded, kv_transfer_params=_offer(prefill, prompt))
            with _spec_delta(decode, drafting):
                outs.append(decode.generate([prompt], params, use_tqdm=False)[0])
        assert corrupted  # the snapshot's blocks came over and were overwritten
        assert all(o.outputs[0].error is None and o.num_cached_tokens == UNIT for o in outs)
        assert [o.outputs[0].token_ids for o in outs] == [want, want]
        (_, clean_accepted, _), (_, noisy_accepted, _) = drafting
        assert noisy_accepted < clean_accepted, drafting
        engine.kv.check_invariants(engine.scheduler.live_requests())
        assert _free_blocks(decode) == _all_blocks(decode)


def test_an_offer_must_be_a_hit_position(prefill: LLM) -> None:
    """A num_tokens the decode engine could not start after is refused (400), not computed from."""
    with LLM(kv_role="decode", worker_mode="inproc", **COMMON) as decode:
        bad = {"do_remote_prefill": True, "transfer_id": "x", "remote_host": "127.0.0.1", "remote_port": 1}
        from pypto_serving.kv_ledger import prompt_digest

        bad |= {"prompt_digest": prompt_digest(PROMPTS[0]), "num_tokens": 96}
        with pytest.raises(ValueError, match="this prompt needs 64"):
            decode.generate(PROMPTS[:1], _params(False, kv_transfer_params=bad), use_tqdm=False)


@pytest.mark.parametrize("scheduler", [pytest.param("async", marks=pytest.mark.requires_plugin("async_sched"))])
def test_tp2_ranks_move_their_copies_of_every_cache_group(scheduler: str) -> None:
    """Tensor parallelism (2 ranks, MTP k=2, the async strategy): one engine with ``kv_role = "both"``
    pulls its own offers, so rank ``r``'s connector sends its copy of every cache group (replicated
    over the ranks) to rank ``r``'s, into blocks the decode request allocated fresh. The pulled
    requests' tokens equal the engine's own co-located ones only if every rank's copy arrived (each
    rank attends with its own copy). One engine, not a pair: half the start-up;
    tests/plugins/qwen/test_disaggregated.py runs a TP=2 prefill and a TP=2 decode engine."""
    tp = {**COMMON, "scheduler": scheduler, "tensor_parallel_size": 2, "worker_threads": 1, "dtype": "float32"}
    with LLM(kv_role="both", **tp) as llm:
        engine = llm._engine()
        assert engine.kvx is not None and len(engine.worker.kv_conns) == 2
        for seeded in (False, True):
            reference = llm.generate(PROMPTS[:1], _params(seeded), use_tqdm=False)
            offers = [
                o.kv_transfer_params
                for o in llm.generate(
                    PROMPTS[:1],
                    SamplingParams(temperature=0, max_tokens=1, kv_transfer_params={"do_remote_decode": True}),
                    use_tqdm=False,
                )
            ]
            assert [(o["num_tokens"], len(o["ranks"])) for o in offers] == [(UNIT, 2)]  # type: ignore[index]
            for prompt, offer, ref in zip(PROMPTS, offers, reference):
                out = llm.generate([prompt], _params(seeded, kv_transfer_params=offer), use_tqdm=False)[0]
                assert out.outputs[0].error is None and out.num_cached_tokens == UNIT
                assert out.outputs[0].token_ids == ref.outputs[0].token_ids, seeded
        deadline = time.monotonic() + 10
        while engine.kvx.held and time.monotonic() < deadline:
            engine.check_worker()
            time.sleep(0.02)
        assert engine.kvx.stats == {
            "kv_sent": 2,
            "kv_send_failed": 0,
            "kv_pulled": 2,
            "kv_pull_failed": 0,
            "kv_parts_sent": 2,  # a whole offer moves in one part
            "kv_parts_pulled": 2,
        }
        engine.kv.check_invariants(engine.scheduler.live_requests())
        assert _free_blocks(llm) == _all_blocks(llm)


# -- streamed transfers (stream_kv): the offer's hit is fixed as the prefill is added (``prompt - 1``
# rounded down to the hit unit, what the whole offer moves); each prefill chunk's result publishes
# the blocks a start there reads that the chunk filled (every compressed and indexer block, the window
# blocks from ``hit - 63`` on, the snapshots at the hit) and the decode engine pulls them as they come.
STREAM: dict[str, Any] = {**COMMON, "max_num_batched_tokens": 16, "worker_mode": "inproc"}
# Fresh prompts (a prefix-cache hit on the prefill engine would compute them in one step): 140 tokens
# move a hit at 128, past one window (the prefill gives the window's first blocks back meanwhile);
# 100 tokens a hit at 64.
LONG = [_tokens(11, 134), _tokens(2, 70)]


def _references(settings: dict[str, Any], runs: list[tuple[list[int], bool]]) -> list[tuple[list[int], Any]]:
    """Co-located outputs and drafting counts of ``runs`` (prompt, seeded) from an engine of their own,
    so no stale copy of their KV sits in the decode engine's free blocks to hide a part never moved."""
    out = []
    with LLM(**settings) as ref:
        for prompt, seeded in runs:
            drafting: list[tuple[int, int, int]] = []
            with _spec_delta(ref, drafting):
                tokens = ref.generate([prompt], _params(seeded), use_tqdm=False)[0].outputs[0].token_ids
            out.append((list(tokens), drafting[0]))
    return out


def _stream(p: LLM, d: LLM, rid: str, prompt: list[int], seeded: bool, pause: float = 0.03) -> Any:
    """Prefill ``prompt`` with stream_kv while ``d`` pulls it from the start, stepping both engines in
    turn, ``pause`` seconds after each prefill step for the connectors' threads to move that chunk's
    part; returns the decode output."""
    pe, de = p._engine(), d._engine()
    streamed = {"do_remote_decode": True, "stream_kv": True}
    first = SamplingParams(temperature=0, max_tokens=1, kv_transfer_params=streamed)
    pe.add_request(rid, prompt, first)
    offer = pe.kv_transfer_params(rid)
    assert offer is not None and offer["kv_streamed"] and offer["num_tokens"] == (len(prompt) - 1) // UNIT * UNIT
    de.add_request(rid, prompt, _params(seeded, kv_transfer_params=offer))
    de.step()  # the pull starts before the prefill computed anything
    outs: dict[str, Any] = {}
    deadline = time.monotonic() + 60
    while (pe.has_unfinished() or de.has_unfinished()) and time.monotonic() < deadline:
        if pe.has_unfinished():
            pe.step()
            assert not de.scheduler.requests, "the decode engine admitted the request before its KV was complete"
            time.sleep(pause)  # each chunk's part goes out on its own
        outs.update({o.request_id: o for o in de.step() if o.finished})
    return outs[rid]


@pytest.mark.parametrize("scheduler", ["sync", pytest.param("async", marks=pytest.mark.requires_plugin("async_sched"))])
def test_a_streamed_transfer_moves_the_hit_blocks_chunk_by_chunk(scheduler: str) -> None:
    """The reference is a third engine's co-located output (greedy, then seeded); the streamed
    request starts at the same hit as a whole offer's (test_decode_continues_from_the_transferred_hit)
    and computes the rest of the prompt from KV that arrived in several parts while the prefill ran.
    Both engines free every block. Under the async strategy a chunk's part goes out one step after
    the chunk was scheduled, as its result is applied."""
    settings = {**STREAM, "scheduler": scheduler}
    runs = list(zip(LONG, (False, True)))
    references = _references(settings, runs)
    with LLM(kv_role="prefill", **settings) as p, LLM(kv_role="decode", **settings) as d:
        pe, de = p._engine(), d._engine()
        assert pe.kvx is not None and de.kvx is not None
        for i, ((prompt, seeded), (tokens, expected)) in enumerate(zip(runs, references)):
            drafting: list[tuple[int, int, int]] = [expected]
            parts = de.kvx.stats["kv_parts_pulled"]
            with _spec_delta(d, drafting):
                out = _stream(p, d, f"s-{i}", prompt, seeded)
            assert out.outputs[0].error is None, out.outputs[0].error
            assert out.num_cached_tokens == (len(prompt) - 1) // UNIT * UNIT  # the KV came over
            assert out.outputs[0].token_ids == tokens, seeded
            assert de.kvx.stats["kv_parts_pulled"] - parts >= 3  # not one part at the end of the prefill
            # The MTP windows and input snapshot came over too: the same drafts verified and accepted
            # in as many steps (the tokens alone would not show it at temperature 0).
            assert drafting[0] == drafting[1] and drafting[0][1] > 0, drafting
        assert de.kvx.stats["kv_pull_failed"] == 0 and de.kvx.stats["kv_pulled"] == 2
        for llm in (p, d):
            _all_free(llm)
        assert pe.kvx.stats["kv_sent"] == 2 and pe.kvx.stats["kv_send_failed"] == 0


def test_a_streamed_chunk_longer_than_the_window_moves_the_window_blocks_it_gave_back() -> None:
    """136-token chunks: the first computes positions 0..135 of a 150-token prompt, and applying its
    result gives back the ``swa`` blocks before position 73 (the window of 136), among them blocks 16
    and 17 that a start at the hit (128) reads; its part takes them from the prefix cache, where the
    same result published them. The output and drafting equal a third engine's co-located run."""
    settings = {**STREAM, "max_num_batched_tokens": 136}
    prompt = _tokens(31, 150)
    [(tokens, expected)] = _references(settings, [(prompt, True)])
    with LLM(kv_role="prefill", **settings) as p, LLM(kv_role="decode", **settings) as d:
        de = d._engine()
        assert de.kvx is not None
        drafting: list[tuple[int, int, int]] = [expected]
        with _spec_delta(d, drafting):
            # Two prefill steps only, so a long pause costs little and keeps the first chunk's part its
            # own on a loaded machine (with 30 ms both chunks once went out as one part).
            out = _stream(p, d, "w", prompt, True, pause=0.5)
        assert out.outputs[0].error is None and out.num_cached_tokens == 2 * UNIT
        assert out.outputs[0].token_ids == tokens
        assert drafting[0] == drafting[1], drafting
        assert de.kvx.stats["kv_parts_pulled"] == 2  # the first chunk's part, then the final one
        for llm in (p, d):
            _all_free(llm)


def test_tp2_streamed_transfer_moves_every_ranks_copy_chunk_by_chunk() -> None:
    """Tensor parallelism (2 ranks) with stream_kv: one ``kv_role = "both"`` engine prefills a fresh
    prompt with stream_kv and pulls that offer for a decode request of its own while the prefill runs,
    so each prefill chunk's part goes from rank ``r``'s connector to rank ``r``'s, for every cache
    group. The decode request is admitted only after the final part, starts at the offer's hit, and
    its tokens and drafting equal the engine's co-located run of the same prompt (each rank attends
    with its own copy, so a rank's missing part would change them); no block leaks."""
    tp = {**STREAM, "worker_mode": "process", "tensor_parallel_size": 2, "worker_threads": 1, "dtype": "float32"}
    prompt = LONG[0]
    hit = (len(prompt) - 1) // UNIT * UNIT
    with LLM(kv_role="both", **tp) as llm:
        engine = llm._engine()
        assert engine.kvx is not None and len(engine.worker.kv_conns) == 2
        streamed = {"do_remote_decode": True, "stream_kv": True}
        engine.add_request("p", prompt, SamplingParams(temperature=0, max_tokens=1, kv_transfer_params=streamed))
        offer = engine.kv_transfer_params("p")
        assert offer is not None and offer["kv_streamed"] and offer["num_tokens"] == hit and len(offer["ranks"]) == 2
        drafting: list[tuple[int, int, int]] = []
        outs: dict[str, Any] = {}
        with _spec_delta(llm, drafting):
            engine.add_request("d", prompt, _params(True, kv_transfer_params=offer))
            deadline = time.monotonic() + 120
            while engine.has_unfinished() and time.monotonic() < deadline:
                prefilling = "p" not in outs
                outs.update({o.request_id: o for o in engine.step() if o.finished})
                if prefilling:
                    assert "d" not in engine.scheduler.requests, "admitted before its KV was complete"
                    time.sleep(0.03)  # each chunk's part goes out on its own
        out = outs["d"]
        assert out.outputs[0].error is None, out.outputs[0].error
        assert out.num_cached_tokens == hit
        assert engine.kvx.stats["kv_parts_pulled"] >= 3 and engine.kvx.stats["kv_pull_failed"] == 0
        # Co-located, the same prompt (now a prefix-cache hit at the same position) and seed.
        with _spec_delta(llm, drafting):
            reference = llm.generate([prompt], _params(True), use_tqdm=False)[0]
        assert reference.num_cached_tokens == hit
        assert out.outputs[0].token_ids == reference.outputs[0].token_ids
        assert drafting[0] == drafting[1] and drafting[0][1] > 0, drafting
        deadline = time.monotonic() + 10
        while engine.kvx.held and time.monotonic() < deadline:
            engine.check_worker()
            time.sleep(0.02)
        engine.kv.check_invariants(engine.scheduler.live_requests())
        assert _free_blocks(llm) == _all_blocks(llm)
