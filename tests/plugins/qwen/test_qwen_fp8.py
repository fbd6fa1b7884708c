"""Block-FP8 checkpoints: a tiny Qwen3 checkpoint quantized here (every 2-D projection weight to
float8_e4m3fn with 128x128-style block scales, as FP8 checkpoints are published) loads through the
real loader and gives logits within FP8 tolerance of the float32 original; other quantization
methods and FP8 tensors without a quantization_config are refused by name."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pypto_serving.quantization import QuantizedWeight, UnsupportedQuantizationError
from pypto_serving_qwen.executor import QwenExecutor
from pypto_serving_qwen.loader import CheckpointError
from pypto_serving_qwen.model import QwenSparseMoe
from tests.core.test_quantization import quantize
from tests.plugins.qwen.qwen_fixtures import PagedBatchBuilder, qwen_settings

BLOCK = (16, 16)  # the tiny model's projections are a few blocks wide, as 128x128 is on real ones
_QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _fp8_copy(src: Path, dest: Path, *, declare: bool = True, dequantized: Path | None = None) -> Path:
    """An FP8 copy of ``src``; with ``dequantized``, also a float32 copy holding exactly the values
    the FP8 weights stand for (scales spread over their blocks with a Kronecker product)."""
    shutil.copytree(src, dest)
    (shard,) = dest.glob("*.safetensors")
    tensors = load_file(str(shard))
    out: dict[str, torch.Tensor] = {}
    plain: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name.endswith(".weight") and any(p in name for p in _QUANTIZED):
            q, scale = quantize(t.float(), BLOCK)
            out[name], out[name + "_scale_inv"] = q, scale
            spread = torch.kron(scale, torch.ones(BLOCK))[: t.shape[0], : t.shape[1]]
            plain[name] = q.float() * spread
        else:
            out[name] = plain[name] = t
    save_file(out, str(shard))
    if dequantized is not None:
        shutil.copytree(src, dequantized)
        save_file(plain, str(next(dequantized.glob("*.safetensors"))))
    if declare:
        cfg = json.loads((dest / "config.json").read_text())
        cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(BLOCK)}
        (dest / "config.json").write_text(json.dumps(cfg))
    return dest


def _logits(path: Path, ids: list[int]) -> torch.Tensor:
    """Every position's logits of ``ids``, through the real loader and executor."""
    ex = QwenExecutor(qwen_settings(path))
    ex.load()
    ex.init_kv_cache({"kv": 16})
    return ex.execute(PagedBatchBuilder(4, 16).step([("s", ids)]))


def test_fp8_checkpoint_matches_the_float_one(tmp_path: Path, qwen_checkpoints: Callable[[str], Path]) -> None:
    ref = qwen_checkpoints("qwen3")
    fp8 = _fp8_copy(ref, tmp_path / "fp8", dequantized=tmp_path / "dequantized")
    ids = [3, 17, 5, 99, 42, 7, 250, 11]
    orig, exact, got = (_logits(p, ids) for p in (ref, tmp_path / "dequantized", fp8))
    # The loader reproduces the values the FP8 weights and scales stand for (up to float32 rounding).
    assert torch.allclose(got, exact, rtol=1e-5, atol=1e-5)
    # And those are the float model within FP8 error: e4m3 rounds each weight by up to 2**-4 relative,
    # which through this random tiny model moves the logits by about 10 % (measured 9.8 %); a weight
    # loaded without its scale, or with another block's, moves them by far more.
    rel = ((orig - got).norm() / orig.norm()).item()
    assert 0 < rel < 0.2, rel


def test_fp8_tensors_without_quantization_config_are_refused(
    tmp_path: Path, qwen_checkpoints: Callable[[str], Path]
) -> None:
    bad = _fp8_copy(qwen_checkpoints("qwen3"), tmp_path / "undeclared", declare=False)
    with pytest.raises(
        CheckpointError, match=r"is torch.float8_e4m3fn but config.json declares no quantization_config"
    ):
        QwenExecutor(qwen_settings(bad)).load()


def test_other_quantization_methods_are_refused_by_name(
    tmp_path: Path, qwen_checkpoints: Callable[[str], Path]
) -> None:
    awq = tmp_path / "awq"
    shutil.copytree(qwen_checkpoints("qwen3"), awq)
    cfg = json.loads((awq / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 128}
    (awq / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedQuantizationError, match="quant_method='awq' is not supported"):
        QwenExecutor(qwen_settings(awq)).load()


def _tensor_bytes(path: Path) -> int:
    (shard,) = path.glob("*.safetensors")
    return sum(t.numel() * t.element_size() for t in load_file(str(shard)).values())


def test_fp8_moe_experts_stay_fp8_and_match_the_dequantized_copy(
    tmp_path: Path, qwen_checkpoints: Callable[[str], Path]
) -> None:
    """Qwen3-MoE's routed experts (one FP8 matrix and ``weight_scale_inv`` per expert, as Qwen3-FP8
    publishes them) are held FP8 and run through quant_moe_experts: the same greedy tokens as the
    float32 checkpoint holding the values they stand for, and no float copy of any expert."""
    fp8 = _fp8_copy(qwen_checkpoints("qwen3_moe"), tmp_path / "fp8", dequantized=tmp_path / "dequantized")
    runs = []
    for path in (tmp_path / "dequantized", fp8):
        ex = QwenExecutor(qwen_settings(path))
        ex.load()
        ex.init_kv_cache({"kv": 16})
        builder, ids = PagedBatchBuilder(4, 16), [3, 17, 5, 99, 42, 7, 250, 11]
        logits = [ex.execute(builder.step([("s", ids)]))]
        for _ in range(4):  # greedy decode steps
            logits.append(ex.execute(builder.step([("s", [int(logits[-1][-1].argmax())])])))
        runs.append((ex, torch.cat(logits)))
    (plain, exact), (ex, got) = runs
    assert torch.equal(got.argmax(-1), exact.argmax(-1))
    assert torch.allclose(got, exact, rtol=1e-4, atol=1e-4)
    assert ex.model is not None and plain.model is not None
    moe = [layer.mlp for layer in ex.model.layers if isinstance(layer.mlp, QwenSparseMoe)]
    assert moe and all(
        isinstance(w, QuantizedWeight) and w.data.dtype == torch.float8_e4m3fn for m in moe for w in (m.gate_up, m.down)
    )
    # Held weights: float parameters plus the FP8 data and scales (projections and expert stacks).
    held = sum(p.numel() * p.element_size() for p in ex.model.parameters())
    held += sum(w.nbytes() for w in ex.model.quantized_weights())
    dequantized = sum(p.numel() * p.element_size() for p in plain.model.parameters())
    written = _tensor_bytes(fp8)
    assert held <= 1.1 * written < dequantized, (held, written, dequantized)
