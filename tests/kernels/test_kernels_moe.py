"""topk_routing and moe_experts against naive loops and transformers' Qwen3MoeSparseMoeBlock."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pypto_kernels import moe_experts, topk_routing

E, H, INTER, TOP_K = 8, 32, 16, 3


def naive_experts(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate, up = (gate_up[e].double() @ x[t].double()).chunk(2)
            out[t] += float(weights[t, j]) * (down[e].double() @ (F.silu(gate) * up))
    return out


def random_moe(dtype: torch.dtype, tokens: int = 11, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H, generator=gen).to(dtype)
    gate_up = (torch.randn(E, 2 * INTER, H, generator=gen) * 0.2).to(dtype)
    down = (torch.randn(E, H, INTER, generator=gen) * 0.2).to(dtype)
    router = torch.randn(E, H, generator=gen).to(dtype)
    return x, gate_up, down, router


@pytest.mark.parametrize("norm", [True, False])
def test_moe_experts_matches_naive_loop(norm: bool) -> None:
    x, gate_up, down, router = random_moe(torch.float32)
    weights, ids = topk_routing(x @ router.T, TOP_K, norm)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64 and ids.shape == (11, TOP_K)
    out = moe_experts(x, gate_up, down, weights, ids)
    torch.testing.assert_close(out.double(), naive_experts(x, gate_up, down, weights, ids), atol=1e-5, rtol=1e-5)


def test_moe_experts_empty_and_unused_experts() -> None:
    x, gate_up, down, _ = random_moe(torch.float32, tokens=4)
    ids = torch.tensor([[2, 5], [5, 2], [2, 7], [7, 5]])
    weights = torch.rand(4, 2)
    out = moe_experts(x, gate_up, down, weights, ids)
    torch.testing.assert_close(out.double(), naive_experts(x, gate_up, down, weights, ids), atol=1e-5, rtol=1e-5)
    empty = moe_experts(x[:0], gate_up, down, weights[:0], ids[:0])
    assert empty.shape == (0, H)


def test_softmax_routing_naive() -> None:
    logits = torch.randn(6, E, generator=torch.Generator().manual_seed(1))
    weights, ids = topk_routing(logits, 2, True)
    for t in range(6):
        probs = torch.softmax(logits[t].double(), dim=0)
        top = sorted(range(E), key=lambda e: -probs[e])[:2]
        assert ids[t].tolist() == top
        expected = probs[top] / probs[top].sum()
        torch.testing.assert_close(weights[t].double(), expected, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("scoring", ["sigmoid", "sqrtsoftplus"])
@pytest.mark.parametrize("norm", [True, False])
def test_biased_scoring_routing(scoring: str, norm: bool) -> None:
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(5, E, generator=gen)
    bias = torch.zeros(E)
    bias[0] = 100.0  # forces expert 0 into every selection without affecting its weight
    weights, ids = topk_routing(logits, 2, norm, scoring=scoring, bias=bias, routed_scaling_factor=2.5)
    scores = torch.sigmoid(logits) if scoring == "sigmoid" else torch.sqrt(F.softplus(logits))
    assert (ids[:, 0] == 0).all()
    assert torch.equal(ids[:, 1], scores[:, 1:].argmax(dim=-1) + 1)
    picked = scores.gather(1, ids)
    if norm:
        picked = picked / picked.sum(-1, keepdim=True)
    torch.testing.assert_close(weights, picked * 2.5, atol=1e-6, rtol=1e-6)
    with pytest.raises(ValueError, match="unknown scoring"):
        topk_routing(logits, 2, norm, scoring="tanh")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm", [True, False])
def test_matches_qwen3_moe_sparse_block(dtype: torch.dtype, norm: bool) -> None:
    pytest.importorskip("transformers")
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cfg = Qwen3MoeConfig(
        hidden_size=H,
        moe_intermediate_size=INTER,
        num_experts=E,
        num_experts_per_tok=TOP_K,
        norm_topk_prob=norm,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    block = Qwen3MoeSparseMoeBlock(cfg)
    x, gate_up, down, router = random_moe(dtype, tokens=13, seed=3)
    with torch.no_grad():
        block.gate.weight.copy_(router.float())
        block.experts.gate_up_proj.copy_(gate_up.float())
        block.experts.down_proj.copy_(down.float())
    block = block.to(dtype)
    with torch.no_grad():
        _, hf_weights, hf_ids = block.gate(x)
        expected = block(x[None])[0]

    weights, ids = topk_routing(F.linear(x, router), TOP_K, norm)
    assert torch.equal(ids, hf_ids)
    assert torch.equal(weights.to(dtype), hf_weights)
    out = moe_experts(x, gate_up, down, weights, ids)
    assert out.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-6)
    else:
        torch.testing.assert_close(out, expected, atol=1e-2, rtol=1e-2)
