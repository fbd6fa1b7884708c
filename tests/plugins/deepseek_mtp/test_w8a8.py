"""DeepSeek-V4 as Ascend deployments store it: W8A8_DYNAMIC from msModelSlim, kept int8 at run time.

The checkpoint is written here the way msModelSlim's format document describes its output, not from
the loader's code: each quantized linear ``X.weight`` is int8 ``[out, in]`` with per-output-channel
``X.weight_scale`` and ``X.weight_offset`` (float32 ``[out, 1]``; the value is
``(weight - offset) * scale``), and ``quant_model_description.json`` maps every tensor to
``W8A8_DYNAMIC`` or ``FLOAT``. Here the attention projections, the shared experts and the MTP
layers' ``e_proj`` / ``h_proj`` are symmetric (offsets zero) and the routed experts asymmetric
(min/max per channel), so both forms are read. A float32 copy holds the values the int8 tensors
stand for.

- Loaded through the real loader, every projection and both expert kinds stay int8 (linears through
  ``quant_linear``, routed experts through ``quant_moe_experts``, which quantises each matmul's input
  per token as the NPU's ``npu_dynamic_quant`` does); greedy tokens and MTP drafts equal the float
  copy's, logits within the activations' int8 rounding; the weights held are the checkpoint's bytes.
- The expert kernel (reference and the gathered CUDA path) against a MoE computed here from the
  dequantised experts with per-token int8 activations.
- A tensor-parallel rank reads exactly its rows or columns and their channels' scales.
- Malformed copies are refused naming the tensor, the type and what was expected.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import pypto_kernels.backends.cpu as cpu
import pypto_kernels.quant_moe as qm
from pypto_kernels import describe_kernel
from pypto_kernels.moe import looped_moe_experts
from pypto_serving.quantization import QuantizedWeight, UnsupportedQuantizationError

from .helpers import Checkpoint, FakeCore
from .test_stored_precision import _executor, _generate

QUANTIZED = re.compile(
    r"(attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)|shared_experts\.w[123]|experts\.\d+\.w[123]|e_proj|h_proj)\.weight$"
)
ROUTED = re.compile(r"\.experts\.\d+\.w[123]\.weight$")
DYNAMIC = "W8A8_DYNAMIC"


def _quantize(w: torch.Tensor, asymmetric: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(int8 weight, scale, offset), both ``[out, 1]`` float32: symmetric ``absmax / 127``, or
    asymmetric over each row's ``[min, max]`` mapped onto ``[-128, 127]``."""
    if asymmetric:
        lo, hi = w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True)
        scale = (hi - lo) / 255
        offset = torch.round(-128 - lo / scale)
    else:
        scale, offset = w.abs().amax(dim=1, keepdim=True) / 127, torch.zeros(w.shape[0], 1)
    q = torch.clamp(torch.round(w / scale + offset), -128, 127).to(torch.int8)
    return q, scale, offset


def w8a8_copy(src: Path, dest: Path, plain: Path) -> None:
    """``src`` as msModelSlim's W8A8_DYNAMIC (``dest``) and the float32 values it stands for (``plain``)."""
    for d in (dest, plain):
        shutil.copytree(src, d)
    out: dict[str, torch.Tensor] = {}
    exact: dict[str, torch.Tensor] = {}
    description = {"model_quant_type": DYNAMIC, "version": "1.0.0"}
    for name, t in load_file(str(src / "model.safetensors")).items():
        if not QUANTIZED.search(name):
            out[name] = exact[name] = t
            description[name] = "FLOAT"
            continue
        q, scale, offset = _quantize(t.float(), asymmetric=ROUTED.search(name) is not None)
        out[name], out[name + "_scale"], out[name + "_offset"] = q, scale, offset
        description.update({name: DYNAMIC, name + "_scale": DYNAMIC, name + "_offset": DYNAMIC})
        exact[name] = (q.float() - offset) * scale
    save_file(out, str(dest / "model.safetensors"), metadata={"format": "pt"})
    save_file(exact, str(plain / "model.safetensors"), metadata={"format": "pt"})
    (dest / "quant_model_description.json").write_text(json.dumps(description, indent=1))


