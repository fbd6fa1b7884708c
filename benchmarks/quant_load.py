"""Load time, peak RSS and resident weight memory of a Qwen3 checkpoint per storage format.

python benchmarks/quant_load.py --shape qwen3-0.6b --formats float32,bfloat16,fp8,w8a8 --dir /tmp/ql
python benchmarks/quant_load.py --measure /tmp/ql/fp8          # one load, JSON on stdout
python benchmarks/quant_load.py --linear                        # quant_linear per scheme, ms per call
python benchmarks/quant_load.py --deepseek --dir /tmp/ql         # tiny-deepseek-v4-fp8: stored vs dequantized

Each format's checkpoint is written from one random float model (Qwen3 names and shapes):
``float32`` / ``bfloat16`` as is, ``fp8`` block-FP8 (e4m3, 128x128 ``weight_scale_inv`` blocks,
bfloat16 elsewhere, as Qwen3-FP8 is published) and ``w8a8`` msModelSlim dynamic W8A8 (int8 with
per-channel ``weight_scale`` / ``weight_offset``, ``quant_model_description.json``; bfloat16
elsewhere). Shape ``small-moe`` is Qwen3-MoE (per-expert matrices, as Qwen3-30B-A3B-FP8 stores
them; the experts quantised like the projections). Every load runs in a fresh process through the
real Qwen executor on the CPU in the checkpoint's own dtype (its ``torch_dtype``, named: ``"auto"``
would run a 16-bit checkpoint in float32 on a CPU without 16-bit instructions); the resident memory
it reports is the process's RSS (anonymous + file-backed + shared, from /proc/self/status) after
loading minus before, against the checkpoint's tensor bytes.

``--deepseek`` loads ``tiny-deepseek-v4-fp8`` (DeepSeek-V4's release layout: FP8 E4M3 projections
with UE8M0 128x128 block scales, MXFP4 routed experts, bfloat16 elsewhere), the same with block-FP8
routed experts (DeepSeek-V3 style), and msModelSlim's W8A8_DYNAMIC copy of the embedded model (int8
projections and experts, float32 elsewhere), each through the DeepSeek executor twice, each in a
fresh process: kept in its stored precision (the default) and dequantized at load
(``stored_precision = False``); per load the time, the bytes the executor's weights hold
(``weight_bytes``: each weight storage once) against the checkpoint's tensor bytes (MTP layer
loaded), and greedy decode tokens per second (no speculation, one thread) at concurrency 1 and 8.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

SHAPES: dict[str, dict[str, int]] = {
    # Qwen3-0.6B: 28 layers, hidden 1024, 16 query / 8 KV heads of 128, intermediate 3072, tied embeddings.
    "qwen3-0.6b": {
        "layers": 28,
        "hidden": 1024,
        "heads": 16,
        "kv_heads": 8,
        "head_dim": 128,
        "inter": 3072,
        "vocab": 151936,
    },
    # About 30 M parameters: big enough that weights dominate the RSS, small enough for a test.
    "small": {"layers": 6, "hidden": 512, "heads": 8, "kv_heads": 4, "head_dim": 64, "inter": 2048, "vocab": 16384},
    # The same with Qwen3-MoE routed experts (8 of 512, top-2) in every layer: the FP8 experts' bytes.
    "small-moe": {
        "layers": 6,
        "hidden": 512,
        "heads": 8,
        "kv_heads": 4,
        "head_dim": 64,
        "inter": 2048,
        "vocab": 16384,
        "experts": 8,
        "moe_inter": 512,
    },
    # Loaded once before measuring, so one-time costs (lazy imports, allocator arenas) are not counted.
    "tiny": {"layers": 1, "hidden": 256, "heads": 2, "kv_heads": 1, "head_dim": 128, "inter": 256, "vocab": 512},
}
_QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _rss() -> dict[str, int]:
    """This process's resident memory by kind, in bytes."""
    out: dict[str, int] = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
            out[key] = int(value.split()[0]) * 1024
    return out


