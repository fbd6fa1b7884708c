"""Disaggregated prefill and decode on the embedded tiny Qwen3 with the ``torch_p2p`` (gloo) connector.

The prefill engine's worker runs in its own process (it holds the KV and the connector's TCPStore);
the decode engine pulls over loopback. The reference is the prefill engine serving the same
requests co-located, so the decode engine never computed these prompts itself: its outputs equal
the reference only if the transferred blocks carry the prompt's KV.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest

from pypto_serving import LLM, SamplingParams

COMMON: dict[str, Any] = {
    "model": "tiny-qwen3",
    "device": "cpu",
    "num_kv_blocks": 48,
    "max_model_len": 256,
    "block_size": 16,
}
PROMPTS = [
    [535, 2271, 681, 201, 535, 431, 385, 65, 305, 65, 305, 201, 33, 44, 55, 66, 77, 88, 99, 100, 5],
    [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18],
    list(range(400, 434)),
]
N_OUT = 8


# Every prefill engine here (and most decode engines) runs the sync strategy.
pytestmark = pytest.mark.requires_plugin("sync_sched")


@pytest.fixture(scope="module")
def prefill() -> Iterator[LLM]:
    llm = LLM(kv_role="prefill", worker_mode="process", scheduler="sync", **COMMON)
    yield llm
    llm.shutdown()


def _params(seeded: bool, **kw: Any) -> SamplingParams:
    if seeded:
        return SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=N_OUT, ignore_eos=True, **kw)
    return SamplingParams(temperature=0, max_tokens=N_OUT, ignore_eos=True, **kw)


def _prefill(prefill: LLM, prompts: list[list[int]]) -> list[dict[str, Any]]:
    outs = prefill.generate(
        prompts,
        SamplingParams(temperature=0, max_tokens=1, kv_transfer_params={"do_remote_decode": True}),
        use_tqdm=False,
    )
    params = [o.kv_transfer_params for o in outs]
    assert all(p is not None and p["num_tokens"] == len(q) - 1 for p, q in zip(params, prompts))
    return params  # type: ignore[return-value]


def _free_blocks(llm: LLM) -> int:
    return sum(p.num_free for p in llm._engine().kv.pools.values())


def _all_blocks(llm: LLM) -> int:
    return sum(p.num_blocks for p in llm._engine().kv.pools.values())


@pytest.mark.parametrize("scheduler", ["sync", pytest.param("async", marks=pytest.mark.requires_plugin("async_sched"))])
def test_decode_continues_where_prefill_stopped(prefill: LLM, scheduler: str) -> None:
    with LLM(kv_role="decode", worker_mode="inproc", scheduler=scheduler, **COMMON) as decode:
        for seeded in (False, True):
            reference = prefill.generate(PROMPTS, _params(seeded), use_tqdm=False)
            offers = _prefill(prefill, PROMPTS)
            outs = [
                decode.generate([p], _params(seeded, kv_transfer_params=o), use_tqdm=False)[0]
                for p, o in zip(PROMPTS, offers)
            ]
            for ref, out, prompt in zip(reference, outs, PROMPTS):
                assert out.outputs[0].error is None
                assert out.num_cached_tokens == len(prompt) - 1  # the KV came over, not recomputed
                assert out.outputs[0].token_ids == ref.outputs[0].token_ids, (seeded, prompt[:3])
        engine = decode._engine()
        assert engine.kvx is not None and engine.kvx.stats["kv_pulled"] == 2 * len(PROMPTS)
        engine.kv.check_invariants(engine.scheduler.live_requests())
        assert _free_blocks(decode) == _all_blocks(decode)
    # The prefill engine freed every held block once the decode engine had pulled it.
    deadline = time.monotonic() + 10
    while prefill._engine().kvx.held and time.monotonic() < deadline:  # type: ignore[union-attr]
        prefill._engine().check_worker()
        time.sleep(0.02)
    assert _free_blocks(prefill) == _all_blocks(prefill)


def test_a_stale_offer_fails_the_request_with_a_clear_error(prefill: LLM) -> None:
    """An offer pulled once is gone: a second pull fails only that request, and frees its blocks."""
    with LLM(kv_role="decode", worker_mode="inproc", scheduler="sync", **COMMON) as decode:
        (offer,) = _prefill(prefill, PROMPTS[:1])
        first = decode.generate(PROMPTS[:1], _params(False, kv_transfer_params=offer), use_tqdm=False)[0]
        again = decode.generate(PROMPTS[:1], _params(False, kv_transfer_params=offer), use_tqdm=False)[0]
        assert first.outputs[0].error is None
        assert again.outputs[0].finish_reason == "error"
        assert "holds no KV" in (again.outputs[0].error or "")
        assert _free_blocks(decode) == _all_blocks(decode)
        with pytest.raises(ValueError, match="another prompt"):
            decode.generate(PROMPTS[1:2], _params(False, kv_transfer_params=offer), use_tqdm=False)


def test_held_blocks_are_freed_after_the_transfer_timeout() -> None:
    cfg = {"kv_transfer_timeout": 0.3}
    with LLM(kv_role="prefill", kv_transfer_config=cfg, worker_mode="inproc", scheduler="sync", **COMMON) as p:
        _prefill(p, PROMPTS)
        engine = p._engine()
        assert engine.kvx is not None and len(engine.kvx.held) == len(PROMPTS)
        assert _free_blocks(p) < _all_blocks(p)
        deadline = time.monotonic() + 10
        while engine.kvx.held and time.monotonic() < deadline:
            engine.check_worker()
            time.sleep(0.05)
        assert not engine.kvx.held
        assert _free_blocks(p) == _all_blocks(p)


def test_a_killed_prefill_fails_only_its_requests_and_leaks_no_block() -> None:
    """The prefill worker is killed while the decode engine pulls its offers: it is stopped (SIGSTOP)
    before the pulls start, so each pull has asked for its blocks and waits, then killed. The decode
    engine fails exactly those requests with the reason, frees their blocks and serves on."""
    extra = {"kv_connector_extra_config": {"timeout": 5}}
    victim = LLM(kv_role="prefill", worker_mode="process", scheduler="sync", kv_transfer_config=extra, **COMMON)
    try:
        with LLM(
            kv_role="decode", worker_mode="inproc", scheduler="sync", kv_transfer_config=extra, **COMMON
        ) as decode:
            warm = _prefill(victim, PROMPTS[:1])  # a first pull forms the connection
            assert decode.generate(PROMPTS[:1], _params(False, kv_transfer_params=warm[0]), use_tqdm=False)[0]
            offers = _prefill(victim, PROMPTS)
            engine = decode._engine()
            pid = victim._engine().worker.pid
            assert pid is not None
            os.kill(pid, signal.SIGSTOP)
            for i, (prompt, offer) in enumerate(zip(PROMPTS, offers)):
                engine.add_request(f"pd-{i}", prompt, _params(False, kv_transfer_params=offer))
            engine.add_request("local", PROMPTS[0], _params(False))  # co-located: unaffected
            engine.step()
            time.sleep(0.2)  # the first pull has asked the stopped producer and waits
            os.kill(pid, signal.SIGKILL)
            outs: dict[str, Any] = {}
            deadline = time.monotonic() + 30
            while engine.has_unfinished() and time.monotonic() < deadline:
                outs.update({o.request_id: o for o in engine.step() if o.finished})
            assert not engine.has_unfinished()
            assert outs["local"].outputs[0].error is None and len(outs["local"].outputs[0].token_ids) == N_OUT
            for i in range(len(PROMPTS)):
                assert outs[f"pd-{i}"].outputs[0].finish_reason == "error"
                assert "KV transfer failed" in (outs[f"pd-{i}"].outputs[0].error or "")
            assert engine.kvx is not None and engine.kvx.stats["kv_pull_failed"] == len(PROMPTS)
            engine.kv.check_invariants(engine.scheduler.live_requests())
            assert _free_blocks(decode) == _all_blocks(decode)
            assert engine.dead_reason is None
            again = decode.generate(PROMPTS[1:2], _params(False), use_tqdm=False)[0]
            assert len(again.outputs[0].token_ids) == N_OUT
    finally:
        victim.shutdown()


def test_a_killed_decode_leaves_no_block_held_on_the_prefill_side() -> None:
    """The decode worker is killed while it pulls: whether the prefill engine's connector was sending
    or still waiting for the pull, it lets go (a failed send, or the offer withdrawn at
    kv_transfer_timeout) and the prefill engine frees every held block."""
    cfg = {"kv_transfer_timeout": 1.0, "kv_connector_extra_config": {"timeout": 2}}
    with LLM(kv_role="prefill", kv_transfer_config=cfg, worker_mode="inproc", scheduler="sync", **COMMON) as p:
        victim = LLM(kv_role="decode", kv_transfer_config=cfg, worker_mode="process", scheduler="sync", **COMMON)
        try:
            offers = _prefill(p, PROMPTS)
            engine = victim._engine()
            pid = engine.worker.pid
            assert pid is not None
            for i, (prompt, offer) in enumerate(zip(PROMPTS, offers)):
                engine.add_request(f"pd-{i}", prompt, _params(False, kv_transfer_params=offer))
            os.kill(pid, signal.SIGKILL)
            held = p._engine().kvx
            assert held is not None
            deadline = time.monotonic() + 15
            while held.held and time.monotonic() < deadline:
                p._engine().check_worker()
                time.sleep(0.05)
            assert not held.held
            assert _free_blocks(p) == _all_blocks(p)
            p._engine().kv.check_invariants([])
            again = p.generate(PROMPTS[:1], _params(False), use_tqdm=False)[0]  # the prefill engine serves on
            assert len(again.outputs[0].token_ids) == N_OUT
        finally:
            victim.shutdown()


def test_a_moe_decode_continues_where_prefill_stopped(qwen_checkpoints: Any) -> None:
    """Qwen3-MoE (routed experts beside the attention): the decode engine's greedy tokens equal the
    prefill engine's co-located ones from the transferred KV alone."""
    moe: dict[str, Any] = {
        "model": str(qwen_checkpoints("qwen3_moe")),
        "device": "cpu",
        "dtype": "float32",
        "num_kv_blocks": 32,
        "max_model_len": 128,
        "block_size": 4,
        "scheduler": "sync",
        "worker_mode": "inproc",
    }
    prompts = [[(7 * i + 3) % 300 for i in range(n)] for n in (13, 22)]
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with LLM(kv_role="prefill", **moe) as p, LLM(kv_role="decode", **moe) as d:
        reference = p.generate(prompts, greedy, use_tqdm=False)
        offers = _prefill(p, prompts)
        for prompt, offer, ref in zip(prompts, offers, reference):
            again = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, kv_transfer_params=offer)
            out = d.generate([prompt], again, use_tqdm=False)[0]
            assert out.outputs[0].error is None and out.num_cached_tokens == len(prompt) - 1
            assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        assert _free_blocks(d) == _all_blocks(d)


