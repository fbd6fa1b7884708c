"""The DeepSeek-V4 MTP executor on a real accelerator (skipped on a host without CUDA).

test_fake_device.py proves placement and the absence of host reads with fake CUDA tensors; these run
the executor on the real device when the host has one: the shipped tiny model's greedy tokens equal
transformers' on that device, MTP speculation there changes no greedy token while its drafts are
accepted, and ``execute`` (prefill, chunked prefill and verification mixed) runs under
``torch.cuda.set_sync_debug_mode("error")``, which turns any synchronising call into an exception,
and gives the CPU executor's logits.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

from pypto_serving import LLM, SamplingParams  # noqa: E402
from pypto_serving_deepseek_mtp.plugin import TINY_DEEPSEEK_V4  # noqa: E402
from tests.device_helpers import batch_on, no_host_sync  # noqa: E402
from tests.plugins.embedded import tokenize, transformers_greedy  # noqa: E402

from .helpers import FakeCore  # noqa: E402

DEVICE = "cuda"
K = 2
PROMPTS = ["import os\nimport sys\n\n", "class Config:\n    def __init__(self", "    for i in range(len("]


def test_greedy_tokens_equal_transformers_on_the_device() -> None:
    prompts = [tokenize(TINY_DEEPSEEK_V4, p) for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    with LLM(str(TINY_DEEPSEEK_V4), device=DEVICE, dtype="float32", worker_mode="inproc") as llm:
        ours = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    assert ours == [transformers_greedy(TINY_DEEPSEEK_V4, ids, 16, device=DEVICE) for ids in prompts]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mtp_speculation_equals_no_speculation_and_drafts_are_accepted(dtype: str) -> None:
    prompts = [tokenize(TINY_DEEPSEEK_V4, p) for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outputs, stats = [], []
    for spec in (None, {"method": "mtp", "num_speculative_tokens": K}):
        with LLM(
            str(TINY_DEEPSEEK_V4), device=DEVICE, dtype=dtype, worker_mode="inproc", speculative_config=spec
        ) as llm:
            outputs.append([list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)])
            stats.append(llm.engine.stats() if llm.engine is not None else {})
    assert outputs[1] == outputs[0]
    assert stats[1]["spec_accepted"] / max(1, stats[1]["spec_drafted"]) > 0.3, stats[1]


def _executor(path: Any, device: str) -> Any:
    from pypto_serving.config import ServingSettings
    from pypto_serving_deepseek_mtp.executor import DeepseekMTPExecutor

    settings = ServingSettings(
        model=str(path),
        dtype="bfloat16",  # the grouped MoE path, which reads no expert counts back, takes bf16 on CUDA
        device=device,
        block_size=4,
        speculative_config={"method": "mtp", "num_speculative_tokens": K},
        max_num_seqs=4,
    )
    ex = DeepseekMTPExecutor(settings)
    return ex, ex.load()


def _steps(core: FakeCore) -> list[Any]:
    a, b = list(range(3, 12)), list(range(20, 26))
    return [
        core.batch([("a", a[:4], 0, 0), ("b", b, 0, 1)]),
        core.batch([("a", a[4:], 4, 1), ("b", [40, 41, 42], len(b), 1 + K)]),
        core.batch([("a", [50], len(a), 1), ("b", [43, 44], len(b) + 2, 2)]),
        core.batch([("a", [51], len(a) + 1, 1), ("c", list(range(60, 65)), 0, 1), ("b", [45], len(b) + 3, 1)]),
    ]


@pytest.mark.parametrize("name", ["mixed_yarn", "csa_heavy"])
def test_execute_makes_no_host_sync_and_gives_the_cpus_logits(checkpoints: Any, name: str) -> None:
    path = checkpoints[name].path
    torch.manual_seed(0)
    device_ex, info = _executor(path, DEVICE)
    device_steps = [batch_on(b, DEVICE) for b in _steps(FakeCore(device_ex, info))]
    torch.manual_seed(0)  # the same scrambled block layout on the CPU
    cpu_ex, cpu_info = _executor(path, "cpu")
    cpu_steps = _steps(FakeCore(cpu_ex, cpu_info))
    for on_device, on_cpu in zip(device_steps, cpu_steps):
        with no_host_sync():
            logits = device_ex.execute(on_device)
        assert logits.device.type == "cuda"
        expected = cpu_ex.execute(on_cpu).float()
        # bfloat16 on two devices: products summed in other orders round differently.
        scale = expected.abs().max().item()
        assert (logits.float().cpu() - expected).abs().max().item() <= 0.05 * scale
