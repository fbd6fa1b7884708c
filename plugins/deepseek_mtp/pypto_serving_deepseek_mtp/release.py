"""DeepSeek-V4's release layout, written from a float checkpoint: what ``tiny-deepseek-v4-fp8`` is.

The release (DeepSeek's ``inference/model.py`` reads it) names tensors without a ``model.`` prefix
(``embed.weight``, ``head.weight``, ``norm.weight``, ``hc_head_fn``, ``layers.N.attn.kv_norm.weight``,
``mtp.0.*``) and stores, as its ``config.json`` says:

- the attention and shared-expert projections (and the MTP layers' ``e_proj`` / ``h_proj``) as
  ``float8_e4m3fn`` with ``X.scale`` ``float8_e8m0fnu``, one power-of-two scale per 128x128 block
  (``quantization_config = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0",
  "weight_block_size": [128, 128]}``);
- the routed experts as MXFP4 (``"expert_dtype": "fp4"``): int8 ``[out, in/2]``, two E2M1 codes a
  byte, with ``X.scale`` ``float8_e8m0fnu [out, in/32]``;
- attention sinks, hyper-connection (mHC) weights, compressor position biases and the router's
  bias in float32, the hash router's ``tid2eid`` as int64, everything else in bfloat16.

:func:`write_release_layout` writes that from any checkpoint this plugin reads (the loader's own
name normalisation gives the release names), so the embedded model can exercise the real format.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from pypto_serving.quantization import quantize_fp8_ue8m0, quantize_mxfp4

from .weights import normalise_name

#: The release's FP8 block (``weight_block_size``).
RELEASE_BLOCK = (128, 128)
#: Bump when the written layout changes, so copies written by an older version are rewritten.
WRITER_VERSION = "1"

_LAYER = r"(?:(?:layers|mtp)\.\d+\.)"
_FP8 = re.compile(
    rf"^{_LAYER}(?:attn\.(?:wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)|ffn\.shared_experts\.w[123]|e_proj|h_proj)\.weight$"
)
_ROUTED = re.compile(rf"^{_LAYER}ffn\.experts\.\d+\.w[123]\.weight$")
_FLOAT32 = re.compile(rf"^{_LAYER}?(?:hc_\w+|attn\.attn_sink|.*\.ape|ffn\.gate\.bias)$")
# Files of a model directory copied as they are.
_SIDE_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json")


def release_name(key: str) -> str:
    """The release's name for checkpoint tensor ``key`` (any naming the loader reads)."""
    name = normalise_name(key)
    # The loader keeps the K=V head's norm as ``attn.norm``; the release calls it ``attn.kv_norm``.
    return re.sub(r"(^|\.)attn\.norm\.weight$", r"\1attn.kv_norm.weight", name)


def release_tensors(
    name: str, tensor: torch.Tensor, block: tuple[int, int], expert_dtype: str = "fp4"
) -> dict[str, torch.Tensor]:
    """Tensor ``name`` (a release name) as the release stores it, with its scales if quantized;
    routed experts as MXFP4 (``expert_dtype="fp4"``) or block FP8 (``"fp8"``, DeepSeek-V3 style)."""
    stem = name.removesuffix(".weight")
    if _ROUTED.match(name) and expert_dtype == "fp4":
        packed, scale = quantize_mxfp4(tensor)
        return {name: packed, f"{stem}.scale": scale}
    if _FP8.match(name) or _ROUTED.match(name):
        q, scale = quantize_fp8_ue8m0(tensor, block)
        return {name: q, f"{stem}.scale": scale}
    if not tensor.is_floating_point():
        return {name: tensor.to(torch.int64) if name.endswith("tid2eid") else tensor}
    return {name: tensor.to(torch.float32 if _FLOAT32.match(name) else torch.bfloat16)}


def write_release_layout(
    src: str | Path, dest: str | Path, block: tuple[int, int] = RELEASE_BLOCK, expert_dtype: str = "fp4"
) -> None:
    """Write the model directory ``src`` into ``dest`` (which exists) in the release layout: one
    ``model.safetensors``, ``config.json`` with the release's ``quantization_config`` and
    ``expert_dtype`` (``"fp8"``: block-FP8 routed experts instead of MXFP4), the tokenizer and
    generation config copied."""
    src, dest = Path(src), Path(dest)
    out: dict[str, torch.Tensor] = {}
    for path in sorted(src.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                out.update(release_tensors(release_name(key), f.get_tensor(key), block, expert_dtype))
    save_file(out, str(dest / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "scale_fmt": "ue8m0",
        "weight_block_size": list(block),
    }
    config["expert_dtype"] = expert_dtype
    config["dtype"] = config["torch_dtype"] = "bfloat16"
    (dest / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in _SIDE_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, dest / name)


def source_key(src: str | Path) -> str:
    """What a release copy of ``src`` depends on: the writer's version and the source files' bytes."""
    digest = hashlib.sha256(f"release-layout {WRITER_VERSION}".encode())
    for path in sorted(Path(src).iterdir()):
        if path.is_file():
            digest.update(path.name.encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()
