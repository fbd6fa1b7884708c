"""paged_attention / varlen_attention / write_kv_cache against naive per-request, per-token loops.

The per-request paths are also checked against the former padded implementation
(``_reference_paged_attention``) on ragged batches, and their memory against the step's size.
"""

from __future__ import annotations

import ctypes
import os
import sys
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import pypto_kernels.attention as attention_module
from pypto_kernels import (
    empty_paged_cache,
    memory_order,
    native,
    paged_attention,
    paged_cache_layout,
    varlen_attention,
    write_kv_cache,
)
from pypto_kernels.attention import _reference_paged_attention

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


def test_write_kv_cache_round_trip_touches_only_its_slots() -> None:
    gen = torch.Generator().manual_seed(1)
    key_cache = torch.zeros(4, 4, 2, 8)
    value_cache = torch.zeros(4, 4, 2, 6)
    key = torch.randn(3, 2, 8, generator=gen)
    value = torch.randn(3, 2, 6, generator=gen)
    slots = torch.tensor([13, 2, 7])
    write_kv_cache(key, value, key_cache, value_cache, slots)
    flat_k, flat_v = key_cache.view(16, 2, 8), value_cache.view(16, 2, 6)
    for t, slot in enumerate(slots.tolist()):
        assert torch.equal(flat_k[slot], key[t]) and torch.equal(flat_v[slot], value[t])
    untouched = torch.ones(16, dtype=torch.bool)
    untouched[[13, 2, 7]] = False
    assert (flat_k[untouched] == 0).all() and (flat_v[untouched] == 0).all()


@pytest.mark.parametrize("slot", [-1, 16])
def test_write_kv_cache_refuses_padding_and_out_of_range_slots_on_the_cpu(slot: int) -> None:
    """No padding rows (slot -1): the write has no data-dependent shape, so it cannot skip any."""
    key_cache, value_cache = torch.zeros(4, 4, 2, 8), torch.zeros(4, 4, 2, 8)
    with pytest.raises(IndexError):
        write_kv_cache(torch.ones(2, 2, 8), torch.ones(2, 2, 8), key_cache, value_cache, torch.tensor([3, slot]))


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


def test_write_kv_cache_cache_whose_blocks_and_offsets_do_not_merge() -> None:
    """A cache viewed [block_size, blocks, ...] -> [blocks, block_size, ...] has no flat view: (block, offset) path."""
    storage = torch.zeros(4, 3, 2, 8)  # [block_size, blocks, heads, dim]
    key_cache, value_cache = storage.transpose(0, 1), torch.zeros(3, 4, 2, 8)
    key = torch.randn(2, 2, 8)
    write_kv_cache(key, key * 2, key_cache, value_cache, torch.tensor([5, 0]))
    assert torch.equal(storage[1, 1], key[0]) and torch.equal(storage[0, 0], key[1])
    assert torch.equal(value_cache[1, 1], key[0] * 2) and torch.count_nonzero(storage) == 2 * key[0].numel()


def test_paged_attention_trailing_padding_rows_are_zero() -> None:
    gen = torch.Generator().manual_seed(9)
    data = build_paged_batch([(3, 5), (1, 4)], 4, 2, 1, 8, 8, torch.float32, gen)
    padded_query = torch.cat((data["query"], torch.randn(2, 2, 8, generator=gen)))
    names = ("key_cache", "value_cache", "block_tables", "query_start_loc", "seq_lens")
    args = tuple(data[name] for name in names)
    out = paged_attention(padded_query, *args, 0.3)
    torch.testing.assert_close(out[:4], paged_attention(data["query"], *args, 0.3))
    assert out.shape == (6, 2, 8) and (out[4:] == 0).all()


PAGED_ARGS = ("query", "key_cache", "value_cache", "block_tables", "query_start_loc", "seq_lens")

# Ragged batches as (q_len, seq_len): prefill only, chunked prefill over cached prefixes, decode only,
# and everything mixed with an idle request.
RAGGED_BATCHES = {
    "prefill": [(13, 13), (1, 1), (30, 30), (6, 6)],
    "chunked": [(8, 40), (17, 20), (3, 33)],
    "decode": [(1, 1), (1, 37), (1, 16), (1, 64), (1, 5)],
    "mixed": [(21, 21), (1, 50), (9, 29), (0, 12), (1, 2), (16, 48), (1, 17)],
}


