"""Safetensors loading, streamed and sliced per tensor-parallel rank, with names normalised to
DeepSeek's layout.

Two namings are read (docs/deepseek_mtp.md lists both):

- DeepSeek's own, as its reference inference code and the official release use it
  (``layers.0.attn.wq_a.weight``, ``embed.weight``, ``head.weight``, ``hc_head_fn``, ``mtp.0.*``;
  transformers writes the same names back on ``save_pretrained``, under a ``model.`` prefix);
- transformers' in-memory names (``model.layers.0.self_attn.q_a_proj.weight``,
  ``model.embed_tokens.weight``, ``lm_head.weight``, the fused ``mlp.experts.gate_up_proj`` and
  ``down_proj``), which are mapped to DeepSeek's, fused experts split per expert.

Each tensor is read with ``safe_open(...).get_slice`` and only this rank's part of it
(:class:`.sharding.ShardPlan`), so a rank's peak is its share of the model plus one tensor.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from pypto_serving.quantization import SCALE_SUFFIX, QuantizationConfig, UnsupportedQuantizationError

from .sharding import ShardPlan, TensorPart

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
) -> dict[str, torch.Tensor]:
    """This rank's part (``plan``; everything without one) of every tensor of the checkpoint, floats
    cast to ``dtype`` except the float32-kept ones. With a block-FP8 ``quantization``, FP8 weights are
    dequantized with their ``weight_scale_inv`` (only the blocks of this rank's part); without one,
    an FP8 tensor is refused (its scales are unknown)."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    out: dict[str, torch.Tensor] = {}
    with ExitStack() as stack:
        handles = [stack.enter_context(safe_open(str(p), framework="pt")) for p in files]
        where = {key: f for f in handles for key in f.keys()}  # noqa: SIM118 - safe_open is not a mapping
        reader = _Reader(where, quantization, plan)
        for key in where:
            for name, t in reader.read(key):
                out[name] = _cast(name, t, dtype, fp32_suffixes).to(device)
    return out


class _Reader:
    """Reads tensors by checkpoint key: only this rank's part, FP8 ones dequantized with their scales."""

    def __init__(self, where: dict[str, Any], quantization: QuantizationConfig | None, plan: ShardPlan | None) -> None:
        self.where = where
        self.quantization = quantization
        self.plan = plan
        self._check_scales()

    def _check_scales(self) -> None:
        if self.quantization is None:
            return
        orphans = [k for k in self.where if k.endswith(SCALE_SUFFIX) and k[: -len(SCALE_SUFFIX)] not in self.where]
        if orphans:
            raise UnsupportedQuantizationError(
                f"{SCALE_SUFFIX} scales without their fp8 weight(s): {', '.join(sorted(orphans)[:5])}"
            )

    def read(self, key: str) -> Iterator[tuple[str, torch.Tensor]]:
        """(normalised name, this rank's part) of checkpoint tensor ``key``; scales yield nothing."""
        if self.quantization is not None and key.endswith(SCALE_SUFFIX):
            return
        name = normalise_name(key)
        fused = _fused(name)
        if fused is not None:
            yield from self._read_fused(key, *fused)
            return
        if self.plan is not None and not self.plan.wanted(name):
            return
        sl = self.where[key].get_slice(key)
        part = self.plan.part_of(name, sl.get_shape()) if self.plan is not None else None
        index = () if part is None else (slice(None),) * part.dim + (part.part,)
        yield name, self._part(key, sl, index, part)

    def _read_fused(self, key: str, prefix: str, projections: tuple[str, ...]) -> Iterator[tuple[str, torch.Tensor]]:
        sl = self.where[key].get_slice(key)
        n_experts, height, cols = sl.get_shape()
        if sl.get_dtype() in _FP8:
            raise UnsupportedQuantizationError(f"fused fp8 expert tensor {key!r} is not supported")
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

    def _part(self, key: str, sl: Any, index: tuple[Any, ...], part: TensorPart | None) -> torch.Tensor:
        """``sl[index]`` (``part`` of the tensor); an FP8 weight dequantized with the blocks of its scales."""
        t: torch.Tensor = sl[index] if index else sl[:]
        if self.quantization is None or t.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
            return t
        scale_key = key + SCALE_SUFFIX
        if scale_key not in self.where:
            raise UnsupportedQuantizationError(f"fp8 weight(s) without {SCALE_SUFFIX} scales: {key}")
        scale = self.where[scale_key].get_tensor(scale_key)
        return _dequantize_part(t, scale, self.quantization.block, sl.get_shape(), part)


def _fused(name: str) -> tuple[str, tuple[str, ...]] | None:
    """(layer prefix, the projections stacked in it) for a fused transformers expert tensor."""
    layer = _LAYER.match(name)
    if layer is None:
        return None
    projections = _FUSED.get(name[layer.end() :])
    return None if projections is None else (layer.group(0), projections)


def _dequantize_part(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], full: list[int], part: TensorPart | None
) -> torch.Tensor:
    """A part of a block-FP8 weight of shape ``full`` times its scales, in float32: only the scale
    blocks the part covers are expanded."""
    if len(full) != 2:
        raise UnsupportedQuantizationError(f"fp8 weight of shape {full} is not a matrix")
    want = [-(-n // b) for n, b in zip(full, block)]
    if list(scale_inv.shape) != want:
        raise UnsupportedQuantizationError(
            f"fp8 weight of shape {full} needs scales of shape {want} for {block[0]}x{block[1]} blocks, "
            f"got {list(scale_inv.shape)}"
        )
    spans = [slice(0, full[0]), slice(0, full[1])]
    if part is not None:
        spans[part.dim] = part.part
    scales = scale_inv.float()
    for dim, (span, b) in enumerate(zip(spans, block)):
        first, last = span.start // b, (span.stop - 1) // b
        scales = scales.narrow(dim, first, last - first + 1).repeat_interleave(b, dim)
        scales = scales.narrow(dim, span.start - first * b, span.stop - span.start)
    return weight.float() * scales


def _cast(name: str, t: torch.Tensor, dtype: torch.dtype, fp32_suffixes: tuple[str, ...]) -> torch.Tensor:
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise UnsupportedQuantizationError(
            f"tensor {name!r} is {t.dtype} but config.json declares no quantization_config: its scales are unknown"
        )
    if t.is_floating_point():
        return t.to(torch.float32 if name.endswith(fp32_suffixes) else dtype)
    return t


def mtp_depths(weights: dict[str, torch.Tensor]) -> int:
    """Number of consecutive ``mtp.{d}.*`` layers present (0, 1, ...)."""
    found = {int(m.group(1)) for k in weights if (m := _MTP.match(k))}
    n = 0
    while n in found:
        n += 1
    return n
