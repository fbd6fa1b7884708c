"""Ascend W8A8 (msModelSlim, dynamic) and block-FP8 checkpoints kept in their stored precision.

The W8A8 checkpoint is written here the way msModelSlim's format document describes it: each
quantized linear ``X.weight`` int8 ``[n, k]`` with ``X.weight_scale`` / ``X.weight_offset`` float32
``[n, 1]`` (dequantised ``(weight - offset) * scale``; zeros for symmetric weights) and
``quant_model_description.json`` mapping every tensor to ``W8A8_DYNAMIC`` or ``FLOAT``. Loaded
through the real loader, the projections stay int8 / FP8 (never a float copy), greedy tokens equal
those of the float checkpoint holding the dequantised values, and malformed checkpoints are refused
by name."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pypto_serving.quantization import QuantizedWeight, UnsupportedQuantizationError
from pypto_serving_qwen.executor import QwenExecutor
from pypto_serving_qwen.loader import CheckpointError
from tests.plugins.qwen.qwen_fixtures import PagedBatchBuilder, qwen_settings
from tests.plugins.qwen.test_qwen_fp8 import _fp8_copy

_QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _w8a8_copy(src: Path, dest: Path, dequantized: Path | None = None, *, head: bool = False) -> Path:
    """msModelSlim-style W8A8_DYNAMIC copy of ``src`` (and a float32 copy of the values it stands for);
    ``head``: the output projection ``lm_head.weight`` quantized too."""
    shutil.copytree(src, dest)
    (shard,) = dest.glob("*.safetensors")
    out: dict[str, torch.Tensor] = {}
    plain: dict[str, torch.Tensor] = {}
    description = {"model_quant_type": "W8A8_DYNAMIC"}
    quantized = (*_QUANTIZED, "lm_head") if head else _QUANTIZED
    for name, t in load_file(str(shard)).items():
        if name.endswith(".weight") and any(p in name for p in quantized):
            w = t.float()
            scale = w.abs().amax(dim=1, keepdim=True) / 127
            q = torch.round(w / scale).clamp(-127, 127).to(torch.int8)
            out[name], out[name + "_scale"], out[name + "_offset"] = q, scale, torch.zeros_like(scale)
            for n in (name, name + "_scale", name + "_offset"):
                description[n] = "W8A8_DYNAMIC"
            plain[name] = q.float() * scale
        else:
            out[name] = plain[name] = t
            description[name] = "FLOAT"
    save_file(out, str(shard))
    (dest / "quant_model_description.json").write_text(json.dumps(description))
    if dequantized is not None:
        shutil.copytree(src, dequantized)
        save_file(plain, str(next(dequantized.glob("*.safetensors"))))
    return dest


STATIC_SCALE, STATIC_OFFSET = 6.0 / 127, 2.0  # activations in about [-6.1, 5.9], in steps of 0.047


def _static_copy(src: Path, dest: Path, *, skew_k: bool = False) -> Path:
    """msModelSlim static W8A8: int8 weights, per-tensor ``input_scale`` / ``input_offset``
    (bfloat16 ``[1]``), ``deq_scale = input_scale * weight_scale`` as int64 holding float32 bits (the
    float16-model layout) and ``quant_bias = -input_offset * row sums`` (int32; the model has no
    biases). ``skew_k`` gives k_proj another input scale than q/v."""
    shutil.copytree(src, dest)
    (shard,) = dest.glob("*.safetensors")
    out: dict[str, torch.Tensor] = {}
    description = {"model_quant_type": "W8A8"}
    for name, t in load_file(str(shard)).items():
        description[name] = "FLOAT"
        if not (name.endswith(".weight") and any(p in name for p in _QUANTIZED)):
            out[name] = t
            continue
        w, prefix = t.float(), name.removesuffix(".weight")
        w_scale = w.abs().amax(dim=1) / 127
        q = torch.round(w / w_scale[:, None]).clamp(-127, 127).to(torch.int8)
        in_scale = STATIC_SCALE * (2 if skew_k and "k_proj" in name else 1)
        deq = (in_scale * w_scale).float()
        out[name] = q
        out[prefix + ".input_scale"] = torch.tensor([in_scale], dtype=torch.bfloat16)
        out[prefix + ".input_offset"] = torch.tensor([STATIC_OFFSET], dtype=torch.bfloat16)
        out[prefix + ".deq_scale"] = deq.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
        out[prefix + ".quant_bias"] = (-STATIC_OFFSET * q.long().sum(dim=1)).to(torch.int32)
        for suffix in ("weight", "input_scale", "input_offset", "deq_scale", "quant_bias"):
            description[f"{prefix}.{suffix}"] = "W8A8"
    save_file(out, str(shard))
    (dest / "quant_model_description.json").write_text(json.dumps(description))
    return dest


def _run(path: Path, ids: list[int], steps: int = 6) -> tuple[QwenExecutor, torch.Tensor, list[int]]:
    """Prompt logits and ``steps`` greedy tokens through the real loader and executor."""
    ex = QwenExecutor(qwen_settings(path))
    ex.load()
    ex.init_kv_cache({"kv": 32})
    builder = PagedBatchBuilder(4, 32)
    logits = ex.execute(builder.step([("s", ids)]))
    tokens = [int(logits[-1].argmax())]
    for _ in range(steps - 1):
        out = ex.execute(builder.step([("s", [tokens[-1]])]))
        tokens.append(int(out[-1].argmax()))
    return ex, logits, tokens


def _stored(ex: QwenExecutor) -> list[QuantizedWeight]:
    assert ex.model is not None
    return ex.model.quantized_weights()


IDS = [3, 17, 5, 99, 42, 7, 250, 11]


def test_w8a8_checkpoint_stays_int8_and_matches_its_float_values(
    tmp_path: Path, qwen_checkpoints: Callable[[str], Path]
) -> None:
    ref = qwen_checkpoints("qwen3")
    w8 = _w8a8_copy(ref, tmp_path / "w8a8", dequantized=tmp_path / "deq")
    ex, got, tokens = _run(w8, IDS)
    weights = _stored(ex)
    assert ex.config is not None and len(weights) == 4 * ex.config.num_layers  # qkv, o, gate_up, down
    assert all(w.data.dtype == torch.int8 and w.offset is None for w in weights)  # zero offsets dropped
    _, exact, exact_tokens = _run(tmp_path / "deq", IDS)
    # Dynamic W8A8 also quantises activations per token (int8): 2.4 % on these logits (measured).
    rel = ((got - exact).norm() / exact.norm()).item()
    assert rel < 0.03, rel
    assert tokens == exact_tokens


def test_a_quantized_output_projection_stays_int8_and_runs_the_int8_product(
    tmp_path: Path, qwen_checkpoints: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``lm_head.weight`` described W8A8_DYNAMIC (``convert --quantize-head`` writes one): held int8
    (no float head beside it) and multiplied by the CPU's int8 product; logits close to the float
    copy's, greedy tokens equal."""
    ref = qwen_checkpoints("qwen3")
    w8 = _w8a8_copy(ref, tmp_path / "w8a8", dequantized=tmp_path / "deq", head=True)
    shapes: list[tuple[int, ...]] = []
    int_mm, packed_mm = torch._int_mm, torch.ops.onednn.qlinear_pointwise

    def counting(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        shapes.append(tuple(b.shape))
        return int_mm(a, b)

    def counting_packed(*args: object) -> torch.Tensor:
        shapes.append(("packed", *args[3].size()))  # type: ignore[attr-defined]
        return packed_mm(*args)  # type: ignore[no-any-return]

    monkeypatch.setattr(torch, "_int_mm", counting)
    monkeypatch.setattr(torch.ops.onednn, "qlinear_pointwise", counting_packed)
    ex, got, tokens = _run(w8, IDS)
    assert ex.model is not None and ex.config is not None
    head = ex.model.lm_head_q
    assert head is not None and head.offset is None and head.shape == (ex.config.vocab_size, ex.config.hidden_size)
    assert ex.model.lm_head_t.numel() == 0 and ex.model.lm_head_packed is None
    # The head, once per step: oneDNN's prepacked int8 product on a CPU with int8 dot products (its
    # plain data freed), torch._int_mm over the int8 data elsewhere.
    if head.packed is not None:
        assert head.data.numel() == 0 and shapes.count(("packed", *head.packed.tensor.size())) == 6
    else:
        assert head.data.dtype == torch.int8 and shapes.count((ex.config.hidden_size, ex.config.vocab_size)) == 6
    _, exact, exact_tokens = _run(tmp_path / "deq", IDS)
    rel = ((got - exact).norm() / exact.norm()).item()
    assert rel < 0.03, rel  # 2.4 % with a float head, 2.5 % with an int8 one (measured)
    assert tokens == exact_tokens


def test_a_quantized_head_tied_to_the_embedding_is_refused(
    tmp_path: Path, qwen_checkpoints: Callable[[str], Path]
) -> None:
    tied = tmp_path / "tied"
    shutil.copytree(qwen_checkpoints("qwen2_tied"), tied)
    _edit(tied, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"].clone()}))  # an explicit copy
    w8 = _w8a8_copy(tied, tmp_path / "w8a8", head=True)
    with pytest.raises(CheckpointError, match=r"lm_head.weight is quantized \(w8a8_dynamic\) but config.json sets tie"):
        QwenExecutor(qwen_settings(w8)).load()


def test_w8a8_moe_experts_stay_int8_and_greedy_tokens_match(
    tmp_path: Path, qwen_checkpoints: Callable[[str], Path]
) -> None:
    """Qwen3-MoE with W8A8_DYNAMIC routed experts (int8 per expert, per-row scales, as msModelSlim
    writes them): held int8 in per-layer stacks, run through quant_moe_experts."""
    w8 = _w8a8_copy(qwen_checkpoints("qwen3_moe"), tmp_path / "w8a8", dequantized=tmp_path / "deq")
    ex, got, tokens = _run(w8, IDS)
    assert ex.model is not None
    stacks = [w for n, w in ex.model.named_quantized_weights() if n.endswith((".gate_up", ".down"))]
    assert stacks and all(w.data.dtype == torch.int8 and w.data.dim() == 3 and w.offset is None for w in stacks)
    _, exact, exact_tokens = _run(tmp_path / "deq", IDS)
    rel = ((got - exact).norm() / exact.norm()).item()
    assert rel < 0.03, rel  # per-token int8 activations in both expert matmuls: 1.3 % (measured)
    assert tokens == exact_tokens


def test_static_w8a8_experts_are_refused_by_name(tmp_path: Path, qwen_checkpoints: Callable[[str], Path]) -> None:
    static = _static_copy(qwen_checkpoints("qwen3_moe"), tmp_path / "static")
    with pytest.raises(CheckpointError, match=r"routed experts as static W8A8 \(model\.layers\.0\.mlp\.experts\."):
        QwenExecutor(qwen_settings(static)).load()


def test_fp8_checkpoint_stays_fp8_and_greedy_tokens_match(
    tmp_path: Path, qwen_checkpoints: Callable[[str], Path]
) -> None:
    fp8 = _fp8_copy(qwen_checkpoints("qwen3"), tmp_path / "fp8", dequantized=tmp_path / "deq")
    ex, got, tokens = _run(fp8, IDS)
    assert all(w.data.dtype == torch.float8_e4m3fn for w in _stored(ex)) and _stored(ex)
    _, exact, exact_tokens = _run(tmp_path / "deq", IDS)
    assert torch.allclose(got, exact, rtol=1e-5, atol=1e-5) and tokens == exact_tokens


def test_static_w8a8_checkpoint_loads_as_stored_and_stays_close(
    tmp_path: Path, qwen_checkpoints: Callable[[str], Path]
) -> None:
    ref = qwen_checkpoints("qwen3")
    ex, got, _ = _run(_static_copy(ref, tmp_path / "static"), IDS, steps=1)
    weights = _stored(ex)
    assert weights and all(w.scheme == "w8a8_static" and w.data.dtype == torch.int8 for w in weights)
    first = weights[0]  # layer 0's fused q/k/v: one input scale, float32 deq_scale decoded from int64 bits
    assert first.input_scale is not None and first.input_scale.tolist() == [pytest.approx(STATIC_SCALE, rel=1e-2)]
    (shard,) = (tmp_path / "static").glob("*.safetensors")
    k_deq = load_file(str(shard))["model.layers.0.self_attn.q_proj.deq_scale"].to(torch.int32).view(torch.float32)
    assert first.deq_scale is not None and torch.equal(first.deq_scale[: k_deq.numel()], k_deq)
    _, exact, _ = _run(ref, IDS, steps=1)
    # Static per-tensor int8 activations (one fixed range for every token) cost more: 8.3 % (measured).
    rel = ((got - exact).norm() / exact.norm()).item()
    assert rel < 0.1, rel


def test_fused_static_weights_with_different_input_scales_are_refused(
    tmp_path: Path, qwen_checkpoints: Callable[[str], Path]
) -> None:
    path = _static_copy(qwen_checkpoints("qwen3"), tmp_path / "skew", skew_k=True)
    with pytest.raises(
        CheckpointError, match=r"qkv_weight: the weights fused here have different static W8A8 input_scales"
    ):
        QwenExecutor(qwen_settings(path)).load()


def _edit(path: Path, fn: Callable[[dict[str, torch.Tensor]], None]) -> None:
    (shard,) = path.glob("*.safetensors")
    tensors = load_file(str(shard))
    fn(tensors)
    save_file(tensors, str(shard))


SCALE = "model.layers.0.self_attn.q_proj.weight_scale"


@pytest.mark.parametrize(
    ("fmt", "breakage", "error", "message"),
    [
        ("w8a8", lambda t: t.pop(SCALE), CheckpointError, r"missing 1 weight\(s\): " + SCALE),
        ("w8a8", lambda t: t.__setitem__(SCALE, t[SCALE].to(torch.int32)), CheckpointError, "is I32; expected F32"),
        ("w8a8", lambda t: t.__setitem__(SCALE, t[SCALE][:-1]), CheckpointError, "has shape"),
        (
            "fp8",
            lambda t: t.pop(SCALE + "_inv"),
            UnsupportedQuantizationError,
            "without _scale_inv scales: " + SCALE[:-6],
        ),
        (
            "fp8",
            lambda t: t.__setitem__(SCALE + "_inv", t[SCALE + "_inv"][:, :1].contiguous()),
            CheckpointError,
            r"expected \[4, 4\]",
        ),
        ("fp8", lambda t: t.__setitem__(SCALE + "_inv", t[SCALE + "_inv"].to(torch.int32)), CheckpointError, "is I32"),
    ],
)
def test_malformed_quantized_checkpoints_are_refused_by_name(
    tmp_path: Path,
    qwen_checkpoints: Callable[[str], Path],
    fmt: str,
    breakage: Callable[..., object],
    error: type,
    message: str,
) -> None:
    src = qwen_checkpoints("qwen3")
    path = _w8a8_copy(src, tmp_path / "m") if fmt == "w8a8" else _fp8_copy(src, tmp_path / "m")
    _edit(path, breakage)
    with pytest.raises(error, match=message):
        QwenExecutor(qwen_settings(path)).load()


def test_unknown_modelslim_types_are_refused_by_name(tmp_path: Path, qwen_checkpoints: Callable[[str], Path]) -> None:
    path = _w8a8_copy(qwen_checkpoints("qwen3"), tmp_path / "m")
    description = json.loads((path / "quant_model_description.json").read_text())
    description["model.layers.0.self_attn.q_proj.weight"] = "W4A8_DYNAMIC"
    (path / "quant_model_description.json").write_text(json.dumps(description))
    with pytest.raises(
        UnsupportedQuantizationError,
        match=r"'model\.layers\.0\.self_attn\.q_proj\.weight' is quantized as 'W4A8_DYNAMIC'",
    ):
        QwenExecutor(qwen_settings(path)).load()


def test_load_logs_which_kernel_runs_the_stored_projections(
    tmp_path: Path, qwen_checkpoints: Callable[[str], Path], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO", logger="pypto_serving_qwen.executor")
    QwenExecutor(qwen_settings(_w8a8_copy(qwen_checkpoints("qwen3"), tmp_path / "w8a8"))).load()
    lines = [r.getMessage() for r in caplog.records]
    from pypto_kernels.backends.cpu import QUANT_LINEAR_LABEL

    assert f"w8a8_dynamic projections (kept as stored): quant_linear runs {QUANT_LINEAR_LABEL}" in lines


def test_a_16_bit_checkpoint_without_torch_dtype_loads_as_stored(
    tmp_path: Path, qwen_checkpoints: Callable[[str], Path], cpu_flags: Callable[..., None]
) -> None:
    """dtype='auto' with no torch_dtype in config.json follows the stored tensors, not float32 (on a
    CPU with bfloat16 instructions)."""
    cpu_flags("avx512_bf16")
    path = tmp_path / "bf16"
    shutil.copytree(qwen_checkpoints("qwen3"), path)
    _edit(path, lambda t: t.update({n: v.bfloat16() for n, v in t.items()}))
    cfg = json.loads((path / "config.json").read_text())
    for key in ("torch_dtype", "dtype"):
        cfg.pop(key, None)
    (path / "config.json").write_text(json.dumps(cfg))
    ex = QwenExecutor(qwen_settings(path, dtype="auto"))
    ex.load()
    assert ex.dtype == torch.bfloat16
    assert ex.model is not None and {p.dtype for p in ex.model.parameters()} == {torch.bfloat16}