def _paged(data: dict[str, Any], scale: float, **kwargs: Any) -> torch.Tensor:
    return paged_attention(*(data[name] for name in PAGED_ARGS), scale, **kwargs)


@pytest.mark.parametrize("kind", sorted(RAGGED_BATCHES))
@pytest.mark.parametrize("block_size", [1, 5, 16])
@pytest.mark.parametrize(("num_q_heads", "num_kv_heads"), [(4, 4), (6, 2), (8, 1)])
@pytest.mark.parametrize("gather_bytes", [1, 1 << 12, None], ids=["chunk-per-request", "few-per-chunk", "default"])
def test_paged_attention_matches_padded_reference_and_per_request_loop(
    monkeypatch: pytest.MonkeyPatch,
    kind: str,
    block_size: int,
    num_q_heads: int,
    num_kv_heads: int,
    gather_bytes: int | None,
) -> None:
    if gather_bytes is not None:
        monkeypatch.setattr(attention_module, "_GATHER_BYTES", gather_bytes)
    batch = RAGGED_BATCHES[kind]
    gen = torch.Generator().manual_seed(block_size * 31 + num_q_heads * 7 + len(kind))
    data = build_paged_batch(batch, block_size, num_q_heads, num_kv_heads, 16, 16, torch.float32, gen)
    out = _paged(data, 0.25)
    reference = _reference_paged_attention(*(data[name] for name in PAGED_ARGS), 0.25)
    torch.testing.assert_close(out, reference, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, expected_paged(data, 0.25, None, None), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 3, 11])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_paged_attention_query_tiles_match_reference(
    monkeypatch: pytest.MonkeyPatch, window: int | None, with_sinks: bool
) -> None:
    """A tiny tile budget splits every prompt into many query tiles, each over its own key range."""
    monkeypatch.setattr(attention_module, "_TILE_ELEMENTS", 200)
    gen = torch.Generator().manual_seed(17 + (window or 0) + with_sinks)
    data = build_paged_batch(RAGGED_BATCHES["mixed"], 4, 6, 3, 16, 16, torch.float32, gen)
    sinks = torch.randn(6, generator=gen) if with_sinks else None
    out = _paged(data, 0.3, sliding_window=window, sinks=sinks)
    reference = _reference_paged_attention(*(data[name] for name in PAGED_ARGS), 0.3, window, sinks)
    torch.testing.assert_close(out, reference, atol=1e-5, rtol=1e-5)


def test_paged_attention_host_lengths_match_device_tensors() -> None:
    gen = torch.Generator().manual_seed(23)
    batch = RAGGED_BATCHES["mixed"]
    data = build_paged_batch(batch, 16, 8, 2, 16, 16, torch.float32, gen)
    hosted = _paged(data, 0.2, query_lens_host=[q for q, _ in batch], seq_lens_host=[s for _, s in batch])
    torch.testing.assert_close(hosted, _paged(data, 0.2), atol=0, rtol=0)


def test_varlen_attention_host_lengths_and_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(attention_module, "_TILE_ELEMENTS", 64)
    gen = torch.Generator().manual_seed(29)
    q, k, v = torch.randn(20, 4, 8, generator=gen), torch.randn(20, 2, 8, generator=gen), torch.randn(20, 2, 8)
    qsl = torch.tensor([0, 12, 13, 20])
    out = varlen_attention(q, k, v, qsl, 0.4, sliding_window=5, query_lens_host=[12, 1, 7])
    expected = torch.cat(
        [naive_attention(q[s:e], k[s:e], v[s:e], 0, 0.4, True, 5, None) for s, e in ((0, 12), (12, 13), (13, 20))]
    )
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


class _LargestNewTensor(TorchDispatchMode):
    """Records the largest tensor any op returns, ignoring views of the inputs (the cache itself)."""

    def __init__(self, inputs: list[torch.Tensor]) -> None:
        super().__init__()
        self.input_storages = {t.untyped_storage().data_ptr() for t in inputs}
        self.largest = 0
        self.largest_op = ""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        result = func(*args, **(kwargs or {}))
        for value in tree_flatten(result)[0]:
            # A sparse tensor has no storage of its own; its values are counted where they are read.
            if not isinstance(value, torch.Tensor) or value.layout != torch.strided:
                continue
            if value.untyped_storage().data_ptr() not in self.input_storages:
                nbytes = value.numel() * value.element_size()
                if nbytes > self.largest:
                    self.largest, self.largest_op = nbytes, f"{func} {tuple(value.shape)}"
        return result


