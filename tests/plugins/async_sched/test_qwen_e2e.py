"""End to end with the Qwen executor in a worker process: async equals sync token for token."""

from __future__ import annotations

from importlib import metadata
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pypto_serving_async_sched")
pytest.importorskip("pypto_serving_sync_sched")
pytest.importorskip("pypto_serving_qwen")
pytest.importorskip("transformers")

import torch

from pypto_serving import LLM, SamplingParams
from pypto_serving.plugins import PluginManager
from tests.plugins.qwen.qwen_fixtures import make_qwen_checkpoint


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_qwen_checkpoint(tmp_path_factory.mktemp("qwen3"), "qwen3")


def _plugins() -> PluginManager | None:
    """Entry-point plugins, plus the Qwen plugin in-process when it is not pip-installed."""
    if "qwen" in {ep.name for ep in metadata.entry_points(group="pypto_serving")}:
        return None
    from pypto_serving_qwen import plugin

    return PluginManager(extra_plugins=[plugin])


def _generate(path: Path, scheduler: str, prompts: list[list[int]], params: list[SamplingParams]) -> Any:
    llm = LLM(
        model=str(path),
        plugins=_plugins(),
        scheduler=scheduler,
        worker_mode="process",
        device="cpu",
        dtype="float32",
        block_size=4,
        max_model_len=128,
        num_kv_blocks=28,  # 112 token slots for ~170 tokens of work: forces preemption
        max_num_batched_tokens=24,  # chunked prefill of the longer prompts
        seed=0,
    )
    try:
        assert llm.engine.scheduler_name == scheduler
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs], llm.engine.stats()
    finally:
        llm.shutdown()


def test_qwen_async_equals_sync_in_worker_process(qwen3: Path) -> None:
    gen = torch.Generator().manual_seed(5)
    lengths = [3, 7, 12, 20, 30, 5]
    prompts = [torch.randint(4, 320, (n,), generator=gen).tolist() for n in lengths]
    params = [
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=16),
        SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=1.2, top_k=20, seed=12, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, stop_token_ids=[7, 9]),
    ]
    sync, _ = _generate(qwen3, "sync", prompts, params)
    asyn, stats = _generate(qwen3, "async", prompts, params)
    assert asyn == sync
    assert sum(len(t) for t, _ in sync) > 60
    assert stats["num_preemptions"] > 0
