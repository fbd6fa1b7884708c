"""Quantized checkpoints: reading ``quantization_config`` and dequantizing FP8 block-scaled weights.

A checkpoint's ``config.json`` may carry a ``quantization_config``. The one format read here is
FP8 with block scales, as Qwen3-FP8 and DeepSeek's FP8 checkpoints store it::

    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}

Each quantized linear weight ``X.weight`` is ``float8_e4m3fn`` of shape ``[out, in]`` and comes with
``X.weight_scale_inv``, float32 of shape ``[ceil(out / 128), ceil(in / 128)]``: the value of element
``(i, j)`` is ``weight[i, j] * weight_scale_inv[i // 128, j // 128]`` (the name says it is the
inverse of the scale that quantized it). Weights are dequantized at load time to the model's dtype;
any other ``quant_method`` is refused with an error naming it, because loading its tensors as if
they were plain floats would serve garbage.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = [
    "SCALE_SUFFIX",
    "Fp8BlockDequantizer",
    "QuantizationConfig",
    "UnsupportedQuantizationError",
    "dequantize_fp8_blocks",
    "read_quantization_config",
]

SCALE_SUFFIX = "_scale_inv"
"""Appended to a weight's name for its block scales: ``X.weight`` -> ``X.weight_scale_inv``."""

_FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


class UnsupportedQuantizationError(ValueError):
    """The checkpoint is quantized in a way this engine does not read."""


@dataclass(frozen=True, slots=True)
class QuantizationConfig:
    """A supported ``quantization_config``: FP8 weights with ``block`` = (rows, columns) scales."""

    method: str
    block: tuple[int, int]
    fmt: str = "e4m3"


def read_quantization_config(config: dict[str, Any], where: str = "config.json") -> QuantizationConfig | None:
    """The checkpoint's quantization, or ``None`` for a plain float checkpoint.

    :param config: the parsed ``config.json``.
    :param where: names the file in errors.
    :raises UnsupportedQuantizationError: any method other than block-scaled FP8, or FP8 whose
        format or block size is missing or malformed; the message names what was found.
    """
    raw = config.get("quantization_config")
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise UnsupportedQuantizationError(f"{where}: quantization_config must be an object, got {raw!r}")
    method = raw.get("quant_method")
    if method != "fp8":
        raise UnsupportedQuantizationError(
            f"{where}: quantization_config.quant_method={method!r} is not supported; only block-scaled "
            "'fp8' checkpoints are read (dequantized at load). Use an unquantized or FP8 checkpoint."
        )
    fmt = raw.get("fmt", "e4m3")
    if fmt not in _FP8_DTYPES:
        raise UnsupportedQuantizationError(
            f"{where}: fp8 fmt={fmt!r} is not supported; use one of {sorted(_FP8_DTYPES)}"
        )
    block = raw.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise UnsupportedQuantizationError(
            f"{where}: fp8 without weight_block_size=[rows, columns] (per-tensor or per-channel FP8 "
            f"scales) is not supported; got weight_block_size={block!r}"
        )
    return QuantizationConfig(method="fp8", block=(block[0], block[1]), fmt=fmt)


def dequantize_fp8_blocks(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """``weight`` (FP8, ``[out, in]``) times its per-block ``scale_inv``, in float32.

    :raises UnsupportedQuantizationError: the scale grid does not cover the weight in ``block`` tiles.
    """
    rows, cols = block
    out, inp = weight.shape
    want = (-(-out // rows), -(-inp // cols))
    if tuple(scale_inv.shape) != want:
        raise UnsupportedQuantizationError(
            f"fp8 weight of shape {list(weight.shape)} needs scales of shape {list(want)} for "
            f"{rows}x{cols} blocks, got {list(scale_inv.shape)}"
        )
    scales = scale_inv.float().repeat_interleave(rows, 0)[:out].repeat_interleave(cols, 1)[:, :inp]
    return weight.float() * scales


@dataclass(slots=True)
class Fp8BlockDequantizer:
    """Pairs streamed checkpoint tensors with their block scales, in whatever order they arrive.

    ``feed(name, tensor)`` returns the tensors ready to load: plain ones at once, an FP8 weight once
    both it and ``name + "_scale_inv"`` have been fed (dequantized to float32, under the weight's
    name; the scale itself is consumed). At most the unmatched halves of pairs are held meanwhile.
    ``finish()`` raises if an FP8 weight never got its scale or a scale never got its weight.
    """

    config: QuantizationConfig
    _weights: dict[str, torch.Tensor] = field(default_factory=dict)
    _scales: dict[str, torch.Tensor] = field(default_factory=dict)

    def feed(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        if name.endswith(SCALE_SUFFIX):
            weight_name = name[: -len(SCALE_SUFFIX)]
            weight = self._weights.pop(weight_name, None)
            if weight is None:
                self._scales[weight_name] = tensor
                return []
            return [(weight_name, dequantize_fp8_blocks(weight, tensor, self.config.block))]
        if tensor.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
            return [(name, tensor)]
        scale = self._scales.pop(name, None)
        if scale is None:
            self._weights[name] = tensor
            return []
        return [(name, dequantize_fp8_blocks(tensor, scale, self.config.block))]

    def finish(self) -> None:
        if self._weights:
            raise UnsupportedQuantizationError(
                f"fp8 weight(s) without {SCALE_SUFFIX} scales: {', '.join(sorted(self._weights)[:5])}"
            )
        if self._scales:
            raise UnsupportedQuantizationError(
                f"{SCALE_SUFFIX} scales without their fp8 weight(s): {', '.join(sorted(self._scales)[:5])}"
            )
