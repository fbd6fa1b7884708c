"""DeepSeek-V4 kernels against straightforward per-element implementations written here."""

from __future__ import annotations

import math

import pytest
import torch

import pypto_kernels
from pypto_kernels import (
    apply_interleaved_rope,
    compressor_pool,
    grouped_linear,
    hc_head,
    hc_merge,
    hc_sinkhorn_mix,
    indexer_topk,
    interleaved_rope_cos_sin,
    sink_attention,
)

TOL = dict(atol=1e-5, rtol=1e-5)
NEW_KERNELS = (
    "interleaved_rope_cos_sin",
    "apply_interleaved_rope",
    "grouped_linear",
    "hc_sinkhorn_mix",
    "hc_merge",
    "hc_head",
    "compressor_pool",
    "indexer_topk",
    "sink_attention",
)


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_registered_and_exported() -> None:
    for name in NEW_KERNELS:
        assert name in pypto_kernels.KERNEL_NAMES
        assert name in pypto_kernels.__all__
        fn = getattr(pypto_kernels, name)
        assert pypto_kernels.reference_kernel(name) is fn.reference
        assert pypto_kernels.get_kernel(name, "cpu") is fn.reference


# ---------------------------------------------------------------- interleaved RoPE, grouped linear


def test_interleaved_rope_matches_complex_rotation() -> None:
    g = _gen(1)
    t, h, d, rd = 5, 3, 12, 8
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rd, 2, dtype=torch.float32) / rd))
    positions = torch.tensor([0, 3, 7, 8, 20])
    cos, sin = interleaved_rope_cos_sin(positions, inv_freq, 1.5)
    assert cos.shape == (t, rd // 2) and cos.dtype == torch.float32
    x = torch.randn(t, h, d, generator=g)
    out = apply_interleaved_rope(x, cos, sin)

    expected = x.clone()
    for ti in range(t):
        for i in range(rd // 2):
            angle = positions[ti].item() * inv_freq[i].item()
            rot = complex(math.cos(angle), math.sin(angle)) * 1.5
            for hi in range(h):
                a, b = x[ti, hi, d - rd + 2 * i].item(), x[ti, hi, d - rd + 2 * i + 1].item()
                z = complex(a, b) * rot
                expected[ti, hi, d - rd + 2 * i] = z.real
                expected[ti, hi, d - rd + 2 * i + 1] = z.imag
    torch.testing.assert_close(out, expected, **TOL)
    assert torch.equal(out[..., : d - rd], x[..., : d - rd])
    # Without heads, and undone by -sin (scaling 1).
    cos1, sin1 = interleaved_rope_cos_sin(positions, inv_freq, 1.0)
    x2 = torch.randn(t, d, generator=g)
    torch.testing.assert_close(apply_interleaved_rope(apply_interleaved_rope(x2, cos1, sin1), cos1, -sin1), x2, **TOL)


def test_interleaved_rope_rejects_oversized_tables() -> None:
    with pytest.raises(ValueError, match="rope dim"):
        apply_interleaved_rope(torch.zeros(2, 4), torch.zeros(2, 3), torch.zeros(2, 3))


def test_grouped_linear_matches_per_group_matmul() -> None:
    g = _gen(2)
    t, groups, d_in, d_out = 4, 3, 5, 6
    x = torch.randn(t, groups, d_in, generator=g)
    w = torch.randn(groups * d_out, d_in, generator=g)
    expected = torch.cat([x[:, i] @ w[i * d_out : (i + 1) * d_out].T for i in range(groups)], dim=1)
    torch.testing.assert_close(grouped_linear(x, w, groups), expected, **TOL)
    with pytest.raises(ValueError):
        grouped_linear(x, w, groups + 1)


# ---------------------------------------------------------------- hyper-connections


def _hc_mix_naive(streams, fn, base, scale, iters, eps, norm_eps):  # type: ignore[no-untyped-def]
    t, n, _ = streams.shape
    posts, combs, collapsed = [], [], []
    for ti in range(t):
        flat = streams[ti].reshape(-1)
        flat = flat / torch.sqrt((flat * flat).mean() + norm_eps)
        mixes = fn @ flat
        pre = torch.sigmoid(mixes[:n] * scale[0] + base[:n]) + eps
        post = 2 * torch.sigmoid(mixes[n : 2 * n] * scale[1] + base[n : 2 * n])
        logits = (mixes[2 * n :] * scale[2] + base[2 * n :]).reshape(n, n)
        comb = torch.exp(logits - logits.max(dim=1, keepdim=True).values)
        comb = comb / comb.sum(dim=1, keepdim=True) + eps
        for j in range(n):
            comb[:, j] = comb[:, j] / (comb[:, j].sum() + eps)
        for _ in range(iters - 1):
            for i in range(n):
                comb[i, :] = comb[i, :] / (comb[i, :].sum() + eps)
            for j in range(n):
                comb[:, j] = comb[:, j] / (comb[:, j].sum() + eps)
        posts.append(post)
        combs.append(comb)
        collapsed.append(sum(pre[i] * streams[ti, i] for i in range(n)))
    return torch.stack(posts), torch.stack(combs), torch.stack(collapsed)


@pytest.mark.parametrize("n", [1, 3])
def test_hc_sinkhorn_mix_merge_head(n: int) -> None:
    g = _gen(3)
    t, d, iters = 4, 8, 5
    streams = torch.randn(t, n, d, generator=g)
    fn = torch.randn(n * (n + 2), n * d, generator=g) * 0.2
    base = torch.randn(n * (n + 2), generator=g) * 0.1
    scale = torch.rand(3, generator=g) + 0.5
    post, comb, collapsed = hc_sinkhorn_mix(streams, fn, base, scale, iters, 1e-6, 1e-6)
    e_post, e_comb, e_collapsed = _hc_mix_naive(streams, fn, base, scale, iters, 1e-6, 1e-6)
    torch.testing.assert_close(post, e_post, **TOL)
    torch.testing.assert_close(comb, e_comb, **TOL)
    torch.testing.assert_close(collapsed, e_collapsed, **TOL)
    if n > 1:  # columns normalised last: close to doubly stochastic
        torch.testing.assert_close(comb.sum(dim=-2), torch.ones(t, n), atol=1e-4, rtol=0)

    block_out = torch.randn(t, d, generator=g)
    merged = hc_merge(streams, block_out, post, comb)
    expected = torch.empty_like(streams)
    for ti in range(t):
        for i in range(n):
            mix = sum(comb[ti, j, i] * streams[ti, j] for j in range(n))
            expected[ti, i] = post[ti, i] * block_out[ti] + mix
    torch.testing.assert_close(merged, expected, **TOL)

    head_fn = torch.randn(n, n * d, generator=g) * 0.2
    head_base = torch.randn(n, generator=g) * 0.1
    head_scale = torch.rand(1, generator=g) + 0.5
    out = hc_head(streams, head_fn, head_base, head_scale, 1e-6, 1e-6)
    e_out = torch.empty(t, d)
    for ti in range(t):
        flat = streams[ti].reshape(-1)
        flat = flat / torch.sqrt((flat * flat).mean() + 1e-6)
        pre = torch.sigmoid(head_fn @ flat * head_scale + head_base) + 1e-6
        e_out[ti] = sum(pre[i] * streams[ti, i] for i in range(n))
    torch.testing.assert_close(out, e_out, **TOL)


# ---------------------------------------------------------------- compressor pooling


def _pool_naive(kv, gate, bias, rate, first_window, overlap):  # type: ignore[no-untyped-def]
    """Pool by absolute position: entry w reads source positions explicitly."""
    width = kv.shape[1] // (2 if overlap else 1)
    origin = first_window * rate - (rate if overlap and first_window > 0 else 0)
    last_pos = origin + kv.shape[0] - 1
    entries = []
    w = first_window
    while (w + 1) * rate - 1 <= last_pos:
        slots = []  # (row, column offset, bias row)
        if overlap:
            for j in range(rate):
                if w > 0:
                    slots.append(((w - 1) * rate + j - origin, 0, j))
            for j in range(rate):
                slots.append((w * rate + j - origin, width, j))
        else:
            slots = [(w * rate + j - origin, 0, j) for j in range(rate)]
        entry = torch.zeros(width)
        for c in range(width):
            logits = torch.tensor([gate[row, off + c] + bias[b, off + c] for row, off, b in slots])
            probs = torch.softmax(logits, dim=0)
            entry[c] = sum(p * kv[row, off + c] for p, (row, off, _) in zip(probs, slots))
        entries.append(entry)
        w += 1
    return torch.stack(entries) if entries else torch.zeros(0, width)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize(("rows", "first_window"), [(12, 0), (13, 0), (3, 0), (16, 2), (9, 1)])
def test_compressor_pool(overlap: bool, rows: int, first_window: int) -> None:
    g = _gen(4)
    rate, hd = 4, 3
    width = hd * (2 if overlap else 1)
    kv = torch.randn(rows, width, generator=g)
    gate = torch.randn(rows, width, generator=g)
    bias = torch.randn(rate, width, generator=g)
    out = compressor_pool(kv, gate, bias, rate, first_window, overlap)
    torch.testing.assert_close(out, _pool_naive(kv, gate, bias, rate, first_window, overlap), **TOL)


# ---------------------------------------------------------------- indexer and sink attention


def _batch(seed: int, q_lens: list[int], k_lens: list[int], d: int, heads: int, p_visible: float = 0.6):  # type: ignore[no-untyped-def]
    """Flat queries, per-request keys padded to [R, L, D] and a [T, L] mask that is False past k_lens."""
    g = _gen(seed)
    num_tokens, l_max = sum(q_lens), max(k_lens)
    query = torch.randn(num_tokens, heads, d, generator=g)
    keys = torch.randn(len(q_lens), l_max, d, generator=g)
    mask = torch.rand(num_tokens, l_max, generator=g) < p_visible
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()])
    for r, kl in enumerate(k_lens):
        mask[qsl[r] : qsl[r + 1], kl:] = False
        keys[r, kl:] = float("nan")  # padding must never leak
    return query, keys, mask, qsl


