"""``pypto-serving convert``: the shipped tiny Qwen3 and DeepSeek-V4 checkpoints converted to block FP8
load through today's loaders and decode exactly as float copies holding the values the FP8 weights
stand for (built here from the files, independently of the loaders); the W8A8 files follow
msModelSlim's layout and decode, by its ``(q - offset) * scale`` convention, to within half a step of
the original weights; what cannot be converted is refused with the reason."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from pypto_serving.cli import main
from pypto_serving.convert import ConversionError, convert_checkpoint

qwen_plugin = pytest.importorskip("pypto_serving_qwen.plugin")
deepseek_plugin = pytest.importorskip("pypto_serving_deepseek_mtp.plugin")
TINY_QWEN3: Path = qwen_plugin.TINY_QWEN3
TINY_DEEPSEEK_V4: Path = deepseek_plugin.TINY_DEEPSEEK_V4


def _tensors(model: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for shard in sorted(model.glob("*.safetensors")):
        out.update(load_file(str(shard)))
    return out


def _dequantized_copy(fp8: Path, dest: Path) -> Path:
    """A float32 copy of an FP8 checkpoint: each weight times its scale spread over its block."""
    shutil.copytree(fp8, dest, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    block = json.loads((fp8 / "config.json").read_text())["quantization_config"]["weight_block_size"]
    cfg = json.loads((dest / "config.json").read_text())
    del cfg["quantization_config"]
    (dest / "config.json").write_text(json.dumps(cfg))
    tensors, plain = _tensors(fp8), {}
    for name, t in tensors.items():
        if name.endswith("_scale_inv"):
            continue
        if t.dtype == torch.float8_e4m3fn:
            spread = torch.kron(tensors[name + "_scale_inv"], torch.ones(block))[: t.shape[0], : t.shape[1]]
            plain[name] = t.float() * spread
        else:
            plain[name] = t
    save_file(plain, str(dest / "model.safetensors"))
    return dest


def _greedy(model: Path, **settings: object) -> list[int]:
    from tests.plugins.embedded import engine_greedy, tokenize

    ids = tokenize(model, "def main():\n")
    return engine_greedy(str(model), ids, 12, dtype="float32", **settings)


def test_qwen_to_block_fp8_by_the_cli_decodes_as_its_dequantized_copy(tmp_path: Path) -> None:
    out = tmp_path / "fp8"
    assert main(["convert", "tiny-qwen3", str(out), "--to", "fp8", "--shard-gb", "0.002"]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["quantization_config"] == {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) > 1  # 2 MB shards: streamed into several files
    assert (out / "tokenizer.json").read_bytes() == (TINY_QWEN3 / "tokenizer.json").read_bytes()
    src, got = _tensors(TINY_QWEN3), _tensors(out)
    q, scale = got["model.layers.0.mlp.gate_proj.weight"], got["model.layers.0.mlp.gate_proj.weight_scale_inv"]
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32 and scale.shape == (3, 1)  # [384, 128]
    for name in ("model.embed_tokens.weight", "model.norm.weight", "model.layers.0.self_attn.q_norm.weight"):
        assert torch.equal(got[name], src[name])
    plain = _dequantized_copy(out, tmp_path / "plain")
    err = (_tensors(plain)["model.layers.0.mlp.gate_proj.weight"] - src["model.layers.0.mlp.gate_proj.weight"]).abs()
    assert err.max() <= src["model.layers.0.mlp.gate_proj.weight"].abs().max() / 16  # e4m3: 3 mantissa bits
    assert _greedy(out) == _greedy(plain)


def test_deepseek_v4_to_block_fp8_decodes_as_its_dequantized_copy_with_mtp(tmp_path: Path) -> None:
    out = tmp_path / "fp8"
    result = convert_checkpoint(TINY_DEEPSEEK_V4, out, "fp8", block=(16, 16))
    quantized = set(result.quantized)
    assert "mtp.0.e_proj.weight" in quantized and "model.layers.0.ffn.experts.0.w1.weight" in quantized
    for kept in ("head.weight", "model.embed_tokens.weight", "model.layers.0.ffn.gate.weight", "mtp.0.enorm.weight"):
        assert kept in result.kept
    plain = _dequantized_copy(out, tmp_path / "plain")
    spec = {"speculative_config": {"method": "mtp", "num_speculative_tokens": 1}}
    assert _greedy(out, **spec) == _greedy(plain, **spec)


@pytest.mark.parametrize("model", [TINY_QWEN3, TINY_DEEPSEEK_V4], ids=["qwen3", "deepseek_v4"])
def test_w8a8_follows_msmodelslim_and_decodes_to_half_a_step(tmp_path: Path, model: Path) -> None:
    out = tmp_path / "w8a8"
    result = convert_checkpoint(model, out, "w8a8")
    description = json.loads((out / "quant_model_description.json").read_text())
    src, got = _tensors(model), _tensors(out)
    assert description.pop("model_quant_type") == "W8A8_DYNAMIC"
    assert set(description) == set(got)
    assert not (out / "config.json").read_text().count("quantization_config")
    for name in result.quantized:
        stem = name[: -len("weight")]
        q, scale, offset = got[name], got[stem + "weight_scale"], got[stem + "weight_offset"]
        assert {description[n] for n in (name, stem + "weight_scale", stem + "weight_offset")} == {"W8A8_DYNAMIC"}
        assert q.dtype == torch.int8 and q.shape == src[name].shape
        assert scale.shape == offset.shape == (q.shape[0], 1) and scale.dtype == offset.dtype == torch.float32
        assert not offset.any()  # symmetric
        decoded = (q.float() - offset) * scale  # msModelSlim: deq_weight = (weight - weight_offset) * weight_scale
        assert ((decoded - src[name].float()).abs() <= scale / 2 + 1e-7).all(), name
    floats = [n for n, kind in description.items() if kind == "FLOAT"]
    assert set(floats) == set(result.kept)
    assert all(torch.equal(got[n], src[n]) for n in floats)
    assert not any("norm" in n or "embed" in n or "head.weight" in n or ".gate.weight" in n for n in result.quantized)


def test_quantize_head_gives_a_tied_qwen_its_own_int8_head_that_decodes_as_its_float_values(tmp_path: Path) -> None:
    """``--quantize-head`` on the tied tiny Qwen3: the embedding stays float, ``lm_head.weight`` is its
    int8 per-row quantisation (msModelSlim's layout, to half a step), the config unties them, and the
    engine decodes it as a float copy holding those values (the activations' per-token int8 rounding
    aside: the greedy tokens agree)."""
    out = tmp_path / "w8a8"
    assert main(["convert", "tiny-qwen3", str(out), "--to", "w8a8", "--quantize-head"]) == 0
    assert json.loads((TINY_QWEN3 / "config.json").read_text())["tie_word_embeddings"] is True
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    description = json.loads((out / "quant_model_description.json").read_text())
    assert description["model.embed_tokens.weight"] == "FLOAT"
    assert {description["lm_head.weight" + s] for s in ("", "_scale", "_offset")} == {"W8A8_DYNAMIC"}
    src, got = _tensors(TINY_QWEN3), _tensors(out)
    embedding = src["model.embed_tokens.weight"].float()
    assert torch.equal(got["model.embed_tokens.weight"], src["model.embed_tokens.weight"])
    q, scale = got["lm_head.weight"], got["lm_head.weight_scale"]
    assert q.dtype == torch.int8 and q.shape == embedding.shape and scale.shape == (q.shape[0], 1)
    assert ((q.float() * scale - embedding).abs() <= scale / 2 + 1e-7).all()
    plain = tmp_path / "plain"
    shutil.copytree(out, plain, ignore=shutil.ignore_patterns("*.safetensors", "quant_model_description.json"))
    floats = {n: t for n, t in got.items() if t.dtype != torch.int8 and not n.endswith(("_scale", "_offset"))}
    for name, t in got.items():
        if t.dtype == torch.int8:
            floats[name] = t.float() * got[name + "_scale"]
    save_file(floats, str(plain / "model.safetensors"))
    assert _greedy(out) == _greedy(plain)
    fp8 = tmp_path / "fp8"  # an FP8 head: kept FP8, and decodes as its dequantised copy exactly
    convert_checkpoint(TINY_QWEN3, fp8, "fp8", quantize_head=True)
    assert _tensors(fp8)["lm_head.weight"].dtype == torch.float8_e4m3fn
    assert _greedy(fp8) == _greedy(_dequantized_copy(fp8, tmp_path / "fp8-plain"))
    with pytest.raises(ConversionError, match="DeepSeek-V4 executor keeps its output projection in float"):
        convert_checkpoint(TINY_DEEPSEEK_V4, tmp_path / "ds", "w8a8", quantize_head=True)


def test_what_cannot_be_converted_is_refused(tmp_path: Path) -> None:
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    with pytest.raises(ConversionError, match="not an empty directory"):
        convert_checkpoint(TINY_QWEN3, tmp_path / "full", "fp8")
    with pytest.raises(ConversionError, match="unknown target format 'int4'"):
        convert_checkpoint(TINY_QWEN3, tmp_path / "a", "int4")
    fp8 = tmp_path / "fp8"
    convert_checkpoint(TINY_QWEN3, fp8, "fp8")
    with pytest.raises(ConversionError, match="already quantized"):
        convert_checkpoint(fp8, tmp_path / "again", "w8a8")
    assert main(["convert", str(tmp_path / "nowhere"), str(tmp_path / "b"), "--to", "fp8"]) == 2


def test_output_shards_hold_every_tensor_once(tmp_path: Path) -> None:
    out = tmp_path / "w8a8"
    convert_checkpoint(TINY_DEEPSEEK_V4, out, "w8a8", shard_bytes=1 << 20)
    weight_map = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    seen: list[str] = []
    for shard in sorted(out.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            keys = list(f.keys())
        assert all(weight_map[k] == shard.name for k in keys)
        seen += keys
    assert sorted(seen) == sorted(weight_map)