def _config(shape: dict[str, int], dtype: str) -> dict[str, Any]:
    moe = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "num_experts": shape.get("experts", 0),
        "num_experts_per_tok": 2,
        "moe_intermediate_size": shape.get("moe_inter", 0),
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        **(moe if shape.get("experts") else {}),
        "vocab_size": shape["vocab"],
        "hidden_size": shape["hidden"],
        "intermediate_size": shape["inter"],
        "num_hidden_layers": shape["layers"],
        "num_attention_heads": shape["heads"],
        "num_key_value_heads": shape["kv_heads"],
        "head_dim": shape["head_dim"],
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": True,
        "torch_dtype": dtype,
    }


def _float_tensors(shape: dict[str, int]) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(0)
    h, d, i = shape["hidden"], shape["head_dim"], shape["inter"]
    out: dict[str, torch.Tensor] = {"model.embed_tokens.weight": torch.randn(shape["vocab"], h, generator=g) * 0.02}
    out["model.norm.weight"] = torch.ones(h)
    for layer in range(shape["layers"]):
        p = f"model.layers.{layer}"
        dims = {
            "self_attn.q_proj": (shape["heads"] * d, h),
            "self_attn.k_proj": (shape["kv_heads"] * d, h),
            "self_attn.v_proj": (shape["kv_heads"] * d, h),
            "self_attn.o_proj": (h, shape["heads"] * d),
            "mlp.gate_proj": (i, h),
            "mlp.up_proj": (i, h),
            "mlp.down_proj": (h, i),
        }
        if shape.get("experts"):  # per-expert matrices and the router replace the dense MLP
            e, m = shape["experts"], shape["moe_inter"]
            dims = {k: v for k, v in dims.items() if k.startswith("self_attn")}
            dims["mlp.gate"] = (e, h)
            for x in range(e):
                dims.update({f"mlp.experts.{x}.{n}_proj": (m, h) for n in ("gate", "up")})
                dims[f"mlp.experts.{x}.down_proj"] = (h, m)
        for name, dim in dims.items():
            out[f"{p}.{name}.weight"] = torch.randn(dim, generator=g) * dim[1] ** -0.5
        for norm in ("input_layernorm", "post_attention_layernorm", "self_attn.q_norm", "self_attn.k_norm"):
            out[f"{p}.{norm}.weight"] = torch.ones(d if "_norm" in norm and "self_attn" in norm else h)
    return out