@pytest.mark.parametrize("with_sinks", [False, True])
def test_paged_attention_memory_is_bounded_by_the_step_tokens(with_sinks: bool) -> None:
    """A 2048-token chunk (over a 2048-token cached prefix) beside 63 decodes at 2k context.

    The padded path would build float32 scores of R x Hq x Q_max x L_max = 64 x 2 x 2048 x 4096
    (4 GiB); the per-request path's largest intermediate must stay within one query tile's scores
    and one gather chunk plus a few times the step's query and key rows.
    """
    num_q_heads, num_kv_heads, head_dim, block_size = 2, 1, 8, 16
    batch = [(2048, 4096)] + [(1, 2048)] * 63
    gen = torch.Generator().manual_seed(31)
    data = build_paged_batch(batch, block_size, num_q_heads, num_kv_heads, head_dim, head_dim, torch.float32, gen)
    sinks = torch.randn(num_q_heads, generator=gen) if with_sinks else None
    mode = _LargestNewTensor([data[name] for name in PAGED_ARGS])
    with mode:
        out = _paged(data, head_dim**-0.5, sinks=sinks)
    num_tokens, max_seq = sum(q for q, _ in batch), max(s for _, s in batch)
    padded_scores = len(batch) * num_q_heads * 2048 * max_seq * 4
    tile_bytes = attention_module._TILE_ELEMENTS * 4 + attention_module._GATHER_BYTES
    bound = tile_bytes + 4 * (num_tokens + max_seq) * num_q_heads * head_dim * 4
    assert mode.largest <= bound, mode.largest_op
    assert padded_scores > 200 * bound
    assert out.shape == (num_tokens, num_q_heads, head_dim) and torch.isfinite(out).all()
    # Spot-check one decode row and the chunk's last rows against the per-token loop.
    for r in (0, 40):
        start = int(data["query_start_loc"][r])
        q = data["query"][start : start + batch[r][0]][-4:]
        first = batch[r][1] - q.shape[0]
        expected = naive_attention(q, data["keys"][r], data["values"][r], first, head_dim**-0.5, True, None, sinks)
        torch.testing.assert_close(out[start : start + batch[r][0]][-4:], expected, atol=1e-5, rtol=1e-5)


