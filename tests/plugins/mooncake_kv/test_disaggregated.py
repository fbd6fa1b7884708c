"""Disaggregated prefill and decode on the embedded tiny Qwen3 with the ``mooncake`` connector: the
KV moves through Mooncake's transfer engine over TCP (P2P handshake, no metadata server).

The prefill engine's worker runs in its own process; the decode engine (in this process) reads the
blocks from it over loopback. The reference is the prefill engine serving the same requests
co-located, so the decode engine's outputs equal it only if the blocks carry the prompt's KV.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest

from pypto_serving import LLM

from ..qwen.test_disaggregated import COMMON, N_OUT, PROMPTS, _all_blocks, _free_blocks, _params, _prefill
from .conftest import mooncake_engine_missing

_why = mooncake_engine_missing()
pytestmark = [
    pytest.mark.skipif(_why is not None, reason=_why or ""),
    pytest.mark.requires_plugin("qwen"),
    pytest.mark.requires_plugin("sync_sched"),
]
MOONCAKE = {"kv_connector": "mooncake", "kv_connector_extra_config": {"protocol": "tcp", "timeout": 5}}


@pytest.fixture(scope="module")
def prefill() -> Iterator[LLM]:
    llm = LLM(kv_role="prefill", worker_mode="process", scheduler="sync", kv_transfer_config=MOONCAKE, **COMMON)
    yield llm
    llm.shutdown()


def _settle(llm: LLM) -> None:
    """Wait until the prefill engine has applied every ``sent`` event (freed the held blocks)."""
    deadline = time.monotonic() + 10
    while llm._engine().kvx.held and time.monotonic() < deadline:  # type: ignore[union-attr]
        llm._engine().check_worker()
        time.sleep(0.02)


def test_decode_continues_where_prefill_stopped(prefill: LLM) -> None:
    with LLM(kv_role="decode", worker_mode="inproc", scheduler="sync", kv_transfer_config=MOONCAKE, **COMMON) as d:
        for seeded in (False, True):
            reference = prefill.generate(PROMPTS, _params(seeded), use_tqdm=False)
            offers = _prefill(prefill, PROMPTS)
            assert all(o["engine"].startswith("127.0.0.1:") for o in offers)  # the transfer engine's address
            outs = [
                d.generate([p], _params(seeded, kv_transfer_params=o), use_tqdm=False)[0]
                for p, o in zip(PROMPTS, offers)
            ]
            for ref, out, prompt in zip(reference, outs, PROMPTS):
                assert out.outputs[0].error is None
                assert out.num_cached_tokens == len(prompt) - 1  # the KV came over, not recomputed
                assert out.outputs[0].token_ids == ref.outputs[0].token_ids, (seeded, prompt[:3])
        engine = d._engine()
        assert engine.kvx is not None and engine.kvx.stats["kv_pulled"] == 2 * len(PROMPTS)
        engine.kv.check_invariants(engine.scheduler.live_requests())
        assert _free_blocks(d) == _all_blocks(d)
    _settle(prefill)
    assert _free_blocks(prefill) == _all_blocks(prefill)


def test_a_stale_offer_fails_only_its_request(prefill: LLM) -> None:
    """An offer pulled once is gone: the second pull fails with the reason, frees its blocks, and
    the connection stays usable for the next pull."""
    with LLM(kv_role="decode", worker_mode="inproc", scheduler="sync", kv_transfer_config=MOONCAKE, **COMMON) as d:
        offer, other = _prefill(prefill, PROMPTS[:2])
        first = d.generate(PROMPTS[:1], _params(False, kv_transfer_params=offer), use_tqdm=False)[0]
        again = d.generate(PROMPTS[:1], _params(False, kv_transfer_params=offer), use_tqdm=False)[0]
        assert first.outputs[0].error is None
        assert again.outputs[0].finish_reason == "error"
        assert "holds no KV" in (again.outputs[0].error or "")
        after = d.generate(PROMPTS[1:2], _params(False, kv_transfer_params=other), use_tqdm=False)[0]
        assert after.outputs[0].error is None and after.num_cached_tokens == len(PROMPTS[1]) - 1
        assert _free_blocks(d) == _all_blocks(d)
    _settle(prefill)
    assert _free_blocks(prefill) == _all_blocks(prefill)


def test_a_killed_prefill_fails_only_its_requests_and_leaks_no_block() -> None:
    """The prefill worker is stopped, the decode engine asks for its offers, then the worker is
    killed: those requests fail with the reason, their blocks are freed, the engine serves on."""
    victim = LLM(kv_role="prefill", worker_mode="process", scheduler="sync", kv_transfer_config=MOONCAKE, **COMMON)
    try:
        with LLM(
            kv_role="decode", worker_mode="inproc", scheduler="sync", kv_transfer_config=MOONCAKE, **COMMON
        ) as decode:
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
            assert outs["local"].outputs[0].error is None and len(outs["local"].outputs[0].token_ids) == N_OUT
            for i in range(len(PROMPTS)):
                assert outs[f"pd-{i}"].outputs[0].finish_reason == "error"
                assert "KV transfer failed" in (outs[f"pd-{i}"].outputs[0].error or "")
            assert engine.kvx is not None and engine.kvx.stats["kv_pull_failed"] == len(PROMPTS)
            engine.kv.check_invariants(engine.scheduler.live_requests())
            assert _free_blocks(decode) == _all_blocks(decode)
            assert engine.dead_reason is None
    finally:
        victim.shutdown()


def test_a_killed_decode_leaves_no_block_held_on_the_prefill_side() -> None:
    """The decode worker is killed while it pulls: whether the prefill engine's connector was serving
    the read or still waiting for it, it lets go (the connection's end, or the offer withdrawn at
    kv_transfer_timeout) and the prefill engine frees every held block and serves on."""
    cfg = {**MOONCAKE, "kv_transfer_timeout": 1.0}
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
            again = p.generate(PROMPTS[:1], _params(False), use_tqdm=False)[0]
            assert len(again.outputs[0].token_ids) == N_OUT
        finally:
            victim.shutdown()
