"""End to end through the engine: greedy output equals transformers, and MTP k=1..3 equals no
speculation. Skipped while ``pypto_serving.LLM`` is not importable."""

from __future__ import annotations

import pytest
import torch

from .helpers import plugin_manager

try:
    from pypto_serving import LLM, SamplingParams
except ImportError:  # the engine lands separately; the executor tests above do not need it
    LLM = None

pytestmark = pytest.mark.skipif(LLM is None, reason="pypto_serving.LLM is not importable yet")

MAX_TOKENS = 48


def _generate(path, prompts, **settings):
    llm = LLM(
        model=str(path),
        plugins=plugin_manager(),
        dtype="float32",
        device="cpu",
        worker_mode="inproc",
        block_size=4,
        max_num_batched_tokens=16,
        **settings,
    )
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]
    finally:
        llm.shutdown()


def _prompts():
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, 96, (n,), generator=g).tolist() for n in (9, 21)]


def test_engine_greedy_matches_transformers(checkpoints):
    ckpt = checkpoints["mixed_yarn"]
    prompts = _prompts()
    ours = _generate(ckpt.path, prompts)
    for prompt, got in zip(prompts, ours):
        with torch.no_grad():
            ref = ckpt.hf.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False)
        assert got == ref[0, len(prompt) :].tolist()


@pytest.mark.parametrize("k", [1, 2, 3])
def test_engine_mtp_equals_no_speculation(checkpoints, k):
    ckpt = checkpoints["mixed_yarn"]
    prompts = _prompts()
    base = _generate(ckpt.path, prompts)
    spec = _generate(ckpt.path, prompts, speculative_config={"method": "mtp", "num_speculative_tokens": k})
    assert spec == base
