"""The native CPU paged attention (C, :mod:`pypto_kernels.native`) against a naive per-token loop, and
its build: cached per source and CPU, off without a compiler or when asked, never half-loaded."""

from __future__ import annotations

import logging
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

import pypto_kernels.attention as attention_module
from pypto_kernels import native, paged_attention

from .test_kernels_attention import PAGED_ARGS, build_paged_batch, expected_paged

needs_native = pytest.mark.skipif(
    native.library() is None, reason="no native CPU kernels on this machine (no C compiler; see the log)"
)

# (q_len, seq_len): decode rows of every block edge, speculative runs (3 and 16 queries: native), a
# 17-query prefill chunk (the request loop), an idle request.
RUNS_BATCH = [(1, 1), (1, 15), (1, 16), (1, 17), (1, 300), (3, 40), (16, 50), (17, 60), (0, 9)]


def _head_major(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` with its caches copied into head-major views (whatever their dtype)."""
    out = dict(data)
    for name in ("key_cache", "value_cache"):
        blocks, size, heads, dim = data[name].shape
        physical = torch.empty((blocks, heads, size, dim), dtype=data[name].dtype)
        out[name] = physical.transpose(1, 2).copy_(data[name])
        assert attention_module.is_head_major(out[name])
    return out


class _Calls:
    """Counts a native kernel's calls and the query rows they attend: the row kernel's (one per row of
    its rows argument) or, with ``kernel="prefill_attention"``, the prefill kernel's (its spans' query
    counts)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, kernel: str = "paged_attention") -> None:
        self.calls, self.rows = 0, 0
        inner = getattr(native, kernel)

        def counted(*args: Any, **kwargs: Any) -> torch.Tensor:
            self.calls += 1
            self.rows += int(args[4][:, 2].sum()) if kernel == "prefill_attention" else int(args[4].shape[0])
            return inner(*args, **kwargs)

        monkeypatch.setattr(native, kernel, counted)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["token_major", "head_major"])
@pytest.mark.parametrize(("num_q_heads", "num_kv_heads"), [(4, 4), (8, 2)])
@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_native_attends_decode_and_speculative_runs_as_the_naive_loop(
    monkeypatch: pytest.MonkeyPatch,
    dtype: torch.dtype,
    layout: str,
    num_q_heads: int,
    num_kv_heads: int,
    window: int | None,
    with_sinks: bool,
) -> None:
    """Every run of up to 16 queries goes through one native call (the 17-query chunk does not), in a
    NaN-filled cache with shuffled blocks; a bfloat16 cache is widened exactly, so its float32 result
    matches the naive loop over the same values to float32 rounding."""
    gen = torch.Generator().manual_seed(num_q_heads + (window or 0) + 7 * with_sinks)
    data = build_paged_batch(RUNS_BATCH, 16, num_q_heads, num_kv_heads, 32, 24, dtype, gen)
    if layout == "head_major":
        data = _head_major(data)
    sinks = torch.randn(num_q_heads, generator=gen) if with_sinks else None
    calls = _Calls(monkeypatch)
    out = paged_attention(*(data[name] for name in PAGED_ARGS), 0.25, sliding_window=window, sinks=sinks)
    assert calls.calls == 1 and calls.rows == sum(q for q, _ in RUNS_BATCH if q <= attention_module.NATIVE_MAX_QUERIES)
    expected = expected_paged(data, 0.25, window, sinks)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=tolerance)
    if dtype == torch.bfloat16:  # the kernel's own float32 output, before the cast back to bfloat16
        tables, spans = attention_module._tables_and_spans(
            data["query"], data["key_cache"], data["block_tables"], data["query_start_loc"], data["seq_lens"],
            window, None, None,
        )  # fmt: skip
        short = [s for s in spans if s.num_queries <= attention_module.NATIVE_MAX_QUERIES]
        rows = attention_module._native_rows(short, window)
        raw = native.paged_attention(data["query"], data["key_cache"], data["value_cache"], tables, rows, 0.25, sinks)
        picked = rows[:, 0]
        torch.testing.assert_close(raw[picked], expected[picked], atol=1e-5, rtol=1e-5)


@needs_native
def test_native_result_does_not_depend_on_the_threads() -> None:
    """The same bits on any thread count: the (row, KV head) items split in contiguous ranges of about
    equal keys, uneven ones, and more threads than items (some take none)."""
    gen = torch.Generator().manual_seed(11)
    data = build_paged_batch([(1, 40 + 9 * r) for r in range(24)], 16, 8, 2, 64, 64, torch.float32, gen)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = paged_attention(*(data[name] for name in PAGED_ARGS), 0.125)
        for count in (max(2, threads), 3, 7, 64):
            torch.set_num_threads(count)
            assert torch.equal(one, paged_attention(*(data[name] for name in PAGED_ARGS), 0.125)), count
    finally:
        torch.set_num_threads(threads)


@needs_native
def test_native_rows_outside_the_call_are_left_and_bad_out_is_refused() -> None:
    gen = torch.Generator().manual_seed(12)
    data = build_paged_batch([(1, 20), (1, 33)], 16, 4, 2, 16, 16, torch.float32, gen)
    tables = data["block_tables"]
    out = torch.full((2, 4, 16), 7.0)
    rows = torch.tensor([[1, 1, 0, 33]])
    native.paged_attention(data["query"], data["key_cache"], data["value_cache"], tables, rows, 0.25, None, out)
    assert torch.equal(out[0], torch.full((4, 16), 7.0))
    torch.testing.assert_close(out[1], expected_paged(data, 0.25, None, None)[1], atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="contiguous float32"):
        native.paged_attention(
            data["query"], data["key_cache"], data["value_cache"], tables, rows, 0.25, None, out.double()
        )


@pytest.fixture
def fresh_library(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Any:
    """``native.library`` rebuilt from scratch into an empty cache directory, restored afterwards."""
    monkeypatch.setenv("PYPTO_KERNELS_CACHE", str(tmp_path))
    native.library.cache_clear()
    yield tmp_path
    native.library.cache_clear()


def test_native_off_when_asked(fresh_library: Path, monkeypatch: pytest.MonkeyPatch, caplog: Any) -> None:
    monkeypatch.setenv("PYPTO_KERNELS_NATIVE", "0")
    with caplog.at_level(logging.INFO, logger="pypto_kernels"):
        assert native.library() is None
    assert "PYPTO_KERNELS_NATIVE=0" in caplog.text
    assert not native.reads_dtypes(torch.float32, torch.float32)
    assert list(fresh_library.iterdir()) == []


def test_no_compiler_or_a_failed_build_leaves_the_torch_paths(
    fresh_library: Path, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with caplog.at_level(logging.WARNING, logger="pypto_kernels"):
        assert native.library() is None
    assert "no C compiler" in caplog.text
    native.library.cache_clear()
    monkeypatch.setenv("CC", str(fresh_library / "no-such-cc"))
    with caplog.at_level(logging.WARNING, logger="pypto_kernels"):
        assert native.library() is None
    assert "failed" in caplog.text
    # The dispatched kernel still answers, through the torch paths.
    gen = torch.Generator().manual_seed(13)
    data = build_paged_batch([(1, 20), (3, 33)], 16, 4, 2, 16, 16, torch.float32, gen)
    out = paged_attention(*(data[name] for name in PAGED_ARGS), 0.25)
    torch.testing.assert_close(out, expected_paged(data, 0.25, None, None), atol=1e-5, rtol=1e-5)


@needs_native
def test_build_is_cached_and_renamed_into_place(fresh_library: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    compiles: list[list[str]] = []
    run = subprocess.run

    def counted(args: list[str], **kwargs: Any) -> Any:
        if "-o" in args:
            compiles.append(args)
        return run(args, **kwargs)

    monkeypatch.setattr(subprocess, "run", counted)
    compiler = native._compiler()
    assert compiler is not None
    first = native._build(compiler)
    second = native._build(compiler)
    assert first == second and len(compiles) == 1
    assert list(fresh_library.iterdir()) == [first]  # no partial file left beside it
    assert native.library() is not None and len(compiles) == 1


@needs_native
@pytest.mark.parametrize("head_dim", [32, 64, 96])
def test_bfloat16_queries_take_the_bf16_dot_product_with_the_same_result(head_dim: int) -> None:
    """A bfloat16 query over a bfloat16 cache: AVX512-BF16's pairwise products (a head dim of one, two
    and three 32-value steps) against widening each key, both equal to the naive loop over the same
    values to float32 rounding; the two sum in different orders, so their bits differ somewhere, which
    shows the dot-product path ran."""
    if not native.bf16_dot_available():
        pytest.skip("this CPU has no AVX512-BF16: the library is built without the bfloat16 dot product")
    gen = torch.Generator().manual_seed(head_dim)
    batch = [(1, 40 + 7 * r) for r in range(24)]
    data = build_paged_batch(batch, 16, 8, 2, head_dim, head_dim, torch.bfloat16, gen)
    data = _head_major(data)
    tables, spans = attention_module._tables_and_spans(
        data["query"], data["key_cache"], data["block_tables"], data["query_start_loc"], data["seq_lens"],
        None, None, None,
    )  # fmt: skip
    rows = attention_module._native_rows(spans, None)
    args = (data["query"], data["key_cache"], data["value_cache"], tables, rows, 0.25, None)
    dotted = native.paged_attention(*args)
    widened = native.paged_attention(*args, bf16_dot=False)
    expected = expected_paged(data, 0.25, None, None)
    torch.testing.assert_close(dotted, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(widened, expected, atol=1e-5, rtol=1e-5)
    assert not torch.equal(dotted, widened)


# Decode rows of every length about a 16-key block (one, a block less one, a block, a block and one,
# two blocks either side) and longer, and a speculative run of three queries.
BLOCKED_BATCH = [(1, 1), (1, 15), (1, 16), (1, 17), (1, 31), (1, 32), (1, 33), (1, 300), (3, 45)]


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("num_q_heads", "num_kv_heads", "head_dim", "window", "with_sinks"),
    [(4, 4, 64, None, False), (4, 2, 64, 20, True), (16, 8, 128, None, False), (8, 2, 128, None, True),
     (14, 2, 96, 37, False), (7, 1, 32, None, False)],
)  # fmt: skip
def test_blocked_decode_attention_is_the_naive_loop(
    dtype: torch.dtype, num_q_heads: int, num_kv_heads: int, head_dim: int, window: int | None, with_sinks: bool
) -> None:
    """The blocked passes (16 keys' scores summed at once, the value sums in registers: query heads one,
    two, four and seven = 4 + 2 + 1 at a time, value dims 32 to 128 per tile, bfloat16 values widened
    into even and odd dims) against the naive loop over the same values, for float32 and bfloat16
    caches, bfloat16 queries (the bf16 dot product where built) and float32 ones over a bfloat16 cache
    (the keys widened). The per-key passes give the same to float32 rounding."""
    if not native.blocked_attention_available():
        pytest.skip("this CPU has no AVX-512: the library is built without the blocked passes")
    gen = torch.Generator().manual_seed(num_q_heads * head_dim + (window or 0))
    data = build_paged_batch(BLOCKED_BATCH, 16, num_q_heads, num_kv_heads, head_dim, head_dim, dtype, gen)
    if num_kv_heads > 1:  # one KV head: the two layouts are one
        data = _head_major(data)
    sinks = torch.randn(num_q_heads, generator=gen) if with_sinks else None
    tables, spans = attention_module._tables_and_spans(
        data["query"], data["key_cache"], data["block_tables"], data["query_start_loc"], data["seq_lens"],
        window, None, None,
    )  # fmt: skip
    rows = attention_module._native_rows(spans, window)
    expected = expected_paged(data, 0.25, window, sinks)
    queries = [data["query"]] if dtype == torch.float32 else [data["query"], data["query"].float()]
    for query in queries:
        args = (query, data["key_cache"], data["value_cache"], tables, rows, 0.25, sinks)
        blocked = native.paged_attention(*args)
        per_key = native.paged_attention(*args, blocked=False)
        torch.testing.assert_close(blocked, expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(per_key, expected, atol=1e-5, rtol=1e-5)
        # The bf16 dot product's sums are the per-key passes' to the bit (the 16 lane sums by the same
        # tree); the others' are not, which shows the blocked passes ran.
        dotted = query.dtype == torch.bfloat16 and native.bf16_dot_available()
        assert torch.equal(blocked, per_key) == dotted


@needs_native
@pytest.mark.parametrize("blocked", [True, False])
@pytest.mark.parametrize("head_dim", [64, 24])
def test_native_decode_writes_bfloat16_rows_as_torch_rounds_the_float32_ones(blocked: bool, head_dim: int) -> None:
    """A bfloat16 ``out``: each row the kernel names is its float32 result rounded by torch
    (``.to(torch.bfloat16)``), bitwise, through the blocked and the per-key passes (a value dim of
    24 takes the per-key ones either way); the rows it does not name are left as they are."""
    gen = torch.Generator().manual_seed(head_dim)
    data = build_paged_batch([(1, 40), (1, 17), (1, 70)], 16, 8, 2, 32, head_dim, torch.bfloat16, gen)
    rows = torch.tensor([[0, 0, 0, 40], [2, 2, 0, 70]])
    args = (data["query"], data["key_cache"], data["value_cache"], data["block_tables"], rows, 0.25, None)
    wide = native.paged_attention(*args, blocked=blocked)
    narrow = native.paged_attention(*args, out=torch.full((3, 8, head_dim), 5.0, dtype=torch.bfloat16), blocked=blocked)
    assert torch.equal(narrow[1], torch.full((8, head_dim), 5.0, dtype=torch.bfloat16))
    assert torch.equal(narrow[[0, 2]], wide[[0, 2]].to(torch.bfloat16))


@needs_native
def test_blocked_decode_attention_of_a_row_depends_only_on_its_own_inputs() -> None:
    """Each row's result is the same bits in one call with the others on one thread as alone on two
    (bfloat16 cache, dot product where built: the engine's default on such a CPU)."""
    gen = torch.Generator().manual_seed(5)
    data = build_paged_batch([(3, 70), (1, 68), (1, 40)], 16, 8, 2, 64, 64, torch.bfloat16, gen)
    rows = torch.tensor([[0, 0, 0, 68], [1, 0, 0, 69], [2, 0, 0, 70], [3, 1, 0, 68], [4, 2, 0, 40]])
    args = (data["query"], data["key_cache"], data["value_cache"], data["block_tables"])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        together = native.paged_attention(*args, rows, 0.25, None)
        torch.set_num_threads(max(2, threads))
        for r in range(rows.shape[0]):
            alone = native.paged_attention(*args, rows[r : r + 1], 0.25, None)
            assert torch.equal(together[r], alone[r])
    finally:
        torch.set_num_threads(threads)


def test_the_cache_directory_without_a_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A user without a home directory (no $HOME, no password entry) builds into the temporary
    directory instead of failing; the explicit settings win in order."""
    import tempfile

    monkeypatch.delenv("PYPTO_KERNELS_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)

    def no_home() -> Path:
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.setattr(Path, "home", staticmethod(no_home))
    assert native.cache_dir().parent == Path(tempfile.gettempdir())
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert native.cache_dir() == tmp_path / "xdg" / "pypto_kernels"
    monkeypatch.setenv("PYPTO_KERNELS_CACHE", str(tmp_path / "mine"))
    assert native.cache_dir() == tmp_path / "mine"


def test_a_cache_directory_others_may_write_is_refused(
    fresh_library: Path, monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    """A library found in the cache directory is loaded into the process, so a directory other users
    may write (or one of another user's) is refused, with the reason, and the torch paths run."""
    shared = fresh_library / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setenv("PYPTO_KERNELS_CACHE", str(shared))
    with caplog.at_level(logging.WARNING, logger="pypto_kernels"):
        assert native.library() is None
    assert "only it may write" in caplog.text
    assert list(shared.iterdir()) == []
    created = fresh_library / "fresh" / "dir"
    monkeypatch.setenv("PYPTO_KERNELS_CACHE", str(created))
    native.library.cache_clear()
    if native._compiler() is not None:
        assert native.library() is not None
        assert created.stat().st_mode & 0o777 == 0o700


def test_only_unscaled_cpu_caches_of_one_native_dtype_are_read_natively() -> None:
    """The C kernel reads host memory: an accelerator's cache (a fake CUDA one here, as the fake-device
    tests run) or a scaled (FP8) or mixed-dtype one never reaches it."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    cpu = torch.zeros(2, 16, 2, 32)
    assert native.reads(cpu, cpu, scaled=False) == (native.library() is not None)
    assert not native.reads(cpu, cpu, scaled=True)
    assert not native.reads(cpu, cpu.to(torch.bfloat16), scaled=False)
    assert not native.reads(cpu.to(torch.float8_e4m3fn), cpu.to(torch.float8_e4m3fn), scaled=False)
    with FakeTensorMode(allow_non_fake_inputs=True):
        cuda = torch.empty(2, 16, 2, 32, device="cuda")
        assert not native.reads(cuda, cuda, scaled=False)


# -- long runs (prefill chunks): csrc/prefill_attention.c


def _avx512_flags() -> frozenset[str]:
    """CPU flags where the paged attention routes prefill runs to the native kernel."""
    return frozenset({"avx2", "fma", "avx512f"})


def _expected_bf16_weights(data: dict[str, Any], scale: float, window: int | None) -> torch.Tensor:
    """The softmax reference with the weights rounded as the prefill kernel's bfloat16 pair path rounds
    them (in float64 otherwise): each key's weight ``exp(score - m)`` rounded to bfloat16, where ``m``
    is the running maximum of the scores up to the end of the key's chunk of 64 positions (chunks
    aligned to positions), the chunks' weighted sums rescaled to the last maximum, over the sum of the
    rounded weights."""
    outs = []
    qsl = data["query_start_loc"].tolist()
    for r, seq in enumerate(data["seq_lens"].tolist()):
        q = data["query"][qsl[r] : qsl[r + 1]].double()
        rep = q.shape[1] // data["keys"][r].shape[1]
        k, v = (data[name][r].double().repeat_interleave(rep, 1) for name in ("keys", "values"))
        out = torch.zeros(q.shape[0], q.shape[1], v.shape[2], dtype=torch.float64)
        for i in range(q.shape[0]):
            p = seq - q.shape[0] + i
            first = max(0, p - window + 1) if window else 0
            chunk = torch.arange(first, p + 1) // 64 - first // 64
            scores = torch.einsum("hd,lhd->hl", q[i], k[first : p + 1]) * scale
            top = torch.full((q.shape[1], int(chunk[-1]) + 1), -torch.inf, dtype=torch.float64)
            top = top.scatter_reduce(1, chunk.expand(q.shape[1], -1), scores, "amax").cummax(1).values
            weights = (scores - top[:, chunk]).exp().float().bfloat16().double()
            weights = weights * (top - top[:, -1:]).exp()[:, chunk]
            out[i] = torch.einsum("hl,lhd->hd", weights, v[first : p + 1]) / weights.sum(1)[:, None]
        outs.append(out)
    return torch.cat(outs).float()


def _weights_rounded(data: dict[str, Any]) -> bool:
    """Whether the prefill kernel takes its bfloat16 pair path for these caches (bfloat16, AVX512-BF16)."""
    return data["key_cache"].dtype == torch.bfloat16 and native.bf16_dot_available()


# (q_len, seq_len): whole prompts (shorter and longer than a 64-query tile), chunks over cached
# prefixes ending mid-block, decode rows and a speculative run beside them, an idle request.
PREFILL_BATCH = [(17, 17), (70, 70), (129, 200), (33, 47), (1, 90), (5, 61), (0, 9), (64, 64)]


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["token_major", "head_major"])
@pytest.mark.parametrize(
    ("num_q_heads", "num_kv_heads", "head_dim", "v_dim", "block_size"),
    [(4, 4, 40, 32, 16), (8, 2, 64, 64, 16), (8, 1, 24, 48, 8), (6, 3, 128, 16, 4)],
)
@pytest.mark.parametrize(("window", "with_sinks"), [(None, False), (20, False), (None, True), (37, True)])
def test_native_prefill_attends_long_runs_as_the_naive_loop(
    monkeypatch: pytest.MonkeyPatch,
    dtype: torch.dtype,
    layout: str,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    v_dim: int,
    block_size: int,
    window: int | None,
    with_sinks: bool,
) -> None:
    """Every run of more than 16 queries goes through one call of the prefill kernel (and the short
    runs through the row kernel) in a NaN-filled cache with shuffled blocks: the result is the naive
    per-query softmax loop's to float32 rounding (bfloat16 caches widened exactly)."""
    gen = torch.Generator().manual_seed(num_q_heads * 31 + head_dim + (window or 0) + with_sinks)
    data = build_paged_batch(PREFILL_BATCH, block_size, num_q_heads, num_kv_heads, head_dim, v_dim, dtype, gen)
    if layout == "head_major" and num_kv_heads > 1:  # one KV head: both layouts are the same memory
        data = _head_major(data)
    sinks = torch.randn(num_q_heads, generator=gen) if with_sinks else None
    monkeypatch.setattr(native, "cpu_flags", _avx512_flags)  # the routing of a CPU with AVX-512, on any host
    prefill, rows = _Calls(monkeypatch, "prefill_attention"), _Calls(monkeypatch)
    out = paged_attention(*(data[name] for name in PAGED_ARGS), 0.25, sliding_window=window, sinks=sinks)
    long_rows = sum(q for q, _ in PREFILL_BATCH if q > attention_module.NATIVE_MAX_QUERIES)
    assert (prefill.calls, prefill.rows) == (1, long_rows)
    assert rows.calls == 1 and rows.rows == sum(q for q, _ in PREFILL_BATCH) - long_rows
    expected = expected_paged(data, 0.25, window, sinks)
    tolerance = 2e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=tolerance)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_prefill_result_of_a_query_depends_only_on_its_own_inputs(dtype: torch.dtype) -> None:
    """A query's output is bitwise the same whether its prompt runs alone, in one chunk or in two,
    beside other requests or not, on one thread or two (chunks of keys are aligned to positions);
    bfloat16 queries and caches too (their pair dot products where the CPU has them, the weights then
    rounded to bfloat16: the reference that rounds them so, ten times closer than the unrounded one)."""
    gen = torch.Generator().manual_seed(5)
    data = build_paged_batch([(150, 150), (90, 130)], 16, 8, 2, 64, 64, dtype, gen)
    tables, _ = attention_module._tables_and_spans(
        data["query"], data["key_cache"], data["block_tables"], data["query_start_loc"], data["seq_lens"],
        None, None, None,
    )  # fmt: skip

    def run(span_rows: list[tuple[int, int, int, int, int]], threads: int) -> torch.Tensor:
        out = torch.zeros((data["query"].shape[0], 8, 64))
        saved = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            native.prefill_attention(
                data["query"], data["key_cache"], data["value_cache"], tables, torch.tensor(span_rows), 0.125,
                None, None, out,
            )  # fmt: skip
        finally:
            torch.set_num_threads(saved)
        return out

    together = run([(0, 0, 150, 0, 150), (150, 1, 90, 0, 130)], 2)
    alone = run([(0, 0, 150, 0, 150)], 1)
    # The same prompt as two chunks: 70 queries over keys 0..69, then 80 over 0..149.
    chunked = run([(0, 0, 70, 0, 70), (70, 0, 80, 0, 150)], 2)
    assert torch.equal(together[:150], alone[:150]) and torch.equal(together[:150], chunked[:150])
    exact = expected_paged(data, 0.125, None, None)
    if _weights_rounded(data):
        torch.testing.assert_close(together, _expected_bf16_weights(data, 0.125, None), atol=2e-4, rtol=0)
        assert (together - exact).abs().max() > 2e-3  # the weights really were rounded
    else:
        torch.testing.assert_close(together, exact, atol=2e-5, rtol=2e-5)
    assert not together.isnan().any()


@needs_native
def test_native_prefill_refuses_what_it_cannot_take(monkeypatch: pytest.MonkeyPatch) -> None:
    """A value head size not divisible by 16 keeps the request loop (and the kernel refuses it); an
    ``out`` neither float32 nor bfloat16 is refused."""
    gen = torch.Generator().manual_seed(6)
    data = build_paged_batch([(40, 40)], 16, 4, 2, 32, 24, torch.float32, gen)
    monkeypatch.setattr(native, "cpu_flags", _avx512_flags)  # the routing of a CPU with AVX-512, on any host
    prefill = _Calls(monkeypatch, "prefill_attention")
    out = paged_attention(*(data[name] for name in PAGED_ARGS), 0.25)
    assert prefill.calls == 0
    torch.testing.assert_close(out, expected_paged(data, 0.25, None, None), atol=1e-5, rtol=1e-5)
    spans = torch.tensor([[0, 0, 40, 0, 40]])
    args = (data["query"], data["key_cache"], data["value_cache"], data["block_tables"], spans, 0.25, None, None)
    with pytest.raises(ValueError, match="value head size divisible by 16, got 24"):
        native.prefill_attention(*args, torch.zeros((40, 4, 24)))
    ok = build_paged_batch([(40, 40)], 16, 4, 2, 32, 32, torch.float32, gen)
    ok_args = (ok["query"], ok["key_cache"], ok["value_cache"], ok["block_tables"], spans, 0.25, None, None)
    with pytest.raises(ValueError, match="contiguous float32 or bfloat16"):
        native.prefill_attention(*ok_args, torch.zeros((40, 4, 32), dtype=torch.float64))


@needs_native
@pytest.mark.parametrize("window", [None, 30])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_native_prefill_reads_bfloat16_queries_and_writes_bfloat16_rows(
    window: int | None, cache_dtype: torch.dtype
) -> None:
    """A bfloat16 query read as it is and a bfloat16 output rounded by the kernel, rows outside the
    spans left as they are. Over a float32 cache (or without AVX512-BF16): bitwise the float32 call on
    the query widened, its result rounded by torch (``.to(torch.bfloat16)``). Over a bfloat16 cache
    where the CPU has AVX512-BF16 the scores are the instruction's pair dot products of the query and
    the keys as they are, then scaled (another order of the same exact products): the reference's to
    float32 rounding, not the float32 call's bits, and the weights are rounded to bfloat16 for the
    values' pair dot products: the reference that rounds them so."""
    gen = torch.Generator().manual_seed(7)
    data = _head_major(build_paged_batch([(40, 40), (1, 9), (70, 100)], 16, 8, 2, 64, 64, torch.bfloat16, gen))
    data = {**data, "key_cache": data["key_cache"].to(cache_dtype), "value_cache": data["value_cache"].to(cache_dtype)}
    spans = torch.tensor([[0, 0, 40, 0, 40], [41, 2, 70, 0, 100]])
    args = (data["key_cache"], data["value_cache"], data["block_tables"], spans, 0.25, window, None)
    wide = native.prefill_attention(data["query"].float(), *args, torch.zeros((111, 8, 64)))
    narrow = native.prefill_attention(data["query"], *args, torch.full((111, 8, 64), 3.0, dtype=torch.bfloat16))
    narrow_wide = native.prefill_attention(data["query"], *args, torch.zeros((111, 8, 64)))
    assert torch.equal(narrow[40], torch.full((8, 64), 3.0, dtype=torch.bfloat16))
    picked = torch.cat([torch.arange(40), torch.arange(41, 111)])
    assert torch.equal(narrow[picked], narrow_wide[picked].to(torch.bfloat16))
    expected = expected_paged(data, 0.25, window, None)[picked]
    torch.testing.assert_close(wide[picked], expected, atol=2e-5, rtol=2e-5)
    pairs = _weights_rounded(data)
    if pairs:
        expected = _expected_bf16_weights(data, 0.25, window)[picked]
    torch.testing.assert_close(narrow_wide[picked], expected, atol=2e-4 if pairs else 2e-5, rtol=0 if pairs else 2e-5)
    assert torch.equal(narrow_wide[picked], wide[picked]) != pairs


# ---------------------------------------------------------------- hyper-connection weights


def _hc_inputs(t: int, n: int, d: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    streams = torch.randn(t, n, d + 3, generator=g).to(dtype)[:, :, :d]  # rows of a wider tensor: strided
    mixes = torch.randn(t, n * (n + 2), generator=g) * 2
    base, scale = torch.randn(n * (n + 2), generator=g) * 0.1, torch.rand(3, generator=g) + 0.5
    return streams, mixes, base, scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("t", "n", "d"), [(1, 4, 256), (5, 3, 100), (33, 4, 7), (2, 1, 64), (17, 6, 130)])
def test_native_hc_sinkhorn_mix_is_the_torch_reference(t: int, n: int, d: int, dtype: torch.dtype) -> None:
    """The C pass against :func:`mix_from_logits` (the torch ops it replaces): post and comb to the
    exponential's last bits; the stream sum in the same order, so a float32 one is as close and a
    bfloat16 one at most one bfloat16 step away (where the weights' last bit moves a rounding)."""
    from pypto_kernels.hyper_connections import mix_from_logits

    streams, mixes, base, scale = _hc_inputs(t, n, d, dtype)
    got = native.hc_sinkhorn_mix(mixes, streams, base, scale, 20, 1e-6)
    want = mix_from_logits(mixes, streams, base, scale, 20, 1e-6)
    assert [x.dtype for x in got] == [torch.float32, torch.float32, dtype]
    torch.testing.assert_close(got[0], want[0], rtol=4e-7, atol=1e-7)
    torch.testing.assert_close(got[1], want[1], rtol=4e-6, atol=1e-7)
    step = 2.0**-7 if dtype == torch.bfloat16 else 1e-6
    torch.testing.assert_close(got[2].float(), want[2].float(), rtol=step, atol=1e-6)


def test_hc_sinkhorn_mix_takes_the_native_pass_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel DeepSeek-V4 calls runs the C pass for CPU streams (counted), and the torch ops where
    the pass does not take them (more than 16 streams)."""
    from pypto_kernels import hc_sinkhorn_mix

    calls: list[int] = []
    real = native.hc_sinkhorn_mix
    monkeypatch.setattr(native, "hc_sinkhorn_mix", lambda *a: calls.append(1) or real(*a))
    for n, taken in ((4, 1), (17, 0)):
        calls.clear()
        streams, _, base, scale = _hc_inputs(3, n, 8, torch.float32)
        fn = torch.randn(n * (n + 2), n * 8) * 0.1
        post, comb, collapsed = hc_sinkhorn_mix(streams, fn, base, scale, 3, 1e-6, 1e-6)
        assert len(calls) == taken and post.shape == (3, n) and comb.shape == (3, n, n) and collapsed.shape == (3, 8)


def test_native_hc_sinkhorn_mix_token_depends_only_on_its_own_inputs() -> None:
    """A token's weights are the same alone, in a batch and on one or two threads (bitwise)."""
    streams, mixes, base, scale = _hc_inputs(40, 4, 96, torch.bfloat16, seed=3)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        batch = native.hc_sinkhorn_mix(mixes, streams, base, scale, 20, 1e-6)
        torch.set_num_threads(1)
        single = native.hc_sinkhorn_mix(mixes, streams, base, scale, 20, 1e-6)
    finally:
        torch.set_num_threads(before)
    alone = native.hc_sinkhorn_mix(mixes[7:8], streams[7:8], base, scale, 20, 1e-6)
    for b, s, a in zip(batch, single, alone, strict=True):
        assert torch.equal(b, s) and torch.equal(b[7:8], a)


def test_native_hc_sinkhorn_mix_refuses_what_it_cannot_take() -> None:
    streams, mixes, base, scale = _hc_inputs(2, 4, 8, torch.float32)
    with pytest.raises(ValueError, match="mixes must be float32"):
        native.hc_sinkhorn_mix(mixes[:, :5], streams, base, scale, 20, 1e-6)
    with pytest.raises(ValueError, match="does not take streams"):
        native.hc_sinkhorn_mix(mixes, streams.half(), base, scale, 20, 1e-6)
    assert not native.hc_takes(torch.zeros(2, 17, 8)) and not native.hc_takes(torch.zeros(2, 4, 8)[:, :, ::2])
