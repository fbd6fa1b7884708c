"""Checkpoint loading: every refusal names the file, tensor or field at fault."""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from pypto_serving import read_generation_config
from pypto_serving_qwen.executor import QwenExecutor
from pypto_serving_qwen.loader import CheckpointError, read_config
from tests.plugins.qwen.qwen_fixtures import qwen_settings


@pytest.fixture
def copy_ckpt(tmp_path: Path, qwen_checkpoints: Callable[[str], Path]) -> Callable[[str], Path]:
    """A private, editable copy of a session checkpoint."""

    def copy(name: str) -> Path:
        dest = tmp_path / name
        shutil.copytree(qwen_checkpoints(name), dest)
        return dest

    return copy


def _edit_config(path: Path, **changes: Any) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def _load(path: Path) -> Any:
    return QwenExecutor(qwen_settings(path)).load()


def test_missing_model_dir(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        _load(tmp_path / "nope")


def test_missing_config(copy_ckpt: Callable[[str], Path]) -> None:
    path = copy_ckpt("qwen3")
    (path / "config.json").unlink()
    with pytest.raises(CheckpointError, match=r"config\.json not found"):
        _load(path)


def test_missing_safetensors(copy_ckpt: Callable[[str], Path]) -> None:
    path = copy_ckpt("qwen3")
    (path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"no model\.safetensors or model\.safetensors\.index\.json"):
        _load(path)


def test_only_pytorch_bin_is_named(copy_ckpt: Callable[[str], Path]) -> None:
    path = copy_ckpt("qwen3")
    (path / "model.safetensors").rename(path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"pytorch_model\.bin.*only safetensors"):
        _load(path)


def test_missing_shard(copy_ckpt: Callable[[str], Path]) -> None:
    path = copy_ckpt("qwen3_sharded")
    shard = sorted(path.glob("model-*.safetensors"))[3]
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"shard '{shard.name}'"):
        _load(path)


def test_unsupported_architecture(copy_ckpt: Callable[[str], Path]) -> None:
    path = copy_ckpt("qwen3")
    _edit_config(path, architectures=["LlamaForCausalLM"])
    with pytest.raises(CheckpointError) as err:
        read_config(path)
    msg = str(err.value)
    assert "'LlamaForCausalLM'" in msg
    for arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):
        assert arch in msg


def test_missing_architectures(copy_ckpt: Callable[[str], Path]) -> None:
    path = copy_ckpt("qwen3")
    _edit_config(path, architectures=None)
    with pytest.raises(CheckpointError, match=r"names no 'architectures'.*Qwen3ForCausalLM"):
        read_config(path)


def test_remote_code_is_refused(copy_ckpt: Callable[[str], Path]) -> None:
    path = copy_ckpt("qwen3")
    _edit_config(
        path,
        architectures=["QWenLMHeadModel"],
        auto_map={
            "AutoConfig": "configuration_qwen.QWenConfig",
            "AutoModelForCausalLM": "modeling_qwen.QWenLMHeadModel",
        },
    )
    with pytest.raises(CheckpointError) as err:
        read_config(path)
    msg = str(err.value)
    assert "auto_map" in msg and "modeling_qwen.QWenLMHeadModel" in msg
    assert "remote code" in msg and "trust_remote_code" in msg
    assert "Qwen3ForCausalLM" in msg


def test_wrong_tensor_shape(copy_ckpt: Callable[[str], Path]) -> None:
    path = copy_ckpt("qwen3")
    tensors = load_file(str(path / "model.safetensors"))
    name = "model.layers.1.self_attn.k_proj.weight"
    assert tensors[name].shape == (32, 64)
    tensors[name] = torch.zeros(48, 64)
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError) as err:
        _load(path)
    msg = str(err.value)
    assert name in msg and "[48, 64]" in msg and "[32, 64]" in msg


