"""The Qwen executor on a real accelerator (skipped on a host without CUDA).

The CPU suite proves device discipline with fake CUDA tensors (test_fake_device.py); these run the
same executor on the real device when the host has one: greedy tokens equal transformers' on that
device, a step's forward makes no host synchronisation (``torch.cuda.set_sync_debug_mode("error")``
turns any into an exception) and gives the CPU's logits, CUDA-graph replay gives eager's tokens, and
a seeded request samples the same tokens alone and in a batch.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

from pypto_serving import LLM, SamplingParams  # noqa: E402
from pypto_serving_qwen.executor import KV_GROUP, QwenExecutor  # noqa: E402
from pypto_serving_qwen.plugin import TINY_QWEN3  # noqa: E402
from tests.device_helpers import batch_on, no_host_sync  # noqa: E402
from tests.plugins.embedded import tokenize, transformers_greedy  # noqa: E402
from tests.plugins.qwen.qwen_fixtures import PagedBatchBuilder, qwen_settings  # noqa: E402

DEVICE = "cuda"
PROMPTS = ["import os\nimport sys\n\n", "class Config:\n    def __init__(self", "    for i in range(len("]
BLOCK_SIZE, NUM_BLOCKS = 4, 32
STEPS = [
    [("a", list(range(4, 13))), ("b", list(range(5, 11)))],  # a: whole prompt, b: first chunk
    [("a", [7]), ("b", list(range(20, 28))), ("c", list(range(30, 35)))],  # decode, chunk, new prefill
    [("c", [9]), ("a", [8])],  # decodes only
]


def _engine(prompts: list[list[int]], params: SamplingParams, **settings: Any) -> list[list[int]]:
    with LLM(model=str(TINY_QWEN3), device=DEVICE, worker_mode="inproc", **settings) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_greedy_tokens_equal_transformers_on_the_device() -> None:
    prompts = [tokenize(TINY_QWEN3, p) for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    ours = _engine(prompts, params, dtype="float32")
    assert ours == [transformers_greedy(TINY_QWEN3, ids, 16, device=DEVICE) for ids in prompts]


def test_cuda_graph_replay_equals_eager() -> None:
    prompts = [tokenize(TINY_QWEN3, p) for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    eager = _engine(prompts, params, dtype="float32")
    graphs = _engine(prompts, params, dtype="float32", executor_options={"graph_mode": "cudagraph"})
    assert graphs == eager


def test_a_seeded_request_samples_the_same_tokens_alone_and_in_a_batch() -> None:
    prompts = [tokenize(TINY_QWEN3, p) for p in PROMPTS]
    params = SamplingParams(temperature=0.9, top_p=0.95, max_tokens=16, ignore_eos=True, seed=1234)
    alone = _engine(prompts[:1], params, dtype="float32")
    other = SamplingParams(temperature=0.7, max_tokens=16, ignore_eos=True, seed=7)
    with LLM(model=str(TINY_QWEN3), device=DEVICE, worker_mode="inproc", dtype="float32") as llm:
        outs = llm.generate(prompts, [params, other, other], use_tqdm=False)
    assert list(outs[0].outputs[0].token_ids) == alone[0]


def _executor(path: Path, device: str, dtype: str) -> QwenExecutor:
    ex = QwenExecutor(qwen_settings(path, block_size=BLOCK_SIZE, device=device, dtype=dtype))
    ex.load()
    ex.init_kv_cache({KV_GROUP: NUM_BLOCKS})
    return ex


@pytest.mark.parametrize(("name", "dtype"), [("qwen3", "float32"), ("qwen3_moe", "bfloat16"), ("qwen2", "float32")])
def test_a_step_makes_no_host_sync_and_gives_the_cpus_logits(
    name: str, dtype: str, qwen_checkpoints: Callable[[str], Path]
) -> None:
    """Prefill, chunked prefill and decodes mixed: every step under the sync debugger; the logits
    against the CPU executor's on the same batches (float32 to 1e-4; bfloat16 to its rounding)."""
    path = qwen_checkpoints(name)
    device_ex, cpu_ex = _executor(path, DEVICE, dtype), _executor(path, "cpu", dtype)
    builder = PagedBatchBuilder(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS)
    for chunks in STEPS:
        batch = builder.step(chunks, all_logits=False)
        on_device = batch_on(batch, DEVICE)
        with no_host_sync():
            logits = device_ex.execute(on_device)
        assert logits.device.type == "cuda"
        expected = cpu_ex.execute(batch)
        tol = 1e-4 if dtype == "float32" else 5e-2
        torch.testing.assert_close(logits.float().cpu(), expected.float(), atol=tol, rtol=tol)