# -- tensor parallelism: each rank of the prefill engine sends its shard of the KV (its KV heads) to
# the same rank of the decode engine, over connectors of its own.
TP2: dict[str, Any] = {**COMMON, "tensor_parallel_size": 2, "worker_threads": 1}


def _free_port_pair() -> int:
    """A port ``p`` with ``p`` and ``p + 1`` free now on loopback."""
    for _ in range(50):
        with contextlib.ExitStack() as stack:
            first = stack.enter_context(socket.socket())
            first.bind(("127.0.0.1", 0))
            port = int(first.getsockname()[1])
            second = stack.enter_context(socket.socket())
            try:
                second.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port
    raise AssertionError("no two consecutive free ports")


@pytest.fixture(scope="module")
def prefill_tp2() -> Iterator[LLM]:
    """A TP=2 prefill engine at a fixed kv_port: rank r's connector listens on kv_port + r."""
    cfg = {"kv_port": _free_port_pair()}
    llm = LLM(kv_role="prefill", scheduler="sync", kv_transfer_config=cfg, **TP2)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def decode_tp2() -> Iterator[LLM]:
    llm = LLM(kv_role="decode", scheduler="sync", **TP2)
    yield llm
    llm.shutdown()


def _wait_sent(llm: LLM) -> None:
    """Until the prefill engine has heard every held transfer's end (and freed its blocks)."""
    deadline = time.monotonic() + 10
    while llm._engine().kvx.held and time.monotonic() < deadline:  # type: ignore[union-attr]
        llm._engine().check_worker()
        time.sleep(0.02)