def _sink_attention_naive(query, keys, mask, qsl, sinks, scale):  # type: ignore[no-untyped-def]
    out = torch.zeros(query.shape[0], query.shape[1], keys.shape[-1])
    for r in range(qsl.numel() - 1):
        for t in range(int(qsl[r]), int(qsl[r + 1])):
            idx = mask[t].nonzero().flatten().tolist()
            for h in range(query.shape[1]):
                logits = [float(query[t, h] @ keys[r, j]) * scale for j in idx] + [float(sinks[h])]
                m = max(logits)
                ex = [math.exp(v - m) for v in logits]
                z = sum(ex)
                for p, j in zip(ex[:-1], idx):
                    out[t, h] += p / z * keys[r, j]
    return out


def test_sink_attention_matches_naive() -> None:
    q_lens, k_lens = [3, 1, 0, 4], [5, 7, 2, 3]
    query, keys, mask, qsl = _batch(5, q_lens, k_lens, d=6, heads=3)
    mask[0] = False  # a row with no visible key attends to the sink only -> zeros
    sinks = torch.randn(3, generator=_gen(6))
    out = sink_attention(query, keys, mask, qsl, sinks, 0.4)
    assert not out.isnan().any()
    torch.testing.assert_close(out, _sink_attention_naive(query, keys, mask, qsl, sinks, 0.4), **TOL)
    assert torch.equal(out[0], torch.zeros_like(out[0]))


