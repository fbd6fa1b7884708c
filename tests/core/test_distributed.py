"""Tensor-parallel worker groups on gloo over loopback: TP=2 samples what TP=1 samples (greedy,
seeded, engine-seeded), on one node and on two "nodes" (a ``pypto-serving worker`` subprocess placed
by torchrun's environment variables); mismatched settings are refused at start-up; a rank that dies
mid-step fails the step within the step timeout and the next generate serves again on a fresh group;
ranks that sample differently stop the group. The model is the toy of :mod:`tests.core.tp_toy`, whose
forward shards over the ranks; tiny Qwen3, Qwen3-MoE (expert parallel) and the embedded DeepSeek-V4
(MTP k=2) run at TP=2 through LLM and through `pypto-serving serve` against one rank."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pypto_serving import EngineDeadError, PluginManager, SamplingParams, ServingSettings, devices
from pypto_serving.config import SettingsError
from pypto_serving.distributed import (
    RankLayout,
    check_parallel_settings,
    combine_profiles,
    free_port,
    info_mismatch,
    rank_device,
)
from pypto_serving.executor import CacheGroupSpec, ExecutorInfo
from pypto_serving.messages import MemoryProfile
from pypto_serving.worker import WorkerError
from tests.core.test_worker import bounded, pid_alive
from tests.core.tp_toy import ToyTPPlugin

pytest.importorskip("pypto_serving_sync_sched")

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 20, 30, 40, 50, 60, 11, 12, 13, 14]]
PARAMS = [
    SamplingParams(temperature=0, max_tokens=10),
    SamplingParams(temperature=1.0, seed=5, max_tokens=10),
    SamplingParams(temperature=0.8, top_k=20, max_tokens=10),  # seeded by the engine's seed
]
BASE: dict[str, Any] = dict(executor="tp_toy", block_size=4, num_kv_blocks=64, worker_threads=1)


def toy_llm(**settings: Any) -> Any:
    from pypto_serving import LLM

    return LLM(plugins=PluginManager(extra_plugins=[ToyTPPlugin]), **{**BASE, **settings})


def tokens(outs: list[Any]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    """TP=1, in-process: the plain computation."""
    llm = toy_llm(worker_mode="inproc", scheduler="sync")
    try:
        return tokens(llm.generate(PROMPTS, PARAMS, use_tqdm=False))
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def tp2() -> Iterator[Any]:
    """One TP=2 engine on one node (gloo), pipelined (async) scheduling, a short step timeout."""
    pytest.importorskip("pypto_serving_async_sched")
    llm = toy_llm(tensor_parallel_size=2, scheduler="async", step_timeout=4.0)
    yield llm
    llm.shutdown()


def test_tp2_samples_what_tp1_samples(tp2: Any, reference: list[list[int]]) -> None:
    assert len(tp2.engine.worker.pids) == 2
    outs = bounded(lambda: tp2.generate(PROMPTS, PARAMS, use_tqdm=False))
    assert tokens(outs) == reference
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    assert len({tuple(t) for t in reference}) == 3 and len(set(reference[0])) > 1  # not a degenerate model


def test_idle_ranks_outlive_the_step_timeout(tp2: Any, reference: list[list[int]]) -> None:
    """Rank 0 heartbeats while idle, so ranks waiting for the next command never time out (4 s)."""
    time.sleep(6)
    assert tp2.engine.worker.check_alive() is None
    assert tokens(bounded(lambda: tp2.generate(PROMPTS[:1], PARAMS[:1], use_tqdm=False))) == reference[:1]


def check_memory_profile(worker: Any) -> None:
    """The profile of two ranks sharing this host: each gets half of its memory (sync scheduling:
    no step is in flight when it is asked)."""
    profile = worker.profile_memory(16)
    meminfo = Path("/proc/meminfo").read_text().splitlines()
    mem_total = next(int(x.split()[1]) * 1024 for x in meminfo if x.startswith("MemTotal:"))
    assert profile.total_bytes == mem_total // 2
    assert 0 < profile.used_bytes < profile.total_bytes


def wait_gone(pids: list[int], within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not any(pid_alive(p) for p in pids)


def worker_gone(worker: Any, within: float = 10.0) -> str:
    """Why the worker is gone, once it is (a process's threads may outlive its main thread briefly)."""
    deadline = time.monotonic() + within
    while (reason := worker.check_alive()) is None:
        assert time.monotonic() < deadline, "the worker still runs"
        time.sleep(0.1)
    return reason


def test_a_killed_rank_fails_the_step_and_a_fresh_group_serves(reference: list[list[int]]) -> None:
    """Rank 1 killed mid-generate: the step fails within the step timeout, rank 0 goes too, the next
    generate runs on a fresh group with no KV block left behind. The memory profile is the tightest
    rank's. Then rank 0 killed: rank 1 exits."""
    llm = toy_llm(tensor_parallel_size=2, scheduler="sync", step_timeout=20.0, executor_options={"step_sleep": 0.1})
    try:
        old = llm.engine.worker.pids
        killer = threading.Timer(1.0, lambda: os.kill(old[1], signal.SIGKILL))
        killer.start()
        started = time.monotonic()
        with pytest.raises(EngineDeadError, match=r"tensor-parallel rank 1 of the worker died \(exit code -9\)"):
            bounded(lambda: llm.generate(PROMPTS, [SamplingParams(temperature=0, max_tokens=40)] * 3, use_tqdm=False))
        assert time.monotonic() - started < 20.0
        assert wait_gone(old)
        outs = bounded(lambda: llm.generate(PROMPTS[:1], PARAMS[:1], use_tqdm=False))
        assert tokens(outs) == reference[:1]
        new = llm.engine.worker.pids
        assert len(new) == 2 and not set(new) & set(old) and all(pid_alive(p) for p in new)
        assert all(p.num_free == p.num_blocks for p in llm.engine.kv.pools.values())
        check_memory_profile(llm.engine.worker)  # leaves the profile's cache: rank 0 is killed next
        os.kill(new[0], signal.SIGKILL)
        assert wait_gone(new[1:])  # its wait for rank 0's next broadcast fails
        assert "died (exit code -9)" in worker_gone(llm.engine.worker)
    finally:
        bounded(llm.shutdown, 30)


ENGINE_SCRIPT = """
from pypto_serving import LLM, PluginManager
from tests.core.tp_toy import ToyTPPlugin
if __name__ == "__main__":
    llm = LLM(plugins=PluginManager(extra_plugins=[ToyTPPlugin]), executor="tp_toy", tensor_parallel_size=2,
              block_size=4, num_kv_blocks=16, worker_threads=1)
    print(*llm.engine.worker.pids, flush=True)
    input()
"""


def test_the_ranks_exit_when_the_engine_process_is_killed() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    engine = subprocess.Popen(
        [sys.executable, "-c", ENGINE_SCRIPT],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
        cwd=ROOT,
        text=True,
    )
    try:
        assert engine.stdout is not None
        pids = [int(p) for p in engine.stdout.readline().split()]
        assert len(pids) == 2 and all(pid_alive(p) for p in pids)
        engine.kill()
        assert wait_gone(pids, within=10.0)  # each rank's watchdog sees its parent go
    finally:
        engine.kill()
        engine.communicate()


def test_ranks_sampling_other_tokens_stop_the_group() -> None:
    """The step digest check: rank 1's logits are changed after the gather, so it samples other
    tokens; the step fails with that reason and the group stops (it cannot be trusted)."""
    llm = toy_llm(tensor_parallel_size=2, scheduler="sync", executor_options={"diverge_rank": 1})
    try:
        pids = llm.engine.worker.pids
        (out,) = bounded(lambda: llm.generate(PROMPTS[:1], PARAMS[:1], use_tqdm=False))
        assert out.outputs[0].finish_reason == "error"
        assert "tensor-parallel group lost a rank" in worker_gone(llm.engine.worker)
        assert wait_gone(pids)
    finally:
        bounded(llm.shutdown, 30)


# -- two nodes over loopback: node 0 is an LLM here, node 1 a `pypto-serving worker` subprocess


@pytest.fixture(scope="module")
def toy_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory that, on PYTHONPATH, installs the toy executor as an entry point (a dist-info)."""
    site = tmp_path_factory.mktemp("toy_site")
    info = site / "pypto_toy_tp-0.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: pypto-toy-tp\nVersion: 0.0\n")
    (info / "entry_points.txt").write_text("[pypto_serving]\ntp_toy = tests.core.tp_toy:ToyTPPlugin\n")
    return site


def launch_node_1(site: Path, port: int, *flags: str) -> subprocess.Popen[str]:
    paths = [str(site), str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    # The suite's dtype pin (tests/conftest.py) stays: node 0's settings, built in this process, have it.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYPTO_SERVING_") or k == "PYPTO_SERVING_DTYPE"}
    env["PYTHONPATH"] = os.pathsep.join(paths)
    # Node 1 learns its place from torchrun's environment variables, as a multi-node launch sets them.
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NNODES="2", NODE_RANK="1")
    cmd = [sys.executable, "-m", "pypto_serving.cli", "worker", "--executor", "tp_toy", "--block-size", "4"]
    cmd += ["--tensor-parallel-size", "2"]
    return subprocess.Popen(
        [*cmd, "--worker-threads", "1", *flags], env=env, cwd=ROOT, stderr=subprocess.PIPE, text=True
    )


def node_0(port: int) -> Any:
    return toy_llm(tensor_parallel_size=2, nnodes=2, master_port=port, scheduler="sync", max_worker_restarts=0)


def node_1_ranks(launcher: int) -> list[int]:
    """The rank processes a ``pypto-serving worker`` started (not its resource tracker)."""
    from tests.core.server.server_helpers import child_pids

    return [p for p in child_pids(launcher) if b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes()]


def test_two_nodes_form_one_tp2_engine(toy_site: Path, reference: list[list[int]]) -> None:
    """Node 1's rank killed: node 0's next generate fails naming the lost rank, node 1's launcher starts
    a rank again, and the generate after runs on the new two-node group."""
    port = free_port()
    node1 = launch_node_1(toy_site, port)
    try:
        llm = node_0(port)
        try:
            assert len(llm.engine.worker.pids) == 1  # rank 1 lives on "node 1"
            outs = bounded(lambda: llm.generate(PROMPTS, PARAMS, use_tqdm=False))
            assert tokens(outs) == reference
            (rank1,) = node_1_ranks(node1.pid)
            os.kill(rank1, signal.SIGKILL)
            with pytest.raises(EngineDeadError, match="the tensor-parallel group lost a rank"):
                bounded(lambda: llm.generate(PROMPTS, PARAMS, use_tqdm=False))
            outs = bounded(lambda: llm.generate(PROMPTS, PARAMS, use_tqdm=False))
            assert tokens(outs) == reference
            assert node_1_ranks(node1.pid) != [rank1]
        finally:
            bounded(llm.shutdown, 30)
        assert node1.wait(timeout=30) == 0  # node 0's shutdown ends node 1's ranks and its launcher
    finally:
        node1.kill()
        node1.communicate()


def test_nodes_with_different_settings_are_refused(toy_site: Path) -> None:
    port = free_port()
    node1 = launch_node_1(toy_site, port, "--max-num-seqs", "8")
    try:
        with pytest.raises(WorkerError, match=r"different settings: max_num_seqs \(rank 0: 64, rank 1: 8\)"):
            node_0(port)
        assert node1.wait(timeout=30) == 2  # refused: starting its ranks again cannot help
    finally:
        node1.kill()
    assert "different settings: max_num_seqs" in node1.communicate()[1]


# -- the pieces, without processes


def test_the_ranks_agree_on_lora_settings_but_not_on_adapter_paths() -> None:
    """Ranks with other LoRA limits or adapters would put adapters in different slots: compared,
    while each host may keep its adapters in its own directory."""
    from pypto_serving.distributed import _agreed_settings

    base = ServingSettings(lora_modules=["a=/host0/a"], max_loras=2)
    assert _agreed_settings(base) == _agreed_settings(ServingSettings(lora_modules=["a=/host1/a"], max_loras=2))
    for other in ({"lora_modules": ["b=/host0/a"]}, {"max_loras": 3}, {"max_lora_rank": 8}, {"enable_lora": True}):
        differs = ServingSettings(**{"lora_modules": ["a=/host0/a"], "max_loras": 2, **other})
        assert _agreed_settings(differs) != _agreed_settings(base), other


def test_settings_that_cannot_form_a_group_are_refused() -> None:
    with pytest.raises(SettingsError, match="needs worker_mode='process'"):
        toy_llm(tensor_parallel_size=2, worker_mode="inproc")

    def check(engine: bool = True, **kw: Any) -> None:
        check_parallel_settings(ServingSettings(**{"tensor_parallel_size": 2, **kw}), engine=engine)

    check(nnodes=2, master_port=29500)
    check(engine=False, nnodes=2, node_rank=1, master_port=29500)
    with pytest.raises(SettingsError, match="does not divide evenly over nnodes=4"):
        check(nnodes=4, master_port=29500)
    with pytest.raises(SettingsError, match="node_rank=2 must be below nnodes=2"):
        check(engine=False, nnodes=2, node_rank=2, master_port=29500)
    with pytest.raises(SettingsError, match=r"the engine .* runs on node 0"):
        check(nnodes=2, node_rank=1, master_port=29500)
    with pytest.raises(SettingsError, match="node_rank >= 1"):
        check(engine=False, nnodes=2, master_port=29500)
    with pytest.raises(SettingsError, match="nnodes=2 needs master_port"):
        check(nnodes=2)


def test_torchrun_variables_set_the_multi_node_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("MASTER_ADDR", "MASTER_PORT", "NNODES", "NODE_RANK", "PYPTO_SERVING_MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    assert (ServingSettings.load().master_port, ServingSettings.load().nnodes) == (0, 1)
    monkeypatch.setenv("MASTER_ADDR", "10.1.2.3")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.setenv("NNODES", "2")
    monkeypatch.setenv("NODE_RANK", "1")
    s = ServingSettings.load()
    assert (s.master_addr, s.master_port, s.nnodes, s.node_rank) == ("10.1.2.3", 29500, 2, 1)
    assert s.source_of("master_port") == "environment variable MASTER_PORT"
    monkeypatch.setenv("PYPTO_SERVING_MASTER_PORT", "1234")  # the project's own name wins
    assert ServingSettings.load().master_port == 1234
    assert ServingSettings.load(master_port=7).master_port == 7  # and an explicit value over both
    monkeypatch.setenv("NNODES", "two")
    with pytest.raises(SettingsError, match="nnodes='two' from environment variable NNODES"):
        ServingSettings.load()


def test_rank_layout_and_devices() -> None:
    layout = RankLayout(world_size=16, nnodes=2, node_rank=1)
    assert (layout.per_node, list(layout.local_ranks), layout.local_index(9)) == (8, list(range(8, 16)), 1)
    assert [rank_device(d, 1) for d in ("cpu", "cuda", "cuda:2", "npu")] == ["cpu", "cuda:1", "cuda:3", "npu:1"]


@pytest.fixture
def fresh_npu_probe() -> Iterator[None]:
    """The NPU probe runs once per process: forget its answer before and after a test."""
    devices._npu_usable.cache_clear()
    yield
    devices._npu_usable.cache_clear()


@pytest.mark.parametrize(
    ("body", "error"),
    [
        ('raise RuntimeError("libascend_hal.so: cannot open shared object file")', "RuntimeError: libascend_hal.so"),
        ("import ascend_toolkit_not_here", "ModuleNotFoundError: No module named 'ascend_toolkit_not_here'"),
    ],
)
def test_a_broken_torch_npu_is_logged_with_its_error(
    fresh_npu_probe: None,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    body: str,
    error: str,
) -> None:
    """An installed torch_npu that fails to import still means "no NPU" for device 'auto', but says so
    once, with its error: a broken install is not silently taken for a host without an NPU."""
    (tmp_path / "torch_npu").mkdir()
    (tmp_path / "torch_npu" / "__init__.py").write_text(body + "\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert rank_device("auto", 0) == "cpu" and rank_device("auto", 1) == "cpu"
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "torch_npu is installed but unusable" in warnings[0] and error in warnings[0]


def test_no_torch_npu_is_no_npu_silently(fresh_npu_probe: None, caplog: pytest.LogCaptureFixture) -> None:
    assert importlib.util.find_spec("torch_npu") is None  # the test environment has no Ascend stack
    assert rank_device("auto", 0) in ("cpu", "cuda:0")
    assert not [r for r in caplog.records if r.levelname == "WARNING"]


def test_memory_profiles_combine_to_the_tightest_rank() -> None:
    gib = 2**30
    a = MemoryProfile(ok=True, total_bytes=80 * gib, used_bytes=20 * gib, peak_bytes=2 * gib)
    b = MemoryProfile(ok=True, total_bytes=80 * gib, used_bytes=30 * gib, peak_bytes=1 * gib)
    # One device per rank: rank b leaves 0.9 * 80 - 30 - 1 = 41 GiB, less than a's 50.
    assert combine_profiles([a, b], 0.9, 1) == b
    # Two ranks sharing a host's memory: each gets half of the total and of what is in use.
    half = combine_profiles([a, b], 0.9, 2)
    assert (half.total_bytes, half.used_bytes, half.peak_bytes) == (40 * gib, 15 * gib, 1 * gib)
    failed = MemoryProfile(ok=False, error="rank 1: out of memory")
    assert combine_profiles([a, failed], 0.9, 1) == failed


def test_loaded_models_must_agree() -> None:
    group = CacheGroupSpec("kv", 16, bytes_per_block=1024)
    a = ExecutorInfo(cache_groups=[group], vocab_size=64, max_model_len=256)
    assert info_mismatch([a, ExecutorInfo(cache_groups=[group], vocab_size=64, max_model_len=256)]) is None
    b = ExecutorInfo(cache_groups=[group], vocab_size=65, max_model_len=256)
    assert (
        info_mismatch([a, b])
        == "the tensor-parallel ranks loaded different models: vocab_size (rank 0: 64, rank 1: 65)"
    )


# -- tiny Qwen3 (the qwen plugin's tensor parallelism) through LLM and the server

QWEN: dict[str, Any] = dict(device="cpu", dtype="float32", block_size=4, num_kv_blocks=256, worker_threads=1)
QWEN_PROMPTS = ["hello world", "the quick brown fox", "one two three four five six"]
QWEN_PARAMS = [
    SamplingParams(temperature=0, max_tokens=12),
    SamplingParams(temperature=0, max_tokens=12),
    SamplingParams(temperature=0.8, seed=3, max_tokens=12),
]


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("pypto_serving_qwen")
    pytest.importorskip("transformers")
    from tests.core.server.server_helpers import write_tokenizer
    from tests.plugins.qwen.qwen_fixtures import make_qwen_checkpoint

    path = make_qwen_checkpoint(tmp_path_factory.mktemp("qwen_tp") / "tiny-qwen3", "qwen3", num_hidden_layers=2)
    write_tokenizer(path, 320)
    return path


def qwen_outputs(path: Path, **settings: Any) -> list[Any]:
    from pypto_serving import LLM

    with LLM(model=str(path), **QWEN, **settings) as llm:
        return [o.outputs[0] for o in bounded(lambda: llm.generate(QWEN_PROMPTS, QWEN_PARAMS, use_tqdm=False), 120)]


@pytest.fixture(scope="module")
def qwen_reference(qwen_dir: Path) -> list[Any]:
    return qwen_outputs(qwen_dir, worker_mode="inproc", scheduler="sync")


@pytest.mark.parametrize("scheduler", ["sync", pytest.param("async", marks=pytest.mark.requires_plugin("async_sched"))])
def test_tiny_qwen3_tp2_equals_tp1(qwen_dir: Path, qwen_reference: list[Any], scheduler: str) -> None:
    outs = qwen_outputs(qwen_dir, tensor_parallel_size=2, scheduler=scheduler)
    assert [o.token_ids for o in outs] == [o.token_ids for o in qwen_reference]
    assert len({tuple(o.token_ids) for o in qwen_reference}) == 3


def served_texts(model: str, flags: list[str], prompts: list[str], log: Path) -> list[str]:
    """Greedy completions of ``prompts`` from `pypto-serving serve --model MODEL FLAGS` (the engine-core
    process spawns the ranks), one request at a time."""
    import httpx

    from tests.core.server.test_server_process import Proc

    base = ["--device", "cpu", "--dtype", "float32", "--worker-threads", "1", "--tensor-parallel-size", "2"]
    proc = Proc(["--model", model, *base, *flags], log)
    try:
        proc.wait_healthy(180)
        texts = []
        for prompt in prompts:
            body = {"prompt": prompt, "max_tokens": 12, "temperature": 0}
            reply = httpx.post(proc.url + "/v1/completions", json=body, timeout=60)
            assert reply.status_code == 200, reply.text
            texts.append(reply.json()["choices"][0]["text"])
        return texts
    finally:
        proc.kill()


def test_tiny_qwen3_tp2_through_the_server(qwen_dir: Path, qwen_reference: list[Any], tmp_path: Path) -> None:
    flags = ["--block-size", "4", "--num-kv-blocks", "256"]
    texts = served_texts(str(qwen_dir), flags, QWEN_PROMPTS[:2], tmp_path / "log")  # the greedy ones
    assert texts == [ref.text for ref in qwen_reference[:2]]


def test_tiny_qwen3_moe_expert_parallel_through_the_server(
    tmp_path_factory: pytest.TempPathFactory, tmp_path: Path
) -> None:
    """Qwen3-MoE with its experts placed whole on the two ranks (all-to-all dispatch and combine),
    served, against the same checkpoint on one in-process rank."""
    pytest.importorskip("pypto_serving_qwen")
    pytest.importorskip("transformers")
    from tests.core.server.server_helpers import write_tokenizer
    from tests.plugins.qwen.qwen_fixtures import make_qwen_checkpoint

    path = make_qwen_checkpoint(tmp_path_factory.mktemp("qwen_moe_tp") / "tiny-qwen3-moe", "qwen3_moe")
    write_tokenizer(path, 320)
    want = qwen_outputs(path, worker_mode="inproc", scheduler="sync")[:2]
    flags = ["--block-size", "4", "--num-kv-blocks", "256", "--enable-expert-parallel", "true"]
    assert served_texts(str(path), flags, QWEN_PROMPTS[:2], tmp_path / "log") == [w.text for w in want]
    assert len({w.text for w in want}) == 2


# -- the embedded tiny DeepSeek-V4 (the deepseek_mtp plugin's tensor and expert parallelism), MTP k=2

MTP = {"method": "mtp", "num_speculative_tokens": 2}
DS_PROMPTS = ["hello world", "the quick brown fox"]
DS_PARAMS = [SamplingParams(temperature=0, max_tokens=12), SamplingParams(temperature=0.8, seed=3, max_tokens=12)]


def deepseek_tokens(**settings: Any) -> list[list[int]]:
    from pypto_serving import LLM

    opts = dict(model="tiny-deepseek-v4", device="cpu", dtype="float32", worker_threads=1, speculative_config=MTP)
    with LLM(**opts, **settings) as llm:
        outs = bounded(lambda: llm.generate(DS_PROMPTS, DS_PARAMS, use_tqdm=False), 120)
        return tokens(outs)


@pytest.fixture(scope="module")
def deepseek_reference() -> list[list[int]]:
    pytest.importorskip("pypto_serving_deepseek_mtp")
    return deepseek_tokens(worker_mode="inproc", scheduler="sync")


@pytest.mark.requires_plugin("deepseek_mtp")
@pytest.mark.parametrize(
    ("scheduler", "expert_parallel"),
    [
        ("sync", False),
        ("sync", True),
        pytest.param("async", False, marks=pytest.mark.requires_plugin("async_sched")),
        pytest.param("async", True, marks=pytest.mark.requires_plugin("async_sched")),
    ],
)
def test_tiny_deepseek_v4_tp2_with_mtp_equals_tp1(
    deepseek_reference: list[list[int]], scheduler: str, expert_parallel: bool
) -> None:
    outs = deepseek_tokens(tensor_parallel_size=2, scheduler=scheduler, enable_expert_parallel=expert_parallel)
    assert outs == deepseek_reference


@pytest.mark.requires_plugin("deepseek_mtp")
def test_tiny_deepseek_v4_tp2_with_mtp_through_the_server(tmp_path: Path) -> None:
    """The embedded DeepSeek-V4 served at tensor_parallel_size=2 with MTP k=2 and expert parallelism
    answers greedy prompts with one in-process rank's text."""
    from pypto_serving import LLM

    want_params = SamplingParams(temperature=0, max_tokens=12)
    opts = dict(model="tiny-deepseek-v4", device="cpu", dtype="float32", worker_threads=1, worker_mode="inproc")
    with LLM(**opts) as llm:
        want = [o.outputs[0].text for o in llm.generate(DS_PROMPTS, want_params, use_tqdm=False)]
    assert all(want)
    flags = ["--speculative-config", '{"method": "mtp", "num_speculative_tokens": 2}']
    texts = served_texts("tiny-deepseek-v4", [*flags, "--enable-expert-parallel", "true"], DS_PROMPTS, tmp_path / "l")
    assert texts == want
