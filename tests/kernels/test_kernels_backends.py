"""Paged attention and cache writes of the CUDA and NPU backends, behind the registry.

No GPU or NPU is needed: fake ``flash_attn`` and ``torch_npu`` modules are put into
``sys.modules``, whose ops implement the documented semantics of the vendor functions with plain
torch (a per-request loop written here, independent of the engine's kernels) and assert the
documented argument layout (int32 cumulative lengths and block tables, TND, the 2048 x 2048 mask).
The backend functions run on CPU tensors and are compared with the padded reference
``_reference_paged_attention``. These tests check the argument plumbing against *simulated* ops,
not the vendor kernels: the tests marked for a real device compare the fast paths with the
reference where a GPU (with flash-attn) or an NPU is present, and skip elsewhere.
"""

from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Iterator
from typing import Any, NamedTuple

import pytest
import torch

import pypto_kernels
from pypto_kernels import registry
from pypto_kernels.attention import _reference_paged_attention
from pypto_kernels.backends import cpu as cpu_backend
from pypto_kernels.backends import cuda as cuda_backend

# (q_len, seq_len): a prefill over two blocks, a chunk after a long cached prefix, decodes on and
# just past a block boundary, a one-token prompt and a short prefill.
CUDA_BATCH = [(300, 300), (50, 600), (1, 257), (1, 1), (7, 7)]
NPU_BATCH = [(300, 300), (50, 600), (1, 129), (1, 1), (7, 7)]
SCALE = 0.125


@pytest.fixture
def clean_registry(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(registry, "_FAST_PATHS", {})
    monkeypatch.setattr(registry, "_LOADED_DEVICE_TYPES", set())
    yield


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, scale: float) -> torch.Tensor:
    """Float32 softmax attention of q [n, Hq, D] over k/v [L, Hkv, D] with a [n, L] mask; GQA by head groups."""
    group = q.shape[1] // k.shape[1]
    kf, vf = k.float().repeat_interleave(group, dim=1), v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,lhd->hql", q.float(), kf) * scale
    scores = scores.masked_fill(~visible[None], float("-inf"))
    probs = torch.nan_to_num(torch.softmax(scores, dim=-1))  # a row with no visible key gives zeros
    return torch.einsum("hql,lhd->qhd", probs, vf).to(q.dtype)