def test_a_tp2_decode_continues_where_a_tp2_prefill_stopped(prefill_tp2: LLM, decode_tp2: LLM) -> None:
    """The reference is the prefill engine's own co-located TP=2 output: the decode engine computed
    only the last prompt token, so its tokens match only if both ranks' shards arrived. (The async
    strategy with TP=2: tests/plugins/deepseek_mtp/test_disaggregated.py.)"""
    decode = decode_tp2
    engine = decode._engine()
    assert engine.kvx is not None and len(engine.worker.kv_conns) == 2
    pulled = engine.kvx.stats["kv_pulled"]
    for seeded in (False, True):
        reference = prefill_tp2.generate(PROMPTS[:2], _params(seeded), use_tqdm=False)
        offers = _prefill(prefill_tp2, PROMPTS[:2])
        port = prefill_tp2._engine().settings.kv_transfer().kv_port  # type: ignore[union-attr]
        assert [r["remote_port"] for r in offers[0]["ranks"]] == [port, port + 1]  # one connector per rank
        for prompt, offer, ref in zip(PROMPTS, offers, reference):
            out = decode.generate([prompt], _params(seeded, kv_transfer_params=offer), use_tqdm=False)[0]
            assert out.outputs[0].error is None and out.num_cached_tokens == len(prompt) - 1
            assert out.outputs[0].token_ids == ref.outputs[0].token_ids, (seeded, prompt[:3])
    assert engine.kvx.stats["kv_pulled"] == pulled + 4 and engine.kvx.stats["kv_pull_failed"] == 0
    engine.kv.check_invariants(engine.scheduler.live_requests())
    assert _free_blocks(decode) == _all_blocks(decode)
    _wait_sent(prefill_tp2)
    assert prefill_tp2._engine().kvx.stats["kv_send_failed"] == 0  # type: ignore[union-attr]
    assert _free_blocks(prefill_tp2) == _all_blocks(prefill_tp2)


