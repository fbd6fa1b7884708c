"""topk_routing and moe_experts against naive loops and transformers' Qwen3MoeSparseMoeBlock.

The grouped path (``grouped_moe_experts``) is checked against the per-expert loop it replaces
(``looped_moe_experts``, kept as the reference) on random and adversarial routings.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException, FakeTensorMode

from pypto_kernels import moe_experts, topk_routing
from pypto_kernels.moe import grouped_mm_supported, grouped_moe_experts, looped_moe_experts

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


def clamped_swiglu(gate_up: torch.Tensor, limit: float = 0.5) -> torch.Tensor:
    """A DeepSeek-V4-style clamped SwiGLU: any row-wise activation must pass through unchanged."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)


def routing(kind: str, tokens: int, top_k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, ids) of one routing pattern; ids are distinct per token as top-k makes them."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "random":
        ids = torch.rand(tokens, E, generator=gen).argsort(dim=-1)[:, :top_k]
    elif kind == "few_experts":  # experts 0, 1, 4, 6 and 7 get no tokens
        pool = torch.tensor([5, 2, 3])
        ids = pool[torch.rand(tokens, 3, generator=gen).argsort(dim=-1)[:, :top_k]]
    else:  # "one_expert": every token's first choice is the last expert
        ids = torch.rand(tokens, E - 1, generator=gen).argsort(dim=-1)[:, : top_k - 1]
        ids = torch.cat([torch.full((tokens, 1), E - 1), ids], dim=1)
    return torch.rand(tokens, top_k, generator=gen), ids


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": lambda gu: F.silu(gu.chunk(2, dim=-1)[0]) * gu.chunk(2, dim=-1)[1],
    "clamped": clamped_swiglu,
}


@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
@pytest.mark.parametrize("kind", ["random", "few_experts", "one_expert"])
@pytest.mark.parametrize("top_k", [1, TOP_K])
@pytest.mark.parametrize("tokens", [1, 7, 64])
def test_grouped_matches_loop(tokens: int, top_k: int, kind: str, activation: str) -> None:
    x, gate_up, down, _ = random_moe(torch.float32, tokens=tokens, seed=tokens)
    weights, ids = routing(kind, tokens, top_k, seed=top_k)
    act = ACTIVATIONS[activation]
    inputs = [t.clone() for t in (x, gate_up, down, weights, ids)]
    expected = looped_moe_experts(x, gate_up, down, weights, ids, act)
    got = grouped_moe_experts(x, gate_up, down, weights, ids, act)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(moe_experts(x, gate_up, down, weights, ids, act), expected, atol=1e-5, rtol=1e-5)
    for before, after in zip(inputs, (x, gate_up, down, weights, ids)):
        assert torch.equal(before, after)  # the weights (shared with other layers' calls) stay untouched
    assert grouped_moe_experts(x[:0], gate_up, down, weights[:0], ids[:0], act).shape == (0, H)


@pytest.mark.parametrize("impl", [grouped_moe_experts, looped_moe_experts])
@pytest.mark.parametrize("tokens", [1, 9, 64])
def test_dropped_routes_add_nothing_and_cost_no_expert_flops(impl: Callable[..., torch.Tensor], tokens: int) -> None:
    """Routes with id E (how expert parallelism marks another rank's routes) add nothing, even with a
    weight: the result is that of the kept routes alone, and it stays finite although ``_grouped_mm``
    leaves the dropped rows' output unset."""
    x, gate_up, down, _ = random_moe(torch.float32, tokens=tokens, seed=tokens)
    weights, ids = routing("random", tokens, TOP_K, seed=tokens)
    drop = torch.rand(ids.shape, generator=torch.Generator().manual_seed(1)) < 0.5
    dropped_ids = torch.where(drop, E, ids)
    got = impl(x, gate_up, down, weights, dropped_ids)
    assert bool(torch.isfinite(got).all())
    kept = naive_experts(x, gate_up, down, torch.where(drop, 0.0, weights), ids)
    torch.testing.assert_close(got.double(), kept, atol=1e-5, rtol=1e-5)
    every = impl(x, gate_up, down, weights, torch.full_like(ids, E))
    assert torch.equal(every, torch.zeros_like(x))


