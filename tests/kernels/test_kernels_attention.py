"""paged_attention / varlen_attention / write_kv_cache against naive per-request, per-token loops."""

from __future__ import annotations

import pytest
import torch

from pypto_kernels import paged_attention, varlen_attention, write_kv_cache

# (q_len, seq_len): plain prefill, chunk over a 9-token cached prefix, two decodes, an idle request.
MIXED_BATCH = [(7, 7), (5, 14), (1, 20), (1, 3), (0, 6)]


def naive_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    first_pos: int,
    scale: float,
    causal: bool,
    window: int | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """One request, token by token: q [Q, Hq, D] at positions first_pos.., k/v [L, Hkv, D]."""
    group = q.shape[1] // k.shape[1]
    kf = k.float().repeat_interleave(group, dim=1)
    vf = v.float().repeat_interleave(group, dim=1)
    out = torch.empty(q.shape[0], q.shape[1], v.shape[-1])
    for i in range(q.shape[0]):
        p = first_pos + i
        scores = torch.einsum("hd,lhd->hl", q[i].float(), kf) * scale
        j = torch.arange(k.shape[0])
        allowed = torch.ones_like(j, dtype=torch.bool)
        if causal:
            allowed &= j <= p
        if window is not None:
            allowed &= j > p - window
        scores[:, ~allowed] = float("-inf")
        if sinks is not None:
            scores = torch.cat((scores, sinks.float()[:, None]), dim=-1)
        probs = torch.softmax(scores, dim=-1)[:, : k.shape[0]]
        out[i] = torch.einsum("hl,lhd->hd", probs, vf)
    return out