@pytest.fixture(scope="module")
def copies(checkpoints: dict[str, Checkpoint], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(W8A8 copy, float copy) of the two-MTP-depth test checkpoint."""
    root = tmp_path_factory.mktemp("w8a8")
    w8a8_copy(checkpoints["mixed_yarn"].path, root / "w8a8", root / "plain")
    return root / "w8a8", root / "plain"


def _checkpoint_bytes(path: Path) -> int:
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return sum(f.get_tensor(k).nbytes for k in f.keys())  # noqa: SIM118 - safe_open is not a mapping


def _prefill_logits(ex: Any, info: Any, tokens: list[int]) -> torch.Tensor:
    """Logits at every position of ``tokens``, one prefill step."""
    return ex.execute(FakeCore(ex, info).batch([("a", tokens, 0, len(tokens))])).float()


SEQUENCE = [5, 17, 3, 60, 41, 8, 22, 90, 1, 33, 2, 71, 64, 12, 9, 50, 47, 80, 6, 28, 19, 44, 70, 3]


def test_w8a8_stays_int8_and_tracks_its_float_values(copies: tuple[Path, Path]) -> None:
    """Int8 at run time, the checkpoint's bytes held; against the float copy, at every position of
    a 24-token prefill, logits within the activations' int8 rounding and the same top-1 token where
    the float model's top two are apart by more than that rounding moves them."""
    w8a8, plain = copies
    stored, info = _executor(w8a8, stored=True, k=0)
    for p in stored.model.layers:
        for key in ("attn.wq_a.weight", "attn.wo_a.weight", "shared.gate_up", "experts.gate_up", "experts.down"):
            assert isinstance(p[key], QuantizedWeight) and p[key].scheme == "w8a8_dynamic", key
            assert p[key].data.dtype == torch.int8, key
        assert p["shared.gate_up"].offset is None and p["experts.down"].offset is not None  # symmetric / not
    held, ckpt = stored.weight_bytes(), _checkpoint_bytes(w8a8)
    assert held <= 1.1 * ckpt, (held, ckpt)
    got = _prefill_logits(stored, info, SEQUENCE)
    want = _prefill_logits(*_executor(plain, stored=False, k=0), SEQUENCE)
    error = (got - want).abs().amax(dim=-1)
    assert ((got - want).norm() / want.norm()).item() < 0.06  # measured 0.043
    top2 = want.topk(2, dim=-1).values
    clear = top2[:, 0] - top2[:, 1] > 2 * error
    assert clear.sum() >= len(SEQUENCE) // 2  # measured: 17 of 24 clear; top-1 equal at 22 of 24 overall
    assert torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])


