"""Block-FP8 DeepSeek-V4 checkpoints: the shipped tiny model with its projection weights quantized
here loads through the real loader and decodes exactly as a float32 copy holding the values the FP8
weights stand for; FP8 tensors without a quantization_config are refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pypto_serving.quantization import UnsupportedQuantizationError
from pypto_serving_deepseek_mtp.plugin import TINY_DEEPSEEK_V4
from tests.core.test_quantization import quantize
from tests.plugins.embedded import engine_greedy, tokenize

BLOCK = (16, 16)


def _copies(dest: Path, *, declare: bool = True) -> tuple[Path, Path]:
    """(FP8 copy, float32 copy of the dequantized values) of the tiny model."""
    fp8, plain = dest / "fp8", dest / "plain"
    for d in (fp8, plain):
        shutil.copytree(TINY_DEEPSEEK_V4, d)
    tensors = load_file(str(TINY_DEEPSEEK_V4 / "model.safetensors"))
    quant: dict[str, torch.Tensor] = {}
    exact: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        is_projection = t.dim() == 2 and name.endswith(".weight") and min(t.shape) >= 16
        if is_projection and ("attn.w" in name or "experts" in name or "shared" in name):
            q, scale = quantize(t.float(), BLOCK)
            quant[name], quant[name + "_scale_inv"] = q, scale
            exact[name] = q.float() * torch.kron(scale, torch.ones(BLOCK))[: t.shape[0], : t.shape[1]]
        else:
            quant[name] = exact[name] = t
    assert any(v.dtype == torch.float8_e4m3fn for v in quant.values())
    save_file(quant, str(fp8 / "model.safetensors"))
    save_file(exact, str(plain / "model.safetensors"))
    if declare:
        cfg = json.loads((fp8 / "config.json").read_text())
        cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(BLOCK)}
        (fp8 / "config.json").write_text(json.dumps(cfg))
    return fp8, plain


@pytest.mark.requires_plugin("sync_sched")
def test_fp8_decodes_as_its_dequantized_values(tmp_path: Path) -> None:
    fp8, plain = _copies(tmp_path)
    ids = tokenize(TINY_DEEPSEEK_V4, "def main():\n")
    kw = {"dtype": "float32", "scheduler": "sync"}
    assert engine_greedy(str(fp8), ids, 12, **kw) == engine_greedy(str(plain), ids, 12, **kw)


def test_fp8_without_quantization_config_is_refused(tmp_path: Path) -> None:
    from pypto_serving import ServingSettings
    from pypto_serving_deepseek_mtp.executor import DeepseekMTPExecutor

    fp8, _ = _copies(tmp_path, declare=False)
    with pytest.raises(UnsupportedQuantizationError, match="declares no quantization_config"):
        DeepseekMTPExecutor(ServingSettings(model=str(fp8), device="cpu", dtype="float32")).load()


def test_ue8m0_scale_fmt_with_float32_scale_inv_loads(tmp_path: Path) -> None:
    """DeepSeek-V3.1 style: ``scale_fmt = "ue8m0"`` declared while the scales stay float32
    ``weight_scale_inv`` tensors; they are read as they are (the E8M0 dtype is required only of the
    release's ``X.scale`` tensors)."""
    from pypto_serving_deepseek_mtp.model import FP32_SUFFIXES
    from pypto_serving_deepseek_mtp.weights import load_weights

    fp8, plain = _copies(tmp_path)
    cfg = json.loads((fp8 / "config.json").read_text())
    cfg["quantization_config"]["scale_fmt"] = "ue8m0"
    (fp8 / "config.json").write_text(json.dumps(cfg))
    got = load_weights(fp8, torch.device("cpu"), torch.float32, FP32_SUFFIXES)
    want = load_weights(plain, torch.device("cpu"), torch.float32, FP32_SUFFIXES)
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in got)