def test_sink_attention_batched_equals_per_request() -> None:
    q_lens, k_lens = [4, 1, 6], [9, 3, 6]
    query, keys, mask, qsl = _batch(7, q_lens, k_lens, d=8, heads=2)
    sinks = torch.randn(2, generator=_gen(8))
    batched = sink_attention(query, keys, mask, qsl, sinks, 0.3)
    for r in range(len(q_lens)):
        a, b = int(qsl[r]), int(qsl[r + 1])
        one = torch.tensor([0, b - a])
        # Padding only changes float32 reduction order (matmul / softmax lengths): equal to ~1 ulp.
        alone = sink_attention(query[a:b], keys[r : r + 1], mask[a:b], one, sinks, 0.3)
        torch.testing.assert_close(alone, batched[a:b], atol=1e-6, rtol=1e-6)
        kl = k_lens[r]
        unpadded = sink_attention(query[a:b], keys[r : r + 1, :kl], mask[a:b, :kl], one, sinks, 0.3)
        torch.testing.assert_close(unpadded, batched[a:b], atol=1e-6, rtol=1e-6)


def test_sink_attention_bf16_and_empty() -> None:
    query, keys, mask, qsl = _batch(9, [2, 3], [4, 4], d=4, heads=2)
    sinks = torch.zeros(2)
    out = sink_attention(query.bfloat16(), keys.nan_to_num().bfloat16(), mask, qsl, sinks, 0.5)
    assert out.dtype == torch.bfloat16 and out.shape == (5, 2, 4)
    empty = sink_attention(query[:0], keys, mask[:0], torch.tensor([0, 0, 0]), sinks, 0.5)
    assert empty.shape == (0, 2, 4)
    with pytest.raises(ValueError, match="requests"):
        sink_attention(query, keys[:1], mask, qsl, sinks, 0.5)