def test_w8a8_fast_paths_decode_as_the_reference(copies: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """The int8 checkpoint with MTP drafting: the CPU's int8 linears and experts (``torch._int_mm``)
    give the greedy tokens and drafts of the references (dequantise per call), logits within 1e-4."""
    import pypto_kernels
    import pypto_serving_deepseek_mtp.model as model_mod

    w8a8, _ = copies
    prompts = {"a": [5, 17, 3, 60, 41, 8, 22, 90, 1], "b": [33, 2, 71]}
    got = _generate(*_executor(w8a8, stored=True), prompts)
    monkeypatch.setattr(model_mod, "quant_linear", pypto_kernels.quant_linear.reference)
    monkeypatch.setattr(model_mod, "quant_moe_experts", pypto_kernels.quant_moe_experts.reference)
    want = _generate(*_executor(w8a8, stored=True), prompts)
    assert got[0] == want[0] and got[2] == want[2]
    assert any(any(d) for d in got[2])
    for a, b in zip(got[1], want[1], strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_w8a8_experts_match_the_per_token_int8_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(3)
    stacks, floats = [], []
    for rows, cols in ((2 * 24, 40), (40, 24)):
        w = torch.randn(5, rows, cols, generator=gen)
        parts = [_quantize(e, asymmetric=True) for e in w]
        q, scale, offset = (torch.stack([p[i] for p in parts]) for i in range(3))
        stacks.append(QuantizedWeight("w8a8_dynamic", q, scale[..., 0], (1, 1), offset[..., 0]))
        floats.append((q.float() - offset) * scale)
    x = torch.randn(7, 40, generator=gen)
    ids = torch.tensor([[0, 3], [3, 5], [0, 5], [3, 0], [5, 5], [0, 3], [3, 3]])
    weights = torch.rand(7, 2, generator=gen)

    def int8_rows(t: torch.Tensor) -> torch.Tensor:  # symmetric per-row int8 and back
        s = t.abs().amax(dim=-1, keepdim=True) / 127
        return torch.round(t / s).clamp(-127, 127) * s

    def act(h: torch.Tensor) -> torch.Tensor:
        gate, up = h.chunk(2, dim=-1)
        return int8_rows(torch.nn.functional.silu(gate) * up)

    want = looped_moe_experts(int8_rows(x), floats[0], floats[1], weights, ids, act)
    torch.testing.assert_close(qm.quant_moe_experts.reference(x, *stacks, weights, ids), want)
    monkeypatch.setattr(qm, "GATHER_EXPERTS", 2)
    torch.testing.assert_close(qm.gathered_quant_moe_experts(x, *stacks, weights, ids), want)
    assert torch.equal(stacks[0].dequantize(), floats[0])
    # The CPU's int8 path (torch._int_mm, no dequantised weight) for calls of few routes.
    assert cpu.supports_quant_moe_experts(x, *stacks, weights, ids)
    assert not cpu.supports_quant_moe_experts(x.repeat(3, 1), *stacks, weights.repeat(3, 1), ids.repeat(3, 1))
    torch.testing.assert_close(cpu.int8_moe_experts(x, *stacks, weights, ids), want)
    torch.testing.assert_close(qm.quant_moe_experts(x, *stacks, weights, ids), want)  # CPU dispatch
    assert describe_kernel("quant_moe_experts", "cpu", scheme="w8a8_dynamic", routes=14) == cpu.INT8_MOE_LABEL


def test_a_rank_reads_its_part_of_the_int8_weights(copies: tuple[Path, Path]) -> None:
    from pypto_serving.parallel import ParallelContext
    from pypto_serving_deepseek_mtp.config import load_config
    from pypto_serving_deepseek_mtp.model import FP32_SUFFIXES
    from pypto_serving_deepseek_mtp.sharding import ShardPlan
    from pypto_serving_deepseek_mtp.weights import load_weights

    w8a8, plain = copies
    plan = ShardPlan(load_config(w8a8), ParallelContext(rank=1, world_size=2))
    got = load_weights(w8a8, torch.device("cpu"), torch.float32, FP32_SUFFIXES, plan=plan, stored=True)
    want = load_weights(plain, torch.device("cpu"), torch.float32, FP32_SUFFIXES, plan=plan)
    assert got.keys() == want.keys()
    names = ["layers.1.attn.wq_b.weight", "layers.1.attn.wo_b.weight", "layers.1.ffn.experts.0.w2.weight"]
    for name in names:
        w = got[name]
        assert isinstance(w, QuantizedWeight) and w.scheme == "w8a8_dynamic" and w.shape == tuple(want[name].shape)
        torch.testing.assert_close(w.dequantize(), want[name])
    assert got["layers.1.attn.compressor.wkv.weight"].dtype == torch.float32  # described FLOAT


def _broken(src: Path, dest: Path, description: dict[str, Any] | None = None, **tensors: Any) -> Path:
    shutil.copytree(src, dest)
    t = load_file(str(dest / "model.safetensors"))
    for key, value in tensors.items():
        name = key.replace("__", ".")
        if value is None:
            t.pop(name)
        else:
            t[name] = value
    save_file(t, str(dest / "model.safetensors"))
    if description is not None:
        path = dest / "quant_model_description.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **description}))
    return dest


def test_malformed_w8a8_checkpoints_are_refused_by_name(copies: tuple[Path, Path], tmp_path: Path) -> None:
    from pypto_serving_deepseek_mtp.model import FP32_SUFFIXES
    from pypto_serving_deepseek_mtp.weights import load_weights

    w8a8, _ = copies
    wq = "model.layers.1.attn.wq_b.weight"  # the checkpoint's own name, as the description has it
    key = wq.replace(".", "__")
    scale = torch.ones(64, 1)
    cases = {
        "static": ({wq: "W8A8"}, {}, rf"{wq} is static W8A8 \(quant_model_description\.json: W8A8\)"),
        "w4a8": ({wq: "W4A8_DYNAMIC"}, {}, rf"tensor '{wq}' is quantized as 'W4A8_DYNAMIC'"),
        "no-scale": ({}, {key + "_scale": None}, rf"{wq} has no scales: expected {wq}_scale, float32 \[64, 1\]"),
        "scale-shape": ({}, {key + "_scale": scale[:32]}, rf"{wq}_scale is F32 \[32, 1\]; expected float32 \[64, 1\]"),
        "scale-dtype": ({}, {key + "_scale": scale.to(torch.int32)}, rf"{wq}_scale is I32 \[64, 1\]"),
        "not-int8": ({}, {key: torch.zeros(64, 16)}, rf"{wq} is F32; W8A8_DYNAMIC expects int8 \[out, in\]"),
        "undescribed-int8": (
            {},
            {"model__layers__1__attn__compressor__wkv__weight": torch.zeros(32, 32, dtype=torch.int8)},
            r"model\.layers\.1\.attn\.compressor\.wkv\.weight is I8 but neither config\.json nor quant_model_desc",
        ),
    }
    for case, (description, tensors, message) in cases.items():
        path = _broken(w8a8, tmp_path / case, description, **tensors)
        with pytest.raises(UnsupportedQuantizationError, match=message):
            load_weights(path, torch.device("cpu"), torch.float32, FP32_SUFFIXES, stored=True)
    both = _broken(w8a8, tmp_path / "both")
    config = json.loads((both / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [16, 16]}
    (both / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedQuantizationError, match=r"both config\.json .* and quant_model_description\.json"):
        load_weights(both, torch.device("cpu"), torch.float32, FP32_SUFFIXES)