def test_a_pull_from_another_tensor_parallel_size_fails_only_that_request(decode_tp2: LLM) -> None:
    """A TP=1 prefill engine's offer cannot fill a TP=2 decode engine's shards: the pull fails with
    the reason, frees its blocks, and the decode engine serves on; the prefill engine frees the offer
    at its kv_transfer_timeout."""
    cfg = {"kv_transfer_timeout": 0.5}
    with LLM(kv_role="prefill", kv_transfer_config=cfg, worker_mode="inproc", scheduler="sync", **COMMON) as p:
        (offer,) = _prefill(p, PROMPTS[:1])
        engine = decode_tp2._engine()
        failed = engine.kvx.stats["kv_pull_failed"]  # type: ignore[union-attr]
        out = decode_tp2.generate(PROMPTS[:1], _params(False, kv_transfer_params=offer), use_tqdm=False)[0]
        assert out.outputs[0].finish_reason == "error"
        assert out.outputs[0].error == (
            "KV transfer failed: the prefill engine runs tensor_parallel_size=1 and this decode engine 2: "
            "the KV moves rank to rank, so both need the same tensor_parallel_size"
        )
        assert engine.kvx.stats["kv_pull_failed"] == failed + 1  # type: ignore[union-attr]
        assert _free_blocks(decode_tp2) == _all_blocks(decode_tp2)
        again = decode_tp2.generate(PROMPTS[:1], _params(False), use_tqdm=False)[0]  # co-located: unaffected
        assert again.outputs[0].error is None and len(again.outputs[0].token_ids) == N_OUT
        _wait_sent(p)
        assert _free_blocks(p) == _all_blocks(p)


def test_kv_role_with_ranks_on_other_hosts_is_refused() -> None:
    """Each rank's connector talks to the engine over a pipe: ranks on other hosts have none."""
    from pypto_serving.config import SettingsError

    with pytest.raises(SettingsError, match="kv_role with nnodes > 1 is not supported"):
        LLM(kv_role="prefill", tensor_parallel_size=2, nnodes=2, master_port=29999, **COMMON)


