"""DeepSeek-V4 projections: interleaved partial RoPE and the grouped low-rank output projection.

V4 rotates the *trailing* ``rope_dim`` channels of a head as interleaved pairs ``(2i, 2i+1)``
(the original Meta / DeepSeek layout), not HF's "rotate_half" halves; the leading channels pass
through. Tables are half-size ``[T, rope_dim // 2]`` float32.
"""

from __future__ import annotations

import torch

from .registry import dispatch


@dispatch("interleaved_rope_cos_sin")
def interleaved_rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, attention_scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Half-size float32 cos/sin tables ``[T, rope_dim // 2]`` for ``positions [T]``."""
    freqs = positions.to(torch.float32)[:, None] * inv_freq.to(positions.device)[None, :]
    return freqs.cos() * attention_scaling, freqs.sin() * attention_scaling


@dispatch("apply_interleaved_rope")
def apply_interleaved_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the trailing ``2 * cos.shape[-1]`` channels of ``x [T, ..., D]`` pairwise (interleaved).

    ``cos``/``sin`` are ``[T, rope_dim // 2]``; middle dims (heads) broadcast. The rotation runs in
    float32 and is cast back to ``x.dtype``. Pass ``-sin`` to undo a rotation.
    """
    half = cos.shape[-1]
    rd = 2 * half
    if rd > x.shape[-1]:
        raise ValueError(f"rope dim {rd} exceeds the last dim {x.shape[-1]}")
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    c, s = cos.reshape(shape), sin.reshape(shape)
    rope = x[..., x.shape[-1] - rd :].float()
    even, odd = rope[..., 0::2], rope[..., 1::2]
    rotated = torch.stack((even * c - odd * s, odd * c + even * s), dim=-1).flatten(-2)
    return torch.cat([x[..., : x.shape[-1] - rd], rotated.to(x.dtype)], dim=-1)


@dispatch("grouped_linear")
def grouped_linear(x: torch.Tensor, weight: torch.Tensor, groups: int) -> torch.Tensor:
    """Block-diagonal projection: ``x [T, G, in]`` with ``weight [G * out, in]`` -> ``[T, G * out]``.

    Group ``g`` of the input only meets rows ``g * out:(g + 1) * out`` of the weight (V4's ``wo_a``).
    """
    if x.dim() != 3 or x.shape[1] != groups:
        raise ValueError(f"x must be [T, {groups}, in], got {tuple(x.shape)}")
    w = weight.view(groups, -1, x.shape[-1])
    return torch.einsum("tgi,goi->tgo", x, w).flatten(1)
