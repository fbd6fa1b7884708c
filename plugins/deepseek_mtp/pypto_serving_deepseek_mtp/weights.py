"""Safetensors loading, streamed and sliced per tensor-parallel rank, with names normalised to
DeepSeek's layout.

Two namings are read (docs/deepseek_mtp.md lists both):

- DeepSeek's own, as its reference inference code and the official release use it
  (``layers.0.attn.wq_a.weight``, ``layers.0.attn.kv_norm.weight``, ``embed.weight``,
  ``head.weight``, ``hc_head_fn``, ``mtp.0.*``; transformers writes the same names back on
  ``save_pretrained``, under a ``model.`` prefix and with ``attn.norm`` for ``attn.kv_norm``);
- transformers' in-memory names (``model.layers.0.self_attn.q_a_proj.weight``,
  ``model.embed_tokens.weight``, ``lm_head.weight``, the fused ``mlp.experts.gate_up_proj`` and
  ``down_proj``), which are mapped to DeepSeek's, fused experts split per expert.

Each tensor is read with ``safe_open(...).get_slice`` and only this rank's part of it
(:class:`.sharding.ShardPlan`), so a rank's peak is its share of the model plus one tensor.
Quantized tensors are read as ``config.json`` describes them (block FP8 with ``weight_scale_inv``
or the release's E8M0 ``X.scale``, MXFP4 routed experts; docs/deepseek_mtp.md, Quantized
checkpoints), and refused by name where they do not match that description. With ``stored=True``
(what the executor loads) the projections the model multiplies through ``pypto_kernels.quant_linear``
and the routed experts (MXFP4 or block FP8) stay in their stored precision as
:class:`~pypto_serving.quantization.QuantizedWeight` (the bytes as stored, FP8 block scales decoded
to float32); without it, or where this rank's part cuts through a scale block, they are dequantized.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from pypto_serving.quantization import (
    MODELSLIM_DESCRIPTION,
    MXFP4_GROUP,
    SCALE_SUFFIX,
    CheckpointFormat,
    QuantizationConfig,
    QuantizedWeight,
    UnsupportedQuantizationError,
    decode_ue8m0,
    dequantize_mxfp4,
    read_checkpoint_format,
    read_modelslim_description,
)

from .sharding import ShardPlan, TensorPart

logger = logging.getLogger(__name__)

#: A loaded tensor: a float (or integer) tensor, or a weight kept in its stored precision.
Loaded = torch.Tensor | QuantizedWeight

_TOP_LEVEL = {
    "embed_tokens.weight": "embed.weight",
    "lm_head.weight": "head.weight",
    "hc_head.hc_fn": "hc_head_fn",
    "hc_head.hc_base": "hc_head_base",
    "hc_head.hc_scale": "hc_head_scale",
}
# transformers' per-layer names (left) for DeepSeek's (right).
_LAYER_LEAVES = {
    "self_attn.sinks": "attn.attn_sink",
    "self_attn.q_a_proj.weight": "attn.wq_a.weight",
    "self_attn.q_a_norm.weight": "attn.q_norm.weight",
    "self_attn.q_b_proj.weight": "attn.wq_b.weight",
    "self_attn.kv_proj.weight": "attn.wkv.weight",
    "self_attn.kv_norm.weight": "attn.norm.weight",
    "attn.kv_norm.weight": "attn.norm.weight",  # the release's name for the K=V head's norm
    "self_attn.o_a_proj.weight": "attn.wo_a.weight",
    "self_attn.o_b_proj.weight": "attn.wo_b.weight",
    "self_attn.compressor.position_bias": "attn.compressor.ape",
    "self_attn.compressor.kv_proj.weight": "attn.compressor.wkv.weight",
    "self_attn.compressor.gate_proj.weight": "attn.compressor.wgate.weight",
    "self_attn.compressor.kv_norm.weight": "attn.compressor.norm.weight",
    "self_attn.compressor.indexer.position_bias": "attn.indexer.compressor.ape",
    "self_attn.compressor.indexer.kv_proj.weight": "attn.indexer.compressor.wkv.weight",
    "self_attn.compressor.indexer.gate_proj.weight": "attn.indexer.compressor.wgate.weight",
    "self_attn.compressor.indexer.kv_norm.weight": "attn.indexer.compressor.norm.weight",
    "self_attn.compressor.indexer.q_b_proj.weight": "attn.indexer.wq_b.weight",
    "self_attn.compressor.indexer.scorer.weights_proj.weight": "attn.indexer.weights_proj.weight",
    "mlp.gate.weight": "ffn.gate.weight",
    "mlp.gate.e_score_correction_bias": "ffn.gate.bias",
    "mlp.gate.tid2eid": "ffn.gate.tid2eid",
    "mlp.shared_experts.gate_proj.weight": "ffn.shared_experts.w1.weight",
    "mlp.shared_experts.up_proj.weight": "ffn.shared_experts.w3.weight",
    "mlp.shared_experts.down_proj.weight": "ffn.shared_experts.w2.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    **{f"{hc}_hc.{a}": f"hc_{hc}_{a}" for hc in ("attn", "ffn") for a in ("fn", "base", "scale")},
}
#: transformers' fused expert tensors: ``gate_up_proj [E, 2I, D]`` (w1 rows then w3 rows) and
#: ``down_proj [E, D, I]``.
_FUSED = {"mlp.experts.gate_up_proj": ("w1", "w3"), "mlp.experts.down_proj": ("w2",)}
_MTP = re.compile(r"^mtp\.(\d+)\.")
_LAYER = re.compile(r"^(?:layers|mtp)\.\d+\.")
_FP8 = ("F8_E4M3", "F8_E5M2")
_FP8_FMT = {"e4m3": "F8_E4M3", "e5m2": "F8_E5M2"}
_PACKED = ("I8", "U8")
_E8M0 = "F8_E8M0"
#: DeepSeek's release names a weight's scales ``P.scale`` beside ``P.weight``.
RELEASE_SCALE = ".scale"
_ROUTED = re.compile(r"^(?:layers|mtp)\.\d+\.ffn\.experts\.\d+\.w[123]\.weight$")
#: FP8 weights the model multiplies through ``quant_linear`` (model.linear), so they may stay FP8.
_STORED_FP8 = re.compile(
    r"^(?:layers|mtp)\.\d+\.(?:attn\.(?:wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b|indexer\.weights_proj)"
    r"|ffn\.shared_experts\.w[123]|e_proj|h_proj)\.weight$"
)


def normalise_name(name: str) -> str:
    """``name`` in DeepSeek's layout (scale tensors keep their ``_scale_inv`` suffix)."""
    if name.endswith(SCALE_SUFFIX):
        return normalise_name(name[: -len(SCALE_SUFFIX)]) + SCALE_SUFFIX
    if name.startswith("model."):
        name = name[len("model.") :]
    m = _MTP.match(name)
    prefix, rest = (m.group(0), name[m.end() :]) if m else ("", name)
    if rest in _TOP_LEVEL:
        return prefix + _TOP_LEVEL[rest]
    layer = _LAYER.match(name)
    if layer is None:
        return name
    leaf = name[layer.end() :]
    return layer.group(0) + _LAYER_LEAVES.get(leaf, leaf)


