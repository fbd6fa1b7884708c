"""Data parallelism: two engine replicas behind one server. Every request completes, outputs equal a
single replica's (on the fake executor, and request by request through the HTTP server on the real
tiny Qwen3), requests spread over both replicas, /metrics shows each replica's series, aborts follow
the request, and the routing rules hold (least outstanding tokens; prefix affinity)."""

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


# -- a real tiny Qwen3 (the qwen plugin's embedded ``tiny-qwen3``) behind the HTTP server

QWEN_PROMPTS = ["def fib(n):", "import os", "class Foo:", "for i in range(", "return x +", "print("]


def _qwen_replies(**settings: Any) -> tuple[list[dict[str, Any]], str]:
    """Serve ``tiny-qwen3`` (with ``settings``), send every prompt at once (greedy); the replies in
    prompt order and a /metrics scrape taken after them."""
    import httpx

    from pypto_serving import ServingSettings
    from pypto_serving.server import build_app
    from pypto_serving.server.data_parallel import make_llm

    base = dict(model="tiny-qwen3", device="cpu", dtype="float32", worker_mode="inproc", engine_mode="thread")

    async def send(url: str) -> tuple[list[dict[str, Any]], str]:
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            body = {"model": "tiny-qwen3", "max_tokens": 12, "temperature": 0}
            posts = [client.post("/v1/completions", json={**body, "prompt": p}) for p in QWEN_PROMPTS]
            replies = await asyncio.gather(*posts)
            assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
            return [r.json() for r in replies], (await client.get("/metrics")).text

    llm = make_llm(ServingSettings(**base, block_size=4, num_kv_blocks=128, max_model_len=256, **settings))
    try:
        llm.wait_ready(60)
        server = LiveServer(build_app(llm, manage_engine=False), llm=llm)
        try:
            return asyncio.run(send(server.url))
        finally:
            server.stop()
    finally:
        llm.shutdown(10)


def _outcome(reply: dict[str, Any]) -> tuple[str, str, dict[str, Any]]:
    choice = reply["choices"][0]
    return choice["text"], choice["finish_reason"], reply["usage"]


def _per_replica(text: str, name: str) -> dict[str, float]:
    """Replica label -> value of the samples ``name`` in a /metrics scrape (summed over other labels)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                replica = sample.labels["replica"]
                out[replica] = out.get(replica, 0.0) + sample.value
    return out


@pytest.mark.requires_plugin("qwen")
def test_tiny_qwen3_dp2_through_the_server_equals_one_replica() -> None:
    got, text = _qwen_replies(data_parallel_size=2)
    want, _ = _qwen_replies(data_parallel_size=1)
    assert [_outcome(r) for r in got] == [_outcome(r) for r in want]
    assert len({_outcome(r)[0] for r in want}) == len(QWEN_PROMPTS)  # the prompts lead to different texts
    served = _per_replica(text, "pypto_serving_replica_request_success_total")
    assert set(served) == {"0", "1"} and all(n > 0 for n in served.values()), served  # both replicas served
    assert sum(served.values()) == len(QWEN_PROMPTS)
    assert _per_replica(text, "pypto_serving_replica_outstanding_tokens") == {"0": 0, "1": 0}
    assert set(_per_replica(text, "pypto_serving_replica_num_requests_running")) == {"0", "1"}


def test_cpu_replicas_pin_their_workers_to_their_own_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    """``worker_cpu_bind = "auto"`` alone pins every replica's worker to the same last cores."""
    from pypto_serving import ServingSettings
    from pypto_serving.server import data_parallel
    from pypto_serving.worker import worker_cores

    monkeypatch.setattr(data_parallel.os, "sched_getaffinity", lambda pid: set(range(8)))
    for name in ("OMP_PLACES", "OMP_PROC_BIND"):
        monkeypatch.delenv(name, raising=False)
    base = ServingSettings(device="cpu", worker_threads=2)
    each = data_parallel.replica_settings(base, 3)
    assert [s.worker_cpu_bind for s in each] == ["2,3", "4,5", "6,7"]
    monkeypatch.setattr("pypto_serving.worker.os.sched_getaffinity", lambda pid: set(range(8)))
    assert [worker_cores(s) for s in each] == [[2, 3], [4, 5], [6, 7]]  # the worker reads them back
    # More threads than cores for all replicas: none pinned, rather than all on the same cores.
    assert {s.worker_cpu_bind for s in data_parallel.replica_settings(base, 5)} == {"off"}
    # Choices that are not "auto" on the CPU with one rank keep their workers' cores (every replica's
    # the same), and the server and engine cores take what those leave.
    for other, worker, engine in (
        (base.with_overrides(worker_cpu_bind="0-1"), "0,1", "2,3,4,5,6,7"),
        (base.with_overrides(device="cuda"), "6,7", "0,1,2,3,4,5"),
        (base.with_overrides(worker_cpu_bind="off"), "off", "off"),
    ):
        want = other.with_overrides(worker_cpu_bind=worker, engine_cpu_bind=engine)
        assert data_parallel.replica_settings(other, 2) == [want, want]
    one = base.with_overrides(worker_cpu_bind="6,7", engine_cpu_bind="0,1,2,3,4,5")
    assert data_parallel.replica_settings(base, 1) == [one]


def test_each_replica_is_built_with_its_own_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    from pypto_serving import ServingSettings
    from pypto_serving.server import data_parallel

    built: list[str] = []

    class Recorder:
        def __init__(self, settings: Any, plugins: Any, on_fatal: Any = None) -> None:
            built.append(settings.worker_cpu_bind)
            self.settings = settings
            self.on_finished = None

    monkeypatch.setattr(data_parallel.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr(data_parallel, "AsyncLLM", Recorder)
    data_parallel.DataParallelLLM(ServingSettings(device="cpu", worker_threads=1, data_parallel_size=2))
    assert built == ["2", "3"]