def _fp8(w: Any, block: int = 128) -> tuple[Any, Any]:
    """Block-FP8: per 128x128 block absmax / 448 (``weight_scale_inv``), e4m3 values."""
    import torch

    rows, cols = w.shape
    pad = torch.zeros(-(-rows // block) * block, -(-cols // block) * block)
    pad[:rows, :cols] = w
    tiles = pad.view(pad.shape[0] // block, block, pad.shape[1] // block, block)
    scale = (tiles.abs().amax(dim=(1, 3)) / 448.0).clamp_min(1e-12)
    q = (tiles / scale[:, None, :, None]).view(pad.shape)[:rows, :cols].to(torch.float8_e4m3fn)
    return q.contiguous(), scale


def write_checkpoint(path: Path, shape_name: str, fmt: str) -> int:
    """Write ``fmt``'s checkpoint of ``shape_name`` to ``path``; returns its tensor bytes."""
    import torch
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    tensors = _float_tensors(SHAPES[shape_name])
    head = fmt == "w8a8-head"  # the output projection int8 too, untied (``convert --quantize-head``)
    if head:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    floats = torch.float32 if fmt == "float32" else torch.bfloat16
    out: dict[str, torch.Tensor] = {}
    description: dict[str, str] = {"model_quant_type": "W8A8_DYNAMIC"}
    for name, t in tensors.items():
        linear = name.endswith(".weight") and any(p in name for p in _QUANTIZED)
        if fmt == "fp8" and linear:
            out[name], out[name + "_scale_inv"] = _fp8(t)
        elif fmt.startswith("w8a8") and (linear or name == "lm_head.weight"):
            scale = t.abs().amax(dim=1, keepdim=True) / 127
            out[name] = torch.round(t / scale).clamp(-127, 127).to(torch.int8)
            out[name + "_scale"], out[name + "_offset"] = scale, torch.zeros_like(scale)
            description.update(
                {name: "W8A8_DYNAMIC", name + "_scale": "W8A8_DYNAMIC", name + "_offset": "W8A8_DYNAMIC"}
            )
        else:
            out[name] = t.to(floats)
            description[name] = "FLOAT"
    config = _config(SHAPES[shape_name], "float32" if fmt == "float32" else "bfloat16")
    if fmt == "fp8":
        config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    if head:
        config["tie_word_embeddings"] = False
    if fmt.startswith("w8a8"):
        (path / "quant_model_description.json").write_text(json.dumps(description))
    (path / "config.json").write_text(json.dumps(config))
    save_file(out, str(path / "model.safetensors"))
    return sum(t.numel() * t.element_size() for t in out.values())


def _load(path: Path, options: dict[str, Any] | None = None) -> Any:
    from pypto_serving.config import ServingSettings
    from pypto_serving_qwen.executor import QwenExecutor

    settings = ServingSettings(
        model=str(path), device="cpu", dtype=_stored_dtype(path), block_size=16, executor_options=options or {}
    )
    ex = QwenExecutor(settings)
    ex.load()
    return ex


def _stored_dtype(path: Path) -> str:
    """The checkpoint's own dtype as a setting (``auto`` follows the CPU's 16-bit support instead)."""
    config = json.loads((path / "config.json").read_text())
    return str(config.get("torch_dtype") or config.get("dtype") or "auto")


def _warm_packed_kernels() -> None:
    """Pack and run one oneDNN float32 product, as a load on a CPU whose rule packs does: the tiny
    warm-up checkpoint is below the rule's size, and the library code the first packing touches
    (about 11 MB of file-backed pages of torch's shared library) is a one-time cost, not weights."""
    import torch

    import pypto_kernels as K
    from pypto_kernels.dense import ONEDNN_FLOAT32_MIN_ELEMENTS

    if not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        return
    packed = K.pack_linear(torch.zeros(ONEDNN_FLOAT32_MIN_ELEMENTS // 512, 512), 64, library="onednn")
    assert packed is not None
    for rows in (1, 2, 64):
        K.linear(torch.zeros(rows, 512), packed)
    if K.native.library() is not None:
        panels = K.pack_linear(torch.zeros(64, 512), 64, library="panels")
        assert panels is not None
        K.linear(torch.zeros(2, 512), panels)


def measure(path: Path, fmt: str, options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Load ``path`` once in this process (after a warm-up load of a tiny checkpoint of the same
    format) with executor ``options``; RSS before and after, load time, bytes held, and the bytes of
    the one packed copy made beside a plain matrix (a tied output projection's, ``copy_bytes``)."""
    import gc
    import tempfile

    import torch
    from safetensors import safe_open

    with tempfile.TemporaryDirectory() as tmp:
        write_checkpoint(Path(tmp), "tiny", fmt)
        del _load(Path(tmp), options).model
        gc.collect()
    _warm_packed_kernels()

    checkpoint = 0
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118 - safe_open handles are not iterable
            view = f.get_slice(name)
            numel = 1
            for n in view.get_shape():
                numel *= n
            checkpoint += numel * torch.empty((), dtype=_DTYPES[view.get_dtype()]).element_size()
    before = _rss()
    t0 = time.perf_counter()
    ex = _load(path, options)
    seconds = time.perf_counter() - t0
    after = _rss()
    assert ex.model is not None
    held = sum(p.numel() * p.element_size() for p in ex.model.parameters())
    stored = getattr(ex.model, "quantized_weights", list)  # absent before stored-precision weights
    held += sum(w.nbytes() for w in stored())
    head = ex.model.lm_head_packed
    beside = head is not None and head.weight is not None and head.library in ("onednn", "panels")
    return {
        "checkpoint_bytes": checkpoint,
        "held_bytes": held,
        # oneDNN's copy is opaque (no storage to count): it holds the matrix's values, no more (the
        # native panels too, but for outputs padded to a multiple of 64: none at these vocabularies).
        "copy_bytes": head.weight.numel() * head.weight.element_size() if beside else 0,
        "resident_bytes": after["VmRSS"] - before["VmRSS"],
        "resident_by_kind": {k: after[k] - before.get(k, 0) for k in after if k != "VmHWM"},
        # VmHWM (this process's peak RSS; unlike ru_maxrss it does not inherit the parent's peak
        # across fork + exec). Includes the checkpoint's file pages while they are mapped.
        "peak_rss_bytes": after["VmHWM"],
        "peak_over_before_bytes": after["VmHWM"] - before["VmRSS"],
        "rss_before_bytes": before["VmRSS"],
        "load_seconds": round(seconds, 3),
        "dtype": str(ex.dtype),
    }


_DTYPES_NAMES = {
    "F32": "float32",
    "BF16": "bfloat16",
    "F16": "float16",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E8M0": "float8_e8m0fnu",
    "I8": "int8",
    "I64": "int64",
}


def _dtype_table() -> dict[str, Any]:
    import torch

    return {k: getattr(torch, v) for k, v in _DTYPES_NAMES.items()}


_DTYPES: dict[str, Any] = {}


def time_linears(rows: tuple[int, ...] = (1, 64), repeats: int = 20) -> None:
    """Milliseconds per projection of one Qwen3-0.6B layer (fused q/k/v, o, gate/up, down) on the
    CPU: float32 / bfloat16 ``F.linear``, the FP8 and W8A8 fast paths, the reference, and
    ``torch._weight_int8pack_mm`` (weight-only int8, bfloat16 activations) for the int8 choice."""
    import torch

    from pypto_serving.quantization import QuantizedWeight

    shapes = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)]
    weights = [torch.randn(s) * s[1] ** -0.5 for s in shapes]
    fp8 = [QuantizedWeight("fp8_block", *_fp8(w), (128, 128)) for w in weights]
    int8 = []
    for w in weights:
        scale = w.abs().amax(dim=1, keepdim=True) / 127
        int8.append(QuantizedWeight("w8a8_dynamic", torch.round(w / scale).to(torch.int8), scale))

    def per_layer(fn: Any) -> float:
        fn()
        t0 = time.perf_counter()
        for _ in range(repeats):
            fn()
        return (time.perf_counter() - t0) / repeats * 1e3

    print(f"torch threads {torch.get_num_threads()}; ms per layer (4 projections)")
    for m in rows:
        xs = {s: torch.randn(m, s[1]) for s in shapes}
        for name, fn in _linear_cases(xs, weights, fp8, int8).items():
            print(f"  rows {m:3}  {name:24} {per_layer(fn):8.2f} ms")


def _linear_cases(xs: dict[Any, Any], weights: list[Any], fp8: list[Any], int8: list[Any]) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    import pypto_kernels as K

    pairs = list(zip(xs.values(), weights, fp8, int8, strict=True))
    halves = [(x.bfloat16(), w.bfloat16()) for x, w, _, _ in pairs]
    return {
        "float32 F.linear": lambda: [F.linear(x, w) for x, w, _, _ in pairs],
        "bfloat16 F.linear": lambda: [F.linear(x, w) for x, w in halves],
        "fp8 cpu bands (f32)": lambda: [K.quant_linear(x, q) for x, _, q, _ in pairs],
        "fp8 reference": lambda: [K.quant_linear.reference(x, q) for x, _, q, _ in pairs],
        "w8a8 cpu _int_mm": lambda: [K.quant_linear(x, q) for x, _, _, q in pairs],
        "w8a8 reference": lambda: [K.quant_linear.reference(x, q) for x, _, _, q in pairs],
        "int8pack_mm (bf16 act)": lambda: [
            torch._weight_int8pack_mm(x.bfloat16(), q.data, q.scale.reshape(-1).bfloat16()) for x, _, _, q in pairs
        ],
    }


def _deepseek_decode(ex: Any, info: Any, concurrency: int, new_tokens: int) -> float:
    """Greedy decode tokens per second of ``concurrency`` requests of 16 prompt tokens (after their
    prefill), driven like the core drives the executor (tests' FakeCore)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.plugins.deepseek_mtp.helpers import FakeCore

    core = FakeCore(ex, info, num_blocks=64 * concurrency)
    prompts = {f"r{i}": [(7 * i + 31 * j) % 8000 + 3 for j in range(16)] for i in range(concurrency)}
    logits = ex.execute(core.batch([(rid, ids, 0, 1) for rid, ids in prompts.items()]))
    last = logits.argmax(-1).tolist()
    t0 = time.perf_counter()
    for step in range(new_tokens):
        entries = [(rid, [last[i]], 16 + step, 1) for i, rid in enumerate(prompts)]
        last = ex.execute(core.batch(entries)).argmax(-1).tolist()
    return concurrency * new_tokens / (time.perf_counter() - t0)


def measure_deepseek(path: Path, stored: bool, new_tokens: int = 32) -> dict[str, Any]:
    """One DeepSeek-V4 load of ``path`` (stored precision or dequantized) and its decode speed."""
    import torch

    from pypto_serving.config import ServingSettings
    from pypto_serving_deepseek_mtp import DeepseekMTPExecutor

    # One intra-op thread: on a shared 2-core machine more threads oversubscribe it (10x slower here).
    torch.set_num_threads(1)

    def load(mtp: bool) -> tuple[Any, Any]:
        spec = {"method": "mtp", "num_speculative_tokens": 1} if mtp else None
        settings = ServingSettings(
            model=str(path),
            device="cpu",
            dtype=_stored_dtype(path),
            block_size=16,
            max_num_seqs=8,
            speculative_config=spec,
        )
        ex = DeepseekMTPExecutor(settings)
        ex.stored_precision = stored
        return ex, ex.load()

    # The first load (without the MTP layer; it decodes below) takes the one-time costs (imports,
    # kernel registry, allocator arenas); the timed one reads the whole checkpoint, MTP layer included.
    plain, plain_info = load(mtp=False)
    t0 = time.perf_counter()
    ex, _ = load(mtp=True)
    seconds = time.perf_counter() - t0
    return {
        "mode": "stored" if stored else "dequantized",
        "checkpoint_bytes": _tensor_bytes(path),
        "held_bytes": ex.weight_bytes(),
        "load_seconds": round(seconds, 3),
        "dtype": str(ex.dtype),
        "threads": torch.get_num_threads(),
        "decode_tok_s": {c: round(_deepseek_decode(plain, plain_info, c, new_tokens), 1) for c in (1, 8)},
    }


def _tensor_bytes(path: Path) -> int:
    """The tensor bytes of the checkpoint's safetensors files (their headers excluded)."""
    import torch
    from safetensors import safe_open

    total = 0
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open handles are not iterable
                view = f.get_slice(name)
                numel = 1
                for n in view.get_shape():
                    numel *= n
                total += numel * torch.empty((), dtype=_DTYPES[view.get_dtype()]).element_size()
    return total


def deepseek_checkpoints(directory: Path) -> dict[str, Path]:
    """The embedded DeepSeek-V4 in each stored format: the release (FP8 + MXFP4 experts), FP8 experts
    (DeepSeek-V3 style), msModelSlim W8A8_DYNAMIC (the tests' quantiser, written once)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from pypto_serving_deepseek_mtp.plugin import TINY_DEEPSEEK_V4, write_tiny_fp8
    from pypto_serving_deepseek_mtp.release import write_release_layout
    from tests.plugins.deepseek_mtp.test_w8a8 import w8a8_copy

    out = {"fp8+mxfp4": write_tiny_fp8(directory / "tiny-deepseek-v4-fp8")}
    out["fp8 experts"] = directory / "tiny-deepseek-v4-fp8-experts"
    if not out["fp8 experts"].is_dir():
        out["fp8 experts"].mkdir(parents=True)
        write_release_layout(TINY_DEEPSEEK_V4, out["fp8 experts"], expert_dtype="fp8")
    out["w8a8"] = directory / "tiny-deepseek-v4-w8a8"
    if not out["w8a8"].is_dir():
        w8a8_copy(TINY_DEEPSEEK_V4, out["w8a8"], directory / "tiny-deepseek-v4-w8a8-values")
    return out


def deepseek_table(directory: Path) -> None:
    print(f"{'weights':24} {'ckpt MiB':>8} {'held MiB':>8} {'x ckpt':>7} {'load s':>7} {'tok/s c1':>9} {'tok/s c8':>9}")
    for name, path in deepseek_checkpoints(directory).items():
        _deepseek_rows(name, path)


def _deepseek_rows(name: str, path: Path) -> None:
    for mode in ("stored", "dequantized"):
        command = [sys.executable, __file__, "--measure-deepseek", str(path), "--mode", mode]
        run = subprocess.run(
            command, capture_output=True, text=True, env={**os.environ, "PYTHONHASHSEED": "0"}, check=False
        )
        if run.returncode:
            print(name, mode, "failed:", run.stderr[-2000:])
            continue
        r = json.loads(run.stdout.strip().splitlines()[-1])
        mb = 1 / (1 << 20)
        tok = r["decode_tok_s"]
        print(
            f"{name + ', ' + mode:24} {r['checkpoint_bytes'] * mb:8.2f} {r['held_bytes'] * mb:8.2f} "
            f"{r['held_bytes'] / r['checkpoint_bytes']:7.2f} {r['load_seconds']:7.3f} "
            f"{tok['1']:9.1f} {tok['8']:9.1f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="small")
    parser.add_argument("--formats", default="float32,bfloat16,fp8,w8a8")
    parser.add_argument("--dir", type=Path, default=Path("/tmp/quant_load"))
    parser.add_argument("--measure", type=Path, help="load this checkpoint and print its numbers as JSON")
    parser.add_argument("--format", default="float32", help="the --measure checkpoint's format (for the warm-up)")
    parser.add_argument("--executor-options", default="{}", help="the --measure load's executor_options (JSON)")
    parser.add_argument("--linear", action="store_true", help="time quant_linear per scheme instead")
    parser.add_argument("--deepseek", action="store_true", help="tiny DeepSeek-V4 per format: stored vs dequantized")
    parser.add_argument("--measure-deepseek", type=Path, help="one DeepSeek load and decode, JSON on stdout")
    parser.add_argument("--mode", choices=("stored", "dequantized"), default="stored")
    args = parser.parse_args()
    _DTYPES.update(_dtype_table())
    if args.deepseek:
        deepseek_table(args.dir)
        return
    if args.measure_deepseek is not None:
        print(json.dumps(measure_deepseek(args.measure_deepseek, args.mode == "stored")))
        return
    if args.linear:
        time_linears()
        return
    if args.measure is not None:
        print(json.dumps(measure(args.measure, args.format, json.loads(args.executor_options))))
        return
    print(f"shape {args.shape}: {SHAPES[args.shape]}")
    print(
        f"{'format':10} {'ckpt MB':>9} {'held MB':>9} {'resident MB':>12} {'x ckpt':>7} {'peak+ MB':>9} {'load s':>7}"
    )
    for fmt in args.formats.split(","):
        path = args.dir / f"{args.shape}-{fmt}"
        if not (path / "model.safetensors").is_file():
            write_checkpoint(path, args.shape, fmt)
        env = {**os.environ, "PYTHONHASHSEED": "0"}
        command = [sys.executable, __file__, "--measure", str(path), "--format", fmt]
        run = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
        if run.returncode:
            print(fmt, "failed:", run.stderr[-2000:])
            continue
        r = json.loads(run.stdout.strip().splitlines()[-1])
        mb = 1 / (1 << 20)
        print(
            f"{fmt:10} {r['checkpoint_bytes'] * mb:9.1f} {r['held_bytes'] * mb:9.1f} {r['resident_bytes'] * mb:12.1f} "
            f"{r['resident_bytes'] / r['checkpoint_bytes']:7.2f} {r['peak_over_before_bytes'] * mb:9.1f} "
            f"{r['load_seconds']:7.2f}"
        )


if __name__ == "__main__":
    main()
