"""Rotary position embeddings (HF "rotate_half" / neox layout), incl. linear and YaRN scaling."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from .registry import dispatch

SUPPORTED_ROPE_TYPES = ("default", "linear", "yarn")


def _default_inv_freq(rotary_dim: int, base: float) -> torch.Tensor:
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(torch.float32) / rotary_dim
    return 1.0 / (base**exponents)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_correction_dim(num_rotations: float, dim: int, base: float, max_pos: int) -> float:
    # Dimension index whose wavelength completes ``num_rotations`` turns over ``max_pos`` tokens.
    return (dim * math.log(max_pos / (num_rotations * 2 * math.pi))) / (2 * math.log(base))


def _yarn_inv_freq(
    rotary_dim: int, base: float, scaling: Mapping[str, Any], max_position_embeddings: int
) -> tuple[torch.Tensor, float]:
    original_max = scaling.get("original_max_position_embeddings") or max_position_embeddings
    factor = scaling.get("factor")
    if factor is None:  # DeepSeek-style configs derive the factor from the context extension
        factor = max_position_embeddings / original_max
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    low = _yarn_correction_dim(beta_fast, rotary_dim, base, original_max)
    high = _yarn_correction_dim(beta_slow, rotary_dim, base, original_max)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp

    pos_freqs = base ** (torch.arange(0, rotary_dim, 2).to(torch.float32) / rotary_dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    ramp = torch.clamp((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_weight = 1 - ramp
    inv_freq = interpolation * (1 - extrapolation_weight) + extrapolation * extrapolation_weight
    return inv_freq, float(attention_factor)


def rope_inv_freq(
    rotary_dim: int, base: float, scaling: Mapping[str, Any] | None, max_position_embeddings: int
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies (float32, [rotary_dim // 2]) and the cos/sin attention scaling.

    ``scaling`` is the HF ``rope_scaling`` / ``rope_parameters`` dict; the numbers match
    ``transformers.modeling_rope_utils`` so checkpoints reproduce HF logits. ``base`` always
    wins over a ``rope_theta`` inside ``scaling``.
    """
    if rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(f"rotary_dim must be a positive even number, got {rotary_dim}")
    rope_type = "default"
    if scaling:
        rope_type = scaling.get("rope_type", scaling.get("type", "default")) or "default"
    if rope_type == "default":
        return _default_inv_freq(rotary_dim, base), 1.0
    assert scaling is not None
    if rope_type == "linear":
        return _default_inv_freq(rotary_dim, base) / scaling["factor"], 1.0
    if rope_type == "yarn":
        return _yarn_inv_freq(rotary_dim, base, scaling, max_position_embeddings)
    if rope_type == "dynamic":
        raise NotImplementedError(
            "rope_type 'dynamic' (dynamic NTK) depends on the running sequence length and is not supported; "
            f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")


@dispatch("rope_cos_sin")
def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, attention_scaling: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [T, rotary_dim] for ``positions``, computed in float32 then cast (as HF does)."""
    freqs = positions[:, None].to(torch.float32) * inv_freq.to(device=positions.device, dtype=torch.float32)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos = emb.cos() * attention_scaling
    sin = emb.sin() * attention_scaling
    return cos.to(dtype), sin.to(dtype)


class RopeTable:
    """The :func:`rope_cos_sin` rows of every position below a bound, built once and gathered each step.

    A decode step's cos/sin took eight tensor operations (about 60 µs of a 3 ms concurrency-1 step on
    the small shape); gathering two tables' rows takes two. Rows are built :data:`CHUNK` positions at
    a time by :func:`rope_cos_sin` itself, each a tensor too small for torch to split over threads,
    so a row is the same float operations on the same inputs as where :func:`rope_cos_sin` computes it
    for a step, whichever positions that step holds. The tables cover the highest bound asked so
    far, grown by doubling (at most the model's context: a few MiB on Qwen3's shapes)."""

    CHUNK = 128

    def __init__(self, inv_freq: torch.Tensor, attention_scaling: float, dtype: torch.dtype) -> None:
        self.inv_freq = inv_freq
        self.attention_scaling = attention_scaling
        self.dtype = dtype
        self.rows = 0
        self._cos: torch.Tensor | None = None
        self._sin: torch.Tensor | None = None

    def lookup(self, positions: torch.Tensor, bound: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[T, rotary_dim]`` of ``positions`` (on the tables' device), each below ``bound``
        (known on the host: the step's longest sequence, so no position is read back)."""
        if bound > self.rows:
            self._grow(bound)
        assert self._cos is not None and self._sin is not None
        return self._cos.index_select(0, positions), self._sin.index_select(0, positions)

    def tables(self, bound: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole cos and sin tables ``[rows, rotary_dim]``, covering every position below ``bound``
        (for a caller that reads rows by position itself; a later growth makes new tables)."""
        if bound > self.rows:
            self._grow(bound)
        assert self._cos is not None and self._sin is not None
        return self._cos, self._sin

    def _grow(self, bound: int) -> None:
        rows = max(bound, 2 * self.rows, self.CHUNK)
        rows = -(-rows // self.CHUNK) * self.CHUNK
        every = torch.arange(rows, device=self.inv_freq.device)
        chunks = [
            rope_cos_sin(every[lo : lo + self.CHUNK], self.inv_freq, self.attention_scaling, self.dtype)
            for lo in range(0, rows, self.CHUNK)
        ]
        self._cos = torch.cat([c for c, _ in chunks])
        self._sin = torch.cat([s for _, s in chunks])
        self.rows = rows


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` over the first ``rotary_dim`` dims (HF's formula; the rest
    pass through): ``x cos``, then ``x2 s1`` taken from its first half and ``x1 s2`` added to its second.

    Each element is the same rounded products and one rounded sum as HF's (adding a negated product
    is subtracting it), so the result is bitwise HF's, in three passes over the tensor instead of
    HF's five (its ``neg`` and ``cat`` build a rotated copy first)."""
    rotary_dim = cos.shape[-1]
    half = rotary_dim // 2
    x_rot = x if rotary_dim == x.shape[-1] else x[..., :rotary_dim]
    out = x_rot * cos  # in-place on views, no out= (which compiled graphs refuse on a strided view)
    x1, x2 = x_rot[..., :half], x_rot[..., half:]
    out[..., :half].sub_(x2 * sin[..., :half])
    out[..., half:].add_(x1 * sin[..., half:])
    return out if x_rot is x else torch.cat((out, x[..., rotary_dim:]), dim=-1)


@dispatch("apply_rope")
def apply_rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, Hq, D] and k [T, Hk, D] by cos/sin [T, rotary_dim]; dims past rotary_dim pass through."""
    rotary_dim = cos.shape[-1]
    if rotary_dim > q.shape[-1] or rotary_dim > k.shape[-1] or rotary_dim % 2:
        raise ValueError(f"rotary_dim {rotary_dim} must be even and <= head dims {q.shape[-1]}/{k.shape[-1]}")
    cos_q, sin_q = cos[:, None, :].to(q.dtype), sin[:, None, :].to(q.dtype)
    cos_k, sin_k = cos[:, None, :].to(k.dtype), sin[:, None, :].to(k.dtype)
    return _rotate(q, cos_q, sin_q), _rotate(k, cos_k, sin_k)
