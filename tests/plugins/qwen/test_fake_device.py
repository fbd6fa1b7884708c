"""Device discipline of the Qwen executor: on a fake CUDA device every tensor of a step lives on the
device and the forward (prefill, chunked prefill and decodes mixed; dense and MoE) reads nothing
back to the host.

:func:`fake_cuda` (see :mod:`tests.plugins.qwen.fake_cuda`) makes tensors that say ``cuda`` and hold
no data, so a CPU tensor meeting a device one raises a device mismatch and any host read of device
data (``.item()``, ``.tolist()``, ``int(t)``, ``nonzero``, boolean-mask indexing) raises too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode

from pypto_serving import BatchInput, CacheGroupSpec, ExecutorInfo, SamplingParams
from pypto_serving.messages import NewRequestData, ScheduledEntry, wire_sampling
from pypto_serving.runner import ModelRunner
from pypto_serving_qwen.executor import KV_GROUP, QwenExecutor
from pypto_serving_qwen.loader import QuantPlan, QwenConfig, read_config
from pypto_serving_qwen.model import QwenForCausalLM
from tests.plugins.qwen.fake_cuda import CUDA, fake_cuda, on_device
from tests.plugins.qwen.qwen_fixtures import PagedBatchBuilder, qwen_settings

BLOCK_SIZE, NUM_BLOCKS = 4, 32
# The grouped MoE path (no host sync) takes bf16 on CUDA; float32 there goes through the looped
# reference, which reads the per-expert counts back by design.
CASES = [
    ("qwen3", torch.float32),
    ("qwen3_moe", torch.bfloat16),
    ("qwen3_sliding", torch.bfloat16),
    ("qwen2", torch.float32),  # q/k/v biases, no q/k norms
    ("qwen3_moe+fp8_experts", torch.bfloat16),  # block-FP8 experts through quant_moe_experts
    ("qwen3+fp8_head", torch.bfloat16),  # a block-FP8 output projection through quant_linear
]


@pytest.fixture
def fake() -> Iterator[FakeTensorMode]:
    with fake_cuda() as mode:
        yield mode


def _fp8_experts(cfg: QwenConfig) -> QuantPlan:
    """A plan keeping every routed expert block-FP8 (as a Qwen3-FP8 checkpoint's would)."""
    names = [
        f"model.layers.{layer}.mlp.experts.{e}.{proj}_proj.weight"
        for layer in range(cfg.num_layers)
        for e in range(cfg.num_experts)
        for proj in ("gate", "up", "down")
    ]
    return QuantPlan(dict.fromkeys(names, "fp8_block"), (16, 16))


def _fake_executor(
    path: Path, dtype: torch.dtype, kv_cache_dtype: str = "auto", fp8_experts: bool = False, fp8_head: bool = False
) -> QwenExecutor:
    """A QwenExecutor whose model, parameters and caches are fake CUDA tensors (no weights to load)."""
    ex = QwenExecutor(qwen_settings(path, block_size=BLOCK_SIZE, kv_cache_dtype=kv_cache_dtype))
    ex.config = read_config(path)
    ex.device, ex.dtype = CUDA, dtype
    plan = _fp8_experts(ex.config) if fp8_experts else None
    if fp8_head:  # as `pypto-serving convert --to fp8 --quantize-head` writes it
        plan = QuantPlan({"lm_head.weight": "fp8_block"}, (16, 16))
    ex.model = QwenForCausalLM(ex.config, CUDA, dtype, plan=plan).eval()
    ex.init_kv_cache({KV_GROUP: NUM_BLOCKS})
    return ex


def _tensors(ex: QwenExecutor, batch: BatchInput) -> list[torch.Tensor]:
    assert ex.model is not None
    tensors = [*ex.model.parameters(), *ex.model.buffers(), *(t for kv in ex.kv_caches for t in kv)]
    tensors += [t for w in ex.model.quantized_weights() for t in w.tensors()]
    values = [getattr(batch, f.name) for f in dataclasses.fields(batch)]
    flat = [v for value in values for v in (value.values() if isinstance(value, dict) else [value])]
    return tensors + [t for t in flat if isinstance(t, torch.Tensor)]


def _execute(ex: QwenExecutor, batch: BatchInput, vocab: int) -> None:
    assert all(t.device == CUDA for t in _tensors(ex, batch))
    logits = ex.execute(batch)
    expected = (CUDA, torch.float32, (len(batch.logits_indices), vocab))
    assert (logits.device, logits.dtype, tuple(logits.shape)) == expected


def test_the_harness_catches_host_reads_and_device_mixing(fake: FakeTensorMode) -> None:
    """Without this the tests below could pass by not checking anything."""
    lens = torch.tensor([3, 5], device=CUDA)
    with pytest.raises(DataDependentOutputException):
        lens.tolist()
    with pytest.raises(DataDependentOutputException):
        lens.max().item()
    for read in (lambda: int(lens[0]), lambda: lens.nonzero(), lambda: lens[lens > 3]):
        with pytest.raises(Exception):  # noqa: B017 - the class differs between torch versions
            read()
    with pytest.raises(Exception, match=r"[Dd]evice"):
        _ = lens + torch.ones(2, dtype=lens.dtype)  # a (fake) CPU tensor
    assert lens[1:].device == CUDA and lens.to(CUDA).device == CUDA  # indexing and copies are traced


@pytest.mark.parametrize(("name", "dtype"), CASES)
def test_prefill_then_mixed_chunked_prefill_and_decode_on_the_device(
    name: str, dtype: torch.dtype, qwen_checkpoints: Callable[[str], Path]
) -> None:
    path = qwen_checkpoints(name.split("+")[0])
    builder = PagedBatchBuilder(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS)  # draws its block order here
    steps = [
        [("a", list(range(4, 13))), ("b", list(range(5, 11)))],  # a: whole prompt, b: first chunk
        [("a", [7]), ("b", list(range(20, 28))), ("c", list(range(30, 35)))],  # decode, chunk, new prefill
        [("c", [9]), ("a", [8])],  # decodes only
    ]
    with fake_cuda():
        ex = _fake_executor(path, dtype, fp8_experts=name.endswith("+fp8_experts"), fp8_head=name.endswith("_head"))
        assert ex.config is not None and ex.model is not None
        assert bool(ex.model.quantized_weights()) == ("+" in name)
        assert (ex.model.lm_head_q is not None) == name.endswith("_head")
        for chunks in steps:
            _execute(ex, on_device(builder.step(chunks, all_logits=False)), ex.config.vocab_size)
        # The native decoder (ctypes over CPU pointers) is the CPU's alone: every step ran the forward.
        assert not ex.model.native_decoder_enabled and ex.graph_stats.native_decoder_steps == 0
        # So is the greedy loop built on it: declined with no host read, the runner's forwards one by one.
        decode = on_device(builder.step([("c", [11]), ("a", [12])], all_logits=False))
        assert ex.greedy_steps(decode, 4, [frozenset()] * 2) is None


@pytest.mark.parametrize("per_head", [False, True], ids=["scale-1.0", "per-head-scales"])
def test_an_fp8_cache_is_written_and_read_on_the_device(
    qwen_checkpoints: Callable[[str], Path], per_head: bool
) -> None:
    """kv_cache_dtype = "fp8": quantising writes and dequantising reads add no host read or device mix,
    with scale 1.0 or the checkpoint's per-head scales (device tensors, never compared on the host)."""
    builder = PagedBatchBuilder(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS)
    steps = [[("a", list(range(4, 13))), ("b", list(range(5, 11)))], [("a", [7]), ("b", list(range(20, 25)))]]
    path = qwen_checkpoints("qwen3")  # written outside the fake mode (transformers saves real tensors)
    with fake_cuda():
        ex = _fake_executor(path, torch.bfloat16, kv_cache_dtype="fp8")
        assert ex.config is not None and ex.kv_caches[0][0].dtype == torch.float8_e4m3fn
        for layer in ex.model.layers if per_head and ex.model is not None else []:
            heads = layer.self_attn.num_kv_heads
            layer.self_attn.kv_scales = (torch.ones(heads, device=CUDA), torch.ones(heads, device=CUDA))
        for chunks in steps:
            _execute(ex, on_device(builder.step(chunks, all_logits=False)), ex.config.vocab_size)


def test_without_host_lengths_attention_would_read_back(qwen_checkpoints: Callable[[str], Path]) -> None:
    """The negative case: hiding the host lengths from the attention kernel makes the step fail."""
    path = qwen_checkpoints("qwen3")
    builder = PagedBatchBuilder(BLOCK_SIZE, NUM_BLOCKS)
    with fake_cuda():
        ex = _fake_executor(path, torch.float32)
        assert ex.model is not None
        batch = on_device(builder.step([("a", [4, 5, 6])], all_logits=False))
        layer = ex.model.layers[0].self_attn
        original = layer.forward

        def forward(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: Any, meta: Any) -> torch.Tensor:
            blind = dataclasses.replace(meta, query_lens_host=None, seq_lens_host=None)
            out: torch.Tensor = original(x, cos, sin, cache, blind)
            return out

        layer.forward = forward  # type: ignore[method-assign]
        with pytest.raises(DataDependentOutputException):
            ex.execute(batch)


def _runner(ex: QwenExecutor, vocab: int) -> ModelRunner:
    runner = ModelRunner(ex, qwen_settings(Path("unused"), block_size=BLOCK_SIZE))
    runner.info = ExecutorInfo([CacheGroupSpec(KV_GROUP, BLOCK_SIZE, bytes_per_block=1)], vocab, 512)
    runner.device = ex.device
    # A host with CUDA would pin a staging buffer, which under the fake mode is a fake tensor too.
    runner.input_batch.staging.pinned = False
    sampling = wire_sampling(SamplingParams(temperature=0.0), ())
    for rid, prompt in (("a", [4, 5, 6, 7, 8, 9]), ("b", [10, 11, 12])):
        runner._admit(
            NewRequestData(request_id=rid, prompt_token_ids=prompt, output_token_ids=[], sampling=sampling, seed=0)
        )
    runner.states["b"].last_sampled = 40  # b has a sampled token to decode from
    return runner


def _entry(rid: str, tokens: list[int], start: int, blocks: list[int], last: bool = False) -> ScheduledEntry:
    return ScheduledEntry(
        request_id=rid,
        token_ids=tokens,
        use_last_sampled=last,
        num_draft=0,
        start_pos=start,
        rejected_seen=0,
        new_block_ids={KV_GROUP: blocks},
        sample=True,
    )


@pytest.mark.parametrize(("name", "dtype"), CASES[:2])
def test_the_runners_batch_runs_on_the_device(
    name: str, dtype: torch.dtype, qwen_checkpoints: Callable[[str], Path], fake: FakeTensorMode
) -> None:
    """ModelRunner._build_batch builds on the host and copies to the device: the executor gets it there."""
    path = qwen_checkpoints(name)
    ex = _fake_executor(path, dtype)
    assert ex.config is not None
    runner = _runner(ex, ex.config.vocab_size)
    # a: the last 2 prompt tokens after 4 cached ones; b: a decode after its 3-token prompt.
    entries = [_entry("a", [8, 9], 4, [3, 7]), _entry("b", [], 3, [5], last=True)]
    runner._append_blocks(entries)  # what step() does first: the worker keeps each request's tables
    batch, _ = runner._build_batch(entries)
    assert batch.query_start_loc_host == [0, 2, 3] and batch.seq_lens_host == [6, 4]
    _execute(ex, batch, ex.config.vocab_size)
