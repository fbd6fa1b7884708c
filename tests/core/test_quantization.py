"""FP8 block-scaled checkpoints: config validation and dequantization against an element-wise
reference, with weights quantized here the way FP8 checkpoints are made (per-block absmax / 448)."""

from __future__ import annotations

import itertools

import pytest
import torch

from pypto_serving.quantization import (
    Fp8BlockDequantizer,
    QuantizationConfig,
    UnsupportedQuantizationError,
    dequantize_fp8_blocks,
    read_quantization_config,
)

FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [4, 8]}


def quantize(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-block absmax scaling to the e4m3 range, as FP8 block checkpoints are produced."""
    rows, cols = block
    out, inp = weight.shape
    grid = (-(-out // rows), -(-inp // cols))
    scale_inv = torch.empty(grid)
    q = torch.empty(out, inp, dtype=torch.float8_e4m3fn)
    for bi, bj in itertools.product(range(grid[0]), range(grid[1])):
        tile = weight[bi * rows : (bi + 1) * rows, bj * cols : (bj + 1) * cols]
        s = tile.abs().max().clamp_min(1e-12) / 448.0
        scale_inv[bi, bj] = s
        q[bi * rows : (bi + 1) * rows, bj * cols : (bj + 1) * cols] = (tile / s).to(torch.float8_e4m3fn)
    return q, scale_inv


def test_reads_block_fp8_and_refuses_everything_else() -> None:
    assert read_quantization_config({}) is None
    assert read_quantization_config({"quantization_config": FP8_CONFIG}) == QuantizationConfig("fp8", (4, 8), "e4m3")
    for raw, named in [
        ({"quant_method": "awq", "bits": 4}, "quant_method='awq'"),
        ({"quant_method": "gptq"}, "quant_method='gptq'"),
        ({"quant_method": "fp8"}, "weight_block_size=None"),
        ({**FP8_CONFIG, "fmt": "e3m4"}, "fmt='e3m4'"),
        ({**FP8_CONFIG, "weight_block_size": [128]}, "weight_block_size=[128]"),
    ]:
        with pytest.raises(UnsupportedQuantizationError, match=named.replace("[", r"\[").replace("]", r"\]")):
            read_quantization_config({"quantization_config": raw})


@pytest.mark.parametrize("shape", [(8, 16), (10, 21), (3, 5)])  # whole blocks, ragged edges, one partial block
def test_dequantize_matches_the_elementwise_definition(shape: tuple[int, int]) -> None:
    torch.manual_seed(0)
    w = torch.randn(shape) * 3
    q, s = quantize(w, (4, 8))
    got = dequantize_fp8_blocks(q, s, (4, 8))
    for i, j in itertools.product(range(shape[0]), range(shape[1])):
        assert got[i, j].item() == (q[i, j].float() * s[i // 4, j // 8]).item()  # one float32 product
    # And it is the original weight within e4m3's 3 mantissa bits (relative step 2**-3).
    assert torch.allclose(got, w, rtol=2**-3, atol=1e-6)


def test_dequantize_refuses_a_scale_grid_of_the_wrong_shape() -> None:
    q, s = quantize(torch.randn(8, 16), (4, 8))
    with pytest.raises(UnsupportedQuantizationError, match=r"needs scales of shape \[2, 2\].*got \[2, 1\]"):
        dequantize_fp8_blocks(q, s[:, :1], (4, 8))


def test_pairs_weights_and_scales_in_any_order() -> None:
    torch.manual_seed(1)
    w1, w2, bias = torch.randn(8, 16), torch.randn(4, 8), torch.randn(8)
    (q1, s1), (q2, s2) = quantize(w1, (4, 8)), quantize(w2, (4, 8))
    d = Fp8BlockDequantizer(QuantizationConfig("fp8", (4, 8)))
    ready: dict[str, torch.Tensor] = {}
    stream = [
        ("a.weight_scale_inv", s1),
        ("b.weight", q2),
        ("a.bias", bias),
        ("a.weight", q1),
        ("b.weight_scale_inv", s2),
    ]
    for name, t in stream:
        ready.update(d.feed(name, t))
    d.finish()
    assert sorted(ready) == ["a.bias", "a.weight", "b.weight"]
    assert torch.equal(ready["a.bias"], bias)
    assert torch.equal(ready["a.weight"], dequantize_fp8_blocks(q1, s1, (4, 8)))
    assert torch.equal(ready["b.weight"], dequantize_fp8_blocks(q2, s2, (4, 8)))


def test_an_unpaired_weight_or_scale_is_an_error() -> None:
    q, s = quantize(torch.randn(4, 8), (4, 8))
    lonely = Fp8BlockDequantizer(QuantizationConfig("fp8", (4, 8)))
    lonely.feed("a.weight", q)
    with pytest.raises(UnsupportedQuantizationError, match=r"without _scale_inv scales: a\.weight"):
        lonely.finish()
    orphan = Fp8BlockDequantizer(QuantizationConfig("fp8", (4, 8)))
    orphan.feed("a.weight_scale_inv", s)
    with pytest.raises(UnsupportedQuantizationError, match="scales without their fp8 weight"):
        orphan.finish()
