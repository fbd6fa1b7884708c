"""Reading a local Hugging Face Qwen checkpoint: config.json and safetensors (generation_config.json is
read by the core's :func:`pypto_serving.read_generation_config`, the same for every executor).

Nothing here imports transformers: the config is parsed from JSON into :class:`QwenConfig`, and the
weights are streamed one tensor at a time (shard by shard) straight into the pre-built parameters,
so peak host memory stays at one tensor, never the whole checkpoint.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

import pypto_kernels as K
from pypto_serving.quantization import (
    SCALE_SUFFIX,
    QuantizationConfig,
    UnsupportedQuantizationError,
    deq_scale_as_float,
    dequantize_fp8_blocks,
    read_modelslim_description,
    read_quantization_config,
)

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "CheckpointError",
    "QuantPlan",
    "QwenConfig",
    "WeightTarget",
    "load_weights",
    "plan_quantization",
    "read_config",
    "resolve_dtype",
]

logger = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES: tuple[str, ...] = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}

# safetensors' names of the FP8 dtypes, for the error refusing them without a quantization_config.
_TORCH_DTYPE_NAMES = {"F8_E4M3": "torch.float8_e4m3fn", "F8_E5M2": "torch.float8_e5m2"}
# safetensors' dtype names of the tensors a stored-precision target takes (``WeightTarget.stored``).
_SAFETENSORS_DTYPES = {
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I8": torch.int8,
    "I32": torch.int32,
    "I64": torch.int64,
    "F32": torch.float32,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
}
_INTEGER_NAMES = {"I8": "torch.int8", "U8": "torch.uint8", "I32": "torch.int32", "I64": "torch.int64"}

# Checkpoint entries that are derived state, not weights (older exports saved RoPE buffers).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", ".self_attn.k_scale", ".self_attn.v_scale")
#: A layer's FP8 KV cache scales as vLLM reads them: ``model.layers.N.self_attn.k_scale`` / ``v_scale``.
_KV_SCALE = re.compile(r"^model\.layers\.(\d+)\.self_attn\.([kv])_scale$")


class CheckpointError(ValueError):
    """The model directory cannot be served: the message names the file, tensor or field at fault."""


@dataclass(frozen=True, slots=True)
class QwenConfig:
    """The subset of config.json the Qwen executor needs, normalised across Qwen2/Qwen3/Qwen3-MoE and
    across the legacy (``rope_theta`` + ``rope_scaling``) and transformers-5 (``rope_parameters``) layouts."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    rotary_dim: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool
    layer_windows: tuple[int | None, ...]  # sliding window per layer, None = full attention
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    torch_dtype: str | None = None
    eos_token_ids: tuple[int, ...] = ()
    quantization: QuantizationConfig | None = None  # block-FP8 weights, dequantized at load
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def is_moe_layer(self, layer: int) -> bool:
        # Same rule as HF Qwen3-MoE: experts unless listed in mlp_only_layers or off the sparse step.
        return (
            self.num_experts > 0
            and layer not in self.mlp_only_layers
            and (layer + 1) % max(self.decoder_sparse_step, 1) == 0
        )


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} must hold a JSON object")
    return data


def _model_dir(model: str | Path) -> Path:
    path = Path(model).expanduser()
    if not path.is_dir():
        raise CheckpointError(
            f"model directory {str(path)!r} does not exist or is not a directory "
            "(pypto-serving serves local Hugging Face checkpoints only)"
        )
    return path


def _eos_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list) and all(isinstance(v, int) for v in value):
        return list(value)
    raise CheckpointError(f"eos_token_id must be an int or a list of ints, got {value!r}")


def _check_architecture(raw: Mapping[str, Any], path: Path) -> str:
    supported = ", ".join(SUPPORTED_ARCHITECTURES)
    archs = raw.get("architectures") or []
    arch = archs[0] if isinstance(archs, list) and archs else None
    auto_map = raw.get("auto_map") or {}
    # auto_map that names a model class means the checkpoint's forward pass lives in its own Python
    # files; we never execute checkpoint code (no trust_remote_code), whatever the architecture says.
    custom_classes = sorted(k for k in auto_map if str(k).startswith("AutoModel")) if isinstance(auto_map, dict) else []
    if custom_classes:
        raise CheckpointError(
            f"{path} has auto_map ({', '.join(f'{k}={auto_map[k]}' for k in custom_classes)}): the model "
            "needs remote code from the checkpoint, which pypto-serving never runs (no trust_remote_code); "
            f"architecture {arch!r} is not served natively. Supported architectures: {supported}"
        )
    if arch is None:
        raise CheckpointError(f"{path} names no 'architectures'; the Qwen executor serves: {supported}")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise CheckpointError(f"architecture {arch!r} from {path} is not supported; supported: {supported}")
    return str(arch)


