"""DeepSeek-V4 checkpoints served in their stored precision: FP8 (UE8M0 block scales) projections
stay FP8 and run through ``quant_linear``; routed experts stay as stored (MXFP4 packed, or block
FP8 with their scales) and ``quant_moe_experts`` dequantises only the experts a step routes to.

- The expert kernel (reference and the gathered, host-read-free fast path) against this test's
  independent MXFP4 and FP8 decoders (test_release_layout's quantiser, written from the published
  format).
- A checkpoint whose routed experts are block FP8 (``expert_dtype = "fp8"``) keeps them FP8 and
  decodes as when they are dequantised at load.
- The same release-layout checkpoint loaded as stored and dequantised at load gives the same greedy
  tokens and MTP drafts, and logits within float32 rounding; with FP8 blocks that the grouped
  ``wo_a`` meets whole (kept FP8) and blocks it cuts (dequantised with a warning).
- A tensor-parallel rank keeps the parts made of whole blocks and dequantises (with a warning) the
  parts that cut through one.
- ``tiny-deepseek-v4-fp8`` holds about its checkpoint's bytes (<= 1.1x) as stored, where the
  dequantising load holds several times more, with the same greedy tokens and drafts.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

import pypto_kernels.mxfp4 as mx
import pypto_kernels.quant_moe as qm
from pypto_kernels.moe import looped_moe_experts
from pypto_serving.quantization import QuantizedWeight

from .helpers import Checkpoint, FakeCore, greedy_generate
from .test_release_layout import _fp4_decode, _fp4_encode, _fp8_decode, _fp8_encode

ATOL = 1e-4


# ----------------------------------------------------------------------------- the expert kernel


def _experts(n: int, rows: int, cols: int, gen: torch.Generator) -> tuple[QuantizedWeight, torch.Tensor]:
    """``n`` random ``[rows, cols]`` experts as MXFP4 (stacked) and the floats they stand for."""
    packed, scales, exact = [], [], []
    for _ in range(n):
        w = torch.randn(rows, cols, generator=gen) * torch.logspace(-2, 0.5, cols)
        q, s = _fp4_encode(w)
        packed.append(q)
        scales.append(s)
        exact.append(_fp4_decode(q, s))
    return QuantizedWeight("mxfp4", torch.stack(packed), torch.stack(scales), (1, 32)), torch.stack(exact)


@pytest.fixture(scope="module")
def experts() -> tuple[QuantizedWeight, torch.Tensor, QuantizedWeight, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    gate_up, gate_up_f = _experts(5, 2 * 48, 64, gen)  # two whole groups a row
    down, down_f = _experts(5, 64, 48, gen)  # a group and a half: a ragged last group
    return gate_up, gate_up_f, down, down_f


def test_mxfp4_stacks_decode_as_the_published_format(experts: Any) -> None:
    gate_up, gate_up_f, down, down_f = experts
    assert torch.equal(mx.dequantize_mxfp4(gate_up.data, gate_up.scale), gate_up_f)
    assert torch.equal(mx.dequantize_mxfp4(down.data, down.scale), down_f)
    assert torch.equal(gate_up.dequantize(), gate_up_f)  # QuantizedWeight's own reference
    # Every byte under every finite exponent: bfloat16 (computed in bfloat16) is exact too.
    every = torch.arange(256, dtype=torch.uint8).view(torch.int8).expand(255, 256)
    exps = torch.arange(255, dtype=torch.uint8).view(torch.float8_e8m0fnu)[:, None].expand(255, 16)
    want = _fp4_decode(every, exps)
    assert torch.equal(mx.dequantize_mxfp4(every, exps), want)
    assert torch.equal(mx.dequantize_mxfp4(every, exps, torch.bfloat16).float(), want)
    nan = torch.full((1, 1), 255, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    assert mx.dequantize_mxfp4(torch.ones(1, 16, dtype=torch.int8), nan).isnan().all()


def _float32_sums(want: torch.Tensor) -> dict[str, float]:
    """assert_close's tolerances for float32 sums of the same products in another order (the CPU's
    native expert products against MKL's): the decoded experts' outputs reach the thousands, where an
    ulp is 2**-13, so the absolute tolerance follows the largest output."""
    return {"rtol": 1e-5, "atol": 1e-6 * float(want.abs().max())}


@pytest.mark.parametrize("chunk", [32, 2], ids=["one-chunk", "chunked"])
def test_mxfp4_experts_match_the_float_experts(experts: Any, chunk: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Reference and gathered path against the float MoE over the independently decoded experts,
    with dropped routes (id E, expert parallel) and experts no token picks."""
    gate_up, gate_up_f, down, down_f = experts
    monkeypatch.setattr(qm, "GATHER_EXPERTS", chunk)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(7, 64, generator=gen)
    ids = torch.tensor([[0, 3], [3, 5], [0, 5], [3, 0], [5, 5], [0, 3], [3, 3]])  # 5 = dropped; 1, 2, 4 idle
    weights = torch.rand(7, 2, generator=gen)
    want = looped_moe_experts(x, gate_up_f, down_f, weights, ids)
    close = _float32_sums(want)
    torch.testing.assert_close(qm.quant_moe_experts.reference(x, gate_up, down, weights, ids), want, **close)
    torch.testing.assert_close(qm.gathered_quant_moe_experts(x, gate_up, down, weights, ids), want, **close)
    torch.testing.assert_close(qm.quant_moe_experts(x, gate_up, down, weights, ids), want, **close)  # CPU dispatch
    for impl in (qm.quant_moe_experts.reference, qm.gathered_quant_moe_experts):
        assert impl(x[:0], gate_up, down, weights[:0], ids[:0]).shape == (0, 64)