def test_grouped_bf16_tracks_loop() -> None:
    x, gate_up, down, router = random_moe(torch.bfloat16, tokens=33, seed=5)
    weights, ids = topk_routing(F.linear(x, router), TOP_K, True)
    expected = looped_moe_experts(x, gate_up, down, weights, ids)
    got = grouped_moe_experts(x, gate_up, down, weights, ids)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, expected, atol=1e-2, rtol=1e-2)


def test_dtypes_grouped_mm_rejects_take_the_loop() -> None:
    x, gate_up, down, router = random_moe(torch.float64, tokens=9, seed=6)
    assert not grouped_mm_supported(x, gate_up, down)
    assert grouped_mm_supported(x.float(), gate_up.float(), down.float())
    weights, ids = topk_routing(F.linear(x, router), TOP_K, True)
    out = moe_experts(x, gate_up, down, weights, ids)
    torch.testing.assert_close(out, naive_experts(x, gate_up, down, weights, ids), atol=1e-9, rtol=1e-9)


def test_grouped_makes_no_host_sync_on_a_fake_cuda_device() -> None:
    """Fake tensors hold no data: any host read of a value (.tolist, .item, bincount's size) raises."""
    x, gate_up, down, router = random_moe(torch.bfloat16, tokens=6, seed=7)
    weights, ids = topk_routing(F.linear(x, router), TOP_K, True)
    with FakeTensorMode():
        # Made inside the mode: a CPU-only torch cannot move a (fake) tensor to CUDA.
        fake = [torch.empty(t.shape, dtype=t.dtype, device="cuda") for t in (x, gate_up, down, weights, ids)]
        assert grouped_mm_supported(*fake[:3])
        assert not grouped_mm_supported(*(t.float() for t in fake[:3]))  # CUDA float32: aten's fallback syncs
        unaligned = torch.empty(E, H, INTER + 1, dtype=torch.bfloat16, device="cuda")
        assert not grouped_mm_supported(fake[0], fake[1], unaligned)  # the CUTLASS kernel wants 16-byte rows
        out = moe_experts(*fake, activation=clamped_swiglu)
        assert out.shape == x.shape and out.device.type == "cuda" and out.dtype == torch.bfloat16
        # The loop's bincount (size read from the data) and .tolist() are caught: the check above has teeth.
        with pytest.raises((DataDependentOutputException, DynamicOutputShapeException)):
            looped_moe_experts(*fake)


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid", "sqrtsoftplus"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_topk_routing_makes_no_host_sync_on_a_fake_cuda_device(scoring: str, with_bias: bool) -> None:
    """Routing is scores, topk, gather and a renormalisation: shapes known without reading data."""
    with FakeTensorMode(allow_non_fake_inputs=False):
        logits = torch.empty(6, E, dtype=torch.bfloat16, device="cuda")
        bias = torch.empty(E, device="cuda") if with_bias else None
        weights, ids = topk_routing(logits, TOP_K, True, scoring, bias, routed_scaling_factor=2.5)
        assert weights.device.type == ids.device.type == "cuda"
        assert (weights.shape, weights.dtype, ids.shape, ids.dtype) == (
            (6, TOP_K),
            torch.float32,
            (6, TOP_K),
            torch.int64,
        )


def test_moe_experts_runs_grouped_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The plugins call moe_experts: on the CPU in float32/bf16 it must never fall back to the loop."""
    import pypto_kernels.moe as moe

    def no_loop(*args: object, **kwargs: object) -> torch.Tensor:
        raise AssertionError("moe_experts fell back to the per-expert loop")

    monkeypatch.setattr(moe, "looped_moe_experts", no_loop)
    for dtype in (torch.float32, torch.bfloat16):
        x, gate_up, down, router = random_moe(dtype, tokens=5, seed=8)
        weights, ids = topk_routing(F.linear(x, router), TOP_K, True)
        assert moe_experts(x, gate_up, down, weights, ids).shape == x.shape