def _indexer_naive(iq, iw, keys, visible, qsl, topk, scale):  # type: ignore[no-untyped-def]
    chosen = torch.zeros_like(visible)
    for r in range(qsl.numel() - 1):
        for t in range(int(qsl[r]), int(qsl[r + 1])):
            cand = visible[t].nonzero().flatten().tolist()
            score = {
                e: sum(float(iw[t, h]) * max(float(iq[t, h] @ keys[r, e]), 0.0) * scale for h in range(iq.shape[1]))
                for e in cand
            }
            for e in sorted(cand, key=lambda e: (-score[e], e))[:topk]:
                chosen[t, e] = True
    return chosen


@pytest.mark.parametrize("topk", [1, 3, 20])
def test_indexer_topk_matches_naive(topk: int) -> None:
    q_lens, e_lens = [3, 2, 0, 5], [6, 1, 3, 8]
    iq, keys, visible, qsl = _batch(10, q_lens, e_lens, d=5, heads=2, p_visible=0.8)
    iw = torch.randn(iq.shape[0], 2, generator=_gen(11))
    out = indexer_topk(iq, iw, keys, visible, qsl, topk, 0.5)
    assert out.dtype == torch.bool
    assert torch.equal(out, _indexer_naive(iq, iw, keys, visible, qsl, topk, 0.5))
    assert not (out & ~visible).any()


def test_indexer_topk_ties_prefer_earlier_entries() -> None:
    iq = -torch.ones(2, 1, 3)  # every ReLU score is 0: all entries tie
    keys = torch.ones(1, 5, 3)
    visible = torch.tensor([[True, False, True, True, True], [True] * 5])
    out = indexer_topk(iq, torch.ones(2, 1), keys, visible, torch.tensor([0, 2]), 2, 1.0)
    assert out.tolist() == [[True, False, True, False, False], [True, True, False, False, False]]