def test_missing_weights_are_named(copy_ckpt: Callable[[str], Path]) -> None:
    path = copy_ckpt("qwen3_moe")
    tensors = load_file(str(path / "model.safetensors"))
    gone = ["model.layers.2.mlp.experts.3.up_proj.weight", "model.layers.0.self_attn.q_norm.weight"]
    for name in gone:
        del tensors[name]
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError) as err:
        _load(path)
    msg = str(err.value)
    assert "missing 2 weight(s)" in msg
    assert all(name in msg for name in gone)


def test_untied_model_needs_lm_head(copy_ckpt: Callable[[str], Path]) -> None:
    path = copy_ckpt("qwen2")
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["lm_head.weight"]
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"lm_head\.weight"):
        _load(path)


def test_stacked_expert_layout_loads(copy_ckpt: Callable[[str], Path], qwen_checkpoints: Callable[[str], Path]) -> None:
    """transformers' fused in-memory expert layout ([E, 2I, H] / [E, H, I]) loads to the same model."""
    path = copy_ckpt("qwen3_moe")
    tensors = load_file(str(path / "model.safetensors"))
    for layer in (0, 2):
        p = f"model.layers.{layer}.mlp.experts"
        gate_up, down = [], []
        for e in range(4):
            gate_up.append(
                torch.cat([tensors.pop(f"{p}.{e}.gate_proj.weight"), tensors.pop(f"{p}.{e}.up_proj.weight")])
            )
            down.append(tensors.pop(f"{p}.{e}.down_proj.weight"))
        tensors[f"{p}.gate_up_proj"] = torch.stack(gate_up)
        tensors[f"{p}.down_proj"] = torch.stack(down)
    save_file(tensors, str(path / "model.safetensors"))
    stacked = QwenExecutor(qwen_settings(path))
    stacked.load()
    original = QwenExecutor(qwen_settings(qwen_checkpoints("qwen3_moe")))
    original.load()
    assert stacked.model is not None and original.model is not None
    for (name, a), (_, b) in zip(stacked.model.named_parameters(), original.model.named_parameters(), strict=True):
        assert torch.equal(a, b), name


def test_tied_checkpoint_with_lm_head_copy(copy_ckpt: Callable[[str], Path]) -> None:
    """A tied export that still carries lm_head.weight loads; the embedding is the output matrix."""
    path = copy_ckpt("qwen2_tied")
    tensors = load_file(str(path / "model.safetensors"))
    tensors["lm_head.weight"] = torch.zeros_like(tensors["model.embed_tokens.weight"])
    save_file(tensors, str(path / "model.safetensors"))
    ex = QwenExecutor(qwen_settings(path))
    ex.load()
    assert ex.model is not None
    assert torch.equal(ex.model.lm_head_t.t(), tensors["model.embed_tokens.weight"])


def test_generation_config_eos_int_and_defaults(copy_ckpt: Callable[[str], Path]) -> None:
    path = copy_ckpt("qwen3")
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 7, "top_k": 5, "temperature": None}))
    assert read_generation_config(path) == ([7], {"top_k": 5})
    info = _load(path)
    assert info.eos_token_ids == [7, 2]  # generation_config first, then config.json's eos_token_id
    assert info.generation_defaults == {"top_k": 5}
    (path / "generation_config.json").unlink()
    assert _load(path).eos_token_ids == [2]


def test_dtype_auto_reads_torch_dtype(copy_ckpt: Callable[[str], Path], cpu_flags: Callable[..., None]) -> None:
    cpu_flags("avx512_bf16")
    path = copy_ckpt("qwen3")
    _edit_config(path, dtype=None, torch_dtype="bfloat16")
    ex = QwenExecutor(qwen_settings(path, dtype="auto"))
    ex.load()
    assert ex.dtype == torch.bfloat16
    assert ex.model is not None and ex.model.embed.dtype == torch.bfloat16


