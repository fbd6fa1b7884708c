"""MXFP4 matrices (DeepSeek-V4's routed experts) decoded to floats.

MXFP4 (OCP Microscaling, FP4 E2M1 elements): a ``[..., out, in]`` matrix is stored as ``data``
int8 ``[..., out, in / 2]``, two 4-bit E2M1 codes a byte (the low nibble holds the even column),
and ``scale`` ``float8_e8m0fnu`` (or its raw bits as uint8) ``[..., out, ceil(in / 32)]``, one
power-of-two scale ``2 ** (e - 127)`` per 32 values of a row (``e = 255`` is NaN). An E2M1 code has
a sign bit (bit 3) and a magnitude from ``0, 0.5, 1, 1.5, 2, 3, 4, 6`` (bits 2..0).

:func:`dequantize_mxfp4` decodes a stack of them; :func:`pypto_kernels.quant_moe_experts` runs the
MoE MLP over experts stored so, dequantising only the experts a step routes to.
"""

from __future__ import annotations

from typing import Protocol

import torch

__all__ = ["PackedMxfp4", "dequantize_mxfp4"]

#: Values sharing one E8M0 scale along a row.
GROUP = 32
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


class PackedMxfp4(Protocol):
    """A stack of MXFP4 matrices."""

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
