"""``stream_kv`` over the ``mooncake`` connector on the embedded tiny Qwen3: the decode engine reads
the prompt's blocks through Mooncake's transfer engine (TCP) chunk by chunk while the prefill engine
computes them, and starts only once the final part arrived. The reference is a third engine serving
co-located, so the streamed request's tokens equal it only if every part carried its KV."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest

from pypto_serving import LLM, SamplingParams

from ..qwen.test_disaggregated import LONG, N_OUT, STREAM, _all_blocks, _all_free, _free_blocks, _params, _stream
from .conftest import mooncake_engine_missing

_why = mooncake_engine_missing()
pytestmark = [
    pytest.mark.skipif(_why is not None, reason=_why or ""),
    pytest.mark.requires_plugin("qwen"),
    pytest.mark.requires_plugin("sync_sched"),
]
MOONCAKE = {"kv_connector": "mooncake", "kv_connector_extra_config": {"protocol": "tcp", "timeout": 5}}
PAIR: dict[str, Any] = {**STREAM, "scheduler": "sync", "kv_transfer_config": MOONCAKE}


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[LLM, LLM]]:
    with LLM(kv_role="prefill", **PAIR) as p, LLM(kv_role="decode", **PAIR) as d:
        yield p, d


def test_a_streamed_transfer_reads_each_prefill_chunk_as_it_is_computed(pair: tuple[LLM, LLM]) -> None:
    """The reference is a third engine's co-located output: the decode engine's free blocks never
    held these prompts' KV, so a part not read leaves other bytes there."""
    p, d = pair
    de, pe = d._engine(), p._engine()
    assert de.kvx is not None and pe.kvx is not None
    with LLM(**STREAM, scheduler="sync") as colocated:
        references = [colocated.generate([LONG[i]], _params(i == 1), use_tqdm=False)[0] for i in range(2)]
    for i, (seeded, reference) in enumerate(zip((False, True), references)):
        parts = de.kvx.stats["kv_parts_pulled"]
        out = _stream(p, d, f"s-{i}", LONG[i], seeded)
        assert out.outputs[0].error is None and out.num_cached_tokens == len(LONG[i]) - 1
        assert out.outputs[0].token_ids == reference.outputs[0].token_ids, seeded
        assert de.kvx.stats["kv_parts_pulled"] - parts >= 3  # not one part at the end of the prefill
    assert de.kvx.stats["kv_pull_failed"] == 0 and de.kvx.stats["kv_pulled"] == 2
    _all_free(d)
    _all_free(p)
    assert pe.kvx.stats["kv_sent"] == 2 and pe.kvx.stats["kv_send_failed"] == 0
    assert pe.kvx.stats["kv_parts_sent"] == de.kvx.stats["kv_parts_pulled"]


def test_a_streamed_transfer_withdrawn_mid_prefill_fails_only_its_request(pair: tuple[LLM, LLM]) -> None:
    """The prefill request is aborted after two of its chunks: the decode request fails with the
    reason (never computing from the parts it read), both engines free every block and serve on."""
    p, d = pair
    out = _stream(p, d, "w", LONG[2], False, abort_after=2)
    assert out.outputs[0].finish_reason == "error"
    assert "KV transfer failed: the prefill engine withdrew the offer" in (out.outputs[0].error or "")
    _all_free(d)
    _all_free(p)
    again = d.generate([LONG[2]], _params(False), use_tqdm=False)[0]
    assert again.outputs[0].error is None and len(again.outputs[0].token_ids) == N_OUT


def test_a_prefill_killed_mid_stream_fails_only_its_request() -> None:
    """The prefill engine's worker is killed after two chunks: the decode request fails with the
    reason, its blocks are freed, and the decode engine serves on."""
    victim = LLM(kv_role="prefill", **{**PAIR, "worker_mode": "process"})
    try:
        with LLM(kv_role="decode", **PAIR) as d:
            pe, de = victim._engine(), d._engine()
            streamed = SamplingParams(max_tokens=1, kv_transfer_params={"do_remote_decode": True, "stream_kv": True})
            pe.add_request("k", LONG[0], streamed)
            de.add_request("k", LONG[0], _params(False, kv_transfer_params=pe.kv_transfer_params("k")))
            de.step()
            for _ in range(2):
                pe.step()
                time.sleep(0.1)
            assert pe.worker.pid is not None
            os.kill(pe.worker.pid, signal.SIGKILL)
            outs: dict[str, Any] = {}
            deadline = time.monotonic() + 20
            while de.has_unfinished() and time.monotonic() < deadline:
                outs.update({o.request_id: o for o in de.step() if o.finished})
            assert "KV transfer failed" in (outs["k"].outputs[0].error or "")
            assert de.kvx is not None and de.kvx.stats["kv_pull_failed"] == 1
            de.kv.check_invariants(de.scheduler.live_requests())
            assert _free_blocks(d) == _all_blocks(d) and de.dead_reason is None
            again = d.generate([LONG[0]], _params(False), use_tqdm=False)[0]
            assert again.outputs[0].error is None and len(again.outputs[0].token_ids) == N_OUT
    finally:
        victim.shutdown()
