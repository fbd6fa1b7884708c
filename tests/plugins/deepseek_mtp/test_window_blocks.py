"""Bounded sliding-window KV on DeepSeek-V4: the ``swa`` and ``mtp*`` cache groups declare windows,
so a request holds O(window) of their blocks. Every free block of those groups is filled with NaN
after each step: a block given back while some step can still read it turns the output into NaN
garbage, so the greedy tokens over 2.5x the window must still equal transformers'."""

from __future__ import annotations

import functools
import math
from typing import Any

import pytest

pytest.importorskip("transformers.models.deepseek_v4", reason="transformers with DeepSeek-V4 not installed")
pytestmark = pytest.mark.requires_plugin("sync_sched")

from pypto_serving import LLM, SamplingParams  # noqa: E402
from pypto_serving.kv_cache import FREED  # noqa: E402
from pypto_serving_deepseek_mtp.plugin import TINY_DEEPSEEK_V4  # noqa: E402
from tests.plugins.embedded import tokenize, transformers_greedy  # noqa: E402

BLOCK = 16
NEW_TOKENS = 160  # the tiny model's window is 64


@functools.cache
def _reference(prompt: tuple[int, ...]) -> list[int]:
    return transformers_greedy(TINY_DEEPSEEK_V4, list(prompt), NEW_TOKENS)


def _poison_free_blocks(engine: Any) -> None:
    caches = engine.worker._runner.executor.model.caches
    for g in engine.kv.windowed:
        free = list(engine.kv.pools[g.name].free)
        if free:
            caches[g.name][:, free] = float("nan")


@pytest.mark.parametrize("k", [0, 2])
def test_window_groups_hold_bounded_blocks_and_outputs_match_transformers(k: int) -> None:
    prompt = tokenize(TINY_DEEPSEEK_V4, "import os\nimport sys\n\n")
    spec = {"speculative_config": {"method": "mtp", "num_speculative_tokens": k, "policy": "fixed"}} if k else {}
    llm = LLM(
        model=str(TINY_DEEPSEEK_V4),
        device="cpu",
        dtype="float32",
        worker_mode="inproc",
        scheduler="sync",
        block_size=BLOCK,
        num_kv_blocks=64,
        **spec,
    )
    engine = llm.engine
    assert engine is not None
    windowed = {g.name: g.window_tokens for g in engine.kv.windowed}
    assert set(windowed) == {"swa", *(f"mtp{d}" for d in range(k))}
    engine.add_request("r", prompt, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
    tokens: list[int] = []
    peak = {name: 0 for name in windowed}
    try:
        while engine.has_unfinished():
            for out in engine.step():
                tokens = list(out.outputs[0].token_ids)
            _poison_free_blocks(engine)
            for r in engine.scheduler.running:
                for name in windowed:
                    held = sum(1 for b in r.kv.block_ids.get(name, []) if b != FREED)
                    peak[name] = max(peak[name], held)
    finally:
        llm.shutdown()
    assert tokens == _reference(tuple(prompt))
    for name, window in windowed.items():
        assert window is not None
        # The window, the prompt's first chunk and k + 1 new tokens, over block boundaries.
        assert peak[name] <= math.ceil((window + max(len(prompt), k + 1)) / BLOCK) + 2, (name, peak)
    total = math.ceil((len(prompt) + NEW_TOKENS) / BLOCK)
    assert peak["swa"] < total  # without the window every block would still be held
