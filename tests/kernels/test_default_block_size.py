"""Default settings run the device's fused paged attention.

The block size comes from ``ServingSettings()`` as a user gets it (``device = "auto"``, ``block_size``
unset) on a host whose device is CUDA (faked: tensors on a fake CUDA device under ``FakeTensorMode``,
flash-attn a recording stand-in, an sm90 capability) or an NPU (a stand-in ``torch_npu``); the call goes
through the kernel registry as a model's attention layer makes it. The core's rule for which block
sizes each fused path takes (:mod:`pypto_serving.devices`, which the start-up warning uses) is checked
against the kernels' own.
"""

from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import pypto_kernels
from pypto_kernels import registry
from pypto_kernels.backends import cuda as cuda_backend
from pypto_serving import ServingSettings, devices
from tests.plugins.qwen.fake_cuda import CUDA, fake_cuda

HEADS, KV_HEADS, HEAD_DIM = 8, 2, 128  # a Qwen3-like bf16 attention layer
MODEL_FEATURES: dict[str, Any] = {
    "dtype": torch.bfloat16,
    "cache_dtype": torch.bfloat16,
    "value_dtype": torch.bfloat16,
    "num_heads": HEADS,
    "num_kv_heads": KV_HEADS,
    "head_dim": HEAD_DIM,
    "value_head_dim": HEAD_DIM,
    "host_lengths": True,
    "contiguous_cache": True,
}


@pytest.fixture
def clean_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "_FAST_PATHS", {})
    monkeypatch.setattr(registry, "_LOADED_DEVICE_TYPES", set())


@pytest.fixture
def cuda_host(clean_registry: None, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[Any, ...]]]:
    """A host whose ``device = "auto"`` is CUDA (sm90, flash-attn with block tables installed); yields
    the flash-attn calls as (query device, key cache shape)."""
    calls: list[tuple[Any, ...]] = []

    def flash_attn_varlen_func(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_k: torch.Tensor,
        max_seqlen_q: int,
        max_seqlen_k: int,
        dropout_p: float = 0.0,
        softmax_scale: float | None = None,
        causal: bool = False,
        window_size: tuple[int, int] = (-1, -1),
        block_table: torch.Tensor | None = None,
    ) -> torch.Tensor:
        calls.append((q.device, tuple(k.shape)))
        return torch.empty_like(q)

    fake = types.ModuleType("flash_attn")
    fake.flash_attn_varlen_func = flash_attn_varlen_func  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "flash_attn", fake)
    monkeypatch.setattr(cuda_backend, "_capability", lambda index: (9, 0))
    monkeypatch.setattr(devices, "auto_device_kind", lambda: "cuda")
    cuda_backend._load_flash_attn_varlen.cache_clear()
    yield calls
    cuda_backend._load_flash_attn_varlen.cache_clear()


@pytest.fixture
def npu_backend(clean_registry: None, monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """The NPU backend imported over a stand-in torch_npu, on a host whose ``device = "auto"`` is the NPU."""
    fake = types.ModuleType("torch_npu")
    fake.npu_fused_infer_attention_score = lambda *a, **k: None  # type: ignore[attr-defined]
    fake._npu_reshape_and_cache = lambda *a, **k: None  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch_npu", fake)
    monkeypatch.delitem(sys.modules, "pypto_kernels.backends.npu", raising=False)
    monkeypatch.setattr(pypto_kernels.device, "npu_available", lambda: True)
    monkeypatch.setattr(devices, "auto_device_kind", lambda: "npu")
    backend = importlib.import_module("pypto_kernels.backends.npu")
    monkeypatch.setitem(sys.modules, "pypto_kernels.backends.npu", backend)  # dropped again on teardown
    return backend


def test_the_default_configuration_runs_flash_attn_on_cuda(cuda_host: list[tuple[Any, ...]]) -> None:
    block = ServingSettings().block_size
    label = pypto_kernels.describe_kernel("paged_attention", CUDA, block_size=block, **MODEL_FEATURES)
    assert label == cuda_backend.PAGED_ATTENTION_LABEL, f"default block size {block}: {label}"
    q_lens, kv_lens = [5, 1, 1], [5, 300, 40]  # a prefill and two decodes, one past a block boundary
    blocks = sum(-(-n // block) for n in kv_lens) + 1
    with fake_cuda():
        query = torch.empty(sum(q_lens), HEADS, HEAD_DIM, dtype=torch.bfloat16, device=CUDA)
        key_cache, value_cache = (
            torch.empty(blocks, block, KV_HEADS, HEAD_DIM, dtype=torch.bfloat16, device=CUDA) for _ in range(2)
        )
        tables = torch.empty(len(q_lens), max(-(-n // block) for n in kv_lens), dtype=torch.int32, device=CUDA)
        query_start_loc = torch.empty(len(q_lens) + 1, dtype=torch.int32, device=CUDA)
        seq_lens = torch.empty(len(q_lens), dtype=torch.int32, device=CUDA)
        out = pypto_kernels.paged_attention(
            query,
            key_cache,
            value_cache,
            tables,
            query_start_loc,
            seq_lens,
            HEAD_DIM**-0.5,
            query_lens_host=q_lens,
            seq_lens_host=kv_lens,
        )
    assert out.device == CUDA and tuple(out.shape) == tuple(query.shape)
    assert cuda_host == [(CUDA, (blocks, block, KV_HEADS, HEAD_DIM))]


def test_a_block_size_set_on_cuda_is_honoured_even_where_it_turns_flash_attn_off(
    cuda_host: list[tuple[Any, ...]],
) -> None:
    settings = ServingSettings(block_size=16)
    assert settings.block_size == 16
    label = pypto_kernels.describe_kernel("paged_attention", CUDA, block_size=settings.block_size, **MODEL_FEATURES)
    assert label.startswith("reference") and "256" in label


def test_the_default_configuration_runs_the_fused_attention_on_npu(npu_backend: types.ModuleType) -> None:
    block = ServingSettings().block_size
    label = pypto_kernels.describe_kernel("paged_attention", "npu:0", block_size=block, **MODEL_FEATURES)
    assert label == npu_backend.PAGED_ATTENTION_LABEL, f"default block size {block}: {label}"


@pytest.mark.parametrize("kind", ["cuda", "npu"])
def test_the_cores_block_size_rule_is_the_kernels(
    kind: str, cuda_host: list[tuple[Any, ...]], npu_backend: types.ModuleType
) -> None:
    """For every block size up to 1024 the core's start-up warning fires exactly when the kernel
    declines for the block size, and the device's default is one the kernel takes."""
    explain = cuda_backend.explain_paged_attention if kind == "cuda" else npu_backend.explain_paged_attention
    for block in range(1, 1025):
        kernel_takes = explain(block_size=block, **MODEL_FEATURES) is None
        assert (devices.fused_attention_refusal(kind, block) is None) == kernel_takes, (kind, block)
    assert explain(block_size=devices.default_block_size(kind), **MODEL_FEATURES) is None
