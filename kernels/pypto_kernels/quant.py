"""Linear layers over weights kept in their stored low precision.

``quant_linear(x, weight, bias)`` computes ``x @ W.T + bias`` where ``W`` is what ``weight`` stands
for. ``weight`` is any object with the attributes of :class:`QuantizedLinearWeight` (the core's
``pypto_serving.quantization.QuantizedWeight`` is one; this package does not import the core).
Schemes:

- ``"fp8_block"``: ``data`` float8 ``[out, in]``, ``scale`` float32 ``[ceil(out/br), ceil(in/bc)]``
  for ``block=(br, bc)``; ``W[i, j] = data[i, j] * scale[i // br, j // bc]``. Activations stay in
  their dtype (weight-only).
- ``"w8a8_dynamic"``: ``data`` int8, ``scale`` float32 ``[out]``, optional ``offset`` ``[out]``;
  ``W = (data - offset) * scale``. Activations are quantised per token (symmetric int8, scale
  ``absmax / 127``) as msModelSlim's dynamic W8A8 and the NPU's ``npu_dynamic_quant`` do.
  A row-parallel linear (its input split over tensor-parallel ranks) passes ``reduce_absmax``
  (:data:`AbsmaxReduce`): each token's absmax over its slice goes through it (an all-reduce MAX
  over the group) before the scale is taken, so every rank quantises its slice with the scale one
  rank computes over the whole row, and the ranks' partial sums add up to one rank's product (up
  to float summation order). Without it the scales would be per slice, and the result would differ
  from one rank's by the activations' int8 rounding.
- ``"w8a8_static"``: msModelSlim's static W8A8: ``x_q = clamp(round(x / input_scale + input_offset))``,
  ``y = (x_q @ data.T + quant_bias) * deq_scale`` (``quant_bias`` int32 folds the float bias and the
  activation offset in; ``deq_scale = input_scale * weight_scale``).

The reference dequantises the whole weight per call (for tests and as the fallback of every fast
path); the fast paths live in :mod:`pypto_kernels.backends` (``cpu``, ``cuda``, ``npu``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from . import device
from .registry import dispatch, get_kernel, reference_kernel

__all__ = [
    "QUANT_SCHEMES",
    "AbsmaxReduce",
    "PackedInt8Weight",
    "QuantizedLinearWeight",
    "dequantize_weight",
    "pack_quant_linear",
    "quant_linear",
    "quantize_per_token",
]

QUANT_SCHEMES = frozenset({"fp8_block", "w8a8_dynamic", "w8a8_static"})

#: ``absmax [rows, 1] float32 -> [rows, 1]``: each row's absmax over this rank's slice of the row to
#: its absmax over the whole row (``ParallelContext.all_reduce_max`` under tensor parallelism).
AbsmaxReduce = Callable[[torch.Tensor], torch.Tensor]


class QuantizedLinearWeight(Protocol):
    """What :func:`quant_linear` reads from a weight (see the module docstring for each scheme)."""

    scheme: str
    data: torch.Tensor
    scale: torch.Tensor
    block: tuple[int, int]
    offset: torch.Tensor | None
    input_scale: torch.Tensor | None
    input_offset: torch.Tensor | None
    deq_scale: torch.Tensor | None
    quant_bias: torch.Tensor | None
    packed: Any  # a PackedInt8Weight replacing ``data`` (pack_quant_linear), or None


@dataclass(frozen=True, slots=True)
class PackedInt8Weight:
    """oneDNN's prepacked copy of a symmetric int8 ``[out, in]`` weight
    (``torch.ops.onednn.qlinear_prepack``, the layout its VNNI kernels read) with the per-row float32
    ``scale`` its product applies (a view of the weight's own) and one zero point (int64 ``[1]``)."""

    tensor: torch.Tensor
    scale: torch.Tensor
    zero_points: torch.Tensor
    shape: tuple[int, int]

    @property
    def nbytes(self) -> int:
        """The int8 values' bytes (the scales are the weight's)."""
        return self.shape[0] * self.shape[1]


def pack_quant_linear(weight: Any, *, flags: frozenset[str] | None = None) -> bool:
    """Give a dynamic-W8A8 CPU ``weight`` (a :class:`QuantizedLinearWeight` with a ``packed``
    attribute) oneDNN's prepacked int8 copy in place of its ``data`` (freed: resident bytes stay the
    checkpoint's); returns whether it did. Only a symmetric 2-D weight (no ``offset``) on a CPU whose
    int8 products pay (:func:`pypto_kernels.device.cpu_int8_products_pay`, ``flags`` standing in for
    this CPU's): there the packed product, with the weight's scales applied inside it, is 1.2-1.8x
    ``torch._int_mm`` and its separate rescale at 8 rows, 1.1-1.3x at 64 and 2.2x on a 151,936-row
    output projection (its 39 MB int32 result and rescale copies dominate); at one row it is
    0.8-1.1x (docs/benchmarks.md)."""
    data = weight.data
    if (
        weight.scheme != "w8a8_dynamic"
        or weight.offset is not None
        or data.device.type != "cpu"
        or data.dim() != 2
        or not hasattr(torch.ops.onednn, "qlinear_prepack")
        or not device.cpu_int8_products_pay(flags)
        or get_kernel("quant_linear", "cpu") is reference_kernel("quant_linear")  # no CPU fast path loaded
    ):
        return False
    rows, cols = int(data.shape[0]), int(data.shape[1])
    if weight.scale.dtype != torch.float32:
        weight.scale = weight.scale.float()
    scale = weight.scale.reshape(rows)  # a view: the weight's scales serve both
    tensor = torch.ops.onednn.qlinear_prepack(data, None)
    zero_points = torch.zeros(1, dtype=torch.int64)
    weight.packed = PackedInt8Weight(tensor, scale, zero_points, (rows, cols))
    weight.data = data.new_empty((0, cols))
    return True


def fp8_values(data: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """FP8 ``data`` as ``dtype`` (float32 or bfloat16 hold every FP8 value exactly). On the CPU through
    a 256-entry table indexed by the bytes: 4.5x faster than the element-wise conversion there (no
    CPU instruction converts FP8; measured, docs/benchmarks.md), the same values."""
    if data.device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return data.to(dtype)
    table = torch.arange(256, dtype=torch.uint8).view(data.dtype).to(dtype)
    return table.index_select(0, data.reshape(-1).view(torch.uint8).int()).view(data.shape)


def spread_block_scales(scale: torch.Tensor, block: tuple[int, int], shape: tuple[int, int]) -> torch.Tensor:
    """Per-element scales of a ``shape`` weight from its per-block ``scale`` grid (float32)."""
    rows, cols = block
    return scale.float().repeat_interleave(rows, 0)[: shape[0]].repeat_interleave(cols, 1)[:, : shape[1]]


def dequantize_weight(weight: QuantizedLinearWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float weight ``weight`` stands for, ``[out, in]`` in ``dtype`` (a full-size copy: tests only)."""
    data = weight.data
    if weight.scheme == "fp8_block":
        shape = (int(data.shape[0]), int(data.shape[1]))
        return (data.float() * spread_block_scales(weight.scale, weight.block, shape)).to(dtype)
    if weight.scheme == "w8a8_static":  # the weight alone: deq_scale = input_scale * weight_scale
        assert weight.deq_scale is not None and weight.input_scale is not None
        per_row = static_deq_scale(weight.deq_scale) / weight.input_scale.float()
        return (data.float() * per_row.reshape(-1, 1)).to(dtype)
    centred = data.float()
    if weight.offset is not None:
        centred = centred - weight.offset.float().reshape(-1, 1)
    return (centred * weight.scale.float().reshape(-1, 1)).to(dtype)


def quantize_per_token(x: torch.Tensor, reduce_absmax: AbsmaxReduce | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per row: ``(x_q, scale)`` with ``x ~ x_q * scale``, ``scale = absmax / 127``
    (float32 ``[rows, 1]``; an all-zero row gets scale 1 so nothing divides by zero). ``x`` a slice
    of each row (a row-parallel rank's): ``reduce_absmax`` gives the whole row's absmax."""
    xf = x.float()
    absmax = xf.abs().amax(dim=-1, keepdim=True)
    if reduce_absmax is not None:
        absmax = reduce_absmax(absmax)
    scale = torch.where(absmax > 0, absmax / 127.0, torch.ones_like(absmax))
    return torch.clamp(torch.round(xf / scale), -127, 127).to(torch.int8), scale


def quantize_static(x: torch.Tensor, input_scale: torch.Tensor, input_offset: torch.Tensor) -> torch.Tensor:
    """msModelSlim's per-tensor activation quantisation: ``clamp(round(x / s + offset), -128, 127)``."""
    q = torch.round(x.float() / input_scale.float() + input_offset.float())
    return torch.clamp(q, -128, 127).to(torch.int8)


def static_deq_scale(deq_scale: torch.Tensor) -> torch.Tensor:
    """``deq_scale`` as float32: msModelSlim stores it as float32, or for float16 models as int64 whose
    low 32 bits are the float32's bits (the layout Ascend's quantised matmul takes)."""
    if deq_scale.dtype == torch.int64:
        bits: torch.Tensor = (deq_scale & 0xFFFFFFFF).to(torch.int32)
        return bits.view(torch.float32)
    return deq_scale.float()


@dispatch("quant_linear")
def quant_linear(
    x: torch.Tensor,
    weight: QuantizedLinearWeight,
    bias: torch.Tensor | None = None,
    reduce_absmax: AbsmaxReduce | None = None,
) -> torch.Tensor:
    """``x @ W.T + bias`` for a stored-precision ``weight`` (reference: dequantise, then one matmul).

    ``x`` is ``[..., in]``; the result has ``x``'s dtype and shape ``[..., out]``. ``reduce_absmax``:
    ``x`` is this rank's slice of each row of a row-parallel linear (``w8a8_dynamic`` quantises
    with the whole row's scale; the other schemes' activation scales do not span ranks).
    """
    if weight.packed is not None:
        raise ValueError(
            "quant_linear: this weight is packed for oneDNN (pack_quant_linear) and only the CPU kernel reads it; "
            "the reference reads plain data"
        )
    if weight.scheme == "w8a8_static":
        assert weight.input_scale is not None and weight.input_offset is not None
        assert weight.deq_scale is not None and weight.quant_bias is not None
        x_q = quantize_static(x, weight.input_scale, weight.input_offset).float()
        acc = F.linear(x_q, weight.data.float()) + weight.quant_bias.float()
        out = acc * static_deq_scale(weight.deq_scale)
    elif weight.scheme == "w8a8_dynamic":
        x_q, x_scale = quantize_per_token(x.reshape(-1, x.shape[-1]), reduce_absmax)
        out = F.linear(x_q.float(), dequantize_weight(weight)) * x_scale
        out = out.reshape(*x.shape[:-1], -1)
    elif weight.scheme == "fp8_block":
        out = F.linear(x.float(), dequantize_weight(weight))
    else:
        raise ValueError(f"quant_linear: unknown scheme {weight.scheme!r}; known: {sorted(QUANT_SCHEMES)}")
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)