def _layer_windows(raw: Mapping[str, Any], arch: str, num_layers: int) -> tuple[int | None, ...]:
    """Per-layer sliding window with HF's semantics: a window only when ``use_sliding_window`` is on,
    then per ``layer_types`` if given, else layers >= ``max_window_layers`` (Qwen2/Qwen3) or every
    layer (Qwen3-MoE, whose HF attention applies ``sliding_window`` uniformly)."""
    window = raw.get("sliding_window") if raw.get("use_sliding_window") else None
    if not window:
        return (None,) * num_layers
    layer_types = raw.get("layer_types")
    if isinstance(layer_types, list) and len(layer_types) == num_layers:
        return tuple(int(window) if t == "sliding_attention" else None for t in layer_types)
    if arch == "Qwen3MoeForCausalLM":
        return (int(window),) * num_layers
    max_window_layers = int(raw.get("max_window_layers", 28))
    return tuple(int(window) if i >= max_window_layers else None for i in range(num_layers))


def read_config(model: str | Path) -> QwenConfig:
    """Parse and validate ``config.json`` of a local checkpoint directory."""
    path = _model_dir(model) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"config.json not found in {str(path.parent)!r}; is this a Hugging Face model directory?")
    raw = _read_json(path)
    arch = _check_architecture(raw, path)

    def need(key: str) -> Any:
        if raw.get(key) is None:
            raise CheckpointError(f"{path} lacks the required field {key!r} for {arch}")
        return raw[key]

    hidden = int(need("hidden_size"))
    num_heads = int(need("num_attention_heads"))
    num_layers = int(need("num_hidden_layers"))
    num_kv_heads = int(raw.get("num_key_value_heads") or num_heads)
    head_dim = int(raw.get("head_dim") or hidden // num_heads)
    if num_heads % num_kv_heads:
        raise CheckpointError(
            f"{path}: num_attention_heads ({num_heads}) is not a multiple of num_key_value_heads ({num_kv_heads})"
        )

    # transformers 5 writes rope_parameters (theta inside); older configs use rope_theta + rope_scaling.
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise CheckpointError(f"{path}: rope_parameters/rope_scaling must be an object, got {rope!r}")
    rope_theta = float(rope.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = rope.get("rope_type", rope.get("type", "default")) or "default"
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"} if rope_type != "default" else None
    partial = float(rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)))
    rotary_dim = int(head_dim * partial)

    is_qwen2 = arch == "Qwen2ForCausalLM"
    attention_bias = bool(raw.get("attention_bias", False))
    is_moe = arch == "Qwen3MoeForCausalLM"
    num_experts = int(raw.get("num_experts", raw.get("num_local_experts", 0)) or 0) if is_moe else 0
    torch_dtype = raw.get("torch_dtype") or raw.get("dtype")

    return QwenConfig(
        architecture=arch,
        vocab_size=int(need("vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(need("intermediate_size")),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=scaling,
        rotary_dim=rotary_dim,
        max_position_embeddings=int(raw.get("max_position_embeddings", 32768)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        # HF Qwen2 hard-codes q/k/v biases and a bias-free o_proj; Qwen3 uses attention_bias for all four.
        qkv_bias=True if is_qwen2 else attention_bias,
        o_bias=False if is_qwen2 else attention_bias,
        qk_norm=not is_qwen2,
        layer_windows=_layer_windows(raw, arch, num_layers),
        num_experts=num_experts,
        num_experts_per_tok=int(raw.get("num_experts_per_tok", 0) or 0) if is_moe else 0,
        moe_intermediate_size=int(raw.get("moe_intermediate_size", 0) or 0) if is_moe else 0,
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
        decoder_sparse_step=int(raw.get("decoder_sparse_step", 1) or 1),
        mlp_only_layers=tuple(int(i) for i in raw.get("mlp_only_layers") or ()),
        torch_dtype=str(torch_dtype).removeprefix("torch.") if torch_dtype else None,
        eos_token_ids=tuple(_eos_list(raw.get("eos_token_id"))),
        quantization=_read_quantization(raw, path),
        raw=raw,
    )


def _read_quantization(raw: dict[str, Any], path: Path) -> QuantizationConfig | None:
    """config.json's quantization_config, or msModelSlim's description beside it (never both)."""
    declared = read_quantization_config(raw, str(path))
    modelslim = read_modelslim_description(path.parent)
    if declared is not None and modelslim is not None:
        raise UnsupportedQuantizationError(
            f"{path.parent}: both config.json quantization_config ({declared.method}) and "
            "quant_model_description.json are present; the checkpoint must describe one quantization"
        )
    return declared if declared is not None else modelslim


def resolve_dtype(
    setting: str, config: QwenConfig, model_dir: str | Path | None = None, device: torch.device | None = None
) -> torch.dtype:
    """``settings.dtype``; 'auto' follows the checkpoint's torch_dtype, else (config.json names
    none) the one 16-bit dtype its float tensors are stored in (read from ``model_dir``'s
    safetensors headers, so a bfloat16 checkpoint is not silently doubled to float32), else float32.
    On a CPU (``device``) without instructions for a 16-bit dtype, 'auto' runs it in float32, and a
    float32 checkpoint in bfloat16 on a CPU with AVX512-BF16 or AMX, logged
    (:func:`pypto_kernels.auto_dtype`)."""
    name = config.torch_dtype if setting == "auto" else setting
    if name is None and model_dir is not None:
        name = _stored_float_dtype(_model_dir(model_dir))
    if name is None:
        name = "float32"
    if name not in _DTYPES:
        raise CheckpointError(
            f"unsupported dtype {name!r} (from config.json torch_dtype); use one of "
            "float32, bfloat16, float16 via the dtype setting"
        )
    if setting == "auto" and device is not None:
        return K.auto_dtype(_DTYPES[name], device)
    return _DTYPES[name]


def _stored_float_dtype(model_dir: Path) -> str | None:
    """``bfloat16`` / ``float16`` when every floating-point tensor of the checkpoint is stored so."""
    names = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64"}
    found: set[str] = set()
    try:
        shards = _shard_files(model_dir)
    except CheckpointError:
        return None  # load_weights names what is missing
    for name, _, handle in _iter_tensors(shards):
        dtype = handle.get_slice(name).get_dtype()
        if dtype in names and not name.endswith(("_scale_inv", "_scale", "_offset")):
            found.add(names[dtype])
    return found.pop() if len(found) == 1 and found <= {"bfloat16", "float16"} else None


# --------------------------------------------------------------------------- weights


@dataclass(frozen=True, slots=True)
class WeightTarget:
    """Where one checkpoint tensor goes: ``dest`` is a view into a parameter (a slice of a fused
    matrix, or the whole parameter) and ``fills`` the required checkpoint names it satisfies; a
    stacked expert tensor fills the per-expert names it replaces, so either layout counts as present.

    A tensor-parallel rank copies only ``part`` (indices of dimension ``dim``, of ``full`` in the
    checkpoint) of the tensor; ``part=None`` copies all of it.
    """

    dest: torch.Tensor
    fills: tuple[str, ...]
    part: slice | None = None
    dim: int = 0
    full: int = 0
    # Quantized data and scales: the safetensors dtypes accepted (copied without casting the value
    # domain; anything else is refused, naming the tensor). None: a float target (cast on copy).
    stored: tuple[str, ...] | None = None

    def source_shape(self) -> tuple[int, ...]:
        """The checkpoint tensor's shape this target expects."""
        shape = list(self.dest.shape)
        if self.part is not None:
            shape[self.dim] = self.full
        return tuple(shape)

    def index(self) -> tuple[slice, ...]:
        """The checkpoint-tensor index of this rank's part (``[:]`` for the whole tensor)."""
        if self.part is None:
            return (slice(None),)
        return (slice(None),) * self.dim + (self.part,)


@dataclass(frozen=True, slots=True)
class QuantPlan:
    """Which linear weights stay in their stored precision: checkpoint weight name -> scheme
    (``fp8_block`` or ``w8a8_dynamic``, see :class:`pypto_serving.quantization.QuantizedWeight`)."""

    schemes: dict[str, str]
    block: tuple[int, int] = (1, 1)

    def scheme(self, *names: str) -> str | None:
        """The one scheme of weights fused into one matrix; refuses a mix, naming the weights."""
        found = {self.schemes.get(n) for n in names}
        if len(found) > 1:
            detail = ", ".join(f"{n}: {self.schemes.get(n) or 'float'}" for n in names)
            raise CheckpointError(f"weights fused into one matrix are quantized differently ({detail})")
        return found.pop()


def plan_quantization(model_dir: str | Path, config: QwenConfig) -> QuantPlan | None:
    """The stored-precision plan from the checkpoint's own description: FP8 tensors as the
    safetensors headers list them (under a block-FP8 quantization_config), msModelSlim's per-tensor
    types. Routed experts are planned too (block-FP8 or W8A8_DYNAMIC, run by ``quant_moe_experts``).

    :raises CheckpointError: static W8A8 routed experts under msModelSlim (not served yet).
    """
    quant = config.quantization
    if quant is None:
        return None
    if quant.method == "fp8":
        fp8 = {
            name
            for name, _, handle in _iter_tensors(_shard_files(_model_dir(model_dir)))
            if handle.get_slice(name).get_dtype() in _TORCH_DTYPE_NAMES
        }
        return QuantPlan(dict.fromkeys(fp8, "fp8_block"), quant.block)
    weights = {n: s for n, s in quant.tensors.items() if n.endswith(".weight")}
    static = sorted(n for n, s in weights.items() if ".experts." in n and s == "w8a8_static")
    if static:
        raise CheckpointError(
            f"quant_model_description.json quantizes routed experts as static W8A8 ({static[0]}, ...); the "
            "Qwen executor reads W8A8_DYNAMIC experts only (per-tensor input scales of experts are not read)"
        )
    return QuantPlan(weights)


def _shard_files(model_dir: Path) -> list[Path]:
    index = model_dir / INDEX_FILE
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index} has no 'weight_map'")
        shards = [model_dir / name for name in sorted(set(weight_map.values()))]
        for shard in shards:
            if not shard.is_file():
                raise CheckpointError(f"shard {shard.name!r} listed in {INDEX_FILE} is missing from {str(model_dir)!r}")
        return shards
    single = model_dir / SINGLE_FILE
    if single.is_file():
        return [single]
    others = sorted(p.name for p in model_dir.glob("*.bin")) + sorted(p.name for p in model_dir.glob("*.pt"))
    hint = f" (found {', '.join(others)}; only safetensors checkpoints are loaded)" if others else ""
    raise CheckpointError(f"no {SINGLE_FILE} or {INDEX_FILE} in {str(model_dir)!r}{hint}")


def _iter_tensors(shards: list[Path]) -> Iterator[tuple[str, Path, Any]]:
    """Yield (name, shard, lazy slice handle): tensors are materialised one at a time by the caller."""
    for shard in shards:
        with safe_open(str(shard), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open handles are not iterable
                yield name, shard, f


def _copy_into(source: Any, dests: list[WeightTarget], filled: set[str]) -> None:
    """Copy each target's part of one checkpoint tensor into it. ``source`` is the tensor, or its
    safetensors slice handle, so that indexing it reads that part only."""
    for target in dests:
        target.dest.copy_(source[target.index()])
        filled.update(target.fills)


def _check(name: str, shard: Path, shape: tuple[int, ...], dtype: str, dests: list[WeightTarget]) -> None:
    """Refuse an unscaled FP8 or integer tensor (``dtype``: its torch name) for a float target, or
    one whose shape is not what its targets expect, before any of its data is read."""
    if "float8" in dtype:
        raise CheckpointError(
            f"weight {name!r} in {shard.name} is {dtype} but config.json declares no quantization_config: "
            "its scales are unknown, so it cannot be loaded"
        )
    if "int" in dtype:
        raise CheckpointError(
            f"weight {name!r} in {shard.name} is {dtype} but the checkpoint describes it as a float tensor "
            "(no quantization for it in config.json or quant_model_description.json)"
        )
    for target in dests:
        if shape != target.source_shape():
            raise _shape_error(name, shard, shape, target.source_shape())


def _shape_error(name: str, shard: Path, got: tuple[int, ...], want: tuple[int, ...]) -> CheckpointError:
    return CheckpointError(
        f"weight {name!r} in {shard.name} has shape {list(got)} but the model built from config.json "
        f"expects {list(want)}; the checkpoint and its config.json disagree"
    )


def load_weights(
    model_dir: str | Path,
    targets: Mapping[str, list[WeightTarget]],
    required: set[str],
    quantization: QuantizationConfig | None = None,
) -> None:
    """Stream every safetensors tensor into its targets (cast to the parameter dtype and device).

    Tensors are read through ``get_slice``: only the rows (or columns) their targets hold, so a
    tensor-parallel rank never materialises another rank's part, and tensors no target wants are not
    read at all. With a block-FP8 ``quantization`` the (small) ``weight_scale_inv`` tensors are read
    first; an FP8 weight's part is then read from the block holding its first row, dequantized with
    those blocks' scales and trimmed.

    Raises :class:`CheckpointError` on a shape mismatch (naming the tensor and both shapes), on FP8
    tensors in a checkpoint that declares no quantization, and when required weights are absent
    (naming them); :class:`UnsupportedQuantizationError` when an FP8 weight and its scales do not pair.
    """
    path = _model_dir(model_dir)
    shards = _shard_files(path)
    filled: set[str] = set()
    unexpected: list[str] = []
    fp8 = quantization is not None and quantization.method == "fp8"
    scales = _read_scales(shards, targets) if fp8 else {}
    with torch.no_grad():
        for name, shard, handle in _iter_tensors(shards):
            dests = targets.get(name)
            if dests and dests[0].stored is not None:
                _copy_stored(name, shard, handle.get_slice(name), dests, filled)
                continue
            if fp8 and name.endswith(SCALE_SUFFIX):
                continue  # read with _read_scales
            if not dests:
                if dests is None and not name.endswith(_IGNORED_SUFFIXES):
                    unexpected.append(name)
                continue
            view = handle.get_slice(name)
            shape, dtype = tuple(view.get_shape()), _TORCH_DTYPE_NAMES.get(view.get_dtype(), "")
            if not fp8 or not dtype:
                _check(name, shard, shape, dtype or _INTEGER_NAMES.get(view.get_dtype(), ""), dests)
                _copy_into(view, dests, filled)
                continue
            _check(name, shard, shape, "", dests)
            assert quantization is not None
            _copy_fp8(name, view, scales.pop(name, None), quantization.block, dests, filled)
    if scales:
        raise UnsupportedQuantizationError(
            f"{SCALE_SUFFIX} scales without their fp8 weight(s): {', '.join(sorted(scales)[:5])}"
        )
    _report(path, required - filled, unexpected)


def _copy_stored(name: str, shard: Path, view: Any, dests: list[WeightTarget], filled: set[str]) -> None:
    """Copy a quantized tensor (data or scales) into its stored-precision targets, after checking
    its dtype and shape against what they expect."""
    dtype, shape = view.get_dtype(), tuple(view.get_shape())
    accepted = dests[0].stored or ()
    if dtype not in accepted:
        raise CheckpointError(
            f"quantized tensor {name!r} in {shard.name} is {dtype}; expected {' or '.join(accepted)} "
            "(the checkpoint's dtype does not match its quantization description)"
        )
    for target in dests:
        if shape != target.source_shape():
            raise CheckpointError(
                f"quantized tensor {name!r} in {shard.name} has shape {list(shape)} but expected "
                f"{list(target.source_shape())} (for its weight's shape and block size)"
            )
    if dtype == "I64":  # msModelSlim's float16-model deq_scale: float32 bits in an int64
        for target in dests:
            target.dest.copy_(deq_scale_as_float(view[target.index()]))
            filled.update(target.fills)
        return
    _copy_into(view, dests, filled)


def _copy_fp8(
    name: str,
    view: Any,
    scale: torch.Tensor | None,
    block: tuple[int, int],
    dests: list[WeightTarget],
    filled: set[str],
) -> None:
    """Dequantize each target's part of the FP8 weight ``name`` into it."""
    if scale is None:
        raise UnsupportedQuantizationError(f"fp8 weight(s) without {SCALE_SUFFIX} scales: {name}")
    for target in dests:
        target.dest.copy_(_dequantized_part(view, scale, target, block))
        filled.update(target.fills)


def _report(path: Path, missing: set[str], unexpected: list[str]) -> None:
    """Refuse a checkpoint that lacks required weights (naming them); warn about unused tensors."""
    unscaled = sorted(n.removesuffix(SCALE_SUFFIX) for n in missing if n.endswith(SCALE_SUFFIX))
    if unscaled:
        raise UnsupportedQuantizationError(f"fp8 weight(s) without {SCALE_SUFFIX} scales: {', '.join(unscaled[:5])}")
    if missing:
        names = sorted(missing)
        shown = ", ".join(names[:12]) + (f" and {len(names) - 12} more" if len(names) > 12 else "")
        raise CheckpointError(f"checkpoint {str(path)!r} is missing {len(names)} weight(s): {shown}")
    if unexpected:
        logger.warning(
            "ignored %d checkpoint tensor(s) the Qwen model does not use, e.g. %s",
            len(unexpected),
            ", ".join(unexpected[:5]),
        )


def _read_scales(shards: list[Path], targets: Mapping[str, list[WeightTarget]]) -> dict[str, torch.Tensor]:
    """The block scales of every weight a target wants, by weight name (1/(128*128) of its size)."""
    scales: dict[str, torch.Tensor] = {}
    for name, _, handle in _iter_tensors(shards):
        weight = name.removesuffix(SCALE_SUFFIX)
        dests = targets.get(weight)
        if weight != name and dests and dests[0].stored is None:
            scales[weight] = handle.get_tensor(name)
    return scales


def _dequantized_part(view: Any, scale: torch.Tensor, target: WeightTarget, block: tuple[int, int]) -> torch.Tensor:
    """``target``'s part of an FP8 weight (``view``, a safetensors slice handle) in float32.

    The rows (or columns) are read from the start of the block holding the first one, so the part
    meets whole scale blocks; the leading extra rows are dropped after dequantizing.
    """
    shape = tuple(view.get_shape())
    grid = tuple(-(-n // b) for n, b in zip(shape, block, strict=False))
    if len(shape) != 2 or tuple(scale.shape) != grid:
        # Not a 2-D weight with a matching scale grid: let the dequantizer name the mismatch.
        whole: torch.Tensor = dequantize_fp8_blocks(view[:], scale, block)
        return whole[target.index()]
    if target.part is None:
        return dequantize_fp8_blocks(view[:], scale, block)
    dim, step = target.dim, block[target.dim]
    first, stop = int(target.part.start), int(target.part.stop)
    aligned = first // step * step
    lead = (slice(None),) * dim
    piece = view[(*lead, slice(aligned, stop))]
    piece_scale = scale[(*lead, slice(aligned // step, -(-stop // step)))]
    return dequantize_fp8_blocks(piece, piece_scale, block).narrow(dim, first - aligned, stop - first)


def read_kv_scales(model_dir: str | Path, num_layers: int, num_kv_heads: int) -> dict[tuple[int, str], torch.Tensor]:
    """The checkpoint's FP8 KV cache scales, ``(layer, "k" | "v") -> float32 [num_kv_heads]``: each
    ``model.layers.N.self_attn.k_scale`` / ``v_scale`` per tensor (``[]`` or ``[1]``, spread over the
    heads) or per KV head (``[num_kv_heads]``); the cache stores ``K / scale`` and reads back
    ``stored * scale``. Empty when the checkpoint has none (the cache then uses 1.0).

    :raises CheckpointError: a scale of another shape, a non-float or non-positive scale, or a layer
        out of range, naming the tensor and what was expected.
    """
    out: dict[tuple[int, str], torch.Tensor] = {}
    for name, shard, handle in _iter_tensors(_shard_files(_model_dir(model_dir))):
        m = _KV_SCALE.match(name)
        if m is None:
            continue
        layer, which = int(m.group(1)), m.group(2)
        value = handle.get_tensor(name)
        if layer >= num_layers or list(value.shape) not in ([], [1], [num_kv_heads]) or not value.is_floating_point():
            raise CheckpointError(
                f"KV cache scale {name!r} in {shard.name} is {value.dtype} {list(value.shape)}; expected a float "
                f"per tensor ([] or [1]) or per KV head ([{num_kv_heads}]) for one of {num_layers} layers"
            )
        if not bool((value > 0).all()):
            raise CheckpointError(f"KV cache scale {name!r} in {shard.name} has a value <= 0: {value.tolist()}")
        out[layer, which] = value.float().reshape(-1).expand(num_kv_heads).contiguous()
    return out
