"""A prefill/decode pair behind ``pypto-serving router``: real servers (tiny Qwen3, the torch_p2p
connector over loopback), the router sends each completion to the prefill replica with max_tokens 1,
then with its ``kv_transfer_params`` to the decode replica, and streams the decode replica's answer.
The reference is the prefill server answering the same request co-located."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.core.server.conftest import LiveServer
from tests.core.server.router_helpers import RouterThread
from tests.core.server.server_helpers import parse_sse, wait_for

pytest.importorskip("pypto_serving_sync_sched")

SETTINGS: dict[str, Any] = {
    "model": "tiny-qwen3",
    "device": "cpu",
    "num_kv_blocks": 48,
    "max_model_len": 256,
    "block_size": 16,
    # Prefills of more than 16 tokens take several steps: a streamed offer goes out before its end.
    "max_num_batched_tokens": 16,
    "worker_mode": "inproc",
    "engine_mode": "thread",
    "scheduler": "sync",
}


def _metric(url: str, name: str) -> float:
    """The value of ``pypto_serving_<name>`` in the server's /metrics (summed over its label sets)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    rows = [line for line in text.splitlines() if line.startswith(f"pypto_serving_{name}")]
    return sum(float(line.rsplit(" ", 1)[1]) for line in rows)


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[LiveServer, LiveServer, Any, Any]]:
    from pypto_serving import PluginManager, ServingSettings
    from pypto_serving.server import AsyncLLM, build_app

    made = []
    for role in ("prefill", "decode"):
        llm = AsyncLLM(ServingSettings(kv_role=role, **SETTINGS), PluginManager())
        llm.wait_ready(120)
        made.append((LiveServer(build_app(llm, manage_engine=False), llm=llm), llm))
    (p, p_llm), (d, d_llm) = made
    yield p, d, p_llm, d_llm
    for server, llm in made:
        server.stop()
        llm.shutdown(10)