def _gather(cache: torch.Tensor, table_row: torch.Tensor, length: int) -> torch.Tensor:
    block_size = cache.shape[1]
    return cache[table_row[: -(-length // block_size)].long()].flatten(0, 1)[:length]


def _fake_flash_attn(calls: list[dict[str, Any]]) -> types.ModuleType:
    """``flash_attn.flash_attn_varlen_func`` with block_table, per its docstring and mha_varlen_fwd checks."""

    def flash_attn_varlen_func(  # the documented signature
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        cu_seqlens_k: torch.Tensor,
        max_seqlen_q: int,
        max_seqlen_k: int,
        dropout_p: float = 0.0,
        softmax_scale: float | None = None,
        causal: bool = False,
        window_size: tuple[int, int] = (-1, -1),
        softcap: float = 0.0,
        alibi_slopes: torch.Tensor | None = None,
        deterministic: bool = False,
        return_attn_probs: bool = False,
        block_table: torch.Tensor | None = None,
    ) -> torch.Tensor:
        calls.append(
            dict(cu_seqlens_q=cu_seqlens_q.clone(), cu_seqlens_k=cu_seqlens_k.clone(), block_table=block_table)
        )
        calls[-1].update(max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k, causal=causal, window_size=window_size)
        calls[-1]["softmax_scale"] = softmax_scale
        assert q.dtype in (torch.float16, torch.bfloat16) and k.dtype == v.dtype == q.dtype
        assert cu_seqlens_q.dtype == cu_seqlens_k.dtype == torch.int32
        assert cu_seqlens_q.is_contiguous() and cu_seqlens_k.is_contiguous()
        assert block_table is not None and block_table.dtype == torch.int32 and block_table.stride(-1) == 1
        assert k.dim() == 4 and k.shape[1] % 256 == 0, "Paged KV cache block size must be divisible by 256"
        q_lens, k_lens = cu_seqlens_q.diff().tolist(), cu_seqlens_k.diff().tolist()
        assert block_table.shape[0] == len(q_lens) and q.shape[0] == cu_seqlens_q[-1]
        assert max_seqlen_q == max(q_lens) and max_seqlen_k == max(k_lens)
        left, right = window_size
        out = torch.full_like(q, float("nan"))
        for b, (start, n, length) in enumerate(zip(cu_seqlens_q.tolist(), q_lens, k_lens)):
            diag = torch.arange(n)[:, None] + length - n  # bottom-right aligned
            j = torch.arange(length)[None, :]
            visible = (j <= diag) if causal else torch.ones(n, length, dtype=torch.bool)
            visible = (
                visible & ((j >= diag - left) if left >= 0 else True) & ((j <= diag + right) if right >= 0 else True)
            )
            keys, values = _gather(k, block_table[b], length), _gather(v, block_table[b], length)
            out[start : start + n] = _attend(q[start : start + n], keys, values, visible, softmax_scale or 1.0)
        return out

    fake = types.ModuleType("flash_attn")
    fake.flash_attn_varlen_func = flash_attn_varlen_func  # type: ignore[attr-defined]
    return fake


@pytest.fixture
def flash_attn_calls(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[dict[str, Any]]]:
    """Install the fake flash_attn; yields the list of recorded calls."""
    calls: list[dict[str, Any]] = []
    monkeypatch.setitem(sys.modules, "flash_attn", _fake_flash_attn(calls))
    cuda_backend._load_flash_attn_varlen.cache_clear()
    yield calls
    cuda_backend._load_flash_attn_varlen.cache_clear()


def _check_npu_call(query: torch.Tensor, key: torch.Tensor, kw: dict[str, Any]) -> tuple[list[int], list[int]]:
    """The documented TND + page attention argument layout; returns (query lengths, kv lengths)."""
    assert kw.pop("input_layout") == "TND" and kw.pop("sparse_mode") == 3
    mask = kw.pop("atten_mask")
    assert mask.shape == (2048, 2048) and mask.dtype in (torch.bool, torch.int8, torch.uint8)
    assert torch.equal(mask.bool(), torch.ones(2048, 2048, dtype=torch.bool).triu(1))
    assert query.dim() == 3 and query.is_contiguous() and query.shape[1] == kw["num_heads"]
    block_size, kv_heads = kw["block_size"], kw["num_key_value_heads"]
    assert key.dim() == 3 and key.shape[1] == block_size and key.shape[2] == kv_heads * query.shape[2]
    assert block_size % 128 == 0 and 128 <= block_size <= 512
    ends, kv_lens, table = kw["actual_seq_lengths"], kw["actual_seq_lengths_kv"], kw["block_table"]
    assert isinstance(ends, list) and all(isinstance(e, int) for e in ends) and ends[-1] == query.shape[0]
    assert isinstance(kv_lens, list) and len(kv_lens) == len(ends) and table.shape[0] == len(ends)
    assert table.dtype == torch.int32 and table.is_contiguous()
    q_lens = [e - s for s, e in zip([0, *ends[:-1]], ends)]
    assert all(n >= 0 for n in q_lens)
    return q_lens, kv_lens


def _fake_torch_npu(calls: list[dict[str, Any]]) -> types.ModuleType:
    """``npu_fused_infer_attention_score`` (TND, block table, sparse_mode 3) and ``_npu_reshape_and_cache``."""

    def npu_fused_infer_attention_score(
        query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kw: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append(dict(kw))
        q_lens, kv_lens = _check_npu_call(query, key, kw)
        known = {"block_table", "block_size", "actual_seq_lengths", "actual_seq_lengths_kv", "num_heads"}
        assert set(kw) == known | {"num_key_value_heads", "scale"}, sorted(kw)
        blocks, block_size = key.shape[:2]
        k4 = key.view(blocks, block_size, kw["num_key_value_heads"], -1)
        v4 = value.view(blocks, block_size, kw["num_key_value_heads"], -1)
        out, start = torch.full_like(query, float("nan")), 0
        for b, (n, length) in enumerate(zip(q_lens, kv_lens)):
            visible = torch.arange(length)[None, :] <= torch.arange(n)[:, None] + length - n  # rightDownCausal
            keys, values = _gather(k4, kw["block_table"][b], length), _gather(v4, kw["block_table"][b], length)
            out[start : start + n] = _attend(query[start : start + n], keys, values, visible, kw["scale"])
            start += n
        return out, torch.zeros(1)

    def _npu_reshape_and_cache(
        key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, slots: torch.Tensor
    ) -> None:
        calls.append({"slots": slots.clone()})
        assert slots.dtype == torch.int32 and key.dtype == key_cache.dtype and value.dtype == value_cache.dtype
        block_size = key_cache.shape[1]
        for i, slot in enumerate(slots.tolist()):
            if slot >= 0:
                key_cache[slot // block_size, slot % block_size] = key[i]
                value_cache[slot // block_size, slot % block_size] = value[i]

    fake = types.ModuleType("torch_npu")
    fake.npu_fused_infer_attention_score = npu_fused_infer_attention_score  # type: ignore[attr-defined]
    fake._npu_reshape_and_cache = _npu_reshape_and_cache  # type: ignore[attr-defined]
    return fake


@pytest.fixture
def npu_env(clean_registry: None, monkeypatch: pytest.MonkeyPatch) -> tuple[types.ModuleType, list[dict[str, Any]]]:
    """The NPU backend imported over the fake torch_npu, with the registry treating 'npu' as available."""
    calls: list[dict[str, Any]] = []
    monkeypatch.setitem(sys.modules, "torch_npu", _fake_torch_npu(calls))
    monkeypatch.delitem(sys.modules, "pypto_kernels.backends.npu", raising=False)
    monkeypatch.setattr(pypto_kernels.device, "npu_available", lambda: True)
    npu_backend = importlib.import_module("pypto_kernels.backends.npu")
    monkeypatch.setitem(sys.modules, "pypto_kernels.backends.npu", npu_backend)  # dropped again on teardown
    monkeypatch.setattr(npu_backend, "_CAUSAL_MASKS", {})
    return npu_backend, calls


class PagedArgs(NamedTuple):
    """The positional arguments of a paged_attention call, up to ``scale``."""

    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_tables: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    scale: float

    def cpu(self) -> PagedArgs:
        return self.to("cpu")

    def to(self, device: torch.device | str) -> PagedArgs:
        q, k, v, tables, qsl, seq_lens, scale = self
        return PagedArgs(
            q.to(device), k.to(device), v.to(device), tables.to(device), qsl.to(device), seq_lens.to(device), scale
        )


def build_batch(
    batch: list[tuple[int, int]],
    block_size: int,
    dtype: torch.dtype = torch.bfloat16,
    heads: tuple[int, int] = (4, 2),
    head_dim: int = 64,
    pad_rows: int = 3,
    device: torch.device | str = "cpu",
) -> tuple[PagedArgs, dict[str, Any]]:
    """Positional args (query .. scale) and host-length kwargs of a paged_attention call; shuffled blocks."""
    gen = torch.Generator().manual_seed(len(batch) * 1000 + block_size)
    blocks_per = [-(-seq // block_size) for _, seq in batch]
    num_blocks = sum(blocks_per) + 2
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(batch), max(blocks_per) + 1, dtype=torch.int32)  # padded with 0 like the runner
    used = 0
    for r, n in enumerate(blocks_per):
        tables[r, :n] = perm[used : used + n]
        used += n
    cache_shape = (num_blocks, block_size, heads[1], head_dim)
    key_cache, value_cache = (torch.randn(cache_shape, generator=gen).to(dtype) for _ in range(2))
    q_lens, kv_lens = [q for q, _ in batch], [s for _, s in batch]
    query = torch.randn(sum(q_lens) + pad_rows, heads[0], head_dim, generator=gen).to(dtype)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    args = PagedArgs(query, key_cache, value_cache, tables, qsl, torch.tensor(kv_lens, dtype=torch.int32), SCALE)
    return args.to(device), {"query_lens_host": q_lens, "seq_lens_host": kv_lens}


def _assert_matches_reference(out: torch.Tensor, args: PagedArgs, window: int | None = None) -> None:
    expected = _reference_paged_attention(*args, sliding_window=window)
    assert out.shape == expected.shape and out.dtype == expected.dtype
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)
    num_tokens = int(args[4][-1])
    assert not out[num_tokens:].any(), "rows past the last request must be zero"


# ---------------------------------------------------------------------------------------------- CUDA


@pytest.mark.parametrize("window", [None, 100])
def test_cuda_paged_attention_glue_matches_reference(
    flash_attn_calls: list[dict[str, Any]], window: int | None
) -> None:
    args, hosts = build_batch(CUDA_BATCH, block_size=256)
    assert cuda_backend.supports_paged_attention(*args, sliding_window=window, **hosts)
    out = cuda_backend.paged_attention(*args, sliding_window=window, **hosts)
    _assert_matches_reference(out, args, window)
    (call,) = flash_attn_calls
    assert torch.equal(call["cu_seqlens_q"], torch.tensor([0, 300, 350, 351, 352, 359], dtype=torch.int32))
    assert torch.equal(call["cu_seqlens_k"], torch.tensor([0, 300, 900, 1157, 1158, 1165], dtype=torch.int32))
    assert (call["max_seqlen_q"], call["max_seqlen_k"]) == (300, 600)
    assert call["causal"] is True and call["softmax_scale"] == SCALE
    assert call["window_size"] == ((window - 1, 0) if window is not None else (-1, -1))
    assert torch.equal(call["block_table"], args[3])


def test_cuda_paged_attention_decode_only_and_empty(flash_attn_calls: list[dict[str, Any]]) -> None:
    args, hosts = build_batch([(1, 513), (1, 40), (1, 256)], block_size=256, heads=(8, 1), pad_rows=0)
    _assert_matches_reference(cuda_backend.paged_attention(*args, **hosts), args)
    assert flash_attn_calls[-1]["max_seqlen_q"] == 1
    empty = cuda_backend.paged_attention(args[0][:0], *args[1:], query_lens_host=[0, 0, 0], seq_lens_host=[5, 5, 5])
    assert empty.shape == (0, 8, 64) and len(flash_attn_calls) == 1


def test_cuda_write_kv_cache_matches_reference() -> None:
    gen = torch.Generator().manual_seed(1)
    key_cache = torch.randn(6, 16, 2, 8, generator=gen).to(torch.bfloat16)
    value_cache = torch.randn(6, 16, 2, 8, generator=gen).to(torch.bfloat16)
    slots = torch.randperm(6 * 16, generator=gen)[:11]
    key, value = torch.randn(11, 2, 8, generator=gen), torch.randn(11, 2, 8, generator=gen)  # float32: cast on write
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    pypto_kernels.reference_kernel("write_kv_cache")(key, value, expected_k, expected_v, slots)
    assert cuda_backend.supports_write_kv_cache(key, value, key_cache, value_cache, slots)
    cuda_backend.write_kv_cache(key, value, key_cache, value_cache, slots.to(torch.int32))
    assert torch.equal(key_cache, expected_k) and torch.equal(value_cache, expected_v)
    strided = torch.zeros(16, 6, 2, 8).transpose(0, 1)
    assert not cuda_backend.supports_write_kv_cache(key, value, strided, strided, slots)


def test_cuda_routing_declines_to_the_reference(clean_registry: None, flash_attn_calls: list[dict[str, Any]]) -> None:
    fast = pypto_kernels.get_kernel("paged_attention", "cuda")
    assert fast is not cuda_backend.paged_attention and fast.fast is cuda_backend.paged_attention  # type: ignore[attr-defined]
    args, hosts = build_batch(CUDA_BATCH, block_size=256)
    sinks = torch.randn(4)
    out = fast(*args, None, sinks, **hosts)  # sinks: flash-attn has none
    torch.testing.assert_close(out, pypto_kernels.reference_kernel("paged_attention")(*args, None, sinks, **hosts))
    fast(*args)  # no host lengths: no max lengths without a device read
    small, small_hosts = build_batch(CUDA_BATCH, block_size=16)
    fast(*small, **small_hosts)  # block size 16: not a multiple of 256
    fp32, fp32_hosts = build_batch(CUDA_BATCH[:2], block_size=256, dtype=torch.float32)
    fast(*fp32, **fp32_hosts)
    assert flash_attn_calls == []
    # A keyword option the fast path does not implement (one the reference may gain) declines the call.
    assert not cuda_backend.supports_paged_attention(*args, **hosts, future_option=1)
    assert "future_option" in str(cuda_backend.explain_paged_attention(options=["future_option"]))
    _assert_matches_reference(fast(*args, **hosts), args)
    assert len(flash_attn_calls) == 1


def test_cuda_describe_kernel(
    clean_registry: None, flash_attn_calls: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch
) -> None:
    label = cuda_backend.PAGED_ATTENTION_LABEL
    assert pypto_kernels.describe_kernel("paged_attention", "cuda") == label
    assert pypto_kernels.describe_kernel("paged_attention", "cuda:0", sliding_window=128, block_size=256) == label
    sinks = pypto_kernels.describe_kernel("paged_attention", "cuda", sinks=True)
    assert sinks.startswith("reference") and "sinks" in sinks
    assert "256" in pypto_kernels.describe_kernel("paged_attention", "cuda", block_size=16)
    assert "host" in pypto_kernels.describe_kernel("paged_attention", "cuda", host_lengths=False)
    assert pypto_kernels.describe_kernel("write_kv_cache", "cuda") == cuda_backend.WRITE_KV_CACHE_LABEL
    assert pypto_kernels.describe_kernel("paged_attention", "cpu") == cpu_backend.PAGED_ATTENTION_LABEL
    small = {"num_kv_heads": 2, "head_dim": 64, "cache_dtype": torch.float32}
    assert pypto_kernels.describe_kernel("paged_attention", "cpu", **small) == cpu_backend.PAGED_ATTENTION_LABEL
    # A float32 cache is read in place however wide its tokens; a bfloat16 one too by the native kernel,
    # and without it gathered only up to 1 KiB a token.
    wide = {"num_kv_heads": 8, "head_dim": 128}
    in_place = pypto_kernels.describe_kernel("paged_attention", "cpu", cache_dtype=torch.float32, **wide)
    assert in_place == cpu_backend.PAGED_ATTENTION_LABEL
    bf16 = pypto_kernels.describe_kernel("paged_attention", "cpu", cache_dtype=torch.bfloat16, **wide)
    if pypto_kernels.native.library() is not None:
        assert bf16 == cpu_backend.PAGED_ATTENTION_LABEL
    monkeypatch.setattr(pypto_kernels.native, "library", lambda: None)
    gathered = pypto_kernels.describe_kernel("paged_attention", "cpu", cache_dtype=torch.bfloat16, **wide)
    assert gathered.startswith("reference") and "2048 bytes" in gathered
    assert pypto_kernels.describe_kernel("moe_experts", "cuda") == "reference"


def test_cuda_without_flash_attn_uses_the_reference(clean_registry: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # makes `import flash_attn` raise ImportError
    cuda_backend._load_flash_attn_varlen.cache_clear()
    try:
        text = pypto_kernels.describe_kernel("paged_attention", "cuda")
        assert text.startswith("reference") and "flash_attn" in text and "not importable" in text
        args, hosts = build_batch(CUDA_BATCH[:3], block_size=256)
        assert not cuda_backend.supports_paged_attention(*args, **hosts)
        out = pypto_kernels.get_kernel("paged_attention", "cuda")(*args, **hosts)
        _assert_matches_reference(out, args)
    finally:
        cuda_backend._load_flash_attn_varlen.cache_clear()


# ----------------------------------------------------------------------------------------------- NPU


def test_npu_paged_attention_glue_matches_reference(npu_env: tuple[types.ModuleType, list[dict[str, Any]]]) -> None:
    npu_backend, calls = npu_env
    args, hosts = build_batch(NPU_BATCH, block_size=128)
    assert npu_backend.supports_paged_attention(*args, **hosts)
    out = npu_backend.paged_attention(*args, **hosts)
    _assert_matches_reference(out, args)
    (call,) = calls
    assert call["actual_seq_lengths"] == [300, 350, 351, 352, 359]
    assert call["actual_seq_lengths_kv"] == [300, 600, 129, 1, 7]
    assert (call["num_heads"], call["num_key_value_heads"], call["block_size"]) == (4, 2, 128)
    assert call["scale"] == SCALE and torch.equal(call["block_table"], args[3])


def test_npu_write_kv_cache_matches_reference(npu_env: tuple[types.ModuleType, list[dict[str, Any]]]) -> None:
    npu_backend, calls = npu_env
    gen = torch.Generator().manual_seed(2)
    key_cache, value_cache = torch.randn(4, 128, 2, 16).half(), torch.randn(4, 128, 2, 16).half()
    slots = torch.randperm(4 * 128, generator=gen)[:9]
    key, value = torch.randn(9, 2, 16, generator=gen), torch.randn(9, 2, 16, generator=gen)
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    pypto_kernels.reference_kernel("write_kv_cache")(key, value, expected_k, expected_v, slots)
    assert npu_backend.supports_write_kv_cache(key, value, key_cache, value_cache, slots)
    npu_backend.write_kv_cache(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache, expected_k) and torch.equal(value_cache, expected_v)
    assert torch.equal(calls[-1]["slots"], slots.to(torch.int32))
    f32 = torch.zeros(4, 128, 2, 16)
    assert not npu_backend.supports_write_kv_cache(key, value, f32, f32, slots)


def test_npu_routing_and_describe(npu_env: tuple[types.ModuleType, list[dict[str, Any]]]) -> None:
    npu_backend, calls = npu_env
    fast = pypto_kernels.get_kernel("paged_attention", "npu:0")
    assert fast.fast is npu_backend.paged_attention  # type: ignore[attr-defined]
    args, hosts = build_batch(NPU_BATCH[:3], block_size=128)
    windowed = fast(*args, 64, **hosts)  # sliding windows are declared unsupported
    _assert_matches_reference(windowed, args, window=64)
    fast(*args, None, torch.randn(4), **hosts)  # sinks
    small, small_hosts = build_batch(NPU_BATCH[:3], block_size=16)
    fast(*small, **small_hosts)
    fast(*args)  # no host lengths
    assert calls == []
    _assert_matches_reference(fast(*args, **hosts), args)
    assert len(calls) == 1
    label = npu_backend.PAGED_ATTENTION_LABEL
    assert pypto_kernels.describe_kernel("paged_attention", "npu", block_size=128, head_dim=128) == label
    for features in ({"sliding_window": 128}, {"sinks": True}, {"block_size": 16}, {"dtype": torch.float32}):
        assert pypto_kernels.describe_kernel("paged_attention", "npu", **features).startswith("reference"), features
    assert pypto_kernels.describe_kernel("write_kv_cache", "npu") == npu_backend.WRITE_KV_CACHE_LABEL


# ---------------------------------------------------------------------------------------- real devices


def _flash_attn_importable() -> bool:
    cuda_backend._load_flash_attn_varlen.cache_clear()
    return cuda_backend.flash_attn_varlen() is not None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("window", [None, 100])
def test_cuda_device_paged_attention_matches_reference(window: int | None) -> None:
    """On a real GPU: the registered path (flash-attn where importable, else the reference) vs the padded one."""
    args, hosts = build_batch(CUDA_BATCH, block_size=256, device="cuda")
    features = {"block_size": 256, "sliding_window": window}
    expected_label = cuda_backend.PAGED_ATTENTION_LABEL if _flash_attn_importable() else None
    described = pypto_kernels.describe_kernel("paged_attention", args[0].device, **features)
    assert described == expected_label or (expected_label is None and described.startswith("reference"))
    out = pypto_kernels.paged_attention(*args, sliding_window=window, **hosts)
    _assert_matches_reference(out.cpu(), args.cpu(), window)
    key, value = torch.randn(5, 2, 64, device="cuda"), torch.randn(5, 2, 64, device="cuda")
    slots = torch.tensor([3, 700, 256, 1, 9], device="cuda")
    k_cache, v_cache = args[1].clone(), args[2].clone()
    pypto_kernels.write_kv_cache(key, value, k_cache, v_cache, slots)
    expected_k, expected_v = args[1].clone(), args[2].clone()
    pypto_kernels.reference_kernel("write_kv_cache")(key, value, expected_k, expected_v, slots)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


@pytest.mark.skipif(not pypto_kernels.npu_available(), reason="needs an Ascend NPU with torch_npu")
def test_npu_device_paged_attention_matches_reference() -> None:
    """On a real NPU: the fused op (TND, block table) and the reshape-and-cache write vs the references."""
    device = pypto_kernels.select_device("npu")
    args, hosts = build_batch(NPU_BATCH, block_size=128, head_dim=128, device=device)
    assert pypto_kernels.describe_kernel("paged_attention", device, block_size=128, head_dim=128).startswith("npu")
    out = pypto_kernels.paged_attention(*args, **hosts)
    _assert_matches_reference(out.cpu(), args.cpu())
    key, value = torch.randn(5, 2, 128).to(device), torch.randn(5, 2, 128).to(device)
    slots = torch.tensor([3, 700, 256, 1, 9]).to(device)
    k_cache, v_cache = args[1].clone(), args[2].clone()
    pypto_kernels.write_kv_cache(key, value, k_cache, v_cache, slots)
    expected_k, expected_v = args[1].clone(), args[2].clone()
    pypto_kernels.reference_kernel("write_kv_cache")(key, value, expected_k, expected_v, slots)
    assert torch.equal(k_cache.cpu(), expected_k.cpu()) and torch.equal(v_cache.cpu(), expected_v.cpu())


def test_cuda_flash_attn_without_block_table_uses_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    old = types.ModuleType("flash_attn")  # flash-attn < 2.6: varlen without paged KV
    old.flash_attn_varlen_func = lambda q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k: q  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "flash_attn", old)
    cuda_backend._load_flash_attn_varlen.cache_clear()
    try:
        assert cuda_backend.flash_attn_varlen() is None
        assert "not importable" in str(cuda_backend.explain_paged_attention(block_size=256))
    finally:
        cuda_backend._load_flash_attn_varlen.cache_clear()
