"""Quantized checkpoints: reading their description and the stored-precision weight type.

Formats read, each from the checkpoint's own description:

- block-FP8 (Qwen3-FP8, DeepSeek-V3 style), declared in ``config.json``::

    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}

  Each quantized linear weight ``X.weight`` is ``float8_e4m3fn`` of shape ``[out, in]`` and comes
  with ``X.weight_scale_inv``, float32 of shape ``[ceil(out / 128), ceil(in / 128)]``: the value of
  element ``(i, j)`` is ``weight[i, j] * weight_scale_inv[i // 128, j // 128]`` (the name says it is
  the inverse of the scale that quantized it).
- Ascend W8A8 from msModelSlim, described by ``quant_model_description.json`` beside the weights
  (tensor name -> ``W8A8_DYNAMIC``, ``W8A8`` or ``FLOAT``): int8 weights with per-channel
  ``weight_scale`` / ``weight_offset`` (value ``(weight - offset) * scale``; activations quantised
  per token at run time), or for static ``W8A8`` ``input_scale``, ``input_offset``, ``deq_scale``
  and ``quant_bias`` (see :class:`QuantizedWeight`).

Executors keep such weights as :class:`QuantizedWeight` (the stored bytes, never a float copy) and
multiply by them with ``pypto_kernels.quant_linear``; :func:`dequantize_fp8_blocks` and
:class:`Fp8BlockDequantizer` dequantise at load for weights an executor does not keep quantized.
Any other ``quant_method`` or msModelSlim type is refused with an error naming it, because loading
its tensors as if they were plain floats would serve garbage.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "MODELSLIM_DESCRIPTION",
    "QUANT_SCHEMES",
    "SCALE_SUFFIX",
    "Fp8BlockDequantizer",
    "QuantizationConfig",
    "QuantizedWeight",
    "UnsupportedQuantizationError",
    "deq_scale_as_float",
    "dequantize_fp8_blocks",
    "read_modelslim_description",
    "read_quantization_config",
]

SCALE_SUFFIX = "_scale_inv"
"""Appended to a weight's name for its block scales: ``X.weight`` -> ``X.weight_scale_inv``."""

_FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


class UnsupportedQuantizationError(ValueError):
    """The checkpoint is quantized in a way this engine does not read."""


@dataclass(frozen=True, slots=True)
class QuantizationConfig:
    """A supported quantisation: ``method="fp8"`` (FP8 weights with ``block`` = (rows, columns)
    scales) or ``method="w8a8"`` (msModelSlim; ``tensors`` maps each tensor name to its type from
    ``quant_model_description.json``: ``W8A8_DYNAMIC``, ``W8A8`` or ``FLOAT``)."""

    method: str
    block: tuple[int, int]
    fmt: str = "e4m3"
    tensors: dict[str, str] = field(default_factory=dict, compare=False, repr=False)


#: Storage schemes of :class:`QuantizedWeight` (what ``pypto_kernels.quant_linear`` computes for each).
QUANT_SCHEMES = ("fp8_block", "w8a8_dynamic", "w8a8_static")

MODELSLIM_DESCRIPTION = "quant_model_description.json"
_MODELSLIM_TYPES = {"W8A8_DYNAMIC": "w8a8_dynamic", "W8A8": "w8a8_static", "FLOAT": None}


_TENSOR_FIELDS = ("data", "scale", "offset", "input_scale", "input_offset", "deq_scale", "quant_bias")


