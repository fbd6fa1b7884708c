"""Ascend NPU fast paths via ``torch_npu`` fused operators.

Only imported once an NPU tensor is dispatched and ``torch_npu`` is known to import, so
the module-level import below is safe.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch_npu

from ..registry import reference_kernel


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Fused RMSNorm; npu_rms_norm returns (y, rstd)."""
    out: torch.Tensor = torch_npu.npu_rms_norm(x, weight, epsilon=eps)[0]
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Fused SwiGLU: silu of the first half times the second half (op rejects empty/strided input)."""
    if x.numel() == 0:
        empty: torch.Tensor = reference_kernel("silu_and_mul")(x)
        return empty
    out: torch.Tensor = torch_npu.npu_swiglu(x.contiguous(), dim=-1)
    return out


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """rotate_half RoPE via npu_rotary_mul on [1, T, H, rotary_dim] views; extra dims pass through."""
    rotary_dim = cos.shape[-1]
    cos4 = cos.to(q.dtype)[None, :, None, :]
    sin4 = sin.to(q.dtype)[None, :, None, :]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x_rot = x[..., :rotary_dim].contiguous()[None]
        out: torch.Tensor = torch_npu.npu_rotary_mul(x_rot, cos4.to(x.dtype), sin4.to(x.dtype))[0]
        if rotary_dim == x.shape[-1]:
            return out
        return torch.cat((out, x[..., rotary_dim:]), dim=-1)

    return rotate(q), rotate(k)


def register(add: Callable[[str, str, Callable[..., Any]], None]) -> None:
    """Register the NPU fast paths."""
    add("rms_norm", "npu", rms_norm)
    add("silu_and_mul", "npu", silu_and_mul)
    add("apply_rope", "npu", apply_rope)