def test_the_router_splits_a_completion_over_the_pair(pair: tuple[LiveServer, LiveServer, Any, Any]) -> None:
    from pypto_serving.router import RouterSettings

    prefill, decode, _, d_llm = pair
    replicas = [
        {"url": prefill.url, "name": "p", "role": "prefill"},
        {"url": decode.url, "name": "d", "role": "decode"},
    ]
    router = RouterThread(RouterSettings(replicas=replicas, health_interval=0.2))
    try:
        body = {"prompt": "import os\nimport sys\n\ndef main(", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        reference = httpx.post(f"{prefill.url}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
        answer = httpx.post(f"{router.url}/v1/completions", json=body, timeout=60)
        assert answer.status_code == 200, answer.text
        assert answer.headers["x-pypto-replica"] == "d"
        assert answer.json()["choices"][0]["text"] == reference
        with httpx.stream("POST", f"{router.url}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            events, done = parse_sse(r.read().decode())
        assert done and "".join(e["choices"][0]["text"] for e in events if e.get("choices")) == reference
        chat = {"messages": [{"role": "user", "content": "class Config:"}], "max_tokens": 8, "temperature": 0}
        ref_chat = httpx.post(f"{prefill.url}/v1/chat/completions", json=chat, timeout=60).json()
        got_chat = httpx.post(f"{router.url}/v1/chat/completions", json=chat, timeout=60).json()
        assert got_chat["choices"][0]["message"] == ref_chat["choices"][0]["message"]
        assert d_llm.stats["kv_pulled"] == 3
        # The transfers are counted in each server's /metrics (refreshed from the engine stats).
        wait_for(lambda: _metric(decode.url, "kv_transfer_pulled_total") >= 3, 10, "the decode pulls in /metrics")
        wait_for(lambda: _metric(prefill.url, "kv_transfer_sent_total") >= 3, 10, "the prefill sends in /metrics")
        assert _metric(decode.url, "kv_transfer_pull_failed_total") == 0
    finally:
        router.stop()


def test_a_stale_transfer_is_a_502_naming_it_and_the_server_serves_on(
    pair: tuple[LiveServer, LiveServer, Any, Any],
) -> None:
    prefill, decode, _, d_llm = pair
    body = {"prompt": "def main(", "max_tokens": 4, "temperature": 0}
    first = {**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    params = httpx.post(f"{prefill.url}/v1/completions", json=first, timeout=60).json()["kv_transfer_params"]
    ok = httpx.post(f"{decode.url}/v1/completions", json={**body, "kv_transfer_params": params}, timeout=60)
    stale = httpx.post(f"{decode.url}/v1/completions", json={**body, "kv_transfer_params": params}, timeout=60)
    assert ok.status_code == 200
    assert stale.status_code == 502 and stale.json()["error"]["code"] == "kv_transfer_failed"
    assert "holds no KV" in stale.json()["error"]["message"]
    assert httpx.post(f"{decode.url}/v1/completions", json=body, timeout=60).status_code == 200
    engine = d_llm.engine
    assert sum(p.num_free for p in engine.kv.pools.values()) == sum(p.num_blocks for p in engine.kv.pools.values())


def test_a_decode_server_refuses_foreign_kv_transfer_params(pair: tuple[LiveServer, LiveServer, Any, Any]) -> None:
    _, decode, _, _ = pair
    bad = {"do_remote_prefill": True, "transfer_id": "x", "remote_host": "127.0.0.1", "remote_port": 1}
    body = {"prompt": "abc", "max_tokens": 2, "kv_transfer_params": {**bad, "num_tokens": 2, "prompt_digest": "0"}}
    answer = httpx.post(f"{decode.url}/v1/completions", json=body, timeout=30)
    assert answer.status_code == 400 and "another prompt" in answer.text


def test_a_streamed_prefill_hands_out_its_kv_transfer_params_first(
    pair: tuple[LiveServer, LiveServer, Any, Any],
) -> None:
    """``stream_kv`` over HTTP: a streamed prefill request's first SSE event carries the offer, before
    the prefill finished; the decode server pulls with it while the prefill stream is still open."""
    prefill, decode, p_llm, d_llm = pair
    body = {"prompt": "import json\nimport re\n\nclass Parser:\n    def parse(", "max_tokens": 6, "temperature": 0}
    reference = httpx.post(f"{decode.url}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    first = {
        **body,
        "max_tokens": 1,
        "stream": True,
        "kv_transfer_params": {"do_remote_decode": True, "stream_kv": True},
    }
    with httpx.stream("POST", f"{prefill.url}/v1/completions", json=first, timeout=60) as r:
        lines = r.iter_lines()
        head = json.loads(next(line for line in lines if line.startswith("data: "))[len("data: ") :])
        assert head["choices"] == [] and head["kv_transfer_params"]["kv_streamed"]  # before any token
        pulled = {**body, "kv_transfer_params": head["kv_transfer_params"]}
        got = httpx.post(f"{decode.url}/v1/completions", json=pulled, timeout=60)
        events, done = parse_sse("\n".join(lines))
    assert got.status_code == 200 and got.json()["choices"][0]["text"] == reference
    assert done and events[-1]["choices"][0]["finish_reason"] == "length"
    assert all("kv_transfer_params" not in e for e in events)  # handed out once
    wait_for(lambda: not p_llm.engine.kvx.held, 10, "the prefill engine's offer freed")
    for engine in (p_llm.engine, d_llm.engine):
        assert sum(p.num_free for p in engine.kv.pools.values()) == sum(p.num_blocks for p in engine.kv.pools.values())


def _gate_until_pulled(monkeypatch: pytest.MonkeyPatch, prefill: Any, decode: Any) -> list[bool]:
    """Make the prefill engine's steps after a streamed offer went out wait (up to 10 s) for a decode
    engine's pull of that offer to start; returns, per offer, whether the pull started while the
    prefill request was unfinished (its offer is still growing: ``kvx.streams``). An offer's first
    step hands out its ``kv_transfer_params``; a router that waits for the prefill's end before it
    sends the decode request leaves the pull unstarted, the wait times out and records False."""
    engine, pulls = prefill.engine, decode.engine.kvx.pulls
    step, handed_out, checked = engine.step, set(), set()
    found: list[bool] = []

    def started(tid: str) -> bool:
        return any(p.started and p.source["transfer_id"] == tid for p in list(pulls.values()))

    def gated() -> Any:
        for tid in [t for t in engine.kvx.streams if t in handed_out and t not in checked]:
            deadline = time.monotonic() + 10
            while not started(tid) and time.monotonic() < deadline:
                time.sleep(0.002)
            checked.add(tid)
            found.append(started(tid) and tid in engine.kvx.streams)
        handed_out.update(engine.kvx.streams)
        return step()

    monkeypatch.setattr(engine, "step", gated)
    return found


def test_the_router_sends_the_decode_request_as_a_streamed_prefill_starts(
    pair: tuple[LiveServer, LiveServer, Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ``stream_kv`` prefill replica: the router forwards the decode request on the prefill's first
    event (streamed answers too), and the prefill's stream is read to its end behind it. The decode
    engine's pull starts while the prefill still computes: its steps wait for the pull (see
    :func:`_gate_until_pulled`), which only a router that overlaps them starts."""
    from pypto_serving.router import RouterSettings

    prefill, decode, p_llm, d_llm = pair
    replicas = [
        {"url": prefill.url, "name": "p", "role": "prefill", "stream_kv": True},
        {"url": decode.url, "name": "d", "role": "decode"},
    ]
    router = RouterThread(RouterSettings(replicas=replicas, health_interval=0.2))
    try:
        # Two prompts of more than 16 tokens: each prefill takes two steps or more (a prefix-cache hit
        # on the prefill engine would compute a repeated prompt in one).
        fib = "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n"
        bodies = [{"prompt": p, "max_tokens": 8, "temperature": 0, "ignore_eos": True} for p in (fib, fib.upper())]
        refs = [httpx.post(f"{decode.url}/v1/completions", json=b, timeout=60).json() for b in bodies]
        assert all(r["usage"]["prompt_tokens"] > 16 for r in refs)
        pulled, failed = d_llm.stats["kv_pulled"], d_llm.stats["kv_pull_failed"]
        overlapped = _gate_until_pulled(monkeypatch, p_llm, d_llm)
        answer = httpx.post(f"{router.url}/v1/completions", json=bodies[0], timeout=60)
        assert answer.status_code == 200, answer.text
        assert answer.headers["x-pypto-replica"] == "d"
        assert answer.json()["choices"][0]["text"] == refs[0]["choices"][0]["text"]
        with httpx.stream("POST", f"{router.url}/v1/completions", json={**bodies[1], "stream": True}, timeout=60) as r:
            events, done = parse_sse(r.read().decode())
        text = "".join(e["choices"][0]["text"] for e in events if e.get("choices"))
        assert done and text == refs[1]["choices"][0]["text"]
        assert overlapped == [True, True]  # each pull started before its prefill finished
        assert d_llm.stats["kv_pulled"] == pulled + 2 and d_llm.stats["kv_pull_failed"] == failed
        wait_for(lambda: not p_llm.engine.kvx.held, 10, "the prefill engine's offers freed")
        load = router.state.router.replicas["p"]
        wait_for(lambda: load.in_flight == 0 and load.outstanding_tokens == 0, 10, "the prefill halves counted done")
    finally:
        router.stop()
