"""Gated activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .registry import dispatch


@dispatch("silu_and_mul")
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU on a fused gate/up projection: silu(x[..., :I]) * x[..., I:]."""
    half = x.shape[-1] // 2
    if x.shape[-1] != 2 * half:
        raise ValueError(f"silu_and_mul needs an even last dim, got {x.shape[-1]}")
    return F.silu(x[..., :half]) * x[..., half:]