def build_paged_batch(
    batch: list[tuple[int, int]],
    block_size: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    v_dim: int,
    dtype: torch.dtype,
    gen: torch.Generator,
) -> dict[str, torch.Tensor]:
    """Random per-request K/V written through write_kv_cache into a NaN-filled cache with shuffled blocks."""
    max_blocks = max(-(-seq // block_size) for _, seq in batch) + 1
    num_blocks = len(batch) * max_blocks + 3
    perm = torch.randperm(num_blocks, generator=gen)
    key_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    value_cache = torch.full((num_blocks, block_size, num_kv_heads, v_dim), float("nan"), dtype=dtype)
    block_tables = torch.full((len(batch), max_blocks), -1, dtype=torch.int32)
    keys, values, queries, q_lens = [], [], [], []
    used = 0
    for r, (q_len, seq) in enumerate(batch):
        n = -(-seq // block_size)
        block_tables[r, :n] = perm[used : used + n].to(torch.int32)
        used += n
        k = torch.randn(seq, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(seq, num_kv_heads, v_dim, generator=gen).to(dtype)
        pos = torch.arange(seq)
        slots = block_tables[r].long()[pos // block_size] * block_size + pos % block_size
        write_kv_cache(k, v, key_cache, value_cache, slots)
        keys.append(k)
        values.append(v)
        queries.append(torch.randn(q_len, num_q_heads, head_dim, generator=gen).to(dtype))
        q_lens.append(q_len)
    query_start_loc = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return {
        "query": torch.cat(queries),
        "key_cache": key_cache,
        "value_cache": value_cache,
        "block_tables": block_tables,
        "query_start_loc": query_start_loc,
        "seq_lens": torch.tensor([seq for _, seq in batch], dtype=torch.int32),
        "keys": keys,  # type: ignore[dict-item]
        "values": values,  # type: ignore[dict-item]
    }


def expected_paged(data: dict, scale: float, window: int | None, sinks: torch.Tensor | None) -> torch.Tensor:
    outs = []
    qsl = data["query_start_loc"].tolist()
    for r, seq in enumerate(data["seq_lens"].tolist()):
        q = data["query"][qsl[r] : qsl[r + 1]]
        outs.append(
            naive_attention(q, data["keys"][r], data["values"][r], seq - q.shape[0], scale, True, window, sinks)
        )
    return torch.cat(outs)


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize(("num_q_heads", "num_kv_heads"), [(4, 4), (8, 2)])
@pytest.mark.parametrize("window", [None, 4])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_paged_attention_mixed_batch_float32(
    block_size: int, num_q_heads: int, num_kv_heads: int, window: int | None, with_sinks: bool
) -> None:
    gen = torch.Generator().manual_seed(block_size * 100 + num_q_heads + (window or 0) + with_sinks)
    data = build_paged_batch(MIXED_BATCH, block_size, num_q_heads, num_kv_heads, 32, 32, torch.float32, gen)
    sinks = torch.randn(num_q_heads, generator=gen) if with_sinks else None
    scale = 32**-0.5
    out = paged_attention(
        data["query"],
        data["key_cache"],
        data["value_cache"],
        data["block_tables"],
        data["query_start_loc"],
        data["seq_lens"],
        scale,
        sliding_window=window,
        sinks=sinks,
    )
    expected = expected_paged(data, scale, window, sinks)
    assert out.shape == (sum(q for q, _ in MIXED_BATCH), num_q_heads, 32)
    assert out.dtype == torch.float32
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_paged_attention_bf16_and_value_dim() -> None:
    gen = torch.Generator().manual_seed(7)
    data = build_paged_batch(MIXED_BATCH, 16, 8, 2, 32, 24, torch.bfloat16, gen)
    sinks = torch.randn(8, generator=gen)
    out = paged_attention(
        data["query"],
        data["key_cache"],
        data["value_cache"],
        data["block_tables"],
        data["query_start_loc"],
        data["seq_lens"],
        0.2,
        sliding_window=6,
        sinks=sinks,
    )
    assert out.dtype == torch.bfloat16 and out.shape[-1] == 24
    torch.testing.assert_close(out.float(), expected_paged(data, 0.2, 6, sinks), atol=2e-2, rtol=2e-2)


def test_paged_attention_decode_only_int64_tables() -> None:
    gen = torch.Generator().manual_seed(3)
    data = build_paged_batch([(1, 1), (1, 33), (1, 16)], 16, 4, 1, 8, 8, torch.float32, gen)
    out = paged_attention(
        data["query"],
        data["key_cache"],
        data["value_cache"],
        data["block_tables"].long(),
        data["query_start_loc"].long(),
        data["seq_lens"].long(),
        0.5,
    )
    torch.testing.assert_close(out, expected_paged(data, 0.5, None, None), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("window", [None, 3])
def test_varlen_attention(causal: bool, window: int | None) -> None:
    gen = torch.Generator().manual_seed(11)
    lens = [5, 1, 9]
    qsl = torch.tensor([0, 5, 6, 15])
    q = torch.randn(15, 6, 16, generator=gen)
    k = torch.randn(15, 2, 16, generator=gen)
    v = torch.randn(15, 2, 16, generator=gen)
    sinks = torch.randn(6, generator=gen)
    if window is not None and not causal:
        with pytest.raises(ValueError, match="causal"):
            varlen_attention(q, k, v, qsl, 0.25, causal=causal, sliding_window=window)
        return
    out = varlen_attention(q, k, v, qsl, 0.25, causal=causal, sliding_window=window, sinks=sinks)
    expected = torch.cat(
        [
            naive_attention(q[s : s + n], k[s : s + n], v[s : s + n], 0, 0.25, causal, window, sinks)
            for s, n in zip(qsl[:-1].tolist(), lens)
        ]
    )
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_varlen_matches_torch_sdpa() -> None:
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(12, 4, 16, generator=gen)
    k = torch.randn(12, 4, 16, generator=gen)
    v = torch.randn(12, 4, 16, generator=gen)
    qsl = torch.tensor([0, 4, 12])
    out = varlen_attention(q, k, v, qsl, 16**-0.5)
    for s, e in ((0, 4), (4, 12)):
        ref = torch.nn.functional.scaled_dot_product_attention(
            q[s:e].transpose(0, 1), k[s:e].transpose(0, 1), v[s:e].transpose(0, 1), is_causal=True
        ).transpose(0, 1)
        torch.testing.assert_close(out[s:e], ref, atol=1e-5, rtol=1e-5)


def test_write_kv_cache_round_trip_skips_padding() -> None:
    gen = torch.Generator().manual_seed(1)
    key_cache = torch.zeros(4, 4, 2, 8)
    value_cache = torch.zeros(4, 4, 2, 6)
    key = torch.randn(5, 2, 8, generator=gen)
    value = torch.randn(5, 2, 6, generator=gen)
    slots = torch.tensor([13, -1, 2, 7, -1])
    write_kv_cache(key, value, key_cache, value_cache, slots)
    flat_k, flat_v = key_cache.view(16, 2, 8), value_cache.view(16, 2, 6)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(flat_k[slot], key[t]) and torch.equal(flat_v[slot], value[t])
    untouched = torch.ones(16, dtype=torch.bool)
    untouched[[13, 2, 7]] = False
    assert (flat_k[untouched] == 0).all() and (flat_v[untouched] == 0).all()


def test_write_kv_cache_non_contiguous_cache_and_dtype_cast() -> None:
    kv = torch.zeros(3, 4, 2, 1, 8, dtype=torch.bfloat16)  # [blocks, block_size, K/V, heads, dim]
    key_cache, value_cache = kv[:, :, 0], kv[:, :, 1]
    assert not key_cache.is_contiguous()
    key = torch.randn(2, 1, 8)
    write_kv_cache(key, key * 2, key_cache, value_cache, torch.tensor([5, 0]))
    assert torch.equal(kv[1, 1, 0], key[0].bfloat16()) and torch.equal(kv[0, 0, 1], (key[1] * 2).bfloat16())
    assert torch.equal(kv[1, 1, 1], (key[0] * 2).bfloat16()) and torch.equal(kv[0, 0, 0], key[1].bfloat16())
    kv[1, 1].zero_()
    kv[0, 0].zero_()
    assert torch.count_nonzero(kv) == 0


def test_paged_attention_trailing_padding_rows_are_zero() -> None:
    gen = torch.Generator().manual_seed(9)
    data = build_paged_batch([(3, 5), (1, 4)], 4, 2, 1, 8, 8, torch.float32, gen)
    padded_query = torch.cat((data["query"], torch.randn(2, 2, 8, generator=gen)))
    names = ("key_cache", "value_cache", "block_tables", "query_start_loc", "seq_lens")
    args = tuple(data[name] for name in names)
    out = paged_attention(padded_query, *args, 0.3)
    torch.testing.assert_close(out[:4], paged_attention(data["query"], *args, 0.3))
    assert out.shape == (6, 2, 8) and (out[4:] == 0).all()