@dataclass(slots=True)
class QuantizedWeight:
    """A linear weight kept in its stored precision; ``pypto_kernels.quant_linear`` multiplies by it.

    - ``fp8_block``: ``data`` float8 ``[out, in]``; ``scale`` float32 ``[ceil(out/br), ceil(in/bc)]``
      for ``block=(br, bc)``; value ``data[i, j] * scale[i // br, j // bc]``.
    - ``w8a8_dynamic``: ``data`` int8 ``[out, in]``; ``scale`` float32 ``[out, 1]``; ``offset`` (or
      None when symmetric) ``[out, 1]``; value ``(data - offset) * scale``; activations are
      quantised per token at run time.
    - ``w8a8_static``: ``data`` int8 and msModelSlim's ``input_scale``/``input_offset`` (``[1]``),
      ``deq_scale`` (``[out]``, float32 or int64 holding float32 bits) and ``quant_bias`` (int32
      ``[out]``): ``y = (round(x / input_scale + input_offset) @ data.T + quant_bias) * deq_scale``.
    - ``mxfp4`` (routed experts): ``data`` int8 ``[..., out, in/2]``, two E2M1 codes a byte (low
      nibble the even column); ``scale`` ``float8_e8m0fnu [..., out, ceil(in/32)]``; ``block`` is
      ``(1, 32)``.

    Routed experts are stacked ``[E, out, in]`` (``pypto_kernels.quant_moe_experts`` multiplies by
    them): ``mxfp4``, ``fp8_block`` (``scale [E, ceil(out/br), ceil(in/bc)]``) or ``w8a8_dynamic``
    (``scale`` and ``offset`` ``[E, out]``).
    """

    scheme: str
    data: torch.Tensor
    scale: torch.Tensor
    block: tuple[int, int] = (1, 1)
    offset: torch.Tensor | None = None
    input_scale: torch.Tensor | None = None
    input_offset: torch.Tensor | None = None
    deq_scale: torch.Tensor | None = None
    quant_bias: torch.Tensor | None = None
    # On the CPU: oneDNN's prepacked copy (``pypto_kernels.pack_quant_linear``), which replaces
    # ``data`` (then an empty ``[0, in]`` tensor); None elsewhere.
    packed: Any = None

    @property
    def shape(self) -> tuple[int, int]:
        if self.packed is not None:
            return tuple(self.packed.shape)  # type: ignore[return-value]
        return (int(self.data.shape[0]), int(self.data.shape[1]))

    def tensors(self) -> list[torch.Tensor]:
        """The data and every scale tensor held, each once (``scale`` and ``deq_scale`` may be one)."""
        found = (getattr(self, f) for f in _TENSOR_FIELDS)
        return list({id(t): t for t in found if t is not None}.values())

    def nbytes(self) -> int:
        """Bytes held: the data (or its packed copy) and every scale tensor."""
        packed = 0 if self.packed is None else int(self.packed.nbytes)
        return packed + sum(t.numel() * t.element_size() for t in self.tensors())

    def expert(self, index: int) -> QuantizedWeight:
        """Matrix ``index`` of a stack of experts (views of the stack's tensors)."""
        offset = None if self.offset is None else self.offset[index]
        return QuantizedWeight(self.scheme, self.data[index], self.scale[index], self.block, offset)

    def to(self, device: torch.device) -> QuantizedWeight:
        """The same weight with every tensor on ``device``."""
        moved = {f: getattr(self, f) for f in _TENSOR_FIELDS}
        moved = {f: None if t is None else t.to(device) for f, t in moved.items()}
        return QuantizedWeight(self.scheme, block=self.block, **moved)  # type: ignore[arg-type]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight (a full-size copy: for tests and references, never the serving path).
        For ``w8a8_static`` the weight alone is ``data * deq_scale / input_scale``; a stack of
        experts (3-d ``data``) is dequantised expert by expert."""
        if self.data.dim() == 3 and self.scheme != "mxfp4":
            return torch.stack([self.expert(e).dequantize(dtype) for e in range(self.data.shape[0])])
        if self.scheme == "fp8_block":
            return dequantize_fp8_blocks(self.data, self.scale, self.block).to(dtype)
        if self.scheme == "mxfp4":
            rows = self.data.reshape(-1, self.data.shape[-1])
            values = dequantize_mxfp4(rows, self.scale.reshape(-1, self.scale.shape[-1]))
            return values.reshape(*self.data.shape[:-1], -1).to(dtype)
        if self.scheme == "w8a8_static":
            assert self.deq_scale is not None and self.input_scale is not None
            deq = deq_scale_as_float(self.deq_scale)
            return (self.data.float() * (deq / self.input_scale.float()).reshape(-1, 1)).to(dtype)
        centred = self.data.float() if self.offset is None else self.data.float() - self.offset.float().reshape(-1, 1)
        return (centred * self.scale.float().reshape(-1, 1)).to(dtype)


def deq_scale_as_float(deq_scale: torch.Tensor) -> torch.Tensor:
    """msModelSlim's ``deq_scale`` as float32: stored as float32, or (float16 models, the layout
    Ascend's quantised matmul takes) as int64 whose low 32 bits are the float32's bits."""
    if deq_scale.dtype == torch.int64:
        return (deq_scale & 0xFFFFFFFF).to(torch.int32).view(torch.float32)
    return deq_scale.float()


def read_modelslim_description(model_dir: str | Path) -> QuantizationConfig | None:
    """msModelSlim's ``quant_model_description.json`` as a ``w8a8`` config, or None without one.

    :raises UnsupportedQuantizationError: a tensor type other than ``W8A8_DYNAMIC``, ``W8A8`` or
        ``FLOAT`` (e.g. ``W8A16``, ``W4A8_DYNAMIC``, ``W8A8S``), naming the tensor and the type.
    """
    path = Path(model_dir) / MODELSLIM_DESCRIPTION
    if not path.is_file():
        return None
    raw = json.loads(path.read_text())
    if not isinstance(raw, dict):
        raise UnsupportedQuantizationError(f"{path}: must hold a JSON object of tensor name -> quantization type")
    tensors: dict[str, str] = {}
    for name, kind in raw.items():
        if name in ("model_quant_type", "kv_cache_type", "version") or not isinstance(kind, str):
            continue
        if kind not in _MODELSLIM_TYPES:
            raise UnsupportedQuantizationError(
                f"{path}: tensor {name!r} is quantized as {kind!r}, which is not supported; "
                f"supported: {', '.join(_MODELSLIM_TYPES)}"
            )
        scheme = _MODELSLIM_TYPES[kind]
        if scheme is not None:
            tensors[name] = scheme
    return QuantizationConfig(method="w8a8", block=(1, 1), fmt="int8", tensors=tensors)


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


# ---------------------------------------------------------------------------------------------------
# DeepSeek-V4 release layout: UE8M0 block scales and MXFP4 routed experts.
#
# DeepSeek's release describes itself in config.json: ``quantization_config`` = ``{"quant_method":
# "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "weight_block_size": [128, 128]}`` and, top level,
# ``"expert_dtype": "fp4"``. An FP8 weight ``P.weight`` keeps its block scales in ``P.scale``
# (``float8_e8m0fnu``: an 8-bit exponent ``e``, the scale is ``2**(e - 127)``, 255 is NaN), one per
# block, the grid rounded up; its value is ``weight * scale``. A routed expert ``P.weight`` is int8
# ``[out, in / 2]``, two E2M1 codes a byte (the low nibble is the even column), with ``P.scale``
# ``float8_e8m0fnu [out, in / 32]``: MXFP4, one power-of-two scale per 32 values of a row.
# ---------------------------------------------------------------------------------------------------

__all__ += [  # extends the list above, so that this block merges as one piece
    "E2M1_VALUES",
    "MXFP4_GROUP",
    "CheckpointFormat",
    "decode_ue8m0",
    "dequantize_mxfp4",
    "encode_ue8m0",
    "quantize_fp8_ue8m0",
    "quantize_mxfp4",
    "read_checkpoint_format",
    "unpack_e2m1",
]

#: The value of each E2M1 code 0..15: bit 3 is the sign, bits 2..0 the magnitude (OCP MX spec).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
#: Values sharing one E8M0 scale in an MXFP4 row.
MXFP4_GROUP = 32
_SCALE_FMTS = ("ue8m0",)
_EXPERT_DTYPES = ("fp4", "fp8")
_FP8_MAX = 448.0  # largest float8_e4m3fn
_E2M1_MAX = 6.0


@dataclass(frozen=True, slots=True)
class CheckpointFormat:
    """How a checkpoint stores its weights, as its ``config.json`` says.

    :ivar fp8: the block-FP8 description (``None``: no FP8 weights).
    :ivar scale_fmt: ``"ue8m0"`` when the FP8 scales are powers of two (``P.scale`` is then
        ``float8_e8m0fnu``), else ``None`` (float32 scales).
    :ivar expert_dtype: ``"fp4"`` for MXFP4 routed experts, ``"fp8"`` for block-FP8 ones, ``None``
        when the experts are stored like the other weights.
    """

    fp8: QuantizationConfig | None = None
    scale_fmt: str | None = None
    expert_dtype: str | None = None

    def describe(self) -> str:
        """The description, as errors quote it."""
        if self.fp8 is None:
            return f"no quantization_config, expert_dtype={self.expert_dtype!r}"
        return (
            f"quant_method='fp8', fmt={self.fp8.fmt!r}, scale_fmt={self.scale_fmt!r}, "
            f"weight_block_size={list(self.fp8.block)}, expert_dtype={self.expert_dtype!r}"
        )


def read_checkpoint_format(config: dict[str, Any], where: str = "config.json") -> CheckpointFormat:
    """The block-FP8 description (:func:`read_quantization_config`) with DeepSeek's ``scale_fmt``
    and ``expert_dtype``.

    :raises UnsupportedQuantizationError: an unknown ``scale_fmt`` or ``expert_dtype``, or FP8
        experts without a ``quantization_config`` to give their blocks; the message names the key.
    """
    fp8 = read_quantization_config(config, where)
    raw = config.get("quantization_config") or {}
    scale_fmt = raw.get("scale_fmt")
    if scale_fmt is not None and scale_fmt not in _SCALE_FMTS:
        raise UnsupportedQuantizationError(
            f"{where}: quantization_config.scale_fmt={scale_fmt!r} (quant_method='fp8') is not supported; "
            f"expected one of {list(_SCALE_FMTS)} or none (float32 scales)"
        )
    expert_dtype = config.get("expert_dtype", raw.get("expert_dtype"))
    if expert_dtype is not None and expert_dtype not in _EXPERT_DTYPES:
        raise UnsupportedQuantizationError(
            f"{where}: expert_dtype={expert_dtype!r} is not supported; expected 'fp4' (MXFP4: int8 "
            "[out, in/2] E2M1 pairs with float8_e8m0fnu [out, in/32] scales), 'fp8' or none"
        )
    if expert_dtype == "fp8" and fp8 is None:
        raise UnsupportedQuantizationError(
            f"{where}: expert_dtype='fp8' needs a quantization_config with weight_block_size for the experts' scales"
        )
    return CheckpointFormat(fp8=fp8, scale_fmt=scale_fmt, expert_dtype=expert_dtype)


def decode_ue8m0(scale: torch.Tensor) -> torch.Tensor:
    """``float8_e8m0fnu`` (or its raw ``uint8`` bits) as float32: ``2**(e - 127)``, NaN for 255."""
    if scale.dtype not in (torch.float8_e8m0fnu, torch.uint8):
        raise UnsupportedQuantizationError(f"ue8m0 scales must be float8_e8m0fnu, got {scale.dtype}")
    exponent = torch.arange(256, device=scale.device) - 127
    table = torch.ldexp(torch.ones(256, device=scale.device), exponent).masked_fill(exponent == 128, float("nan"))
    return table[scale.view(torch.uint8).int()]


def encode_ue8m0(minimum: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The smallest powers of two ``>= minimum`` (a float tensor), as (``float8_e8m0fnu``, float32)."""
    exponent = torch.ceil(torch.log2(minimum.float().clamp_min(2.0**-127))).clamp(-127, 127)
    bits = (exponent + 127).to(torch.uint8)
    return bits.view(torch.float8_e8m0fnu), torch.exp2(exponent)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """``[..., n]`` bytes (int8 or uint8) holding two E2M1 codes each, low nibble first, as float32
    ``[..., 2n]``."""
    if packed.dtype not in (torch.int8, torch.uint8):
        raise UnsupportedQuantizationError(f"packed E2M1 values must be int8 or uint8, got {packed.dtype}")
    # One lookup per byte in a table of its two values (low nibble, high nibble).
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    byte = torch.arange(256, device=packed.device)
    pairs = torch.stack((table[byte & 0xF], table[byte >> 4]), dim=-1)
    return pairs[packed.view(torch.uint8).int()].flatten(-2)


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor, group: int = MXFP4_GROUP) -> torch.Tensor:
    """An MXFP4 matrix (``packed`` int8 ``[out, in/2]``, ``scale`` ``float8_e8m0fnu [out, ceil(in/group)]``)
    as float32 ``[out, in]``.

    :raises UnsupportedQuantizationError: the scale grid does not match the packed matrix.
    """
    values = unpack_e2m1(packed)
    out, inp = values.shape
    want = [out, -(-inp // group)]
    if list(scale.shape) != want:
        raise UnsupportedQuantizationError(
            f"mxfp4 weight of {inp} columns packed as {list(packed.shape)} needs float8_e8m0fnu scales of "
            f"shape {want} (one per {group} values), got {list(scale.shape)}"
        )
    scales = decode_ue8m0(scale)
    if inp % group == 0:  # whole groups: scale each as a block, without a full-size scale matrix
        return (values.view(out, -1, group) * scales[..., None]).view(out, inp)
    return values * scales.repeat_interleave(group, 1)[:, :inp]


def quantize_fp8_ue8m0(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` ``[out, in]`` as ``float8_e4m3fn`` with one power-of-two scale per ``block``, the
    smallest that keeps the block's largest magnitude in range: (weight, ``float8_e8m0fnu`` scales)."""
    rows, cols = block
    out, inp = weight.shape
    grid = (-(-out // rows), -(-inp // cols))
    padded = weight.float().new_zeros(grid[0] * rows, grid[1] * cols)
    padded[:out, :inp] = weight.float()
    tiles = padded.view(grid[0], rows, grid[1], cols)
    codes, scale = encode_ue8m0(tiles.abs().amax(dim=(1, 3)) / _FP8_MAX)
    q = (tiles / scale[:, None, :, None]).clamp(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(grid[0] * rows, grid[1] * cols)[:out, :inp].contiguous(), codes


def quantize_mxfp4(weight: torch.Tensor, group: int = MXFP4_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` ``[out, in]`` (``in`` even) as MXFP4: (int8 ``[out, in/2]``, ``float8_e8m0fnu``
    ``[out, ceil(in/group)]``), each value rounded to the nearest E2M1 value (ties to the even code)."""
    out, inp = weight.shape
    if inp % 2:
        raise ValueError(f"mxfp4 packs two values a byte: {inp} columns is odd")
    n = -(-inp // group)
    padded = weight.float().new_zeros(out, n * group)
    padded[:, :inp] = weight.float()
    groups = padded.view(out, n, group)
    codes_scale, scale = encode_ue8m0(groups.abs().amax(-1) / _E2M1_MAX)
    x = (groups / scale[..., None]).flatten(1)[:, :inp]
    magnitudes = torch.tensor(E2M1_VALUES[:8], device=x.device)
    mids = (magnitudes[1:] + magnitudes[:-1]) / 2
    lo = torch.bucketize(x.abs(), mids, right=False)
    hi = torch.bucketize(x.abs(), mids, right=True)
    code = torch.where(hi != lo, lo + lo % 2, lo)  # on a midpoint: the even code (round half to even)
    code = code | ((x < 0) & (code > 0)).to(code.dtype) << 3
    packed = (code[:, 0::2] | code[:, 1::2] << 4).to(torch.uint8)
    return packed.view(torch.int8), codes_scale
