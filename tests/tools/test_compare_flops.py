"""benchmarks/compare.py's FLOP accounting (each engine's share of the matmul peak): the projections it
counts from config.json equal the weights of the decoder transformers builds from the same config,
and its attention term equals a brute-force count of (query, key) pairs."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("transformers.models.qwen3", reason="transformers with Qwen3 not installed")

import torch

from tests.scripts import load_script


def _compare() -> Any:
    return load_script("benchmarks/compare.py")


def _linear_weights(model: torch.nn.Module) -> tuple[int, int]:
    """Weights of every nn.Linear in the decoder layers (MoE: the router plus ``top_k`` experts'
    share of the expert weights), and of the output projection."""
    layers = model.model.layers
    decoder = 0
    for layer in layers:
        for name, module in layer.named_modules():
            if isinstance(module, torch.nn.Linear) or name.endswith("mlp.gate"):  # the router is a matmul too
                decoder += module.weight.numel()
            elif name.endswith("mlp.experts"):  # stacked routed experts: a token runs top_k of them
                stacked = sum(p.numel() for p in module.parameters())
                decoder += stacked * model.config.num_experts_per_tok // model.config.num_experts
    return decoder, model.lm_head.weight.numel()


@pytest.mark.parametrize("moe", [False, True], ids=["qwen3", "qwen3-moe"])
def test_matmul_params_are_the_decoders_weights(moe: bool) -> None:
    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3MoeConfig

    common: dict[str, Any] = {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 24,
        "vocab_size": 300,
        "intermediate_size": 96,
        "tie_word_embeddings": False,
    }
    if moe:
        cfg = Qwen3MoeConfig(**common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=40)
    else:
        cfg = Qwen3Config(**common)
    model = AutoModelForCausalLM.from_config(cfg)
    assert _compare().matmul_params(cfg.to_dict()) == _linear_weights(model)


def test_workload_flops_count_every_causal_pair() -> None:
    config = {
        "hidden_size": 8,
        "num_hidden_layers": 3,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 4,
        "vocab_size": 10,
        "intermediate_size": 16,
    }
    compare = _compare()
    prompts, new = [3, 5, 1], 4
    decoder, head = compare.matmul_params(config)
    tokens = sum(prompts) + len(prompts) * new
    pairs = sum(1 for p in prompts for query in range(p + new) for key in range(p + new) if key <= query)
    attention = 3 * 2 * 4 * 2 * 2 * pairs  # layers x heads x head_dim x (QK + PV) x multiply-add
    expected = 2 * decoder * tokens + 2 * head * len(prompts) * new + attention
    assert compare.workload_flops(config, prompts, new) == expected


@pytest.mark.parametrize("tied", [True, False])
def test_bytes_per_step_leave_out_an_embedding_apart_from_the_head(tmp_path: Any, tied: bool) -> None:
    """A step reads the head and the layers, and a few rows of an input embedding of its own: its bytes
    are the files' less that embedding (a tied one is the head, read whole)."""
    import json

    from safetensors.torch import save_file

    tensors = {"model.embed_tokens.weight": torch.zeros(64, 8), "model.layers.0.mlp.up_proj.weight": torch.zeros(4, 8)}
    if not tied:
        tensors["lm_head.weight"] = torch.zeros(64, 8, dtype=torch.int8)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"tie_word_embeddings": tied, "torch_dtype": "float32"}))
    files = (tmp_path / "model.safetensors").stat().st_size
    assert _compare().weight_bytes(str(tmp_path)) == (files if tied else files - 64 * 8 * 4)


def test_bytes_per_step_leave_out_the_experts_a_token_does_not_run(tmp_path: Any) -> None:
    """A mixture of experts' concurrency-1 step reads ``num_experts_per_tok`` of each layer's routed
    experts (and every other weight, shared experts and the router among them)."""
    import json

    from safetensors.torch import save_file

    tensors = {f"model.layers.0.mlp.experts.{e}.down_proj.weight": torch.zeros(4, 8) for e in range(4)}
    tensors["model.layers.0.mlp.gate.weight"] = torch.zeros(4, 8)
    tensors["model.layers.0.mlp.shared_expert.up_proj.weight"] = torch.zeros(4, 8)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    config = {"tie_word_embeddings": True, "torch_dtype": "float32", "num_experts": 4, "num_experts_per_tok": 1}
    (tmp_path / "config.json").write_text(json.dumps(config))
    files = (tmp_path / "model.safetensors").stat().st_size
    assert _compare().weight_bytes(str(tmp_path)) == files - 3 * 4 * 8 * 4  # three of the four experts unread
