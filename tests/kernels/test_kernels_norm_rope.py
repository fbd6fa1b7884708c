"""rms_norm, RoPE and silu_and_mul against transformers' own implementations."""

from __future__ import annotations

import pytest
import torch

from pypto_kernels import RopeTable, add_rms_norm, apply_rope, rms_norm, rope_cos_sin, rope_inv_freq, silu_and_mul

transformers = pytest.importorskip("transformers")
from transformers import Qwen2Config  # noqa: E402
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402
from transformers.models.qwen2.modeling_qwen2 import (  # noqa: E402
    Qwen2RMSNorm,
    Qwen2RotaryEmbedding,
    apply_rotary_pos_emb,
)
from transformers.models.qwen3_next.modeling_qwen3_next import (  # noqa: E402
    apply_rotary_pos_emb as partial_apply_rotary_pos_emb,
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_qwen2(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    hf = Qwen2RMSNorm(64, eps=1e-6)
    with torch.no_grad():
        hf.weight.copy_(torch.randn(64, generator=gen))
    hf = hf.to(dtype)
    x = (torch.randn(9, 64, generator=gen) * 3).to(dtype)
    with torch.no_grad():
        expected = hf(x)
    # The reference is HF's ops in HF's order; the CPU's native pass sums the squares in its own order.
    out = rms_norm.reference(x, hf.weight.detach(), 1e-6)  # type: ignore[attr-defined]
    assert out.dtype == expected.dtype
    assert torch.equal(out, expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    x, res = torch.randn(2, 5, 32, generator=gen).to(dtype), torch.randn(2, 5, 32, generator=gen).to(dtype)
    w = torch.randn(32, generator=gen).to(dtype)
    normed, new_res = add_rms_norm(x, res, w, 1e-5)
    assert torch.equal(new_res, res + x)
    assert torch.equal(normed, rms_norm(res + x, w, 1e-5))


def _qwen2_config(head_dim_total: int, rope_parameters: dict, max_pos: int = 4096) -> Qwen2Config:
    return Qwen2Config(
        hidden_size=head_dim_total * 4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_pos,
        rope_parameters=dict(rope_parameters),
    )


def test_rope_inv_freq_default_matches_qwen2() -> None:
    cfg = _qwen2_config(128, {"rope_type": "default", "rope_theta": 1000000.0})
    expected, scaling = Qwen2RotaryEmbedding.compute_default_rope_parameters(cfg)
    inv_freq, attention_scaling = rope_inv_freq(128, 1000000.0, None, 4096)
    assert inv_freq.dtype == torch.float32 and inv_freq.shape == (64,)
    assert torch.equal(inv_freq, expected) and attention_scaling == scaling == 1.0
    same, _ = rope_inv_freq(128, 1000000.0, {"rope_type": "default"}, 4096)
    assert torch.equal(same, expected)


def test_rope_inv_freq_linear_matches_hf() -> None:
    params = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.5}
    expected, scaling = ROPE_INIT_FUNCTIONS["linear"](_qwen2_config(64, params))
    inv_freq, attention_scaling = rope_inv_freq(64, 10000.0, {"type": "linear", "factor": 2.5}, 4096)
    assert torch.equal(inv_freq, expected) and attention_scaling == scaling


YARN_CASES = [
    {"factor": 4.0, "original_max_position_embeddings": 32768},
    {"factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 1.0, "mscale_all_dim": 1.0},
    {"factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 0.707, "mscale_all_dim": 1.0},
    {
        "factor": 8.0,
        "original_max_position_embeddings": 2048,
        "beta_fast": 16,
        "beta_slow": 2,
        "truncate": False,
    },
    {"factor": 2.0, "original_max_position_embeddings": 4096, "attention_factor": 1.3},
    {"factor": None, "original_max_position_embeddings": 1024},
]


@pytest.mark.parametrize("params", YARN_CASES)
@pytest.mark.parametrize("partial", [1.0, 0.5])
def test_rope_inv_freq_yarn_matches_hf(params: dict, partial: float) -> None:
    max_pos = 131072
    hf_params = {"rope_type": "yarn", "rope_theta": 1000000.0, **params}
    if partial != 1.0:
        hf_params["partial_rotary_factor"] = partial
    expected, expected_scaling = ROPE_INIT_FUNCTIONS["yarn"](_qwen2_config(128, hf_params, max_pos))
    inv_freq, scaling = rope_inv_freq(int(128 * partial), 1000000.0, {"rope_type": "yarn", **params}, max_pos)
    torch.testing.assert_close(inv_freq, expected, atol=1e-6, rtol=1e-6)
    assert torch.equal(inv_freq, expected)
    assert scaling == pytest.approx(expected_scaling, rel=1e-12)


def test_rope_inv_freq_rejects_unsupported() -> None:
    with pytest.raises(NotImplementedError, match="dynamic"):
        rope_inv_freq(64, 10000.0, {"rope_type": "dynamic", "factor": 2.0}, 4096)
    with pytest.raises(ValueError, match=r"'llama3'.*default, linear, yarn"):
        rope_inv_freq(64, 10000.0, {"rope_type": "llama3", "factor": 8.0}, 4096)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rope", [{"rope_type": "default"}, {"rope_type": "yarn", "factor": 4.0}])
def test_rope_cos_sin_and_apply_match_qwen2(dtype: torch.dtype, rope: dict) -> None:
    params = {"rope_theta": 10000.0, **rope}
    if rope["rope_type"] == "yarn":
        params["original_max_position_embeddings"] = 1024
    cfg = _qwen2_config(64, params)
    hf_rope = Qwen2RotaryEmbedding(cfg)
    gen = torch.Generator().manual_seed(2)
    positions = torch.tensor([0, 1, 2, 7, 100, 4000, 3, 5])
    q = torch.randn(8, 4, 64, generator=gen).to(dtype)
    k = torch.randn(8, 2, 64, generator=gen).to(dtype)
    hf_cos, hf_sin = hf_rope(q, positions[None])  # [1, T, D]

    inv_freq, scaling = rope_inv_freq(64, 10000.0, params, 4096)
    cos, sin = rope_cos_sin(positions, inv_freq, scaling, dtype)
    assert torch.equal(cos, hf_cos[0]) and torch.equal(sin, hf_sin[0])

    hf_q, hf_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], hf_cos, hf_sin)
    out_q, out_k = apply_rope(q, k, cos, sin)
    assert out_q.dtype == dtype
    assert torch.equal(out_q, hf_q[0].transpose(0, 1)) and torch.equal(out_k, hf_k[0].transpose(0, 1))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("rotary", "rope"), [(64, None), (128, {"rope_type": "yarn", "factor": 4.0}), (48, None)])
def test_rope_table_rows_are_rope_cos_sin_bitwise(dtype: torch.dtype, rotary: int, rope: dict | None) -> None:
    """The table's gathered rows equal :func:`rope_cos_sin` of the same positions bit for bit, for
    steps of any size, before and after the table grows past its first bound."""
    params = None if rope is None else {**rope, "original_max_position_embeddings": 1024}
    inv_freq, scaling = rope_inv_freq(rotary, 1000000.0, params, 8192)
    table = RopeTable(inv_freq, scaling, dtype)
    gen = torch.Generator().manual_seed(4)
    for bound in (5, 300, 5000):
        for t in (1, 7, 64, 700):
            positions = torch.randint(0, bound, (t,), generator=gen)
            cos, sin = table.lookup(positions, bound)
            want_cos, want_sin = rope_cos_sin(positions, inv_freq, scaling, dtype)
            assert cos.dtype == dtype and torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
        assert bound <= table.rows < 2 * max(bound, RopeTable.CHUNK)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_rope_partial_rotary(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    positions = torch.arange(6) * 3
    inv_freq, scaling = rope_inv_freq(16, 10000.0, None, 4096)  # rotate 16 of 64 dims
    cos, sin = rope_cos_sin(positions, inv_freq, scaling, dtype)
    q = torch.randn(6, 4, 64, generator=gen).to(dtype)
    k = torch.randn(6, 2, 64, generator=gen).to(dtype)
    hf_q, hf_k = partial_apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos[None], sin[None])
    out_q, out_k = apply_rope(q, k, cos, sin)
    assert torch.equal(out_q, hf_q[0].transpose(0, 1)) and torch.equal(out_k, hf_k[0].transpose(0, 1))
    assert torch.equal(out_q[..., 16:], q[..., 16:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul(dtype: torch.dtype) -> None:
    x = torch.randn(3, 5, 20, generator=torch.Generator().manual_seed(4)).to(dtype)
    gate, up = x.chunk(2, dim=-1)
    assert torch.equal(silu_and_mul.reference(x), torch.nn.functional.silu(gate) * up)  # type: ignore[attr-defined]
    # The CPU's native pass: another exponential (test_kernels_native_norm_rope.py bounds it).
    torch.testing.assert_close(silu_and_mul(x), torch.nn.functional.silu(gate) * up)
    with pytest.raises(ValueError, match="even"):
        silu_and_mul(torch.zeros(2, 3))
