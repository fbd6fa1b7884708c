"""Mixture-of-experts MLPs over routed experts kept in their stored precision.

:func:`quant_moe_experts` is :func:`pypto_kernels.moe_experts` for expert stacks that are any object
with ``scheme``, ``data``, ``scale``, ``block`` and ``offset`` (the core's ``QuantizedWeight`` is
one), stacked per expert (``gate_up`` ``[E, 2I, H]``, ``down`` ``[E, H, I]`` in values):

- ``"mxfp4"`` (DeepSeek-V4's release): ``data`` int8 ``[E, N, K/2]``, two E2M1 codes a byte,
  ``scale`` ``float8_e8m0fnu [E, N, ceil(K/32)]`` (:func:`pypto_kernels.dequantize_mxfp4`).
- ``"fp8_block"`` (DeepSeek-V3 style block FP8): ``data`` float8 ``[E, N, K]``, ``scale`` float32
  ``[E, ceil(N/br), ceil(K/bc)]`` for ``block = (br, bc)``; value ``data * scale`` of its block.
- ``"w8a8_dynamic"`` (msModelSlim): ``data`` int8 ``[E, N, K]``, ``scale`` float32 ``[E, N]`` and
  ``offset`` ``[E, N]`` or None; value ``(data - offset) * scale``. As msModelSlim's dynamic W8A8
  and the NPU's ``npu_dynamic_quant`` do, each matmul's input (the tokens, then the activated
  hidden rows) is quantised per row to symmetric int8 (scale ``absmax / 127``) first. Where each
  rank holds a slice of every expert's intermediate rows (tensor-parallel MoE), the down matmuls'
  inputs are slices of the hidden rows: ``reduce_absmax`` (:data:`pypto_kernels.AbsmaxReduce`)
  turns each slice's absmax into the whole row's, so every rank quantises as one rank does. The
  reference and the CPU int8 path quantise all of a call's hidden rows at once (one reduction per
  call); the gathered path once per chunk of experts (per expert where the grouped matmul is
  unavailable). Every rank routes the same tokens, so the ranks' reductions pair up.

No float copy of the experts is kept: each call dequantises only the experts it routes tokens to,
into the activations' dtype, and drops them after the matmuls.

- The reference loops over the experts that have tokens (one host read of the per-expert counts),
  dequantising one expert at a time.
- :func:`gathered_quant_moe_experts` (the CUDA fast path) reads nothing on the host: it ranks the
  experts the step routes to first, gathers and dequantises the first ``min(E, tokens * k)`` of
  them, at most :data:`GATHER_EXPERTS` at a time, and runs :func:`pypto_kernels.moe_experts` (its
  grouped, sync-free path) over each chunk with the routes of the other chunks dropped.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F

from .activation import silu_and_mul
from .moe import moe_experts, routes_by_expert
from .mxfp4 import dequantize_mxfp4
from .quant import AbsmaxReduce, fp8_values, quantize_per_token
from .registry import dispatch

__all__ = [
    "EXPERT_SCHEMES",
    "GATHER_EXPERTS",
    "QuantizedExperts",
    "dequantize_experts",
    "gathered_quant_moe_experts",
    "quant_moe_experts",
]

#: Experts dequantised at once by the gathered path: bounds its float temporaries to this many
#: experts' weights whatever the batch.
GATHER_EXPERTS = 32
#: Storage schemes of expert stacks (see the module docstring).
EXPERT_SCHEMES = frozenset({"mxfp4", "fp8_block", "w8a8_dynamic"})

Activation = Callable[[torch.Tensor], torch.Tensor]


class QuantizedExperts(Protocol):
    """What :func:`quant_moe_experts` reads from a stack of expert matrices."""

    scheme: str
    data: torch.Tensor
    scale: torch.Tensor
    block: tuple[int, int]
    offset: torch.Tensor | None


def _fp8_blocks(data: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """Block-FP8 ``data [..., n, k]`` with ``scale [..., ceil(n/br), ceil(k/bc)]`` as ``dtype``."""
    (br, bc), (n, k) = block, data.shape[-2:]
    values, factors = fp8_values(data, torch.float32), scale.to(torch.float32)
    if n % br == 0 and k % bc == 0:  # whole blocks: broadcast the grid, no spread copy of the scales
        lead = values.shape[:-2]
        tiles = values.reshape(*lead, n // br, br, k // bc, bc)
        return (tiles * factors[..., :, None, :, None]).reshape(*lead, n, k).to(dtype)
    spread = factors.repeat_interleave(br, dim=-2)[..., :n, :].repeat_interleave(bc, dim=-1)[..., :k]
    return (values * spread).to(dtype)


def _int8_channels(
    data: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """Int8 ``data [..., n, k]`` with per-row ``scale`` / ``offset`` ``[..., n]`` as ``dtype``."""
    values = data.to(torch.float32)
    if offset is not None:
        values = values - offset.to(torch.float32).reshape(*offset.shape[: data.dim() - 1], 1)
    return (values * scale.to(torch.float32).reshape(*scale.shape[: data.dim() - 1], 1)).to(dtype)


def dequantize_experts(weight: QuantizedExperts, index: int | torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Expert ``index`` (an int: ``[n, k]``) or experts ``index`` (a 1-d tensor: ``[len, n, k]``) of
    the stack ``weight`` as ``dtype``."""

    def take(t: torch.Tensor) -> torch.Tensor:
        return t[index] if isinstance(index, int) else t.index_select(0, index)

    if weight.scheme == "mxfp4":
        return dequantize_mxfp4(take(weight.data), take(weight.scale), dtype)
    if weight.scheme == "fp8_block":
        return _fp8_blocks(take(weight.data), take(weight.scale), weight.block, dtype)
    if weight.scheme == "w8a8_dynamic":
        offset = None if weight.offset is None else take(weight.offset)
        return _int8_channels(take(weight.data), take(weight.scale), offset, dtype)
    raise ValueError(f"quant_moe_experts: unknown scheme {weight.scheme!r}; known: {sorted(EXPERT_SCHEMES)}")