def test_dtype_auto_runs_a_bf16_checkpoint_in_float32_on_a_cpu_without_bf16(
    copy_ckpt: Callable[[str], Path], cpu_flags: Callable[..., None], caplog: pytest.LogCaptureFixture
) -> None:
    """Emulated bfloat16 is about 20x slower than float32 on such a CPU: 'auto' upcasts and says so;
    an explicit dtype keeps the checkpoint as stored."""
    cpu_flags("avx2", "fma")
    path = copy_ckpt("qwen3")
    _edit_config(path, dtype=None, torch_dtype="bfloat16")
    with caplog.at_level(logging.WARNING, logger="pypto_kernels"):
        ex = QwenExecutor(qwen_settings(path, dtype="auto"))
        ex.load()
    assert ex.dtype == torch.float32 and ex.model is not None and ex.model.embed.dtype == torch.float32
    assert any("no torch.bfloat16 instructions" in r.getMessage() for r in caplog.records)
    kept = QwenExecutor(qwen_settings(path, dtype="bfloat16"))
    kept.load()
    assert kept.dtype == torch.bfloat16


def test_legacy_rope_fields(copy_ckpt: Callable[[str], Path]) -> None:
    """Pre-transformers-5 configs: rope_theta at the top and rope_scaling with 'type'."""
    path = copy_ckpt("qwen3")
    _edit_config(
        path,
        rope_parameters=None,
        rope_theta=5e5,
        rope_scaling={"type": "linear", "factor": 2.0},
        partial_rotary_factor=0.5,
    )
    cfg = read_config(path)
    assert cfg.rope_theta == 5e5
    assert cfg.rope_scaling == {"type": "linear", "factor": 2.0}
    assert cfg.rotary_dim == cfg.head_dim // 2


def test_plugin_registration() -> None:
    from pypto_serving.hookspecs import ExecutorSpec
    from pypto_serving_qwen import plugin

    (spec,) = plugin.pypto_serving_register_executors()
    assert isinstance(spec, ExecutorSpec)
    assert spec.name == "qwen" and spec.factory is plugin.make_executor
    assert spec.architectures == ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")


def test_make_executor_builds_qwen_executor(qwen_checkpoints: Callable[[str], Path]) -> None:
    from pypto_serving_qwen import plugin

    ex = plugin.make_executor(qwen_settings(qwen_checkpoints("qwen2")))
    assert isinstance(ex, QwenExecutor)
    assert ex.load().architecture == "Qwen2ForCausalLM"


def test_load_logs_which_kernel_runs_each_attention_layer_kind(
    qwen_checkpoints: Callable[[str], Path], caplog: Any, monkeypatch: Any
) -> None:
    import pypto_kernels as K

    caplog.set_level("INFO", logger="pypto_serving_qwen.executor")
    QwenExecutor(qwen_settings(qwen_checkpoints("qwen3_sliding"))).load()
    lines = [r.getMessage() for r in caplog.records]
    # qwen3_sliding has one sliding layer (window 6) and full-attention layers; on the CPU both batch
    # their decode rows (its cached tokens are narrow).
    from pypto_kernels.backends.cpu import PAGED_ATTENTION_LABEL

    assert f"full attention layers: paged_attention runs {PAGED_ATTENTION_LABEL}" in lines
    assert f"sliding window 6 layers: paged_attention runs {PAGED_ATTENTION_LABEL}" in lines
    assert "KV writes: write_kv_cache runs reference" in lines
    # A registered fast path is named instead of the reference.
    caplog.clear()
    monkeypatch.setattr(K.registry, "_FAST_PATHS", {})
    K.register_kernel("paged_attention", "cuda", lambda *a, **k: None, label="cuda: test kernel")
    monkeypatch.setattr(K.registry, "_LOADED_DEVICE_TYPES", {"cpu", "cuda"})
    ex = QwenExecutor(qwen_settings(qwen_checkpoints("qwen3")))
    ex.device = torch.device("cuda")
    ex._log_kernels(read_config(qwen_checkpoints("qwen3")))
    assert "full attention layers: paged_attention runs cuda: test kernel" in [r.getMessage() for r in caplog.records]
