"""A profile of the Qwen executor names each layer's forward by its kind inside the worker's trace."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from pypto_serving import LLM, SamplingParams
from tests.plugins.qwen.qwen_fixtures import make_qwen_checkpoint

pytestmark = pytest.mark.requires_plugin("sync_sched")


def test_the_worker_trace_names_each_layer_by_its_kind(tmp_path: Path) -> None:
    model = make_qwen_checkpoint(tmp_path / "qwen3", "qwen3", num_hidden_layers=2)
    # One forward a command, so each forward has a schedule phase of its own.
    with LLM(model=str(model), device="cpu", worker_mode="inproc", scheduler="sync", num_scheduler_steps=1) as llm:
        assert llm.engine is not None
        llm.engine.profile(True, str(tmp_path / "p"))
        llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
        llm.engine.profile(False, str(tmp_path / "p"))
        assert llm.engine.worker._profiler._layers is None  # the hooks left with the profile
    names = Counter(e.get("name") for e in json.loads((tmp_path / "p.worker.json").read_text())["traceEvents"])
    steps = names["forward"]
    assert steps == 3  # a prefill and two decodes
    assert names["layer QwenDecoderLayer"] == 2 * steps
    assert names["QwenAttention"] == 2 * steps and names["QwenMLP"] == 2 * steps
    assert names["schedule"] == steps  # one process: the engine's phases are in the same trace
