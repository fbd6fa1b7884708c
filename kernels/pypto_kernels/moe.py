"""Mixture-of-experts routing and grouped expert MLPs."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from .activation import silu_and_mul
from .registry import dispatch

SCORING_FUNCTIONS = ("softmax", "sigmoid", "sqrtsoftplus")


def router_scores(router_logits: torch.Tensor, scoring: str) -> torch.Tensor:
    """Per-expert router scores in float32 by ``scoring`` (one of :data:`SCORING_FUNCTIONS`)."""
    logits = router_logits.to(torch.float32)
    if scoring == "softmax":
        return torch.softmax(logits, dim=-1)
    if scoring == "sigmoid":
        return torch.sigmoid(logits)
    if scoring == "sqrtsoftplus":
        return torch.sqrt(F.softplus(logits))
    raise ValueError(f"unknown scoring {scoring!r}; supported: {', '.join(SCORING_FUNCTIONS)}")


@dispatch("topk_routing")
def topk_routing(
    router_logits: torch.Tensor,
    top_k: int,
    norm_topk_prob: bool,
    scoring: str = "softmax",
    bias: torch.Tensor | None = None,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick ``top_k`` experts per token; returns (float32 weights [T, k], int64 ids [T, k]).

    Scores are computed in float32 (as HF Qwen-MoE does). ``bias`` (DeepSeek-V3 style
    load-balancing correction) only influences which experts are selected; the weights
    are the unbiased scores, optionally renormalised, then scaled by ``routed_scaling_factor``.
    """
    scores = router_scores(router_logits, scoring)
    if bias is None:
        weights, ids = torch.topk(scores, top_k, dim=-1)
    else:
        _, ids = torch.topk(scores + bias.to(torch.float32), top_k, dim=-1)
        weights = scores.gather(-1, ids)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if routed_scaling_factor != 1.0:
        weights = weights * routed_scaling_factor
    return weights, ids


@dispatch("moe_experts")
def moe_experts(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    activation: Callable[[torch.Tensor], torch.Tensor] = silu_and_mul,
) -> torch.Tensor:
    """Sum over k of weight * down_e(act(gate_up_e x)) for each token's selected experts.

    Tokens are grouped by expert (one matmul pair per expert that has tokens) and
    accumulated with ``index_add_``; weights are cast to ``x.dtype`` and multiplied after
    the down projection, the same order HF uses, so bf16 results track HF closely.
    """
    num_tokens, top_k = ids.shape
    out = torch.zeros_like(x)
    if num_tokens == 0:
        return out
    flat_ids = ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=gate_up.shape[0]).tolist()
    token_of = order // top_k
    flat_weights = weights.reshape(-1)[order].to(x.dtype)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        tokens = token_of[start : start + count]
        hidden = activation(F.linear(x[tokens], gate_up[expert]))
        hidden = F.linear(hidden, down[expert]) * flat_weights[start : start + count, None]
        out.index_add_(0, tokens, hidden.to(out.dtype))
        start += count
    return out