# -- streamed transfers (stream_kv): the decode engine pulls the prompt's blocks chunk by chunk while
# the prefill engine computes them, and starts only once the last part arrived.
STREAM: dict[str, Any] = {**COMMON, "max_num_batched_tokens": 16, "worker_mode": "inproc"}
# Five prefill chunks of 16 tokens each: 74 tokens, 5 blocks move. Each test prefills its own prompts
# (a prefix-cache hit on the prefill engine would compute them in one step).
LONG = [[(37 * i + 11 * k) % 900 for i in range(75)] for k in range(1, 4)]


@pytest.fixture(
    scope="module", params=["sync", pytest.param("async", marks=pytest.mark.requires_plugin("async_sched"))]
)
def stream_pair(request: pytest.FixtureRequest) -> Iterator[tuple[LLM, LLM]]:
    """Both engines on one strategy (async: a step's chunk is published when its result is applied,
    one step later than it was scheduled)."""
    with (
        LLM(kv_role="prefill", scheduler=request.param, **STREAM) as p,
        LLM(kv_role="decode", scheduler=request.param, **STREAM) as d,
    ):
        yield p, d


def _stream(p: LLM, d: LLM, rid: str, prompt: list[int], seeded: bool, abort_after: int = 0) -> Any:
    """Prefill ``prompt`` with stream_kv while ``d`` pulls it from the start (its params taken as the
    request is added), stepping both engines in turn; ``abort_after``: abort the prefill after that
    many steps. Returns the decode output."""
    pe, de = p._engine(), d._engine()
    streamed = {"do_remote_decode": True, "stream_kv": True}
    first = SamplingParams(temperature=0, max_tokens=1, kv_transfer_params=streamed)
    pe.add_request(rid, prompt, first)
    offer = pe.kv_transfer_params(rid)
    assert offer is not None and offer["kv_streamed"] and offer["num_tokens"] == len(prompt) - 1
    de.add_request(rid, prompt, _params(seeded, kv_transfer_params=offer))
    de.step()  # the pull starts before the prefill computed anything
    time.sleep(0.1)
    outs: dict[str, Any] = {}
    steps, deadline = 0, time.monotonic() + 60
    while (pe.has_unfinished() or de.has_unfinished()) and time.monotonic() < deadline:
        if pe.has_unfinished():
            pe.step()
            steps += 1
            assert not de.scheduler.requests, "the decode engine admitted the request before its KV was complete"
            time.sleep(0.05)  # each chunk's part goes out on its own
            if steps == abort_after:
                pe.abort(rid)
        outs.update({o.request_id: o for o in de.step() if o.finished})
    return outs[rid]


def _all_free(llm: LLM) -> None:
    """Once the prefill engine's sends ended: no offer left open or held, every block free."""
    engine = llm._engine()
    deadline = time.monotonic() + 10
    while engine.kvx.held and time.monotonic() < deadline:  # type: ignore[union-attr]
        engine.check_worker()
        time.sleep(0.02)
    assert engine.kvx is not None and not engine.kvx.streams and not engine.kvx.held
    engine.kv.check_invariants(engine.scheduler.live_requests(), engine.kvx.pinned())
    assert _free_blocks(llm) == _all_blocks(llm)


@pytest.fixture(scope="module")
def stream_references() -> dict[tuple[int, bool], list[int]]:
    """``LONG[i]``'s tokens (greedy, seeded) from a third engine serving co-located: the streamed
    pair's decode engine never computes these prompts, so its free blocks never held their KV and a
    part that was not moved leaves other bytes there."""
    with LLM(**STREAM, scheduler="sync") as colocated:
        outs = {(i, s): colocated.generate([LONG[i]], _params(s), use_tqdm=False)[0] for i in range(2) for s in (0, 1)}
    return {(i, bool(s)): list(o.outputs[0].token_ids) for (i, s), o in outs.items()}