def test_only_the_routed_experts_are_dequantised(experts: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    gate_up, _, down, _ = experts
    seen: list[int] = []
    decode = mx.dequantize_mxfp4

    def spy(data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        seen.append(data.shape[0] if data.dim() == 3 else 1)
        return decode(data, scale, dtype)

    monkeypatch.setattr(qm, "dequantize_mxfp4", spy)
    x, weights, ids = torch.randn(1, 64), torch.ones(1, 2), torch.tensor([[4, 1]])
    qm.quant_moe_experts.reference(x, gate_up, down, weights, ids)
    assert seen == [1, 1, 1, 1]  # experts 1 and 4: gate/up and down each
    seen.clear()
    qm.gathered_quant_moe_experts(x, gate_up, down, weights, ids)
    assert seen == [2, 2]  # the two routed experts of five, gathered once per stack


def _fp8_experts(
    n: int, rows: int, cols: int, block: tuple[int, int], gen: torch.Generator
) -> tuple[QuantizedWeight, torch.Tensor]:
    """``n`` random ``[rows, cols]`` experts as block FP8 (stacked, float32 scales) and their values."""
    data, scales, exact = [], [], []
    for _ in range(n):
        q, s = _fp8_encode(torch.randn(rows, cols, generator=gen) * torch.logspace(-2, 0.5, cols), block)
        data.append(q)
        scales.append(s.view(torch.uint8).double().sub(127).exp2().float())
        exact.append(_fp8_decode(q, s, block))
    return QuantizedWeight("fp8_block", torch.stack(data), torch.stack(scales), block), torch.stack(exact)


@pytest.mark.parametrize("block", [(16, 16), (16, 24)], ids=["whole-blocks", "ragged-blocks"])
def test_fp8_experts_match_the_float_experts(block: tuple[int, int], monkeypatch: pytest.MonkeyPatch) -> None:
    """Block-FP8 expert stacks (whole and ragged 16x24 blocks) through the reference and the gathered
    path against the float MoE over the independently decoded experts; a stack holds its bytes."""
    gen = torch.Generator().manual_seed(2)
    gate_up, gate_up_f = _fp8_experts(5, 2 * 48, 64, block, gen)
    down, down_f = _fp8_experts(5, 64, 48, block, gen)
    assert torch.equal(gate_up.dequantize(), gate_up_f)
    assert torch.equal(qm.dequantize_experts(down, 3, torch.float32), down_f[3])
    x = torch.randn(7, 64, generator=gen)
    ids = torch.tensor([[0, 3], [3, 5], [0, 5], [3, 0], [5, 5], [0, 3], [3, 3]])
    weights = torch.rand(7, 2, generator=gen)
    want = looped_moe_experts(x, gate_up_f, down_f, weights, ids)
    close = _float32_sums(want)
    torch.testing.assert_close(qm.quant_moe_experts.reference(x, gate_up, down, weights, ids), want, **close)
    monkeypatch.setattr(qm, "GATHER_EXPERTS", 1)
    torch.testing.assert_close(qm.gathered_quant_moe_experts(x, gate_up, down, weights, ids), want, **close)


# ----------------------------------------------------------------------------- the executor


def _executor(path: Path, *, stored: bool, k: int = 2, dtype: str = "float32") -> tuple[Any, Any]:
    from pypto_serving.config import ServingSettings
    from pypto_serving_deepseek_mtp import DeepseekMTPExecutor

    spec = {"method": "mtp", "num_speculative_tokens": k} if k else None
    settings = ServingSettings(
        model=str(path), dtype=dtype, device="cpu", block_size=4, speculative_config=spec, max_num_seqs=4
    )
    ex = DeepseekMTPExecutor(settings)
    ex.stored_precision = stored
    return ex, ex.load()


def _generate(ex: Any, info: Any, prompts: dict[str, list[int]], k: int = 2) -> tuple[Any, list[Any], list[Any]]:
    core = FakeCore(ex, info)
    logits: list[torch.Tensor] = []
    drafts: list[Any] = []
    execute = ex.execute

    def recording(batch: Any) -> Any:
        out = execute(batch)
        logits.append(out.float().clone())
        return out

    ex.execute = recording
    tokens = greedy_generate(core, prompts, 10, k=k, on_step=lambda _b, _h, new: drafts.append(new))
    return tokens, logits, drafts


def _schemes(ex: Any) -> dict[str, str]:
    """Each stored-precision parameter of the first compressed layer and the first MTP layer: its scheme."""
    out = {}
    for prefix, p in (("layers.1.", ex.model.layers[1]), ("mtp.0.", ex.mtp_layers[0])):
        out.update({prefix + k: v.scheme for k, v in p.items() if isinstance(v, QuantizedWeight)})
    return out


@pytest.fixture(scope="module")
def release(checkpoints: dict[str, Checkpoint], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``mixed_yarn`` (two MTP depths) in the release layout with two FP8 block shapes: 8x16 blocks
    that ``wo_a``'s 8-row output groups meet whole, 16x24 blocks that they cut."""
    from pypto_serving_deepseek_mtp.release import write_release_layout

    out = {}
    for block in ((8, 16), (16, 24)):
        dest = tmp_path_factory.mktemp(f"release{block[0]}x{block[1]}")
        write_release_layout(checkpoints["mixed_yarn"].path, dest, block)
        out[f"{block[0]}x{block[1]}"] = dest
    # DeepSeek-V3 style: the routed experts block FP8 too, in blocks that w1's rows do not fill.
    dest = tmp_path_factory.mktemp("release-fp8-experts")
    write_release_layout(checkpoints["mixed_yarn"].path, dest, (24, 16), expert_dtype="fp8")
    out["fp8-experts"] = dest
    return out


@pytest.mark.parametrize("block", ["8x16", "16x24"])
def test_stored_precision_decodes_as_dequantized_at_load(
    release: dict[str, Path], block: str, caplog: pytest.LogCaptureFixture
) -> None:
    prompts = {"a": [5, 17, 3, 60, 41, 8, 22, 90, 1], "b": [33, 2, 71]}
    with caplog.at_level(logging.WARNING):
        stored, info = _executor(release[block], stored=True)
    schemes = _schemes(stored)
    for name in ("attn.wq_a.weight", "attn.wq_b.weight", "attn.wkv.weight", "attn.wo_b.weight", "shared.gate_up"):
        assert schemes[f"layers.1.{name}"] == "fp8_block" and schemes[f"mtp.0.{name}"] == "fp8_block", name
    assert schemes["layers.1.attn.indexer.wq_b.weight"] == "fp8_block" and schemes["mtp.0.e_proj.weight"] == "fp8_block"
    assert schemes["layers.1.experts.gate_up"] == schemes["layers.1.experts.down"] == "mxfp4"
    assert schemes["mtp.0.experts.down"] == "mxfp4"
    cut = block == "16x24"  # 8-row output groups of 16-row blocks: wo_a is dequantized, with a warning
    assert ("layers.1.attn.wo_a.weight" not in schemes) == cut
    assert any("attn.wo_a.weight: dequantized at load" in r.getMessage() for r in caplog.records) == cut
    got = _generate(stored, info, prompts)
    want = _generate(*_executor(release[block], stored=False), prompts)
    assert got[0] == want[0] and got[2] == want[2]
    assert any(any(d) for d in got[2])
    for a, b in zip(got[1], want[1], strict=True):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=ATOL)


def test_fp8_routed_experts_stay_fp8_and_decode_as_dequantized_at_load(release: dict[str, Path]) -> None:
    """``expert_dtype = "fp8"``: each layer's routed experts are one FP8 stack per projection (w1's
    rows end inside a 24-row block, so every row carries its blocks' scales), never floats; greedy
    tokens and drafts equal those of the same checkpoint dequantised at load, logits within 1e-4."""
    prompts = {"a": [5, 17, 3, 60, 41, 8, 22, 90, 1], "b": [33, 2, 71]}
    stored, info = _executor(release["fp8-experts"], stored=True)
    for p in [*stored.model.layers, *stored.mtp_layers]:
        gate_up, down = p["experts.gate_up"], p["experts.down"]
        assert isinstance(gate_up, QuantizedWeight) and isinstance(down, QuantizedWeight)
        assert (gate_up.scheme, gate_up.data.dtype, down.scheme) == ("fp8_block", torch.float8_e4m3fn, "fp8_block")
        assert gate_up.block == (1, 16) and down.block == (24, 16) and gate_up.scale.shape[1] == gate_up.data.shape[1]
    got = _generate(stored, info, prompts)
    want = _generate(*_executor(release["fp8-experts"], stored=False), prompts)
    assert got[0] == want[0] and got[2] == want[2]
    for a, b in zip(got[1], want[1], strict=True):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=ATOL)


def test_a_rank_keeps_whole_blocks_and_dequantizes_cut_ones(
    release: dict[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    from pypto_serving.parallel import ParallelContext
    from pypto_serving_deepseek_mtp.config import load_config
    from pypto_serving_deepseek_mtp.model import FP32_SUFFIXES
    from pypto_serving_deepseek_mtp.sharding import ShardPlan
    from pypto_serving_deepseek_mtp.weights import load_weights

    path = release["16x24"]
    plan = ShardPlan(load_config(path), ParallelContext(rank=1, world_size=2))
    with caplog.at_level(logging.WARNING):
        got = load_weights(path, torch.device("cpu"), torch.float32, FP32_SUFFIXES, plan=plan, stored=True)
    want = load_weights(path, torch.device("cpu"), torch.float32, FP32_SUFFIXES, plan=plan)
    # wq_b: this rank's 32 of 64 rows are two whole 16-row blocks; wo_a: 8 of 16 rows cut a block;
    # w2: 8 of 16 columns cut a 32-value MXFP4 group; w1: whole rows of its groups.
    kept = {"layers.1.attn.wq_b.weight": "fp8_block", "layers.1.ffn.experts.0.w1.weight": "mxfp4"}
    for name, scheme in kept.items():
        assert isinstance(got[name], QuantizedWeight) and got[name].scheme == scheme
        assert torch.equal(got[name].dequantize(), want[name])
    for name in ("layers.1.attn.wo_a.weight", "layers.1.ffn.experts.0.w2.weight"):
        assert isinstance(got[name], torch.Tensor) and torch.equal(got[name], want[name])
    assert any("dequantized at load" in r.getMessage() and "cuts through" in r.getMessage() for r in caplog.records)


def _checkpoint_bytes(path: Path) -> int:
    total = 0
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
            sl = f.get_slice(key)
            shape = sl.get_shape()
            n = 1
            for d in shape:
                n *= d
            total += n * {"F8_E4M3": 1, "F8_E8M0": 1, "I8": 1, "BF16": 2, "F32": 4, "I64": 8}[sl.get_dtype()]
    return total


def test_tiny_fp8_holds_its_checkpoint_bytes(tmp_path: Path) -> None:
    """``tiny-deepseek-v4-fp8`` at its own dtype (bfloat16), MTP on: the weights held are at most
    1.1x the checkpoint's bytes stored, about 1.5x them dequantized, with the same greedy tokens."""
    from pypto_serving_deepseek_mtp.plugin import write_tiny_fp8

    path = write_tiny_fp8(tmp_path / "tiny-deepseek-v4-fp8")
    ckpt = _checkpoint_bytes(path)
    stored, info = _executor(path, stored=True, dtype="bfloat16")
    dequantized, info_d = _executor(path, stored=False, dtype="bfloat16")
    assert stored.dtype == torch.bfloat16
    assert stored.weight_bytes() <= 1.1 * ckpt, (stored.weight_bytes(), ckpt)
    # bfloat16 embedding and head are most of this small model; its FP8 and MXFP4 weights alone
    # take 2x (FP8) and 3.8x (MXFP4) their bytes once dequantized into bfloat16.
    assert dequantized.weight_bytes() > 1.4 * ckpt, (dequantized.weight_bytes(), ckpt)
    prompts = {"a": [12, 400, 33, 7, 1500, 9, 64], "b": [3, 2000, 81]}
    got, want = _generate(stored, info, prompts), _generate(dequantized, info_d, prompts)
    assert got[0] == want[0] and got[2] == want[2]


def test_fp8_experts_hold_their_checkpoint_bytes(tmp_path: Path) -> None:
    """The embedded model with block-FP8 routed experts (128x128 UE8M0 blocks, DeepSeek-V3 style):
    the experts stay FP8 and the weights held are at most 1.1x the checkpoint's bytes."""
    from pypto_serving_deepseek_mtp.plugin import TINY_DEEPSEEK_V4
    from pypto_serving_deepseek_mtp.release import write_release_layout

    write_release_layout(TINY_DEEPSEEK_V4, tmp_path, expert_dtype="fp8")
    stored, _ = _executor(tmp_path, stored=True, k=0, dtype="bfloat16")
    assert {p["experts.down"].scheme for p in stored.model.layers} == {"fp8_block"}
    held, ckpt = stored.weight_bytes(), _checkpoint_bytes(tmp_path)
    assert held <= 1.1 * ckpt, (held, ckpt)
