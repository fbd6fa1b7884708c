"""Linear weights in the checkpoint's stored precision (block-FP8, msModelSlim dynamic W8A8).

A quantized projection holds a :class:`~pypto_serving.quantization.QuantizedWeight` instead of a
float parameter: its buffers are allocated in the stored dtype and the loader copies the
checkpoint's data and scales into them as they are (never dequantized, so resident memory is the
checkpoint's bytes), and the forward calls :func:`pypto_kernels.quant_linear`. Fused matrices
(q/k/v, gate/up) and tensor-parallel parts are row (or column) ranges of the stored data and the
matching ranges of the scales; a range that cuts through an FP8 scale block is refused, naming
the tensor, since no rank could scale its rows correctly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import pypto_kernels as K
from pypto_serving.quantization import QuantizedWeight

from .loader import CheckpointError, WeightTarget

__all__ = ["Weight", "linear", "make_weight", "weight_targets"]

Weight = nn.Parameter | QuantizedWeight

_FP8_DATA = ("F8_E4M3",)
_INT8_DATA = ("I8",)
_SCALES = ("F32", "BF16", "F16")


def make_weight(
    shape: tuple[int, int], device: torch.device, dtype: torch.dtype, scheme: str | None, block: tuple[int, int]
) -> Weight:
    """An empty weight of ``shape``: a float parameter, or stored-precision buffers for ``scheme``."""
    if scheme is None:
        return nn.Parameter(torch.empty(shape, device=device, dtype=dtype), requires_grad=False)
    rows, cols = shape
    if scheme == "fp8_block":
        data = torch.empty(shape, device=device, dtype=torch.float8_e4m3fn)
        grid = (-(-rows // block[0]), -(-cols // block[1]))
        return QuantizedWeight("fp8_block", data, torch.empty(grid, device=device), block)
    data = torch.empty(shape, device=device, dtype=torch.int8)
    scale, offset = (torch.empty(rows, 1, device=device) for _ in range(2))
    return QuantizedWeight(scheme, data, scale, offset=offset)


def linear(x: torch.Tensor, weight: Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    if isinstance(weight, QuantizedWeight):
        out: torch.Tensor = K.quant_linear(x, weight, bias)
        return out
    return F.linear(x, weight, bias)


def _blocks(part: slice, step: int, total: int, name: str) -> slice:
    """``part`` (rows or columns) as whole scale blocks of ``step``; refuses a cut through a block."""
    start, stop = int(part.start), int(part.stop)
    if start % step or (stop % step and stop != total):
        raise CheckpointError(
            f"{name}: rows/columns {start}:{stop} of a {total}-wide FP8 weight cut through its "
            f"{step}-wide scale blocks; this fusion or tensor-parallel split cannot be served"
        )
    return slice(start // step, -(-stop // step))


def weight_targets(
    weight: Weight, name: str, rows: slice, src: slice, full: int, dim: int = 0
) -> dict[str, list[WeightTarget]]:
    """Targets of checkpoint weight ``name`` (and its scales): ``rows`` of the (fused) matrix come
    from ``src`` of dimension ``dim`` (``full`` long) of the checkpoint tensor."""
    whole = src.start == 0 and src.stop == full
    part = None if whole else src
    if not isinstance(weight, QuantizedWeight):
        dest = weight.data[rows] if dim == 0 else weight.data
        return {name: [WeightTarget(dest, (name,), part, dim, full)]}
    data = weight.data[rows] if dim == 0 else weight.data
    stored = _FP8_DATA if weight.scheme == "fp8_block" else _INT8_DATA
    out = {name: [WeightTarget(data, (name,), part, dim, full, stored=stored)]}
    if weight.scheme == "fp8_block":
        br, bc = weight.block
        step = (br, bc)[dim]
        grid_rows = _blocks(rows, br, int(weight.data.shape[0]), name) if dim == 0 else slice(None)
        scale_part = None if whole else _blocks(src, step, full, name)
        scale_name = name + "_scale_inv"
        target = WeightTarget(weight.scale[grid_rows], (scale_name,), scale_part, dim, -(-full // step), _SCALES)
        out[scale_name] = [target]
        return out
    for suffix, tensor in (("_scale", weight.scale), ("_offset", weight.offset)):
        assert tensor is not None
        dest = tensor[rows] if dim == 0 else tensor
        out[name + suffix] = [WeightTarget(dest, (name + suffix,), part if dim == 0 else None, 0, full, _SCALES)]
    return out


def drop_zero_offsets(weights: list[QuantizedWeight]) -> None:
    """Forget all-zero weight offsets (msModelSlim writes zeros for symmetric weights), so the
    kernels take their symmetric paths; read once, at load."""
    for w in weights:
        if w.offset is not None and not bool(w.offset.any()):
            w.offset = None
