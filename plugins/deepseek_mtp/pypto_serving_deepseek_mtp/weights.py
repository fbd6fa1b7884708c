"""Safetensors loading with name normalisation to the DeepSeek checkpoint layout.

Checkpoints come either in DeepSeek's own layout (``layers.0.attn.wq_a.weight``, ``embed.weight``,
``head.weight``, ``hc_head_fn``; what transformers writes back on ``save_pretrained``, sometimes under
a ``model.`` prefix) or with transformers' in-memory names for the top-level tensors. We normalise
the top-level names only; per-layer names must be in the DeepSeek layout (documented in
docs/deepseek_mtp.md).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors import safe_open

from pypto_serving.quantization import Fp8BlockDequantizer, QuantizationConfig, UnsupportedQuantizationError

_TOP_LEVEL = {
    "embed_tokens.weight": "embed.weight",
    "lm_head.weight": "head.weight",
    "hc_head.hc_fn": "hc_head_fn",
    "hc_head.hc_base": "hc_head_base",
    "hc_head.hc_scale": "hc_head_scale",
}
_MTP = re.compile(r"^mtp\.(\d+)\.")


def normalise_name(name: str) -> str:
    if name.startswith("model."):
        name = name[len("model.") :]
    m = _MTP.match(name)
    prefix, rest = (m.group(0), name[m.end() :]) if m else ("", name)
    return prefix + _TOP_LEVEL.get(rest, rest)


def load_weights(
    model_dir: str | Path,
    device: torch.device,
    dtype: torch.dtype,
    fp32_suffixes: tuple[str, ...],
    quantization: QuantizationConfig | None = None,
) -> dict[str, torch.Tensor]:
    """All tensors of the checkpoint, floats cast to ``dtype`` except the float32-kept ones. With a
    block-FP8 ``quantization``, FP8 weights are dequantized with their ``weight_scale_inv`` first;
    without one, an FP8 tensor is refused (its scales are unknown)."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")
    fp8 = Fp8BlockDequantizer(quantization) if quantization is not None else None
    out: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                for ready, t in fp8.feed(key, f.get_tensor(key)) if fp8 else [(key, f.get_tensor(key))]:
                    name = normalise_name(ready)
                    out[name] = _cast(name, t, dtype, fp32_suffixes).to(device)
    if fp8 is not None:
        fp8.finish()
    return out


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
