"""Small DeepSeek-V4 element-wise helpers that stay in the plugin.

The heavy DeepSeek-specific ops (interleaved partial RoPE, mHC Sinkhorn mixing, compressor window
pooling, lightning-indexer top-k, sink attention, grouped output projection) live in
``pypto_kernels`` (``deepseek``, ``hyper_connections`` and ``compressed_attention`` modules).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Hash-routed layers score the experts a table picked the same way top-k routing does.
from pypto_kernels.moe import router_scores as router_scores


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm in float32; V4 keeps norm weights in float32, so scale before casting back once."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        h = weight.float() * h
    return h.to(dtype)


def clamped_swiglu(gate_up: torch.Tensor, limit: float) -> torch.Tensor:
    """SiLU(gate) * up with V4's clamps (gate from above, up both sides) against activation spikes."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)
