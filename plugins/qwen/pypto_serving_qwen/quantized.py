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

__all__ = [
    "PROJECTIONS",
    "QuantizedWeight",
    "Weight",
    "finish_loading",
    "linear",
    "make_weight",
    "pack_projections",
    "weight_targets",
]

Weight = nn.Parameter | QuantizedWeight | K.PackedLinearWeight

#: The projections of a decoder layer (q/k/v and gate/up fused at load).
PROJECTIONS = ("qkv_weight", "o_weight", "gate_up_weight", "down_weight")

_FP8_DATA = ("F8_E4M3",)
_INT8_DATA = ("I8",)
_SCALES = ("F32", "BF16", "F16")


def make_weight(
    shape: tuple[int, int],
    device: torch.device,
    dtype: torch.dtype,
    scheme: str | None,
    block: tuple[int, int],
    parts: int = 1,
) -> Weight:
    """An empty weight of ``shape``: a float parameter, or stored-precision buffers for ``scheme``
    (``parts``: how many checkpoint weights are fused into it, each with its own static input scale)."""
    if scheme is None:
        return nn.Parameter(torch.empty(shape, device=device, dtype=dtype), requires_grad=False)
    rows, cols = shape
    if scheme == "fp8_block":
        data = torch.empty(shape, device=device, dtype=torch.float8_e4m3fn)
        grid = (-(-rows // block[0]), -(-cols // block[1]))
        return QuantizedWeight("fp8_block", data, torch.empty(grid, device=device), block)
    data = torch.empty(shape, device=device, dtype=torch.int8)
    if scheme == "w8a8_static":
        deq = torch.empty(rows, device=device)
        return QuantizedWeight(
            scheme,
            data,
            deq,
            input_scale=torch.empty(parts, device=device),
            input_offset=torch.empty(parts, device=device),
            deq_scale=deq,
            quant_bias=torch.empty(rows, device=device, dtype=torch.int32),
        )
    scale, offset = (torch.empty(rows, 1, device=device) for _ in range(2))
    return QuantizedWeight(scheme, data, scale, offset=offset)


def linear(
    x: torch.Tensor,
    weight: Weight,
    bias: torch.Tensor | None = None,
    reduce_absmax: K.AbsmaxReduce | None = None,
    *,
    kernel: bool = False,
) -> torch.Tensor:
    """``x @ weight.T + bias``; ``reduce_absmax``: ``x`` is a row-parallel rank's slice of each row
    (``ParallelContext.absmax_reduce``), which a dynamic-W8A8 weight quantises with the whole row's
    per-token scale, as one rank does. ``kernel``: a plain weight runs :func:`pypto_kernels.linear`
    (the eager CPU forward, whose fast path multiplies large float32 weights transposed), else
    ``F.linear``."""
    if isinstance(weight, QuantizedWeight):
        out: torch.Tensor = K.quant_linear(x, weight, bias, reduce_absmax)
        return out
    if kernel or isinstance(weight, K.PackedLinearWeight):
        packed: torch.Tensor = K.linear(x, weight, bias)
        return packed
    return F.linear(x, weight, bias)


def pack_projections(model: nn.Module, batch_rows: int, library: str | None) -> list[K.PackedLinearWeight]:
    """Give every float projection of ``model`` a packed copy (:func:`pypto_kernels.pack_linear` for a
    full decode batch of ``batch_rows``; ``library`` None: its rule); returns those copies, in module
    order (a decoder's layer by layer, each in the order a step reads them). A packed projection stops
    being a registered parameter (its plain matrix stays, in the wrapper)."""
    copies = []
    for module in model.modules():
        for attr in PROJECTIONS:
            value = module._parameters.get(attr)
            if value is None:
                continue
            packed = K.pack_linear(value.data, batch_rows, library=library)
            if packed is None:
                continue
            del module._parameters[attr]
            setattr(module, attr, packed)
            copies.append(packed)
    return copies


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
    weight: Weight, name: str, rows: slice, src: slice, full: int, dim: int = 0, index: int = 0
) -> dict[str, list[WeightTarget]]:
    """Targets of checkpoint weight ``name`` (and its scales): ``rows`` of the (fused) matrix come
    from ``src`` of dimension ``dim`` (``full`` long) of the checkpoint tensor; ``index`` is its
    place among the weights fused into the matrix (for static W8A8's per-weight input scales)."""
    whole = src.start == 0 and src.stop == full
    part = None if whole else src
    if not isinstance(weight, QuantizedWeight):
        plain = weight.plain() if isinstance(weight, K.PackedLinearWeight) else weight.data
        dest = plain[rows] if dim == 0 else plain
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
    if weight.scheme == "w8a8_static":
        out.update(_static_targets(weight, name.removesuffix(".weight"), rows, part, full, dim, index))
        return out
    for suffix, tensor in (("_scale", weight.scale), ("_offset", weight.offset)):
        assert tensor is not None
        dest = tensor[rows] if dim == 0 else tensor
        out[name + suffix] = [WeightTarget(dest, (name + suffix,), part if dim == 0 else None, 0, full, _SCALES)]
    return out


def _static_targets(
    weight: QuantizedWeight, prefix: str, rows: slice, part: slice | None, full: int, dim: int, index: int
) -> dict[str, list[WeightTarget]]:
    """msModelSlim's static W8A8 tensors of linear ``prefix``: per-tensor ``input_scale`` /
    ``input_offset`` (``[1]``), per-output-row ``deq_scale`` and ``quant_bias``."""
    assert weight.input_scale is not None and weight.input_offset is not None and weight.quant_bias is not None
    out: dict[str, list[WeightTarget]] = {}
    for suffix, tensor in (("input_scale", weight.input_scale), ("input_offset", weight.input_offset)):
        name = f"{prefix}.{suffix}"
        out[name] = [WeightTarget(tensor[index : index + 1], (name,), stored=("F32", "BF16", "F16"))]
    # A row-parallel part (dim 1) keeps every output row's deq_scale. quant_bias folds the activation
    # offset times the whole row's weight sum: added by the rank holding the first input columns
    # only, so the ranks' int32 partial sums add up to one rank's; the others read it into a buffer
    # they drop and keep zeros (the per-tensor input scale quantises every rank's slice alike).
    bias_dest = weight.quant_bias
    if dim != 0 and part is not None and part.start > 0:
        weight.quant_bias.zero_()
        bias_dest = torch.empty_like(weight.quant_bias)
    for suffix, tensor, kinds in (("deq_scale", weight.scale, ("F32", "I64")), ("quant_bias", bias_dest, ("I32",))):
        name = f"{prefix}.{suffix}"
        dest, row_part = (tensor[rows], part) if dim == 0 else (tensor, None)
        out[name] = [WeightTarget(dest, (name,), row_part, 0, full, stored=kinds)]
    return out


def finish_loading(weights: list[QuantizedWeight], names: list[str]) -> None:
    """Once loaded (host reads, at load only): forget all-zero weight offsets (msModelSlim writes
    zeros for symmetric weights) so the kernels take their symmetric paths, and fold the static
    input scales of weights fused into one matrix into one, refusing them if they differ (the
    fused matrix quantises its one input once).

    :raises CheckpointError: fused static W8A8 weights with different input scales or offsets.
    """
    for w, name in zip(weights, names, strict=True):
        if w.offset is not None and not bool(w.offset.any()):
            w.offset = None
        if w.input_scale is None or w.input_offset is None:
            continue
        for what, values in (("input_scale", w.input_scale), ("input_offset", w.input_offset)):
            if not bool((values == values[0]).all()):
                raise CheckpointError(
                    f"{name}: the weights fused here have different static W8A8 {what}s {values.tolist()}; "
                    "they quantise the same input, so msModelSlim calibrates one value"
                )
        w.input_scale, w.input_offset = w.input_scale[:1], w.input_offset[:1]