def test_indexer_topk_batched_equals_per_request() -> None:
    q_lens, e_lens = [5, 1, 4], [7, 2, 5]
    iq, keys, visible, qsl = _batch(12, q_lens, e_lens, d=6, heads=3, p_visible=0.9)
    iw = torch.rand(iq.shape[0], 3, generator=_gen(13))
    batched = indexer_topk(iq, iw, keys, visible, qsl, 3, 0.4)
    for r in range(len(q_lens)):
        a, b = int(qsl[r]), int(qsl[r + 1])
        one = torch.tensor([0, b - a])
        el = e_lens[r]
        alone = indexer_topk(iq[a:b], iw[a:b], keys[r : r + 1, :el], visible[a:b, :el], one, 3, 0.4)
        assert torch.equal(alone, batched[a:b, :el])
        assert not batched[a:b, el:].any()


# ---------------------------------------------------------------- host lengths and query tiles


def _host_lens(qsl: torch.Tensor) -> list[int]:
    return (qsl[1:] - qsl[:-1]).tolist()


@pytest.mark.parametrize("tile", [1 << 21, 8, 60])
def test_sink_attention_with_host_lengths_and_tiles(tile: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Host query/key lengths (no device read) and query tiles smaller than a request give the same
    result; keys past ``key_lens_host`` are never read, even where the mask would let them."""
    import pypto_kernels.compressed_attention as ca

    q_lens, k_lens = [4, 1, 0, 6, 1, 1], [9, 3, 2, 6, 8, 5]  # decodes batch a tile's worth at a time
    query, keys, mask, qsl = _batch(21, q_lens, k_lens, d=8, heads=2)
    sinks = torch.randn(2, generator=_gen(22))
    reference = sink_attention(query, keys.nan_to_num(), mask, qsl, sinks, 0.3)
    beyond = mask.clone()
    for r, kl in enumerate(k_lens):
        beyond[int(qsl[r]) : int(qsl[r + 1]), kl:] = True  # NaN keys there: any read would show
    monkeypatch.setattr(ca, "_TILE_ELEMENTS", tile)  # 8 scores: one query row per tile; 60: some pairs
    out = sink_attention(query, keys, beyond, qsl, sinks, 0.3, query_lens_host=_host_lens(qsl), key_lens_host=k_lens)
    torch.testing.assert_close(out, reference, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(out, _sink_attention_naive(query, keys, mask, qsl, sinks, 0.3), **TOL)


@pytest.mark.parametrize("tile", [1 << 21, 5, 40])
def test_indexer_topk_with_host_lengths_and_tiles(tile: int, monkeypatch: pytest.MonkeyPatch) -> None:
    import pypto_kernels.compressed_attention as ca

    q_lens, e_lens = [3, 1, 2, 0, 1, 5, 1], [6, 4, 1, 3, 0, 8, 7]
    iq, keys, visible, qsl = _batch(23, q_lens, e_lens, d=5, heads=2, p_visible=0.8)
    iw = torch.randn(iq.shape[0], 2, generator=_gen(24))
    keys = keys.nan_to_num()
    beyond = visible.clone()
    for r, el in enumerate(e_lens):
        beyond[int(qsl[r]) : int(qsl[r + 1]), el:] = True  # entries a request must not read
    monkeypatch.setattr(ca, "_TILE_ELEMENTS", tile)
    out = indexer_topk(iq, iw, keys, beyond, qsl, 3, 0.5, query_lens_host=_host_lens(qsl), key_lens_host=e_lens)
    assert torch.equal(out, _indexer_naive(iq, iw, keys, visible, qsl, 3, 0.5))


def test_host_lengths_must_match_the_batch() -> None:
    query, keys, mask, qsl = _batch(25, [2, 3], [4, 4], d=4, heads=2)
    sinks = torch.zeros(2)
    with pytest.raises(ValueError, match="requests"):
        sink_attention(query, keys, mask, qsl, sinks, 0.5, query_lens_host=[5])
    with pytest.raises(ValueError, match="tokens"):
        sink_attention(query, keys, mask, qsl, sinks, 0.5, query_lens_host=[2, 4])
    with pytest.raises(ValueError, match="key_lens_host"):
        sink_attention(query, keys, mask, qsl, sinks, 0.5, key_lens_host=[4, 5])
