"""``pypto-serving convert``: a float (float32 / bf16 / fp16) checkpoint to the quantized layouts that
deployments load, streamed tensor by tensor.

Two targets, each as its tools and loaders publish it:

- ``w8a8``: Ascend W8A8 dynamic as msModelSlim writes it. Each linear weight ``X.weight`` becomes
  int8 ``[out, in]`` with per-output-channel ``X.weight_scale`` and ``X.weight_offset`` (float32,
  ``[out, 1]``), symmetric (offsets all zero), so that ``weight ~= (q - offset) * scale``;
  activations are quantized per token at run time. ``quant_model_description.json`` maps every
  tensor to ``W8A8_DYNAMIC`` or ``FLOAT`` (``model_quant_type`` ``W8A8_DYNAMIC``).
- ``fp8``: block-scaled FP8 as Qwen3-FP8 and DeepSeek-V3 publish it. Each linear weight becomes
  ``float8_e4m3fn`` with ``X.weight_scale_inv`` (float32, ``[ceil(out/128), ceil(in/128)]``, one
  per block: ``weight ~= q * scale_inv``) and ``config.json`` gains ``quantization_config``
  ``{"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}``.

Quantized are the 2-D ``.weight`` tensors of linear projections; embeddings, the LM head, norms, MoE
routers, DeepSeek-V4's compressors and indexer head weights and everything not 2-D stay as stored.
``quantize_head`` (``--quantize-head``, Qwen checkpoints) quantizes the output projection
``lm_head.weight`` too, as CTranslate2's int8 does: on a CPU it is most of a small model's decode step
(the 151,936-row vocabulary), and its int8 product reads a quarter of float32's bytes. A checkpoint
that ties it to the embedding gets its own ``lm_head.weight`` (quantized from the embedding, which
stays float) and ``tie_word_embeddings: false``.
Memory is bounded by one output shard plus one tensor; the other files of the directory (config,
tokenizer, generation config) are copied."""

from __future__ import annotations

import argparse
import json
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

__all__ = ["ConversionError", "ConvertResult", "convert_checkpoint", "dequantize_w8a8", "quantize_fp8_blocks"]

FORMATS = ("w8a8", "fp8")
INDEX_FILE = "model.safetensors.index.json"
DESCRIPTION_FILE = "quant_model_description.json"
FP8_MAX = 448.0  # the largest finite float8_e4m3fn value
W8A8 = "W8A8_DYNAMIC"

# Never quantized: their components name embeddings, the head, norms, routers, compressors, the
# indexer's head weights (read in float by every loader that serves these models).
_KEEP_FLOAT = re.compile(
    r"(^|\.)(embed_tokens|embed|lm_head|head|gate|shared_expert_gate|weights_proj|compressor)\."
    r"|norm[^.]*\.weight$"
)


class ConversionError(ValueError):
    """The checkpoint cannot be converted as asked (the message says why)."""


@dataclass(slots=True)
class ConvertResult:
    """What a conversion wrote."""

    output: Path
    quantized: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    shards: list[str] = field(default_factory=list)
    bytes_in: int = 0
    bytes_out: int = 0


def is_quantized_weight(name: str, tensor: torch.Tensor) -> bool:
    """Whether the converter quantizes ``name``: a floating 2-D linear weight not in the float set."""
    return (
        name.endswith(".weight")
        and tensor.dim() == 2
        and tensor.is_floating_point()
        and tensor.element_size() >= 2
        and _KEEP_FLOAT.search(name) is None
    )


def quantize_w8a8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(int8 weight, float32 scale ``[out, 1]``, float32 zero offset ``[out, 1]``): symmetric per channel."""
    w = weight.float()
    scale = (w.abs().amax(dim=1, keepdim=True) / 127.0).clamp_min(1e-12)
    q = torch.round(w / scale).clamp(-128, 127).to(torch.int8)
    return q, scale, torch.zeros_like(scale)


def dequantize_w8a8(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """msModelSlim's per-channel convention: ``(q - offset) * scale``, in float32."""
    return (q.float() - offset.float()) * scale.float()