def _fake_quant(x: torch.Tensor, reduce_absmax: AbsmaxReduce | None = None) -> torch.Tensor:
    """``x`` quantised per row to int8 and back (what a per-token W8A8 matmul multiplies)."""
    q, scale = quantize_per_token(x, reduce_absmax)
    return (q.to(torch.float32) * scale).to(x.dtype)


def _per_token_inputs(
    weight: QuantizedExperts, x: torch.Tensor, activation: Activation, reduce_absmax: AbsmaxReduce | None = None
) -> tuple[torch.Tensor, Activation]:
    """The tokens and the activation as the scheme's matmuls see them: W8A8 quantises both matmuls'
    inputs per row (the hidden rows with the whole row's scale, ``reduce_absmax``), the weight-only
    schemes leave them as they are."""
    if weight.scheme != "w8a8_dynamic":
        return x, activation
    return _fake_quant(x), lambda h: _fake_quant(activation(h), reduce_absmax)


@dispatch("quant_moe_experts")
def quant_moe_experts(
    x: torch.Tensor,
    gate_up: QuantizedExperts,
    down: QuantizedExperts,
    weights: torch.Tensor,
    ids: torch.Tensor,
    activation: Activation = silu_and_mul,
    reduce_absmax: AbsmaxReduce | None = None,
) -> torch.Tensor:
    """Sum over k of ``weight * down_e(act(gate_up_e x))`` for each token's experts (``ids [T, k]``,
    ``weights [T, k]``), the experts stored as the module docstring says; id ``E`` is a dropped route.
    ``reduce_absmax``: the experts' intermediate rows are split over tensor-parallel ranks (W8A8).

    Reference: one expert at a time, only those with tokens (the counts are read to the host),
    each dequantised into ``x.dtype`` for its matmuls and dropped; every expert's hidden rows are
    made before the down matmuls, so W8A8 quantises them in one call.
    """
    out = torch.zeros_like(x)
    if ids.shape[0] == 0:
        return out
    xs, _ = _per_token_inputs(gate_up, x, activation)
    routes = routes_by_expert(ids, weights, gate_up.data.shape[0], x.dtype)
    hidden = [activation(F.linear(xs[r[2]], dequantize_experts(gate_up, r[0], x.dtype))) for r in routes]
    if gate_up.scheme == "w8a8_dynamic" and hidden:
        rows = _fake_quant(torch.cat(hidden), reduce_absmax)
        ends = itertools.accumulate(h.shape[0] for h in hidden)
        hidden = [rows[end - h.shape[0] : end] for h, end in zip(hidden, ends, strict=True)]
    for (expert, _, tokens, route_weights), h in zip(routes, hidden, strict=True):
        routed = F.linear(h, dequantize_experts(down, expert, x.dtype)) * route_weights[:, None]
        out.index_add_(0, tokens, routed.to(out.dtype))
    return out


def gathered_quant_moe_experts(
    x: torch.Tensor,
    gate_up: QuantizedExperts,
    down: QuantizedExperts,
    weights: torch.Tensor,
    ids: torch.Tensor,
    activation: Activation = silu_and_mul,
    reduce_absmax: AbsmaxReduce | None = None,
) -> torch.Tensor:
    """:func:`quant_moe_experts` without a host read (see the module docstring).

    ``rank[e]`` is expert ``e``'s place when the routed experts are ordered first (stable, so by id):
    at most ``tokens * k`` experts are routed, so the first ``min(E, tokens * k)`` places hold them
    all, a size known on the host. Chunk ``c`` dequantises the experts at places ``[c0, c1)`` and
    runs the grouped matmuls with each route renumbered to its expert's place in the chunk, or
    dropped (``c1 - c0``) when its expert is in another chunk.
    """
    num_tokens, top_k = ids.shape
    out = torch.zeros_like(x)
    n_experts = gate_up.data.shape[0]
    routed = min(n_experts, num_tokens * top_k)
    if routed == 0:
        return out
    xs, act = _per_token_inputs(gate_up, x, activation, reduce_absmax)
    flat = ids.reshape(-1)
    hits = torch.zeros(n_experts + 1, dtype=torch.int32, device=ids.device)
    hits = hits.index_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))[:n_experts]
    order = torch.argsort((hits == 0).to(torch.int8), stable=True)
    rank = torch.argsort(order)
    kept = ids < n_experts
    place = torch.where(kept, rank[ids.clamp(max=n_experts - 1)], n_experts)
    for c0 in range(0, routed, GATHER_EXPERTS):
        c1 = min(c0 + GATHER_EXPERTS, routed)
        chunk = order[c0:c1]
        mine = kept & (place >= c0) & (place < c1)
        local = torch.where(mine, place - c0, c1 - c0)
        gu, dn = dequantize_experts(gate_up, chunk, x.dtype), dequantize_experts(down, chunk, x.dtype)
        out = out + moe_experts(xs, gu, dn, weights, local, act)
    return out
