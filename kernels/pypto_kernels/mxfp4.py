"""Mixture-of-experts MLPs over MXFP4 expert weights kept packed (DeepSeek-V4's routed experts).

MXFP4 (OCP Microscaling, FP4 E2M1 elements): a ``[..., out, in]`` matrix is stored as ``data``
int8 ``[..., out, in / 2]``, two 4-bit E2M1 codes a byte (the low nibble holds the even column),
and ``scale`` ``float8_e8m0fnu`` (or its raw bits as uint8) ``[..., out, ceil(in / 32)]``, one
power-of-two scale ``2 ** (e - 127)`` per 32 values of a row (``e = 255`` is NaN). An E2M1 code has
a sign bit (bit 3) and a magnitude from ``0, 0.5, 1, 1.5, 2, 3, 4, 6`` (bits 2..0).

:func:`mxfp4_moe_experts` is :func:`pypto_kernels.moe_experts` for such weights: ``gate_up`` and
``down`` are any objects with ``data`` / ``scale`` stacked per expert (``[E, 2I, H/2]`` /
``[E, 2I, H/32]`` and ``[E, H, I/2]`` / ``[E, H, I/32]``; the core's ``QuantizedWeight`` with
scheme ``"mxfp4"`` is one). No float copy of the experts is kept: each call dequantises only the
experts it routes tokens to, into the activations' dtype, and drops them after the matmuls.

- The reference loops over the experts that have tokens (one host read of the per-expert counts),
  dequantising one expert at a time.
- :func:`gathered_mxfp4_moe_experts` (the CUDA fast path) reads nothing on the host: it ranks the
  experts the step routes to first, gathers and dequantises the first ``min(E, tokens * k)`` of
  them, at most :data:`GATHER_EXPERTS` at a time, and runs :func:`pypto_kernels.moe_experts` (its
  grouped, sync-free path) over each chunk with the routes of the other chunks dropped.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F

from .activation import silu_and_mul
from .moe import moe_experts
from .registry import dispatch

__all__ = ["GATHER_EXPERTS", "PackedMxfp4", "dequantize_mxfp4", "gathered_mxfp4_moe_experts", "mxfp4_moe_experts"]

#: Values sharing one E8M0 scale along a row.
GROUP = 32
#: Experts dequantised at once by the gathered path: bounds its float temporaries to this many
#: experts' weights whatever the batch.
GATHER_EXPERTS = 32
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


class PackedMxfp4(Protocol):
    """What :func:`mxfp4_moe_experts` reads from a stack of MXFP4 matrices."""

    data: torch.Tensor
    scale: torch.Tensor


def dequantize_mxfp4(data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """MXFP4 ``data`` ``[..., n, k/2]`` with ``scale`` ``[..., n, ceil(k/32)]`` as ``dtype`` ``[..., n, k]``."""
    dev = data.device
    # E2M1 values times powers of two are exact in bfloat16 (8 exponent bits, as E8M0 has), so a
    # bfloat16 result is computed in bfloat16; float16 (5 exponent bits) goes through float32.
    work = dtype if dtype in (torch.float32, torch.bfloat16) else torch.float32
    table = torch.tensor(_E2M1, dtype=work, device=dev)
    byte = torch.arange(256, device=dev)
    pairs = torch.stack((table[byte & 0xF], table[byte >> 4]), dim=-1)  # each byte's (even, odd) values
    # index_select over the flat bytes: several times faster than advanced indexing on the CPU.
    codes = data.view(torch.uint8).reshape(-1).int()
    values = pairs.index_select(0, codes).view(*data.shape[:-1], 2 * data.shape[-1])
    exponent = torch.arange(256, device=dev) - 127
    powers = torch.ldexp(torch.ones(256, device=dev), exponent).masked_fill(exponent == 128, float("nan")).to(work)
    factors = powers.index_select(0, scale.view(torch.uint8).reshape(-1).int()).view(scale.shape)
    k = values.shape[-1]
    if k % GROUP == 0:  # whole groups: scale each as a block, no spread copy of the scales
        grouped = values.reshape(*values.shape[:-1], k // GROUP, GROUP) * factors.unsqueeze(-1)
        return grouped.flatten(-2).to(dtype)
    return (values * factors.repeat_interleave(GROUP, dim=-1)[..., :k]).to(dtype)


def _expert(weight: PackedMxfp4, index: int | torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if isinstance(index, int):
        return dequantize_mxfp4(weight.data[index], weight.scale[index], dtype)
    return dequantize_mxfp4(weight.data.index_select(0, index), weight.scale.index_select(0, index), dtype)


@dispatch("mxfp4_moe_experts")
def mxfp4_moe_experts(
    x: torch.Tensor,
    gate_up: PackedMxfp4,
    down: PackedMxfp4,
    weights: torch.Tensor,
    ids: torch.Tensor,
    activation: Callable[[torch.Tensor], torch.Tensor] = silu_and_mul,
) -> torch.Tensor:
    """Sum over k of ``weight * down_e(act(gate_up_e x))`` for each token's experts (``ids [T, k]``,
    ``weights [T, k]``), the experts MXFP4 (see the module docstring); id ``E`` is a dropped route.

    Reference: one expert at a time, only those with tokens (the counts are read to the host),
    each dequantised into ``x.dtype`` for its two matmuls and dropped.
    """
    num_tokens, top_k = ids.shape
    out = torch.zeros_like(x)
    n_experts = gate_up.data.shape[0]
    if num_tokens == 0:
        return out
    flat_ids = ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=n_experts).tolist()[:n_experts]
    token_of = order // top_k
    flat_weights = weights.reshape(-1)[order].to(x.dtype)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        tokens = token_of[start : start + count]
        hidden = activation(F.linear(x[tokens], _expert(gate_up, expert, x.dtype)))
        hidden = F.linear(hidden, _expert(down, expert, x.dtype)) * flat_weights[start : start + count, None]
        out.index_add_(0, tokens, hidden.to(out.dtype))
        start += count
    return out


def gathered_mxfp4_moe_experts(
    x: torch.Tensor,
    gate_up: PackedMxfp4,
    down: PackedMxfp4,
    weights: torch.Tensor,
    ids: torch.Tensor,
    activation: Callable[[torch.Tensor], torch.Tensor] = silu_and_mul,
) -> torch.Tensor:
    """:func:`mxfp4_moe_experts` without a host read (see the module docstring).

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
        gu, dn = _expert(gate_up, chunk, x.dtype), _expert(down, chunk, x.dtype)
        out = out + moe_experts(x, gu, dn, weights, local, activation)
    return out