def quantize_fp8_blocks(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(``float8_e4m3fn`` weight, float32 ``scale_inv`` per ``block``): each block's absmax maps to 448."""
    rows, cols = block
    out, inp = weight.shape
    grid = (-(-out // rows), -(-inp // cols))
    padded = torch.zeros(grid[0] * rows, grid[1] * cols)
    padded[:out, :inp] = weight.float()
    tiles = padded.view(grid[0], rows, grid[1], cols)
    scale_inv = (tiles.abs().amax(dim=(1, 3)) / FP8_MAX).clamp_min(1e-12)
    q = (tiles / scale_inv[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(grid[0] * rows, grid[1] * cols)[:out, :inp].contiguous(), scale_inv


HEAD, EMBEDDING = "lm_head.weight", "model.embed_tokens.weight"


def _convert_tensor(name: str, tensor: torch.Tensor, fmt: str, block: tuple[int, int]) -> dict[str, torch.Tensor]:
    """The output tensors standing for one input tensor (itself when it stays float)."""
    if not is_quantized_weight(name, tensor):
        return {name: tensor}
    return _quantize(name, tensor, fmt, block)


def _quantize(name: str, tensor: torch.Tensor, fmt: str, block: tuple[int, int]) -> dict[str, torch.Tensor]:
    """``tensor`` quantized to ``fmt`` as checkpoint weight ``name``, with its scales."""
    if fmt == "fp8":
        q, scale_inv = quantize_fp8_blocks(tensor, block)
        return {name: q, name + "_scale_inv": scale_inv}
    q, scale, offset = quantize_w8a8(tensor)
    stem = name[: -len("weight")]
    return {name: q, stem + "weight_scale": scale, stem + "weight_offset": offset}


def _source_shards(src: Path) -> list[Path]:
    index = src / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map") or {}
        return [src / f for f in sorted(set(weight_map.values()))]
    shards = sorted(src.glob("*.safetensors"))
    if not shards:
        raise ConversionError(f"{src} has no *.safetensors weights to convert")
    return shards


def _iter_source(shards: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the checkpoint, one at a time (memory-mapped reads)."""
    from safetensors import safe_open

    for shard in shards:
        with safe_open(str(shard), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open handles are not iterable
                yield name, f.get_tensor(name)


@dataclass(slots=True)
class _ShardWriter:
    """Collects output tensors and writes a shard whenever ``max_bytes`` is reached."""

    dst: Path
    max_bytes: int
    pending: dict[str, torch.Tensor] = field(default_factory=dict)
    pending_bytes: int = 0
    files: list[tuple[str, list[str]]] = field(default_factory=list)  # (temporary name, tensor names)
    total: int = 0

    def add(self, tensors: dict[str, torch.Tensor]) -> None:
        for name, t in tensors.items():
            self.pending[name] = t.contiguous()
            self.pending_bytes += t.numel() * t.element_size()
        if self.pending_bytes >= self.max_bytes:
            self.flush()

    def flush(self) -> None:
        from safetensors.torch import save_file

        if not self.pending:
            return
        tmp = f"part-{len(self.files):05d}.safetensors"
        save_file(self.pending, str(self.dst / tmp), metadata={"format": "pt"})
        self.files.append((tmp, list(self.pending)))
        self.total += self.pending_bytes
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> list[str]:
        """Name the shards as Hugging Face loaders expect; write the index when there are several."""
        self.flush()
        if len(self.files) == 1:
            (self.dst / self.files[0][0]).rename(self.dst / "model.safetensors")
            return ["model.safetensors"]
        names, weight_map = [], {}
        for i, (tmp, tensor_names) in enumerate(self.files, 1):
            final = f"model-{i:05d}-of-{len(self.files):05d}.safetensors"
            (self.dst / tmp).rename(self.dst / final)
            names.append(final)
            weight_map.update(dict.fromkeys(tensor_names, final))
        index = {"metadata": {"total_size": self.total}, "weight_map": weight_map}
        (self.dst / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        return names


def _check_paths(src: Path, dst: Path, fmt: str) -> dict[str, Any]:
    """The source's config.json, after refusing what cannot be converted."""
    if fmt not in FORMATS:
        raise ConversionError(f"unknown target format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if not (src / "config.json").is_file():
        raise ConversionError(f"{src} is not a model directory (no config.json)")
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise ConversionError(f"output {dst} exists and is not an empty directory; choose a new one")
    config: dict[str, Any] = json.loads((src / "config.json").read_text())
    if config.get("quantization_config") is not None or (src / DESCRIPTION_FILE).is_file():
        raise ConversionError(f"{src} is already quantized; convert a float (float32, bf16 or fp16) checkpoint")
    return config


def _head_outputs(
    name: str, tensor: torch.Tensor, fmt: str, block: tuple[int, int], tied: bool
) -> dict[str, torch.Tensor] | None:
    """With ``quantize_head``: the outputs of the head or the (tied) embedding, or None for any other
    tensor. A tied checkpoint's ``lm_head.weight`` copy is dropped (the embedding is the head, as in
    Hugging Face's loaders), and the quantized head is made from the embedding."""
    if name == HEAD:
        return {} if tied else _quantize(name, tensor, fmt, block)
    if name == EMBEDDING and tied:
        return {name: tensor, **_quantize(HEAD, tensor, fmt, block)}
    return None


def _check_head(config: dict[str, Any], names: set[str]) -> bool:
    """Whether the head is tied; refuses ``--quantize-head`` where no executor reads a quantized head."""
    if str(config.get("model_type", "")).startswith("deepseek"):
        raise ConversionError("--quantize-head: the DeepSeek-V4 executor keeps its output projection in float")
    tied = bool(config.get("tie_word_embeddings", False))
    wanted = EMBEDDING if tied else HEAD
    if wanted not in names:
        raise ConversionError(f"--quantize-head: the checkpoint has no {wanted} to quantize as its output projection")
    return tied


def _copy_side_files(src: Path, dst: Path) -> None:
    """Everything but the weights: config, tokenizer, generation config, the release's extra folders."""
    for item in src.iterdir():
        if item.suffix == ".safetensors" or item.name == INDEX_FILE:
            continue
        if item.is_dir():
            shutil.copytree(item, dst / item.name)
        else:
            shutil.copy2(item, dst / item.name)


def _write_description(dst: Path, result: ConvertResult, names: list[str]) -> None:
    """msModelSlim's description: each quantized weight and its scale and offset ``W8A8_DYNAMIC``,
    every other tensor ``FLOAT``."""
    quantized = {
        w[: -len("weight")] + suffix for w in result.quantized for suffix in ("weight", "weight_scale", "weight_offset")
    }
    description: dict[str, str] = {"model_quant_type": W8A8}
    description.update({name: W8A8 if name in quantized else "FLOAT" for name in names})
    (dst / DESCRIPTION_FILE).write_text(json.dumps(description, indent=2) + "\n")


def convert_checkpoint(
    src: str | Path,
    dst: str | Path,
    fmt: str,
    *,
    block: tuple[int, int] = (128, 128),
    shard_bytes: int = 4 << 30,
    quantize_head: bool = False,
) -> ConvertResult:
    """Convert the float checkpoint in ``src`` to ``fmt`` (``w8a8`` or ``fp8``) in the new directory ``dst``.

    :param block: the FP8 scale block, rows x columns (128 x 128 as published).
    :param shard_bytes: the size at which an output shard is closed (bounds the memory used).
    :param quantize_head: quantize the output projection ``lm_head.weight`` too (module docstring).
    :raises ConversionError: an unknown format, a non-empty ``dst``, a checkpoint already quantized,
        or ``quantize_head`` for a checkpoint without a head the executors read quantized.
    """
    src, dst = Path(src), Path(dst)
    config = _check_paths(src, dst, fmt)
    shards = _source_shards(src)
    tied = _check_head(config, _tensor_names(shards)) if quantize_head else False
    dst.mkdir(parents=True, exist_ok=True)
    _copy_side_files(src, dst)
    result, writer = ConvertResult(output=dst), _ShardWriter(dst, shard_bytes)
    names: list[str] = []
    for name, tensor in _iter_source(shards):
        result.bytes_in += tensor.numel() * tensor.element_size()
        head = _head_outputs(name, tensor, fmt, block, tied) if quantize_head else None
        out = head if head is not None else _convert_tensor(name, tensor, fmt, block)
        if name in out:  # (a tied checkpoint's head copy is dropped)
            (result.quantized if out[name] is not tensor else result.kept).append(name)
        names.extend(out)
        writer.add(out)
    result.shards = writer.finish()
    result.bytes_out = writer.total
    if quantize_head and tied:
        result.quantized.append(HEAD)
        config["tie_word_embeddings"] = False
    if fmt == "fp8":
        config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(block)}
    else:
        _write_description(dst, result, names)
    (dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return result


def _tensor_names(shards: list[Path]) -> set[str]:
    from safetensors import safe_open

    names: set[str] = set()
    for shard in shards:
        with safe_open(str(shard), framework="pt", device="cpu") as f:
            names.update(f.keys())
    return names


def _cmd_convert(args: argparse.Namespace) -> int:
    src = Path(args.source)
    if not src.is_dir():  # a named model the installed plugins ship (written first if it is derived)
        from .config import ServingSettings
        from .plugins import PluginManager

        src = Path(str(PluginManager().resolve_model(ServingSettings.load(model=args.source)).model))
    block = (args.fp8_block[0], args.fp8_block[1])
    result = convert_checkpoint(
        src,
        args.output,
        args.to,
        block=block,
        shard_bytes=int(args.shard_gb * (1 << 30)),
        quantize_head=args.quantize_head,
    )
    print(
        f"wrote {result.output} ({args.to}): {len(result.quantized)} tensors quantized, {len(result.kept)} kept, "
        f"{result.bytes_in / 1e6:.1f} MB -> {result.bytes_out / 1e6:.1f} MB in {len(result.shards)} shard(s)"
    )
    return 0


def add_convert_command(sub: Any) -> None:
    c = sub.add_parser(
        "convert",
        help="convert a float checkpoint to Ascend W8A8 (msModelSlim layout) or block FP8",
        description="Quantize the linear weights of a float32/bf16/fp16 checkpoint (Qwen, DeepSeek-V4) into a new "
        "directory: w8a8 = int8 per-channel weights with dynamic per-token activations (quant_model_description.json), "
        "fp8 = float8_e4m3fn with 128x128 block scales (quantization_config). Other files are copied.",
    )
    c.add_argument("source", metavar="DIR|NAME", help="the float checkpoint directory, or a named model")
    c.add_argument("output", metavar="OUT", help="the new directory (must not exist or be empty)")
    c.add_argument("--to", required=True, choices=FORMATS, help="the target format")
    c.add_argument(
        "--fp8-block", nargs=2, type=int, default=[128, 128], metavar=("ROWS", "COLS"), help="FP8 scale block"
    )
    c.add_argument(
        "--quantize-head",
        action="store_true",
        help="quantize the output projection (lm_head) too, as CTranslate2's int8 does (Qwen; a tied head gets its "
        "own quantized copy and tie_word_embeddings false)",
    )
    c.add_argument("--shard-gb", type=float, default=4.0, metavar="GB", help="output shard size (bounds memory)")
    c.set_defaults(func=_cmd_convert)