def test_a_streamed_transfer_moves_each_prefill_chunk_as_it_is_computed(
    stream_pair: tuple[LLM, LLM], stream_references: dict[tuple[int, bool], list[int]]
) -> None:
    """The reference is a third engine's co-located output; the streamed request computed only the
    last prompt token, from KV that arrived in several parts while the prefill ran."""
    p, d = stream_pair
    de, pe = d._engine(), p._engine()
    assert de.kvx is not None and pe.kvx is not None
    for i, seeded in enumerate((False, True)):
        parts = de.kvx.stats["kv_parts_pulled"]
        out = _stream(p, d, f"s-{i}", LONG[i], seeded)
        assert out.outputs[0].error is None and out.num_cached_tokens == len(LONG[i]) - 1
        assert out.outputs[0].token_ids == stream_references[i, seeded], seeded
        assert de.kvx.stats["kv_parts_pulled"] - parts >= 3  # not one part at the end of the prefill
    assert de.kvx.stats["kv_pull_failed"] == 0
    _all_free(d)
    _all_free(p)
    assert pe.kvx.stats["kv_sent"] >= 2 and pe.kvx.stats["kv_send_failed"] == 0


def test_a_streamed_transfer_withdrawn_mid_prefill_fails_only_its_request(stream_pair: tuple[LLM, LLM]) -> None:
    """The prefill request is aborted after two of its chunks: its growing offer is withdrawn, the
    decode request fails with the reason (never computing from the parts it had), and both engines
    free every block; each serves on."""
    p, d = stream_pair
    out = _stream(p, d, "w", LONG[2], False, abort_after=2)
    assert out.outputs[0].finish_reason == "error"
    assert "KV transfer failed: the prefill engine withdrew the offer" in (out.outputs[0].error or "")
    _all_free(d)
    _all_free(p)
    again = d.generate([LONG[2]], _params(False), use_tqdm=False)[0]
    assert again.outputs[0].error is None and len(again.outputs[0].token_ids) == N_OUT


def test_stream_kv_is_refused_where_it_cannot_apply(stream_pair: tuple[LLM, LLM]) -> None:
    _, d = stream_pair
    with pytest.raises(ValueError, match="stream_kv applies to a prefill request"):
        d.generate([LONG[0]], _params(False, kv_transfer_params={"stream_kv": True}), use_tqdm=False)


def test_a_decode_killed_mid_stream_ends_only_that_transfer_on_the_prefill_side() -> None:
    """The decode engine's worker is killed (SIGKILL) after two parts of a streamed pull arrived: the
    prefill engine's connector fails that send (a broken connection, or no ``done`` within its
    timeout), the prefill request still finishes, every block (the request's and the offer's pinned
    parts) is freed, and the prefill engine serves on, a new streamed transfer included."""
    cfg = {"kv_transfer_timeout": 1.0, "kv_connector_extra_config": {"timeout": 2}}
    with LLM(kv_role="prefill", scheduler="sync", kv_transfer_config=cfg, **STREAM) as p:
        pe = p._engine()
        assert pe.kvx is not None
        victim = LLM(kv_role="decode", scheduler="sync", kv_transfer_config=cfg, **{**STREAM, "worker_mode": "process"})
        try:
            de = victim._engine()
            streamed = SamplingParams(max_tokens=1, kv_transfer_params={"do_remote_decode": True, "stream_kv": True})
            pe.add_request("k", LONG[0], streamed)
            de.add_request("k", LONG[0], _params(False, kv_transfer_params=pe.kv_transfer_params("k")))
            de.step()  # the pull starts before the prefill computed anything
            for _ in range(2):
                pe.step()
                time.sleep(0.1)  # the part goes out to the live decode worker
            assert pe.kvx.streams and de.kvx is not None and de.kvx.pulls  # mid-stream on both sides
            assert de.worker.pid is not None
            os.kill(de.worker.pid, signal.SIGKILL)
            outs: dict[str, Any] = {}
            deadline = time.monotonic() + 20
            while pe.has_unfinished() and time.monotonic() < deadline:
                outs.update({o.request_id: o for o in pe.step() if o.finished})
            assert outs["k"].outputs[0].error is None  # the prefill itself completed
            _all_free(p)
            assert pe.kvx.stats["kv_send_failed"] == 1 and pe.kvx.stats["kv_sent"] == 0
        finally:
            victim.shutdown()
        assert pe.dead_reason is None
        with LLM(kv_role="decode", scheduler="sync", kv_transfer_config=cfg, **STREAM) as d:
            out = _stream(p, d, "after", LONG[1], False)
        assert out.outputs[0].error is None and out.num_cached_tokens == len(LONG[1]) - 1
        _all_free(p)
        assert pe.kvx.stats["kv_sent"] == 1