def load_weights(
    model_dir: str | Path,
    device: torch.device,
    dtype: torch.dtype,
    fp32_suffixes: tuple[str, ...],
    quantization: QuantizationConfig | None = None,
    plan: ShardPlan | None = None,
    stored: bool = False,
) -> dict[str, Loaded]:
    """This rank's part (``plan``; everything without one) of every tensor of the checkpoint, floats
    cast to ``dtype`` except the float32-kept ones, read one tensor at a time.

    The storage format comes from ``model_dir/config.json`` (:func:`read_checkpoint_format`:
    ``quantization_config`` with DeepSeek's ``scale_fmt``, and ``expert_dtype``; ``quantization``
    stands in when there is no config.json). FP8 weights are dequantized with their block scales
    (``X.weight_scale_inv``, or the release's ``X.scale`` in E8M0) and MXFP4 routed experts with
    their E8M0 group scales, only the blocks of this rank's part; a tensor that does not match the
    description is refused by name. With ``stored`` they stay as stored instead (see the module
    docstring), except parts that cut through a scale block, which are dequantized with a warning."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    config = Path(model_dir) / "config.json"
    fmt = (
        read_checkpoint_format(json.loads(config.read_text()), str(config))
        if config.is_file()
        else CheckpointFormat(fp8=quantization)
    )
    modelslim = read_modelslim_description(model_dir)
    if modelslim is not None and fmt.fp8 is not None:
        raise UnsupportedQuantizationError(
            f"{model_dir}: both config.json (quantization_config: {fmt.describe()}) and "
            f"{MODELSLIM_DESCRIPTION} describe the weights; keep the one that matches the tensors"
        )
    out: dict[str, Loaded] = {}
    with ExitStack() as stack:
        handles = [stack.enter_context(safe_open(str(p), framework="pt")) for p in files]
        where = {key: f for f in handles for key in f.keys()}  # noqa: SIM118 - safe_open is not a mapping
        reader = _Reader(where, fmt, plan, stored, modelslim.tensors if modelslim is not None else {})
        for key in where:
            for name, t in reader.read(key):
                out[name] = (
                    t.to(device) if isinstance(t, QuantizedWeight) else _cast(name, t, dtype, fp32_suffixes).to(device)
                )
    if reader.dequantized:
        logger.warning(
            "%d quantized weight(s) dequantized at load: this rank's tensor-parallel part cuts through "
            "their scale blocks (FP8 blocks or 32-value MXFP4 groups), e.g. %s",
            len(reader.dequantized),
            ", ".join(reader.dequantized[:4]),
        )
    return out


def scale_pairs(keys: Iterable[str]) -> dict[str, str]:
    """Each quantized weight's key mapped to its scales' key: ``X.weight_scale_inv`` (Qwen3-FP8,
    DeepSeek-V3 style), or ``X.scale`` beside ``X.weight`` (DeepSeek's release).

    :raises UnsupportedQuantizationError: a ``_scale_inv`` tensor whose weight is not in the checkpoint.
    """
    keys = set(keys)
    pairs: dict[str, str] = {}
    orphans = []
    for key in sorted(keys):
        if key.endswith(SCALE_SUFFIX):
            weight = key[: -len(SCALE_SUFFIX)]
            if weight not in keys:
                orphans.append(key)
                continue
        elif key.endswith(RELEASE_SCALE) and key[: -len(RELEASE_SCALE)] + ".weight" in keys:
            weight = key[: -len(RELEASE_SCALE)] + ".weight"
        else:
            continue
        pairs[weight] = key
    if orphans:
        raise UnsupportedQuantizationError(
            f"{SCALE_SUFFIX} scales without their fp8 weight(s): {', '.join(orphans[:5])}"
        )
    return pairs


class _Reader:
    """Reads tensors by checkpoint key: only this rank's part, quantized ones dequantized with their scales."""

    def __init__(
        self,
        where: dict[str, Any],
        fmt: CheckpointFormat,
        plan: ShardPlan | None,
        stored: bool,
        w8a8: dict[str, str],
    ) -> None:
        self.where = where
        self.fmt = fmt
        self.plan = plan
        self.stored = stored
        self.w8a8 = {k: v for k, v in w8a8.items() if k.endswith(".weight")}  # msModelSlim's weights
        self.dequantized: list[str] = []  # kept-as-stored candidates whose part cuts through a scale block
        self.scales = scale_pairs(where)
        self._scale_keys = set(self.scales.values())
        # msModelSlim's per-channel tensors are read with their weight.
        self._scale_keys |= {k + s for k in self.w8a8 for s in W8A8_SUFFIXES if k + s in where}

    def read(self, key: str) -> Iterator[tuple[str, Loaded]]:
        """(normalised name, this rank's part) of checkpoint tensor ``key``; scales yield nothing."""
        if key in self._scale_keys:
            return
        name = normalise_name(key)
        fused = _fused(name)
        if fused is not None:
            yield from self._read_fused(key, *fused)
            return
        if self.plan is not None and not self.plan.wanted(name):
            return
        sl = self.where[key].get_slice(key)
        kind = self._kind(key, name, sl.get_dtype())
        shape = list(sl.get_shape())
        if kind == "mxfp4":
            shape = [shape[0], 2 * shape[1]]  # the values, not the bytes, are what a rank splits
        part = self.plan.part_of(name, shape) if self.plan is not None else None
        if kind == "w8a8":
            weight = _w8a8_part(self.where, key, sl, _spans(shape, part))
            keep = self.stored and (_STORED_FP8.match(name) or _ROUTED.match(name))
            yield name, weight if keep else weight.dequantize()
            return
        if kind == "plain":
            index = () if part is None else (slice(None),) * part.dim + (part.part,)
            yield name, sl[index] if index else sl[:]
            return
        scale = self.where[self.scales[key]].get_slice(self.scales[key])
        if kind == "mxfp4":
            _check_mxfp4_grid(key, scale, shape)
            if self._keep(name, shape, part, (1, MXFP4_GROUP)):
                yield name, _mxfp4_stored(sl, scale, shape, part)
            else:
                yield name, _mxfp4_part(sl, scale, shape, part)
            return
        assert self.fmt.fp8 is not None  # _kind returns "fp8" only with a block-FP8 description
        block = self.fmt.fp8.block
        _check_fp8_grid(key, scale, block, shape)
        if (_STORED_FP8.match(name) or _ROUTED.match(name)) and self._keep(name, shape, part, block):
            yield name, _fp8_stored(sl, scale, block, shape, part)
        else:
            yield name, _fp8_part(sl, scale, block, shape, part)

    def _keep(self, name: str, full: list[int], part: TensorPart | None, block: tuple[int, int]) -> bool:
        """Whether ``name`` stays as stored: loading stored, and this rank's part made of whole blocks."""
        if not self.stored:
            return False
        if _whole_blocks(_spans(full, part), full, block):
            return True
        self.dequantized.append(name)
        return False

    def _kind(self, key: str, name: str, dtype: str) -> str:
        """``"mxfp4"``, ``"fp8"`` or ``"plain"`` for tensor ``key`` stored as ``dtype``; refuses one
        the checkpoint's description does not allow."""
        fmt = self.fmt
        routed = _ROUTED.match(name) is not None
        if key in self.w8a8:
            self._check_w8a8(key, dtype)
            return "w8a8"
        if routed and fmt.expert_dtype == "fp4" and dtype not in _FP8:  # FP8 experts read as FP8
            if dtype not in _PACKED:
                raise self._error(
                    key, f"is {dtype}; expert_dtype='fp4' expects int8 [out, in/2], two E2M1 codes a byte"
                )
            self._check_scale(key, (_E8M0,), f"float8_e8m0fnu [out, in/{MXFP4_GROUP}]")
            return "mxfp4"
        if dtype in _FP8:
            if fmt.fp8 is None:
                raise UnsupportedQuantizationError(
                    f"tensor {key!r} is {dtype} but config.json declares no quantization_config: its scales are unknown"
                )
            if dtype != _FP8_FMT[fmt.fp8.fmt]:
                raise self._error(key, f"is {dtype}; fmt={fmt.fp8.fmt!r} expects {_FP8_FMT[fmt.fp8.fmt]}")
            self._check_scale(key, *self._fp8_scale(key))
            return "fp8"
        if routed and dtype in _PACKED:
            raise self._error(key, f"is {dtype}: a packed expert needs expert_dtype='fp4' in config.json")
        if dtype in _PACKED and key.endswith(".weight"):
            raise self._error(key, f"is {dtype} but neither config.json nor {MODELSLIM_DESCRIPTION} quantizes it")
        if key in self.scales:
            raise self._error(self.scales[key], f"scales {key}, which is {dtype}, not a quantized weight")
        return "plain"

    def _check_w8a8(self, key: str, dtype: str) -> None:
        """Refuses a weight msModelSlim's description quantizes that this loader cannot read as
        dynamic W8A8: static W8A8, a non-int8 weight, missing or malformed per-channel tensors."""
        kind = {"w8a8_dynamic": "W8A8_DYNAMIC", "w8a8_static": "W8A8"}[self.w8a8[key]]
        where = f"({MODELSLIM_DESCRIPTION}: {kind})"
        if kind != "W8A8_DYNAMIC":
            raise UnsupportedQuantizationError(
                f"{key} is static W8A8 {where}; the DeepSeek executor reads W8A8_DYNAMIC (per-token activations) only"
            )
        if dtype != "I8":
            raise UnsupportedQuantizationError(f"{key} is {dtype}; W8A8_DYNAMIC expects int8 [out, in] {where}")
        out = self.where[key].get_slice(key).get_shape()[0]
        for suffix in W8A8_SUFFIXES:
            name = key + suffix
            if name not in self.where:
                if suffix == "_offset":
                    continue  # symmetric: no offset
                raise UnsupportedQuantizationError(f"{key} has no scales: expected {name}, float32 [{out}, 1] {where}")
            sl = self.where[name].get_slice(name)
            if sl.get_dtype() not in ("F32", "BF16", "F16") or list(sl.get_shape()) not in ([out], [out, 1]):
                raise UnsupportedQuantizationError(
                    f"{name} is {sl.get_dtype()} {list(sl.get_shape())}; expected float32 [{out}, 1] "
                    f"(one per output channel of {key}) {where}"
                )

    def _fp8_scale(self, key: str) -> tuple[tuple[str, ...], str]:
        """(the dtypes allowed, the expectation in words) for an FP8 weight's scales."""
        assert self.fmt.fp8 is not None
        rows, cols = self.fmt.fp8.block
        grid = f"one per {rows}x{cols} block"
        if self.fmt.scale_fmt == "ue8m0":
            release = self.scales.get(key, "").endswith(RELEASE_SCALE)
            return ((_E8M0,) if release else (_E8M0, "F32")), f"float8_e8m0fnu, {grid}"
        return ("F32", "BF16"), f"float32, {grid}"

    def _check_scale(self, key: str, dtypes: tuple[str, ...], expected: str) -> None:
        scale = self.scales.get(key)
        if scale is None:
            stem = key.removesuffix(".weight")
            name = f"{stem}{RELEASE_SCALE}" if self.fmt.scale_fmt or self.fmt.expert_dtype else key + SCALE_SUFFIX
            raise self._error(key, f"has no scales: expected {name} ({expected})")
        got = self.where[scale].get_slice(scale).get_dtype()
        if got not in dtypes:
            raise self._error(scale, f"is {got}; expected {expected}")

    def _error(self, key: str, what: str) -> UnsupportedQuantizationError:
        return UnsupportedQuantizationError(f"{key} {what} (config.json: {self.fmt.describe()})")

    def _read_fused(self, key: str, prefix: str, projections: tuple[str, ...]) -> Iterator[tuple[str, torch.Tensor]]:
        sl = self.where[key].get_slice(key)
        n_experts, height, cols = sl.get_shape()
        if sl.get_dtype() in _FP8 or sl.get_dtype() in _PACKED:
            raise UnsupportedQuantizationError(f"fused quantized expert tensor {key!r} is not supported")
        size = height // len(projections)
        for e in range(n_experts):
            for i, proj in enumerate(projections):
                name = f"{prefix}ffn.experts.{e}.{proj}.weight"
                if self.plan is not None and not self.plan.wanted(name):
                    continue
                part = self.plan.part_of(name, [size, cols]) if self.plan is not None else None
                rows, span = slice(i * size, (i + 1) * size), slice(None)
                if part is not None and part.dim == 0:
                    rows = slice(rows.start + part.part.start, rows.start + part.part.stop)
                elif part is not None:
                    span = part.part
                yield name, sl[e, rows, span]


def _fused(name: str) -> tuple[str, tuple[str, ...]] | None:
    """(layer prefix, the projections stacked in it) for a fused transformers expert tensor."""
    layer = _LAYER.match(name)
    if layer is None:
        return None
    projections = _FUSED.get(name[layer.end() :])
    return None if projections is None else (layer.group(0), projections)


def _spans(full: list[int], part: TensorPart | None) -> list[slice]:
    """The rows and columns of a matrix of shape ``full`` that ``part`` covers."""
    spans = [slice(0, full[0]), slice(0, full[1])]
    if part is not None:
        spans[part.dim] = part.part
    return spans


def _whole_blocks(spans: list[slice], full: list[int], block: tuple[int, int]) -> bool:
    """Whether every span starts on a block edge and ends on one (or at the matrix's end)."""
    return all(s.start % b == 0 and (s.stop % b == 0 or s.stop == n) for s, n, b in zip(spans, full, block))


def _check_fp8_grid(key: str, scale_sl: Any, block: tuple[int, int], full: list[int]) -> None:
    if len(full) != 2:
        raise UnsupportedQuantizationError(f"fp8 weight {key} of shape {full} is not a matrix")
    want = [-(-n // b) for n, b in zip(full, block)]
    if list(scale_sl.get_shape()) != want:
        raise UnsupportedQuantizationError(
            f"fp8 weight {key} of shape {full} needs scales of shape {want} for {block[0]}x{block[1]} blocks, "
            f"got {list(scale_sl.get_shape())}"
        )


def _float_scales(raw: torch.Tensor) -> torch.Tensor:
    return decode_ue8m0(raw) if raw.dtype == torch.float8_e8m0fnu else raw.float()


def _fp8_stored(
    sl: Any, scale_sl: Any, block: tuple[int, int], full: list[int], part: TensorPart | None
) -> QuantizedWeight:
    """This rank's part (whole blocks) of a block-FP8 weight as stored, its scales as float32."""
    rows, cols = _spans(full, part)
    grid = [slice(s.start // b, -(-s.stop // b)) for s, b in zip((rows, cols), block)]
    scale = _float_scales(scale_sl[grid[0], grid[1]])
    return QuantizedWeight("fp8_block", sl[rows, cols].contiguous(), scale.contiguous(), block)


def _fp8_part(sl: Any, scale_sl: Any, block: tuple[int, int], full: list[int], part: TensorPart | None) -> torch.Tensor:
    """This rank's part of a block-FP8 weight (shape ``full``) times its scales, in float32: only
    the scale blocks the part covers are expanded."""
    spans = _spans(full, part)
    scales = _float_scales(scale_sl[:])
    for dim, (span, b) in enumerate(zip(spans, block)):
        first, last = span.start // b, (span.stop - 1) // b
        scales = scales.narrow(dim, first, last - first + 1).repeat_interleave(b, dim)
        scales = scales.narrow(dim, span.start - first * b, span.stop - span.start)
    weight: torch.Tensor = sl[spans[0], spans[1]]
    return weight.float() * scales


#: msModelSlim's per-channel tensors of a W8A8 weight ``X.weight``: ``X.weight_scale``, ``X.weight_offset``.
W8A8_SUFFIXES = ("_scale", "_offset")


def _w8a8_part(where: dict[str, Any], key: str, sl: Any, spans: list[slice]) -> QuantizedWeight:
    """This rank's part (``spans``: rows, columns) of a W8A8_DYNAMIC weight with its rows' scales and
    offsets (dropped when all zero: symmetric)."""
    rows, cols = spans

    def channels(suffix: str) -> torch.Tensor | None:
        name = key + suffix
        return where[name].get_slice(name)[rows].float().reshape(-1).contiguous() if name in where else None

    scale, offset = channels("_scale"), channels("_offset")
    assert scale is not None  # _check_w8a8 refused a weight without one
    if offset is not None and not offset.any():
        offset = None
    return QuantizedWeight("w8a8_dynamic", sl[rows, cols].contiguous(), scale, (1, 1), offset)


def _check_mxfp4_grid(key: str, scale_sl: Any, full: list[int]) -> None:
    out, inp = full
    want = [out, -(-inp // MXFP4_GROUP)]
    if list(scale_sl.get_shape()) != want:
        raise UnsupportedQuantizationError(
            f"mxfp4 expert {key} packed as {[out, inp // 2]} needs float8_e8m0fnu scales of shape {want} "
            f"(one per {MXFP4_GROUP} values), got {list(scale_sl.get_shape())}"
        )


def _mxfp4_stored(sl: Any, scale_sl: Any, full: list[int], part: TensorPart | None) -> QuantizedWeight:
    """This rank's part (whole 32-value groups) of an MXFP4 expert as stored: bytes and E8M0 scales."""
    rows, cols = _spans(full, part)
    packed = sl[rows, cols.start // 2 : cols.stop // 2].contiguous()
    scale = scale_sl[rows, cols.start // MXFP4_GROUP : -(-cols.stop // MXFP4_GROUP)].contiguous()
    return QuantizedWeight("mxfp4", packed, scale, (1, MXFP4_GROUP))


def _mxfp4_part(sl: Any, scale_sl: Any, full: list[int], part: TensorPart | None) -> torch.Tensor:
    """This rank's part of an MXFP4 expert (``full`` = [out, in] values) in float32: the bytes and
    scales of the 32-value groups the part touches are read and decoded, then trimmed to it."""
    inp = full[1]
    rows, cols = _spans(full, part)
    first, last = cols.start // MXFP4_GROUP, -(-cols.stop // MXFP4_GROUP)
    packed = sl[rows, first * MXFP4_GROUP // 2 : min(last * MXFP4_GROUP, inp) // 2]
    values = dequantize_mxfp4(packed, scale_sl[rows, first:last])
    offset = first * MXFP4_GROUP
    return values[:, cols.start - offset : cols.stop - offset]


def _cast(name: str, t: torch.Tensor, dtype: torch.dtype, fp32_suffixes: tuple[str, ...]) -> torch.Tensor:
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise UnsupportedQuantizationError(
            f"tensor {name!r} is {t.dtype} but config.json declares no quantization_config: its scales are unknown"
        )
    if t.is_floating_point():
        return t.to(torch.float32 if name.endswith(fp32_suffixes) else dtype)
    return t


def mtp_depths(weights: dict[str, Loaded]) -> int:
    """Number of consecutive ``mtp.{d}.*`` layers present (0, 1, ...)."""
    found = {int(m.group(1)) for k in weights if (m := _MTP.match(k))}
    n = 0
    while n in found:
        n += 1
    return n
