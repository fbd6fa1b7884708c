"""Data parallelism: two engine replicas behind one server. Every request completes, outputs equal a
single replica's, requests spread over both replicas, aborts follow the request, and the routing
rules hold (least outstanding tokens; prefix affinity)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pypto_serving import PluginManager, SamplingParams
from tests.core.server.conftest import LiveServer, fake_settings
from tests.fakes import FakePlugin

pytestmark = pytest.mark.requires_plugin("sync_sched")


def _dp(model_dir: Path, **overrides: Any) -> Any:
    from pypto_serving.server.data_parallel import DataParallelLLM

    llm = DataParallelLLM(
        fake_settings(model_dir, data_parallel_size=2, **overrides), PluginManager(extra_plugins=[FakePlugin])
    )
    llm.wait_ready(60)
    return llm


@pytest.fixture
def dp(fake_model_dir: Path) -> Iterator[Any]:
    llm = _dp(fake_model_dir)
    yield llm
    llm.shutdown(10)


def _collect(llm: Any, prompts: list[list[int]], max_tokens: int = 8) -> list[list[int]]:
    async def one(i: int, p: list[int]) -> list[int]:
        last: list[int] = []
        async for out in llm.generate(f"r{i}", p, SamplingParams(temperature=0, max_tokens=max_tokens)):
            last = list(out.outputs[0].token_ids)
        return last

    async def all_of() -> list[list[int]]:
        return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts))))

    return asyncio.run(all_of())


def test_requests_spread_over_replicas_and_match_one_engine(dp: Any, fake_model_dir: Path) -> None:
    from tests.core.server.conftest import start_llm

    prompts = [[(7 * i + j) % 300 + 1 for j in range(3 + i % 5)] for i in range(12)]
    seen: set[int] = set()
    real_add = dp.add_request

    async def spy(rid: str, prompt: list[int], params: SamplingParams) -> Any:
        stream = await real_add(rid, prompt, params)
        seen.add(dp.replica_of(rid))
        return stream

    dp.add_request = spy
    got = _collect(dp, prompts)
    single = start_llm(fake_model_dir)
    try:
        want = _collect(single, prompts)
    finally:
        single.shutdown(10)
    assert got == want
    assert seen == {0, 1}
    assert dp.stats["replicas"][0]["outstanding_tokens"] == dp.stats["replicas"][1]["outstanding_tokens"] == 0


def test_least_tokens_routing_counts_outstanding_tokens(dp: Any) -> None:
    big, small = SamplingParams(max_tokens=100), SamplingParams(max_tokens=5)
    assert dp.route([1, 2, 3], big) == 0  # both idle: the lowest index
    dp._load[0] += 103  # what add_request books for a 3-token prompt with 100 new tokens
    assert dp.route([1, 2, 3], small) == 1
    dp._load[1] += 200
    assert dp.route([1, 2, 3], small) == 0
    dp._load[:] = [0, 0]


def test_prefix_affinity_sends_a_shared_first_block_to_one_replica(fake_model_dir: Path) -> None:
    llm = _dp(fake_model_dir, data_parallel_routing="prefix_affinity")
    try:
        params = SamplingParams(max_tokens=4)
        prefixes = [[p, p + 1, p + 2, p + 3] for p in range(1, 60, 4)]  # block_size 4: one block each
        chosen = {tuple(pre): {llm.route(pre + tail, params) for tail in ([9], [10, 11], [12] * 5)} for pre in prefixes}
        assert all(len(replicas) == 1 for replicas in chosen.values())  # same first block, same replica
        assert {r for replicas in chosen.values() for r in replicas} == {0, 1}  # and both are used
    finally:
        llm.shutdown(10)


def test_abort_reaches_the_owning_replica(fake_model_dir: Path) -> None:
    llm = _dp(fake_model_dir, executor_options={"step_sleep": 0.02})  # 100 tokens take 2 s

    async def run() -> str | None:
        stream = await llm.add_request("a", [1, 2, 3], SamplingParams(max_tokens=100, ignore_eos=True))
        owner = llm.replica_of("a")
        llm.abort("a")
        while True:
            item = await stream.queue.get()
            if item.finished:
                assert llm.replicas[owner].stats is not None
                return str(item.outputs[0].finish_reason)

    try:
        assert asyncio.run(run()) == "abort"
        assert llm.replica_of("a") is None  # its outstanding tokens were released
        assert llm.stats["replicas"][0]["outstanding_tokens"] == llm.stats["replicas"][1]["outstanding_tokens"] == 0
    finally:
        llm.shutdown(10)


def test_the_server_serves_through_both_replicas(fake_model_dir: Path) -> None:
    import httpx

    from pypto_serving.server import build_app

    llm = _dp(fake_model_dir)
    server = LiveServer(build_app(llm, manage_engine=False), llm=llm)
    try:
        with httpx.Client(base_url=server.url, timeout=30) as client:
            texts = [
                client.post(
                    "/v1/completions", json={"model": "tiny-fake", "prompt": f"hello {i}", "max_tokens": 5}
                ).json()
                for i in range(6)
            ]
            metrics = client.get("/metrics").text
        assert all(len(t["choices"][0]["text"]) > 0 for t in texts), texts
        assert "pypto_serving_num_requests_running" in metrics
        assert sum(r["num_steps"] for r in llm.stats["replicas"]) == llm.stats["num_steps"] > 0
    finally:
        server.stop()
        llm.shutdown(10)