def test_paged_attention_reads_a_bf16_cache_without_float32_copies() -> None:
    """Scores and softmax are float32, K/V stay bf16: no float32 tensor as large as one request's keys."""
    num_q_heads, num_kv_heads, head_dim = 8, 2, 32
    batch = [(1, 512), (4, 300)]
    gen = torch.Generator().manual_seed(37)
    data = build_paged_batch(batch, 16, num_q_heads, num_kv_heads, head_dim, head_dim, torch.bfloat16, gen)
    largest_f32 = 0

    class _Float32Sizes(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            nonlocal largest_f32
            result = func(*args, **(kwargs or {}))
            for value in tree_flatten(result)[0]:
                if isinstance(value, torch.Tensor) and value.dtype == torch.float32:
                    largest_f32 = max(largest_f32, value.numel())
            return result

    with _Float32Sizes():
        out = _paged(data, 0.2)
    assert largest_f32 < 300 * num_kv_heads * head_dim
    torch.testing.assert_close(out.float(), expected_paged(data, 0.2, None, None), atol=2e-2, rtol=2e-2)


def test_write_and_paged_attention_read_nothing_back_on_a_fake_cuda_device() -> None:
    """Fake tensors hold no values: any host read (.tolist, .item, boolean-mask indexing) raises, and
    mixing in a CPU tensor raises a device mismatch. Given the host lengths, the references do neither."""
    from torch._subclasses.fake_tensor import DataDependentOutputException

    from tests.plugins.qwen.fake_cuda import fake_cuda

    q_lens, seq_lens = [5, 1, 1], [12, 4, 9]
    with fake_cuda():
        cuda = torch.device("cuda", 0)
        key_cache, value_cache = torch.empty(10, 4, 2, 16, device=cuda), torch.empty(10, 4, 2, 16, device=cuda)
        query = torch.empty(sum(q_lens), 8, 16, device=cuda)
        kv = torch.empty(sum(q_lens), 2, 16, device=cuda)
        slots = torch.empty(sum(q_lens), dtype=torch.int64, device=cuda)
        write_kv_cache.reference(kv, kv, key_cache, value_cache, slots)  # type: ignore[attr-defined]
        tables = torch.empty(3, 3, dtype=torch.int32, device=cuda)
        qsl = torch.empty(4, dtype=torch.int32, device=cuda)
        lens = torch.empty(3, dtype=torch.int32, device=cuda)
        args = (query, key_cache, value_cache, tables, qsl, lens, 0.25)
        for window in (None, 3):
            out = paged_attention.reference(  # type: ignore[attr-defined]
                *args, sliding_window=window, query_lens_host=q_lens, seq_lens_host=seq_lens
            )
            assert out.device == cuda and out.shape == (7, 8, 16)
        with pytest.raises(DataDependentOutputException):  # without them it reads qsl/seq_lens back
            paged_attention.reference(*args)  # type: ignore[attr-defined]


# The CPU fast path batches a step's decode rows; the per-request loop stays the reference.

#: The lengths a batched decode group pads together: one token, either side of a block edge, long.
DECODE_EDGE_LENGTHS = [1, 15, 16, 17, 300]


@pytest.fixture
def torch_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU's torch paths (in-place sampled product, padded gathers), as where no C compiler is found."""
    monkeypatch.setattr(native, "library", lambda: None)


@pytest.fixture(params=["native", "torch"])
def cpu_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each CPU decode path in turn: the native kernel (skipped without a C compiler) and the torch paths."""
    if request.param == "native" and native.library() is None:
        pytest.skip("no native CPU kernels on this machine (no C compiler; see the log)")
    if request.param == "torch":
        monkeypatch.setattr(native, "library", lambda: None)
    return str(request.param)


def _head_major(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` with its caches copied into :func:`pypto_kernels.empty_paged_cache`'s CPU layout."""
    out = dict(data)
    for name in ("key_cache", "value_cache"):
        cache = data[name]
        out[name] = empty_paged_cache(tuple(cache.shape), dtype=cache.dtype, device=cache.device).copy_(cache)
        assert attention_module.is_head_major(out[name])
    return out


@pytest.mark.usefixtures("torch_paths")
def test_cpu_float_caches_are_head_major_and_others_token_major() -> None:
    """The CPU's in-place dtypes get ``[blocks, Hkv, block_size, D]`` memory behind the usual shape;
    writes and reads through it equal a token-major cache's, and a block's bytes stay one run.
    (Without the native kernels: with them bfloat16 is read in place too, the next test.)"""
    shape = (6, 4, 3, 8)
    cache = empty_paged_cache(shape, dtype=torch.float32, device="cpu")
    assert cache.shape == shape and not cache.is_contiguous()
    physical = memory_order(cache)
    assert physical.shape == (6, 3, 4, 8) and physical.is_contiguous() and physical[2].data_ptr() == cache[2].data_ptr()
    assert paged_cache_layout(torch.float32, "cpu") == "head_major"
    for dtype, device in ((torch.bfloat16, "cpu"), (torch.float8_e4m3fn, "cpu"), (torch.float32, "cuda")):
        assert paged_cache_layout(dtype, device) == "token_major"
    plain = empty_paged_cache(shape, dtype=torch.bfloat16, device="cpu")
    assert plain.is_contiguous() and memory_order(plain) is plain
    # Writes by slot land where a token-major cache has them.
    gen = torch.Generator().manual_seed(2)
    rows = torch.randn(7, 3, 8, generator=gen)
    slots = torch.tensor([0, 5, 6, 11, 12, 22, 23])
    token_major = torch.full(shape, float("nan"))
    cache.fill_(float("nan"))
    write_kv_cache(rows, rows * 2, cache, token_major.clone(), slots)
    write_kv_cache(rows, rows * 2, token_major, token_major.clone(), slots)
    assert torch.equal(cache.nan_to_num(), token_major.nan_to_num())


def _resident_fraction(tensor: torch.Tensor) -> float:
    """The fraction of ``tensor``'s pages that are in memory, from ``mincore(2)`` on its own address
    range: the process's resident set would also count what other tests' garbage frees meanwhile."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    page = os.sysconf("SC_PAGE_SIZE")
    start = tensor.data_ptr() // page * page
    end = -(-(tensor.data_ptr() + tensor.untyped_storage().nbytes()) // page) * page
    pages = (end - start) // page
    vec = (ctypes.c_ubyte * pages)()
    if libc.mincore(start, end - start, vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore failed")
    return sum(b & 1 for b in vec) / pages


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads page residency with mincore(2)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_cpu_caches_come_zeroed_with_their_pages_committed(dtype: torch.dtype) -> None:
    """A CPU cache's memory is resident when it is made (its first writes in a step fault nothing in),
    in either layout."""
    # 64 MiB in every dtype: above glibc's largest mmap threshold (32 MiB), so these are fresh pages,
    # as an untouched tensor of that size shows.
    blocks = 64 * 2**20 // (16 * 8 * 128 * torch.empty((), dtype=dtype).element_size())
    # The heap's free chunks give their pages back first: a 64 MiB chunk freed earlier in this process
    # (the whole suite's) can serve the tensor with its old pages still resident.
    ctypes.CDLL(None).malloc_trim(0)
    untouched = torch.empty((blocks, 16, 8, 128), dtype=dtype)
    assert _resident_fraction(untouched) < 0.5
    cache = empty_paged_cache((blocks, 16, 8, 128), dtype=dtype, device="cpu")
    assert _resident_fraction(memory_order(cache)) == 1.0
    assert not memory_order(cache).view(torch.uint8).any()


def test_native_kernels_read_bfloat16_caches_in_place_so_they_are_head_major() -> None:
    if native.library() is None:
        pytest.skip("no native CPU kernels on this machine (no C compiler; see the log)")
    for dtype in (torch.float32, torch.bfloat16):
        assert paged_cache_layout(dtype, "cpu") == "head_major"
        assert attention_module.is_head_major(empty_paged_cache((6, 4, 3, 8), dtype=dtype, device="cpu"))
    for dtype, device in ((torch.float8_e4m3fn, "cpu"), (torch.bfloat16, "cuda")):
        assert paged_cache_layout(dtype, device) == "token_major"


@pytest.mark.parametrize("layout", ["token_major", "head_major"])
@pytest.mark.parametrize(("num_q_heads", "num_kv_heads"), [(4, 4), (8, 2)])
@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("group_bytes", [1, None], ids=["row-per-group", "default"])
def test_batched_decode_matches_the_request_loop_on_ragged_lengths(
    monkeypatch: pytest.MonkeyPatch,
    cpu_path: str,
    num_q_heads: int,
    num_kv_heads: int,
    window: int | None,
    with_sinks: bool,
    group_bytes: int | None,
    layout: str,
) -> None:
    if group_bytes is not None:  # one row per group, in both the padded and the in-place path
        monkeypatch.setattr(attention_module, "_DECODE_GROUP_BYTES", group_bytes)
        monkeypatch.setattr(attention_module, "_IN_PLACE_ENTRIES", group_bytes)
    # Decode rows of every edge length beside a prefill chunk and an idle request, in a NaN-filled cache.
    batch = [(1, n) for n in DECODE_EDGE_LENGTHS] + [(5, 40), (0, 9), (1, 33)]
    gen = torch.Generator().manual_seed(num_q_heads + (window or 0))
    data = build_paged_batch(batch, 16, num_q_heads, num_kv_heads, 16, 16, torch.float32, gen)
    if layout == "head_major":
        data = _head_major(data)
    sinks = torch.randn(num_q_heads, generator=gen) if with_sinks else None
    args = [data[name] for name in PAGED_ARGS]
    batched = attention_module.batched_decode_paged_attention(*args, 0.25, window, sinks)
    loop = attention_module.paged_attention.reference(*args, 0.25, window, sinks)  # type: ignore[attr-defined]
    assert torch.isfinite(batched).all()
    torch.testing.assert_close(batched, loop, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(batched, expected_paged(data, 0.25, window, sinks), atol=1e-5, rtol=1e-5)


def test_batched_decode_fp8_and_bf16_caches_match_the_request_loop(cpu_path: str) -> None:
    gen = torch.Generator().manual_seed(3)
    batch = [(1, n) for n in DECODE_EDGE_LENGTHS]
    data = build_paged_batch(batch, 16, 8, 2, 16, 16, torch.bfloat16, gen)
    args = [data[name] for name in PAGED_ARGS]
    batched = attention_module.batched_decode_paged_attention(*args, 0.25)
    loop = attention_module.paged_attention.reference(*args, 0.25)  # type: ignore[attr-defined]
    torch.testing.assert_close(batched, loop, atol=2e-2, rtol=2e-2)
    fp8 = [args[0], args[1].to(torch.float8_e4m3fn), args[2].to(torch.float8_e4m3fn), *args[3:]]
    scales = {"k_scale": 0.5, "v_scale": 2.0}
    batched = attention_module.batched_decode_paged_attention(*fp8, 0.25, **scales)
    loop = attention_module.paged_attention.reference(*fp8, 0.25, **scales)  # type: ignore[attr-defined]
    torch.testing.assert_close(batched, loop, atol=2e-2, rtol=2e-2)


class _MatmulCount(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.overloadpacket in (torch.ops.aten.bmm, torch.ops.aten.mm):
            self.calls += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.usefixtures("torch_paths")
def test_cpu_bf16_decode_step_is_a_few_matmuls_not_two_per_request() -> None:
    # 64 decode rows of a small model over a bfloat16 cache: the request loop runs 128 matmuls, the
    # padded path one per KV head for scores and one for values, per group of rows.
    gen = torch.Generator().manual_seed(5)
    data = build_paged_batch([(1, 32 + 5 * r) for r in range(64)], 16, 4, 2, 16, 16, torch.bfloat16, gen)
    with _MatmulCount() as count:
        out = _paged(data, 0.25)
    assert 0 < count.calls <= 2 * 2 * 4
    torch.testing.assert_close(out.float(), expected_paged(data, 0.25, None, None).float(), atol=2e-2, rtol=2e-2)


class _OpLog(TorchDispatchMode):
    """The ops a call runs and the largest strided tensor it creates (not a view of ``inputs``)."""

    def __init__(self, inputs: list[torch.Tensor]) -> None:
        super().__init__()
        self.inputs = {t.untyped_storage().data_ptr() for t in inputs}
        self.ops: list[Any] = []
        self.largest = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops.append(func.overloadpacket)
        result = func(*args, **(kwargs or {}))
        for value in tree_flatten(result)[0]:
            strided = isinstance(value, torch.Tensor) and value.layout == torch.strided
            if strided and value.untyped_storage().data_ptr() not in self.inputs:
                self.largest = max(self.largest, value.numel() * value.element_size())
        return result


@pytest.mark.usefixtures("torch_paths")
@pytest.mark.parametrize("layout", ["token_major", "head_major"])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_cpu_float32_decode_rows_read_the_cache_in_place(with_sinks: bool, layout: str) -> None:
    """64 decode rows over a float32 cache (NaN in every slot no row sees): one sampled product for
    the scores, one embedding_bag for the values, no matmul per request and no copy of the keys,
    through the dispatched kernel in either layout."""
    gen = torch.Generator().manual_seed(6)
    lens = [32 + 5 * r for r in range(64)]
    # 2 KV heads x 160 x 4 bytes a token: wider than the padded gather takes, so only the in-place
    # path serves these caches (the dispatch must see a head-major cache as one it reads in place).
    head_dim = 160
    data = build_paged_batch([(1, n) for n in lens], 16, 8, 2, head_dim, head_dim, torch.float32, gen)
    if layout == "head_major":
        data = _head_major(data)
    sinks = torch.randn(8, generator=gen) if with_sinks else None
    log = _OpLog([data[name] for name in PAGED_ARGS])
    with log:
        out = _paged(data, 0.25, sinks=sinks)
    assert log.ops.count(torch.ops.aten.sparse_sampled_addmm) == 1
    assert log.ops.count(torch.ops.aten._embedding_bag_forward_only) == 1
    assert torch.ops.aten.bmm not in log.ops and torch.ops.aten.mm not in log.ops
    # A gather copies the step's keys (1,280 bytes a token here); the index of each (head, key) pair
    # is 64 bytes a token, 128 while it is padded to the longest row.
    key_bytes = sum(lens) * 2 * head_dim * 4
    assert log.largest < key_bytes / 3
    torch.testing.assert_close(out, expected_paged(data, 0.25, None, sinks), atol=1e-5, rtol=1e-5)


@pytest.mark.usefixtures("torch_paths")
def test_in_place_plan_is_shared_by_a_steps_layers_and_never_stale(monkeypatch: pytest.MonkeyPatch) -> None:
    """Layers of one step (same tables and lengths) build the index plan once; tables edited in place
    (same tensor, same lengths, other blocks) get a new plan, so the rows read the blocks they now name."""
    built: list[int] = []
    plan = attention_module._in_place_plan
    monkeypatch.setattr(attention_module, "_in_place_plan", lambda *a: built.append(1) or plan(*a))
    monkeypatch.setattr(attention_module, "_PLANS", attention_module._PlanMemo())
    gen = torch.Generator().manual_seed(8)
    data = build_paged_batch([(1, 40), (1, 17), (1, 40)], 16, 4, 2, 16, 16, torch.float32, gen)
    args = [data[name] for name in PAGED_ARGS]
    first = attention_module.batched_decode_paged_attention(*args, 0.25)
    again = attention_module.batched_decode_paged_attention(*args, 0.25)
    assert len(built) == 1 and torch.equal(first, again)
    # Requests 0 and 2 (same length) swap blocks in place: the spans are the same, the tables are not.
    tables = data["block_tables"]
    tables[[0, 2]] = tables[[2, 0]].clone()
    moved = attention_module.batched_decode_paged_attention(*args, 0.25)
    loop = attention_module.paged_attention.reference(*args, 0.25)  # type: ignore[attr-defined]
    assert len(built) == 2 and not torch.allclose(moved, first)
    torch.testing.assert_close(moved, loop, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(native.library() is None, reason="no native CPU kernels (no C compiler)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 20])
def test_a_prompts_rows_are_the_same_however_the_prompt_is_cut(dtype: torch.dtype, window: int | None) -> None:
    """Given each request's prompt rows, a prompt's queries take the prefill kernel at any run length
    and the rows after them (a decode row, drafts) the row kernel: a 40-token prompt attended as one
    run, or cut into 35 + 5 or 30 + 9 + 1 among other requests' rows, gives its rows bitwise the same.
    By run length alone the short runs took the row kernel, whose sums are in another order."""
    gen = torch.Generator().manual_seed(7)
    data = build_paged_batch([(40, 40), (3, 23)], 16, 8, 2, 64, 64, dtype, gen)
    query, caches, tables = data["query"], (data["key_cache"], data["value_cache"]), data["block_tables"]

    def attend(runs: list[tuple[int, int, int]], prompt: list[int] | None) -> torch.Tensor:
        """Runs (request, first query, queries) of the prompt (request 0: 40 queries at positions
        0-39) and the other request (3 queries at positions 20-22), in that order."""
        q = torch.cat([query[(0 if r == 0 else 40) + lo :][:n] for r, lo, n in runs])
        qsl = torch.tensor([0, *torch.tensor([n for _, _, n in runs]).cumsum(0).tolist()], dtype=torch.int32)
        seqs = torch.tensor([(0 if r == 0 else 20) + lo + n for r, lo, n in runs], dtype=torch.int32)
        table = tables[[r for r, _, _ in runs]]
        return attention_module.batched_decode_paged_attention(
            q, *caches, table, qsl, seqs, 0.125, window, prompt_rows_host=prompt
        )

    whole = attend([(0, 0, 40)], [40])
    assert torch.equal(whole, attend([(0, 0, 40)], None))  # one long run: the prefill kernel either way
    for cuts in ([35, 5], [30, 9, 1]):
        rows, lo = [], 0
        for n in cuts:  # each chunk after the other request's rows: its last prompt row, two decode rows
            step = attend([(1, 0, 3), (0, lo, n)], [1, n])
            assert torch.equal(step[1:3], attend([(1, 1, 2)], [0]))  # its decode rows: the row kernel's
            rows.append(step[3:])
            lo += n
        assert torch.equal(torch.cat(rows), whole)
    assert not torch.equal(attend([(1, 0, 3), (0, 35, 5)], None)[3:], whole[35:])  # by length: the row kernel
    torch.testing.assert_close(
        whole.float(), expected_paged(data, 0.125, window, None)[:40].float(), atol=3e-2, rtol=3e-2
    )
