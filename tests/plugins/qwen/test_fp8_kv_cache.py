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
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

import pypto_kernels as K
from pypto_serving_qwen.executor import QwenExecutor
from pypto_serving_qwen.loader import CheckpointError
from pypto_serving_qwen.plugin import TINY_QWEN3
from tests.plugins.embedded import engine_greedy, tokenize
from tests.plugins.qwen.qwen_fixtures import PagedBatchBuilder, qwen_settings

FP8 = torch.float8_e4m3fn


def test_the_fp8_cache_attends_as_its_dequantised_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """Written with scales 0.5 / 2.0 (and values past the range, which saturate), the FP8 cache gives
    the attention of a float32 cache holding ``stored * scale``, bit for bit (both through the torch
    paths: the native kernel, which reads float32 caches and not FP8 ones, rounds its sums otherwise)."""
    monkeypatch.setattr(K.native, "library", lambda: None)
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


def _prefill_logits(kv_cache_dtype: str, ids: list[int], model: Path = TINY_QWEN3) -> tuple[torch.Tensor, int]:
    """Every position's logits, prefilled in chunks of 64 (later chunks read earlier ones from the cache)."""
    ex = QwenExecutor(qwen_settings(model, kv_cache_dtype=kv_cache_dtype, block_size=16))
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
    for dtype in ("fp8", "bfloat16"):
        fake = ServingSettings(executor="fake", worker_mode="inproc", kv_cache_dtype=dtype)
        with pytest.raises(
            ValueError, match=rf"kv_cache_dtype='{dtype}' is not supported by the fake executor \(it supports 'auto'\)"
        ):
            LLM(settings=fake, plugins=PluginManager(extra_plugins=[FakePlugin]))


# ----------------------------------------------------------------------------- per-head scales


def test_per_head_scales_store_and_read_each_head_over_its_own_scale(monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``[Hkv]`` scale tensor: head ``h`` is stored as ``K[:, h] / s[h]`` (saturated) and read back
    times ``s[h]``: the attention of a float32 cache holding that, bit for bit (torch paths, as above);
    a 0-d tensor scale is the float scale."""
    monkeypatch.setattr(K.native, "library", lambda: None)
    torch.manual_seed(1)
    blocks, block_size, kv_heads, dim = 4, 4, 2, 8
    key, value = torch.randn(6, kv_heads, dim) * 3, torch.randn(6, kv_heads, dim) * 3
    k_scale, v_scale = torch.tensor([0.0625, 4.0]), torch.tensor([2.0, 0.01])  # 0.01: head 1's values saturate
    caches = [torch.empty(blocks, block_size, kv_heads, dim, dtype=FP8) for _ in range(2)]
    tables, slots = torch.tensor([[2, 0]], dtype=torch.int32), torch.tensor([8, 9, 10, 11, 0, 1])
    K.write_kv_cache(key, value, *caches, slots, k_scale=k_scale, v_scale=v_scale)
    stored = caches[0].view(-1, kv_heads, dim)[slots].float()
    for h in range(kv_heads):
        assert torch.equal(stored[:, h], (key[:, h] / k_scale[h]).clamp(-448, 448).to(FP8).float())
    assert caches[1].view(-1, kv_heads, dim)[slots][:, 1].float().abs().max() == 448.0
    query, qsl, seq = (
        torch.randn(6, 4, dim),
        torch.tensor([0, 6], dtype=torch.int32),
        torch.tensor([6], dtype=torch.int32),
    )
    got = K.paged_attention(query, *caches, tables, qsl, seq, 0.3, k_scale=k_scale, v_scale=v_scale)
    floats = [c.float() * s[:, None] for c, s in zip(caches, (k_scale, v_scale), strict=True)]
    assert torch.equal(got, K.paged_attention(query, *floats, tables, qsl, seq, 0.3))
    one = K.paged_attention(query, *caches, tables, qsl, seq, 0.3, k_scale=torch.tensor(2.0), v_scale=torch.tensor(0.5))
    assert torch.equal(one, K.paged_attention(query, *caches, tables, qsl, seq, 0.3, k_scale=2.0, v_scale=0.5))


def _calibrated_copy(dest: Path, ids: list[int], per_head: bool) -> Path:
    """tiny-qwen3 with vLLM's ``self_attn.k_scale`` / ``v_scale`` (amax / 448 of this text's K and V,
    per KV head or per tensor), calibrated on the float model."""
    shutil.copytree(TINY_QWEN3, dest)
    amax: list[torch.Tensor] = []
    write = K.qk_norm_rope_write_kv

    def record(*args: Any, **kwargs: Any) -> torch.Tensor:
        q = write(*args, **kwargs)
        (key_cache, value_cache), slots = args[7], args[8]  # float32 caches: what was written, exactly
        block_size = key_cache.shape[1]
        key, value = (c[slots // block_size, slots % block_size] for c in (key_cache, value_cache))
        amax.append(torch.stack([key.abs().amax(dim=(0, 2)), value.abs().amax(dim=(0, 2))]))
        return q

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(K, "qk_norm_rope_write_kv", record)
        _prefill_logits("auto", ids)
    layers = int(json.loads((dest / "config.json").read_text())["num_hidden_layers"])
    per_layer = torch.stack(amax).view(-1, layers, 2, amax[0].shape[-1]).amax(dim=0) / 448
    tensors = load_file(str(dest / "model.safetensors"))
    for i in range(layers):
        for j, which in enumerate("kv"):
            scale = per_layer[i, j] if per_head else per_layer[i, j].amax()
            tensors[f"model.layers.{i}.self_attn.{which}_scale"] = scale.contiguous()
    save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
    return dest


def test_checkpoint_kv_scales_per_head_and_per_tensor(tmp_path: Path) -> None:
    """Scales from the checkpoint reach each layer (this rank's heads; per tensor spread over them)
    and keep the FP8 cache within the bounds of scale 1.0 (accuracy in docs/benchmarks.md); a scale
    of another shape is refused by name."""
    ids = tokenize(TINY_QWEN3, inspect.getsource(json.decoder))[:128]
    exact, _ = _prefill_logits("auto", ids)
    for per_head in (True, False):
        path = _calibrated_copy(tmp_path / f"per_head_{per_head}", ids, per_head)
        want = load_file(str(path / "model.safetensors"))["model.layers.1.self_attn.v_scale"]
        got, _ = _prefill_logits("fp8", ids, path)
        err = (got - exact).abs()
        assert 0 < err.mean() < 0.06 and err.max() < 1.0
        # Measured, 128 positions: 95.3 % per head, 94.5 % per tensor, 95.3 % at scale 1.0 (on 496: 96.8,
        # 96.4 and 97.4 %): E4M3 keeps 3 mantissa bits at any scale, so calibration only avoids saturation.
        assert (got.argmax(-1) == exact.argmax(-1)).float().mean() >= 0.93
        ex = QwenExecutor(qwen_settings(path, kv_cache_dtype="fp8"))
        ex.load()
        assert ex.model is not None
        scales = ex.model.layers[1].self_attn.kv_scales
        assert scales is not None and torch.equal(scales[1], want.expand_as(scales[1]))
    bad = load_file(str(path / "model.safetensors"))
    bad["model.layers.0.self_attn.k_scale"] = torch.ones(3)
    save_file(bad, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"KV cache scale 'model\.layers\.0\.self_attn\.k_scale' .* \[3\]"):
        QwenExecutor(qwen_settings(path, kv_cache_dtype="fp8")).load()
