"""Mixture-of-experts routing and grouped expert MLPs."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from .activation import silu_and_mul
from .native import PackedExperts
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


#: Dtypes ``torch._grouped_mm`` computes on the CPU (it rejects float64).
_GROUPED_CPU_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def grouped_mm_supported(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether :func:`grouped_moe_experts` runs for these operands.

    On the CPU ``_grouped_mm`` takes float32/bf16/fp16 and reads the offsets from host memory
    (no sync). On CUDA only bf16 with 16-byte aligned rows is taken: its CUTLASS kernel (sm90+)
    reads the offsets on the device and rejects unaligned strides, while other dtypes go through
    an aten fallback that copies the offsets to the host, a sync no better than the loop's;
    torch's meta kernel (fake tensors, compile) accepts bf16 only too.
    """
    if not hasattr(torch, "_grouped_mm") or not x.dtype == gate_up.dtype == down.dtype:
        return False
    if x.device.type == "cpu":
        return x.dtype in _GROUPED_CPU_DTYPES
    aligned = all(dim * x.element_size() % 16 == 0 for dim in down.shape[1:])
    return x.device.type == "cuda" and x.dtype == torch.bfloat16 and aligned


def sorted_routes(
    ids: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The (token, slot) routes sorted by expert, stably, so each token meets its experts in expert
    order: ``(order, token rows, route weights in dtype)``, each in sorted order; no host read."""
    order = torch.argsort(ids.reshape(-1), stable=True)
    return order, order // ids.shape[1], weights.reshape(-1).index_select(0, order).to(dtype)


def routes_by_expert(
    ids: torch.Tensor, weights: torch.Tensor, num_experts: int, dtype: torch.dtype
) -> list[tuple[int, int, torch.Tensor, torch.Tensor]]:
    """``(expert, count, token rows, route weights)`` of each expert with routes, in expert order:
    the routes sorted by expert (:func:`sorted_routes`), their counts read to the host once. Dropped
    routes (id ``num_experts``) sort last and are never listed."""
    _, token_of, flat_weights = sorted_routes(ids, weights, dtype)
    counts = torch.bincount(ids.reshape(-1), minlength=num_experts).tolist()[:num_experts]
    out, start = [], 0
    for expert, count in enumerate(counts):
        if count:
            rows = slice(start, start + count)
            out.append((expert, count, token_of[rows], flat_weights[rows]))
            start += count
    return out


def looped_moe_experts(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    activation: Callable[[torch.Tensor], torch.Tensor] = silu_and_mul,
) -> torch.Tensor:
    """Per-expert Python loop: one matmul pair per expert that has tokens.

    Reads the per-expert token counts to the host (one ``.tolist()`` sync); kept for the
    dtypes and devices :func:`grouped_mm_supported` rejects and as the tests' reference.
    Routes with id ``E`` (dropped, see :func:`moe_experts`) sort last and are never computed.
    """
    out = torch.zeros_like(x)
    if ids.shape[0] == 0:
        return out
    for expert, _, tokens, route_weights in routes_by_expert(ids, weights, gate_up.shape[0], x.dtype):
        hidden = activation(F.linear(x[tokens], gate_up[expert]))
        hidden = F.linear(hidden, down[expert]) * route_weights[:, None]
        out.index_add_(0, tokens, hidden.to(out.dtype))
    return out


def grouped_moe_experts(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    activation: Callable[[torch.Tensor], torch.Tensor] = silu_and_mul,
) -> torch.Tensor:
    """The loop's result from two grouped matmuls over the (token, slot) rows sorted by expert.

    Every step is a tensor op with a shape known without reading data: a stable argsort
    groups the rows by expert, ``searchsorted`` turns the sorted ids into each expert's end
    offset, and ``_grouped_mm`` multiplies each segment by its expert's weights in place.
    The alternatives cost more: gathering each row's expert weights for a ``bmm`` copies
    ``N*k`` weight matrices, and a padded ``[E, C, H]`` layout either reads the capacity ``C``
    from the host (a sync) or bounds it statically by ``N*k``, E times the rows and memory.
    Here the temporaries are ``N*k`` rows of ``H + 3I`` values, bounded by the step's tokens.
    Rows keep the loop's order, so each token sums its experts in the same order as the loop
    (bit-identical to it on the CPU in the tests and benchmarks). Dropped routes (id ``E``) sort
    after the last segment, where ``_grouped_mm`` computes nothing and leaves its output unset, so
    their rows are replaced by zeros before the sum.
    """
    out = torch.zeros_like(x)
    if ids.shape[0] == 0:
        return out
    order, token_of, flat_weights = sorted_routes(ids, weights, x.dtype)
    sorted_ids = ids.reshape(-1).index_select(0, order)
    experts = torch.arange(gate_up.shape[0], device=ids.device, dtype=ids.dtype)
    # offs[e] is the end of expert e's segment: the number of sorted ids <= e.
    offs = torch.searchsorted(sorted_ids, experts, right=True).to(torch.int32)
    # [E, N, K] weights transposed to [E, K, N] are the column-major operand _grouped_mm wants.
    hidden = activation(torch._grouped_mm(x.index_select(0, token_of), gate_up.transpose(1, 2), offs=offs))
    hidden = torch._grouped_mm(hidden, down.transpose(1, 2), offs=offs) * flat_weights.unsqueeze(1)
    hidden = torch.where((sorted_ids < gate_up.shape[0]).unsqueeze(1), hidden, 0.0)
    return out.index_add_(0, token_of, hidden.to(out.dtype))


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

    ``gate_up`` is ``[E, 2I, H]`` and ``down`` ``[E, H, I]``; weights are cast to ``x.dtype``
    and multiplied after the down projection, the same order HF uses, so bf16 results track
    HF closely. Runs :func:`grouped_moe_experts` (no host sync) where ``_grouped_mm`` takes the
    operands, else :func:`looped_moe_experts`.

    An id equal to ``E`` (one past the last expert) marks a dropped route: it adds nothing to its
    token and costs no expert FLOPs. Expert parallelism sends the routes another rank owns this way.
    """
    if grouped_mm_supported(x, gate_up, down):
        return grouped_moe_experts(x, gate_up, down, weights, ids, activation)
    return looped_moe_experts(x, gate_up, down, weights, ids, activation)


@dispatch("routed_moe")
def routed_moe(
    x: torch.Tensor,
    router_weight: torch.Tensor,
    gate_up: torch.Tensor | PackedExperts,
    down: torch.Tensor | PackedExperts,
    top_k: int,
    norm_topk_prob: bool,
) -> torch.Tensor:
    """A Qwen-MoE block's routed experts: softmax routing (:func:`topk_routing`) over the router's
    logits ``F.linear(x, router_weight)`` in ``x``'s dtype, then :func:`moe_experts` of the picked
    experts. One kernel so that a device can run the whole block in one call (on the CPU,
    :func:`pypto_kernels.native.moe_block`: the same arithmetic, the router's product and the sums in
    its own fixed order, ties in the top-k to the lower expert).

    :param router_weight: ``[E, H]``; ``gate_up`` ``[E, 2I, H]``; ``down`` ``[E, H, I]``, plain or
        (the CPU's packed copies, :func:`pypto_kernels.native.pack_experts`) both panels, which the
        reference unpacks.
    :return: ``[T, H]`` in ``x``'s dtype.
    """
    weights, ids = topk_routing(F.linear(x, router_weight), top_k, norm_topk_prob)
    if isinstance(gate_up, PackedExperts):
        gate_up = gate_up.plain()
    if isinstance(down, PackedExperts):
        down = down.plain()
    return moe_experts(x, gate_up, down, weights, ids)
