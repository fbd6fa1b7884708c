"""``kv_cache_dtype = "fp8"``: the paged kernels store K/V as float8_e4m3fn over a per-tensor scale and
read them back dequantised (exactly the attention of the dequantised cache), the tiny Qwen3 keeps its
greedy tokens with a quarter of the cache bytes, and executors without it refuse it by name.

Measured on the shipped tiny-qwen3 (float32, 512 teacher-forced positions of Python source prefilled
in chunks of 64, so later chunks read earlier ones from the cache): max |logit error| 0.49 against
logits up to 14.9, mean 0.029, top-1 agreement 97.3 %, mean KL 1e-3; greedy decoding of four prompts
for 64 tokens each agreed on all 256 tokens. (DeepSeek-V4: tests/plugins/deepseek_mtp/test_fp8_kv_cache.py.)"""

from __future__ import annotations

import inspect
import json

import pytest
import torch

import pypto_kernels as K
from pypto_serving_qwen.executor import QwenExecutor
from pypto_serving_qwen.plugin import TINY_QWEN3
from tests.plugins.embedded import engine_greedy, tokenize
from tests.plugins.qwen.qwen_fixtures import PagedBatchBuilder, qwen_settings

FP8 = torch.float8_e4m3fn


def test_the_fp8_cache_attends_as_its_dequantised_copy() -> None:
    """Written with scales 0.5 / 2.0 (and values past the range, which saturate), the FP8 cache gives
    the attention of a float32 cache holding ``stored * scale``, bit for bit."""
    torch.manual_seed(0)
    blocks, block_size, kv_heads, dim = 6, 4, 2, 8
    lens = [5, 9]
    key, value = torch.randn(sum(lens), kv_heads, dim) * 3, torch.randn(sum(lens), kv_heads, dim) * 3
    key[0, 0, 0] = 10_000.0  # past 448 * 0.5: saturates
    cache_k, cache_v = (
        torch.empty(blocks, block_size, kv_heads, dim, dtype=FP8),
        torch.empty(blocks, block_size, kv_heads, dim, dtype=FP8),
    )
    tables = torch.tensor([[3, 1, 0], [5, 2, 4]], dtype=torch.int32)
    slots = torch.tensor(
        [int(tables[r, p // block_size]) * block_size + p % block_size for r, n in enumerate(lens) for p in range(n)]
    )
    K.write_kv_cache(key, value, cache_k, cache_v, slots, k_scale=0.5, v_scale=2.0)
    stored_k = cache_k.view(-1, kv_heads, dim)[slots].float()
    assert stored_k[0, 0, 0] == 448.0
    assert torch.equal(stored_k[1:], (key[1:] / 0.5).to(FP8).float())
    query = torch.randn(sum(lens), 4, dim)
    qsl, seq = torch.tensor([0, 5, 14], dtype=torch.int32), torch.tensor(lens, dtype=torch.int32)
    got = K.paged_attention(query, cache_k, cache_v, tables, qsl, seq, 0.3, k_scale=0.5, v_scale=2.0)
    want = K.paged_attention(query, cache_k.float() * 0.5, cache_v.float() * 2.0, tables, qsl, seq, 0.3)
    assert torch.equal(got, want)
    exact = K.paged_attention(query, *_float_caches(key, value, cache_k.shape, slots), tables, qsl, seq, 0.3)
    # The second request (no saturated key) stays within e4m3's rounding (3 mantissa bits, 6 %) of the
    # float cache's attention, measured against the values' size.
    assert 0 < (got - exact)[5:].abs().max() < 0.06 * value.abs().max()


def _float_caches(
    key: torch.Tensor, value: torch.Tensor, shape: torch.Size, slots: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    k, v = torch.zeros(shape), torch.zeros(shape)
    K.write_kv_cache(key, value, k, v, slots)
    return k, v


def _prefill_logits(kv_cache_dtype: str, ids: list[int]) -> tuple[torch.Tensor, int]:
    """Every position's logits, prefilled in chunks of 64 (later chunks read earlier ones from the cache)."""
    ex = QwenExecutor(qwen_settings(TINY_QWEN3, kv_cache_dtype=kv_cache_dtype, block_size=16))
    info = ex.load()
    ex.init_kv_cache({"kv": 32})
    builder = PagedBatchBuilder(16, 32)
    rows = [ex.execute(builder.step([("s", ids[i : i + 64])])) for i in range(0, len(ids), 64)]
    return torch.cat(rows), info.cache_groups[0].bytes_per_block


def test_tiny_qwen3_keeps_its_greedy_tokens_with_a_quarter_of_the_cache() -> None:
    ids = tokenize(TINY_QWEN3, inspect.getsource(json.decoder))[:256]
    exact, exact_bytes = _prefill_logits("auto", ids)
    fp8, fp8_bytes = _prefill_logits("fp8", ids)
    assert fp8_bytes * 4 == exact_bytes  # float32 -> one byte per element
    err = (fp8 - exact).abs()
    assert 0 < err.mean() < 0.06 and err.max() < 1.0
    assert (fp8.argmax(-1) == exact.argmax(-1)).float().mean() >= 0.95
    prompt = tokenize(TINY_QWEN3, "def main():\n")
    assert engine_greedy(str(TINY_QWEN3), prompt, 32, kv_cache_dtype="fp8") == engine_greedy(
        str(TINY_QWEN3), prompt, 32
    )


def test_fp8_is_refused_where_it_is_not_supported() -> None:
    from pypto_serving import LLM, PluginManager
    from pypto_serving.config import ServingSettings
    from tests.fakes import FakePlugin

    settings = qwen_settings(TINY_QWEN3, kv_cache_dtype="fp8", executor_options={"graph_mode": "aot_eager"})
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8' is not supported with executor_options graph_mode"):
        QwenExecutor(settings).load()
    # An executor that does not declare it in ExecutorInfo.kv_cache_dtypes is refused by the engine.
    fake = ServingSettings(executor="fake", worker_mode="inproc", kv_cache_dtype="fp8")
    with pytest.raises(
        ValueError, match=r"kv_cache_dtype='fp8' is not supported by the fake executor \(it supports 'auto'\)"
    ):
        LLM(settings=fake, plugins=PluginManager(extra_plugins=[FakePlugin]))
