"""A profile of the DeepSeek-V4 executor names each decoder layer by its attention kind, its attention
and MoE parts, and each MTP depth, inside the worker's trace."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from pypto_serving import LLM, SamplingParams

from .helpers import build_checkpoint, plugin_manager

pytestmark = pytest.mark.requires_plugin("sync_sched")


def test_the_worker_trace_names_each_layer_by_its_kind(tmp_path: Path) -> None:
    ckpt = build_checkpoint(tmp_path / "ds", n_mtp=1)
    llm = LLM(
        model=str(ckpt.path),
        plugins=plugin_manager(),
        dtype="float32",
        device="cpu",
        worker_mode="inproc",
        scheduler="sync",
        block_size=4,
        speculative_config={"method": "mtp", "num_speculative_tokens": 1},
    )
    try:
        assert llm.engine is not None
        llm.engine.profile(True, str(tmp_path / "p"))
        llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
        llm.engine.profile(False, str(tmp_path / "p"))
    finally:
        llm.shutdown()
    names = Counter(e.get("name") for e in json.loads((tmp_path / "p.worker.json").read_text())["traceEvents"])
    steps = names["forward"]
    assert steps >= 2
    for kind in ("sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"):
        assert names[f"layer {kind}"] == steps, names
        assert names[f"attention {kind}"] >= steps
    assert names["moe"] >= 3 * steps
    assert names["layer mtp0"] >= 1
