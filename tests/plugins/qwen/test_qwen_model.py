"""Model-level parity of the Qwen executor against transformers on tiny random checkpoints."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import pypto_kernels
from pypto_kernels.attention import _reference_paged_attention
from pypto_serving_qwen.executor import QwenExecutor
from tests.plugins.qwen.qwen_fixtures import PagedBatchBuilder, qwen_settings

ALL_CHECKPOINTS = [
    "qwen2",
    "qwen2_tied",
    "qwen3",
    "qwen3_sharded",
    "qwen3_yarn",
    "qwen3_sliding",
    "qwen3_moe",
]
FP32_TOL = 1e-4  # max |diff| relative to the reference's logit scale
BF16_TOL = 6e-2  # bf16 rounds every matmul input to 8 bits of mantissa; HF and we round at different points


def _executor(path: Path, num_blocks: int = 64, **overrides: Any) -> QwenExecutor:
    ex = QwenExecutor(qwen_settings(path, **overrides))
    ex.info = ex.load()  # type: ignore[attr-defined]
    ex.init_kv_cache({"kv": num_blocks})
    return ex


def _reference_logits(hf: Any, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()


def _assert_close(ours: torch.Tensor, ref: torch.Tensor, tol: float, what: str) -> None:
    scale = max(1.0, float(ref.abs().max()))
    diff = float((ours - ref).abs().max())
    assert diff <= tol * scale, f"{what}: max |diff| {diff:.3g} > {tol} * logit scale {scale:.3g}"


def _prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(4, vocab, (n,), generator=gen).tolist() for n in lengths]


def _count_panel_rows(monkeypatch: pytest.MonkeyPatch, rows: list[int]) -> None:
    """Append to ``rows`` the row count of every native panel product that runs from now on."""
    panels = pypto_kernels.native.panel_linear
    monkeypatch.setattr(
        pypto_kernels.native,
        "panel_linear",
        lambda x, *a, **k: rows.append(x.numel() // x.shape[-1]) or panels(x, *a, **k),
    )


def _run_schedule(
    ex: QwenExecutor,
    hf: Any,
    sequences: dict[str, list[int]],
    schedule: list[list[tuple[str, int]]],
    tol: float,
    all_logits: bool = True,
) -> int:
    """Run ``schedule`` (per step: (request, number of new tokens)) through the paged executor and
    compare every returned logits row with transformers' full-sequence forward. Returns rows checked."""
    refs = {rid: _reference_logits(hf, toks) for rid, toks in sequences.items()}
    builder = PagedBatchBuilder(block_size=ex.settings.block_size, num_blocks=64)
    checked = 0
    for step, plan in enumerate(schedule):
        chunks = []
        for rid, n in plan:
            start = builder.reqs[rid].computed if rid in builder.reqs else 0
            chunk = sequences[rid][start : start + n]
            assert len(chunk) == n, f"schedule overruns request {rid}"
            chunks.append((rid, chunk))
        batch = builder.step(chunks, all_logits=all_logits)
        logits = ex.execute(batch)
        assert logits.dtype == torch.float32
        assert logits.shape == (len(batch.logits_indices), ex.info.vocab_size)  # type: ignore[attr-defined]
        row = 0
        for (rid, _), count, seq_len in zip(chunks, batch.num_logits, batch.seq_lens.tolist(), strict=True):
            ref = refs[rid][seq_len - count : seq_len]
            _assert_close(logits[row : row + count], ref, tol, f"step {step} request {rid}")
            row += count
            checked += count
    return checked


@pytest.mark.parametrize("name", ALL_CHECKPOINTS)
def test_prefill_parity(
    name: str, qwen_checkpoints: Callable[[str], Path], hf_reference: Callable[[Path], Any]
) -> None:
    path = qwen_checkpoints(name)
    ex = _executor(path)
    seqs = dict(zip("abc", _prompts(ex.info.vocab_size, [13, 1, 7]), strict=True))  # type: ignore[attr-defined]
    assert _run_schedule(ex, hf_reference(path), seqs, [[("a", 13), ("b", 1), ("c", 7)]], FP32_TOL) == 21


@pytest.mark.parametrize("name", ALL_CHECKPOINTS)
def test_mixed_chunked_prefill_and_decode_parity(
    name: str, qwen_checkpoints: Callable[[str], Path], hf_reference: Callable[[Path], Any]
) -> None:
    """Prefill chunks over a cached prefix, fresh prefills and decodes share single forwards."""
    path = qwen_checkpoints(name)
    ex = _executor(path)
    seqs = dict(zip("abc", _prompts(ex.info.vocab_size, [13, 20, 9], seed=1), strict=True))  # type: ignore[attr-defined]
    schedule = [
        [("a", 9), ("b", 6)],  # a: full prompt, b: first chunk
        [("a", 1), ("b", 8), ("c", 5)],  # decode + chunk over b's cached prefix + new prefill
        [("b", 5), ("a", 1), ("c", 1)],  # b's last chunk crosses several blocks
        [("a", 1), ("b", 1), ("c", 1)],
        [("c", 1), ("a", 1)],  # order changes between steps
        [("c", 1)],
    ]
    assert _run_schedule(ex, hf_reference(path), seqs, schedule, FP32_TOL) == 13 + 20 + 9


@pytest.mark.parametrize("name", ["qwen2", "qwen3", "qwen3_moe", "qwen3_sliding", "qwen3_yarn"])
def test_incremental_decode_matches_full_sequence(
    name: str, qwen_checkpoints: Callable[[str], Path], hf_reference: Callable[[Path], Any]
) -> None:
    """Prefill 8 tokens, then 1-token steps through the paged cache: each step's only logits row
    equals transformers' logits at that position of the full sequence (past the sliding window too)."""
    path = qwen_checkpoints(name)
    ex = _executor(path, block_size=3)
    seqs = {"x": _prompts(ex.info.vocab_size, [26], seed=2)[0]}  # type: ignore[attr-defined]
    schedule = [[("x", 8)]] + [[("x", 1)]] * 18
    assert _run_schedule(ex, hf_reference(path), seqs, schedule, FP32_TOL, all_logits=False) == 19


@pytest.mark.skipif(pypto_kernels.native.library() is None, reason="no native CPU kernels (no C compiler)")
@pytest.mark.parametrize("name", ["qwen2", "qwen3"])
def test_cpu_steps_take_the_native_norm_and_rope_passes(
    name: str,
    qwen_checkpoints: Callable[[str], Path],
    hf_reference: Callable[[Path], Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An eager CPU step runs every RMSNorm and every attention's norms, rotation and K/V write as the
    C passes (counted), with transformers' logits (prefill and decode)."""
    native, calls = pypto_kernels.native, {"norm": 0, "qk": 0}

    def counting(kernel: str, key: str) -> None:
        inner = getattr(native, kernel)

        def counted(*args: Any, **kwargs: Any) -> Any:
            calls[key] += 1
            return inner(*args, **kwargs)

        monkeypatch.setattr(native, kernel, counted)

    counting("rms_norm", "norm")
    counting("qk_norm_rope_write_kv", "qk")
    path = qwen_checkpoints(name)
    ex = _executor(path)
    assert ex.model is not None
    layers = len(ex.model.layers)
    seqs = dict(zip("ab", _prompts(ex.info.vocab_size, [9, 4], seed=3), strict=True))  # type: ignore[attr-defined]
    schedule = [[("a", 8), ("b", 3)], [("a", 1), ("b", 1)]]
    assert _run_schedule(ex, hf_reference(path), seqs, schedule, FP32_TOL) == 13
    # Per step: the first layer's input norm, two residual norms in every layer but the first's one,
    # the final norm; one q/k pass per layer.
    assert calls == {"norm": 2 * (2 * layers + 1), "qk": 2 * layers}


@pytest.mark.skipif(pypto_kernels.native.library() is None, reason="no native CPU kernels (no C compiler)")
@pytest.mark.skipif(not pypto_kernels.onednn_supports(torch.bfloat16), reason="no oneDNN bfloat16 on this CPU")
def test_one_bfloat16_decode_row_reads_the_tied_head_through_the_native_gemv(
    qwen_checkpoints: Callable[[str], Path],
    hf_reference: Callable[[Path], Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A tied bfloat16 output projection is stored [vocab, hidden] beside its packed copy (still the
    embedding's storage); a one-row step's logits come from the native GEMV over it, within bfloat16's
    tolerance of transformers (float32: test_cpu_linear_auto_float32_on_avx2)."""
    dtype = "bfloat16"
    gemv, rows = pypto_kernels.native.gemv, []
    monkeypatch.setattr(pypto_kernels.native, "gemv", lambda x, w, **k: rows.append(x.shape[0]) or gemv(x, w, **k))
    path = qwen_checkpoints("qwen2_tied")
    ex = _executor(path, dtype=dtype)
    assert ex.model is not None and ex.model.lm_head_packed is not None
    head = ex.model.lm_head_packed.weight
    assert head is not None and head.is_contiguous() and head.data_ptr() == ex.model.embed.data_ptr()
    seqs = {"x": _prompts(ex.info.vocab_size, [12], seed=5)[0]}  # type: ignore[attr-defined]
    schedule = [[("x", 8)]] + [[("x", 1)]] * 4
    _run_schedule(ex, hf_reference(path), seqs, schedule, BF16_TOL, all_logits=False)
    assert rows == [1, 1, 1, 1, 1]  # the prefill's last row and four decode rows


@pytest.mark.skipif(pypto_kernels.native.library() is None, reason="no native CPU kernels (no C compiler)")
@pytest.mark.parametrize(("name", "choice"), [("qwen2", "panels"), ("qwen3", "panels"), ("qwen3", "auto")])
def test_bfloat16_panels_parity(
    name: str,
    choice: str,
    qwen_checkpoints: Callable[[str], Path],
    hf_reference: Callable[[Path], Any],
    cpu_flags: Callable[..., None],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``cpu_linear = "panels"`` in bfloat16, and ``auto`` on a non-Intel CPU with AVX-512 and
    AVX512-BF16 (the rule's size lowered so the tiny weights qualify): every projection (qwen2's with
    their biases) and the output projection in bfloat16 panels, each product through them (the decode
    steps' layers inside the native decoder), within bfloat16's tolerance of transformers in float32."""
    if choice == "auto":
        monkeypatch.setattr(pypto_kernels.dense, "ONEDNN_FLOAT32_AVX512_MIN_ELEMENTS", 1)
        cpu_flags("avx2", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", vendor="AuthenticAMD")
    rows: list[int] = []
    _count_panel_rows(monkeypatch, rows)
    path = qwen_checkpoints(name)
    ex = _executor(path, dtype="bfloat16", max_num_seqs=3, executor_options={"cpu_linear": choice})
    assert ex.model is not None and ex.model.lm_head_packed is not None
    attn, mlp = ex.model.layers[0].self_attn, ex.model.layers[0].mlp
    for weight in (attn.qkv_weight, attn.o_weight, mlp.gate_up_weight, mlp.down_weight, ex.model.lm_head_packed):
        assert isinstance(weight, pypto_kernels.PackedLinearWeight) and weight.library == "panels"
        assert weight.packed.dtype == torch.bfloat16
    seqs = dict(zip("ab", _prompts(ex.info.vocab_size, [21, 7], seed=4), strict=True))  # type: ignore[attr-defined]
    schedule = [[("a", 20), ("b", 5)], [("a", 1), ("b", 1)], [("b", 1)]]
    _run_schedule(ex, hf_reference(path), seqs, schedule, BF16_TOL)
    # The prefill's four products a layer over its 25 rows (a run of more than 16 queries: kernel by
    # kernel), the decode steps' inside the native decoder (the same panels,
    # tests/plugins/qwen/test_native_decoder.py), the head's every step.
    assert sorted(rows) == sorted([25] * 4 * len(ex.model.layers) + [25, 2, 1])
    assert ex.graph_stats.native_decoder_steps == 2


def test_sliding_window_changes_logits(
    qwen_checkpoints: Callable[[str], Path], hf_reference: Callable[[Path], Any]
) -> None:
    """The sliding checkpoint has the same weights as 'qwen3'; past the window the outputs must differ,
    proving the per-layer window reaches the kernel (the parity tests prove it is the right one)."""
    ex = _executor(qwen_checkpoints("qwen3_sliding"))
    assert ex.config is not None and ex.config.layer_windows == (None, 6, 6)
    tokens = _prompts(ex.config.vocab_size, [16], seed=3)[0]
    logits = ex.execute(PagedBatchBuilder(4, 64).step([("s", tokens)]))
    full = _reference_logits(hf_reference(qwen_checkpoints("qwen3")), tokens)
    assert torch.allclose(logits[:6], full[:6], atol=1e-4)
    assert float((logits[-1] - full[-1]).abs().max()) > 1e-2


def _padded_reference(
    *args: Any, query_lens_host: Any = None, seq_lens_host: Any = None, prompt_rows_host: Any = None, **kw: Any
) -> torch.Tensor:
    return _reference_paged_attention(*args, **kw)  # it reads the lengths from the tensors, every row alike


@pytest.mark.parametrize("kernel", ["per-request", "padded reference"])
@pytest.mark.parametrize("name", ["qwen3", "qwen3_moe", "qwen3_sliding"])
def test_uninitialised_cache_slots_are_never_read(
    name: str,
    kernel: str,
    qwen_checkpoints: Callable[[str], Path],
    hf_reference: Callable[[Path], Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """init_kv_cache allocates without filling (torch.empty); with every slot NaN beforehand, the
    outputs still match transformers: no step reads a slot that no step wrote."""
    path = qwen_checkpoints(name)
    ex = _executor(path)
    for key_cache, value_cache in ex.kv_caches:
        key_cache.fill_(float("nan"))
        value_cache.fill_(float("nan"))
    if kernel != "per-request":
        monkeypatch.setattr(pypto_kernels, "paged_attention", _padded_reference)
    seqs = dict(zip("abc", _prompts(ex.info.vocab_size, [13, 20, 9], seed=5), strict=True))  # type: ignore[attr-defined]
    schedule = [
        [("a", 9), ("b", 6)],
        [("a", 1), ("b", 8), ("c", 5)],
        [("b", 5), ("a", 1), ("c", 1)],
        [("a", 2), ("b", 1), ("c", 3)],
    ]
    assert _run_schedule(ex, hf_reference(path), seqs, schedule, FP32_TOL) == 13 + 20 + 9


def test_init_kv_cache_does_not_fill(qwen_checkpoints: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """The caches come from torch.empty: no zero fill of gigabytes at start-up."""
    ex = QwenExecutor(qwen_settings(qwen_checkpoints("qwen3")))
    ex.load()
    monkeypatch.setattr(torch, "zeros", None)  # any fill through torch.zeros would fail
    ex.init_kv_cache({"kv": 3})
    assert len(ex.kv_caches) == 3 and ex.kv_caches[0][1].shape == (3, 4, 2, 16)
    # Float32 on the CPU: head-major memory behind that shape, which transfers see in memory order.
    assert all(pypto_kernels.attention.is_head_major(t) for pair in ex.kv_caches for t in pair)
    blocks = ex.kv_cache_blocks()
    assert blocks is not None and all(t.shape == (3, 2, 4, 16) and t.is_contiguous() for t in blocks["kv"])


def test_fp8_kv_cache_is_token_major_and_exchanges_no_blocks_with_float32(
    qwen_checkpoints: Callable[[str], Path],
) -> None:
    """A cache the CPU does not read in place keeps the token-major layout the padded gather reads.
    Blocks move as their bytes lie, so engines of different layouts must not exchange them (the
    layout digest differs even where only the layout does), while equal layouts round-trip blocks."""
    from pypto_serving.kv_transfer import gather_blocks, layout_digest, scatter_blocks

    ex = QwenExecutor(qwen_settings(qwen_checkpoints("qwen3"), dtype="bfloat16", kv_cache_dtype="fp8"))
    ex.load()
    ex.init_kv_cache({"kv": 3})
    caches = [t for pair in ex.kv_caches for t in pair]
    assert all(t.dtype == torch.float8_e4m3fn and t.is_contiguous() and t.shape == (3, 4, 2, 16) for t in caches)
    shape = (4, 16, 2, 8)
    head_major = pypto_kernels.empty_paged_cache(shape, dtype=torch.float32, device="cpu")
    head_major.copy_(torch.arange(head_major.numel(), dtype=torch.float32).view(shape))
    ours = {"kv": [pypto_kernels.memory_order(head_major)]}
    assert layout_digest(ours) != layout_digest({"kv": [head_major.contiguous()]})
    other = pypto_kernels.empty_paged_cache(shape, dtype=torch.float32, device="cpu").fill_(-1)
    scatter_blocks({"kv": [pypto_kernels.memory_order(other)]}, {"kv": [3]}, gather_blocks(ours, {"kv": [1]}))
    assert torch.equal(other[3], head_major[1])


@pytest.mark.parametrize("name", ["qwen3", "qwen3_moe"])
@pytest.mark.parametrize("kernels", ["native", "torch"])
def test_bf16_close_to_fp32_reference(
    name: str,
    kernels: str,
    qwen_checkpoints: Callable[[str], Path],
    hf_reference: Callable[[Path], Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A bfloat16 model on the CPU, within bfloat16's tolerance of transformers in float32. Where the
    native kernels are built its KV cache is bfloat16 (head-major), read in place by the C kernel;
    without them float32 (head-major), read in place by the sampled product, at a float32 cache's
    bytes per block."""
    if kernels == "native" and pypto_kernels.native.library() is None:
        pytest.skip("no native CPU kernels on this machine (no C compiler; see the log)")
    if kernels == "torch":
        monkeypatch.setattr(pypto_kernels.native, "library", lambda: None)
    cache_dtype = torch.bfloat16 if kernels == "native" else torch.float32
    path = qwen_checkpoints(name)
    ex = _executor(path, dtype="bfloat16")
    key_cache = ex.kv_caches[0][0]
    assert key_cache.dtype == cache_dtype and pypto_kernels.memory_order(key_cache).shape[1] == key_cache.shape[2]
    (group,) = ex.info.cache_groups  # type: ignore[attr-defined]
    assert group.bytes_per_block == 2 * len(ex.kv_caches) * key_cache[0].numel() * key_cache.element_size()
    read: list[torch.dtype] = []
    if kernels == "native":
        real_native = pypto_kernels.native.paged_attention
        monkeypatch.setattr(
            pypto_kernels.native, "paged_attention", lambda *a, **k: read.append(a[1].dtype) or real_native(*a, **k)
        )
    else:
        real = torch.sparse.sampled_addmm
        monkeypatch.setattr(torch.sparse, "sampled_addmm", lambda *a, **k: read.append(a[1].dtype) or real(*a, **k))
    seqs = dict(zip("ab", _prompts(ex.info.vocab_size, [11, 6], seed=4), strict=True))  # type: ignore[attr-defined]
    schedule = [[("a", 7), ("b", 6)], [("a", 4), ("b", 1)]]
    _run_schedule(ex, hf_reference(path), {**seqs, "b": [*seqs["b"], 5]}, schedule, BF16_TOL)
    # The decode rows of the last step, read in place: the native kernel sees the bfloat16 cache, the
    # sampled product float32 queries.
    assert read and set(read) == {cache_dtype}


def test_kv_cache_dtype_bfloat16_keeps_a_bfloat16_cache(
    qwen_checkpoints: Callable[[str], Path], hf_reference: Callable[[Path], Any]
) -> None:
    """``kv_cache_dtype = "bfloat16"`` keeps a bfloat16 model's cache in bfloat16 on the CPU (half the
    bytes per block of a float32 one), in the layout its decode read takes (head-major for the
    native kernel, token-major for the gathered read), within bfloat16's tolerance of transformers;
    the Qwen executor declares it."""
    path = qwen_checkpoints("qwen3")
    ex = _executor(path, dtype="bfloat16", kv_cache_dtype="bfloat16")
    assert "bfloat16" in ex.info.kv_cache_dtypes  # type: ignore[attr-defined]
    key_cache = ex.kv_caches[0][0]
    head_major = pypto_kernels.paged_cache_layout(torch.bfloat16, "cpu") == "head_major"
    assert key_cache.dtype == torch.bfloat16 and key_cache.is_contiguous() != head_major
    (group,) = ex.info.cache_groups  # type: ignore[attr-defined]
    assert group.bytes_per_block == 2 * len(ex.kv_caches) * key_cache[0].numel() * 2
    seqs = dict(zip("ab", _prompts(ex.info.vocab_size, [11, 6], seed=4), strict=True))  # type: ignore[attr-defined]
    schedule = [[("a", 7), ("b", 6)], [("a", 4), ("b", 1)]]
    _run_schedule(ex, hf_reference(path), {**seqs, "b": [*seqs["b"], 5]}, schedule, BF16_TOL)


def test_dtype_auto_follows_config(
    qwen_checkpoints: Callable[[str], Path], cpu_flags: Callable[..., None], caplog: pytest.LogCaptureFixture
) -> None:
    """auto keeps a float32 checkpoint (the tiny checkpoints are saved so) as stored on a CPU without
    AVX512-BF16 or AMX, and runs it in bfloat16, logged, on one with them."""
    cpu_flags("avx2", "fma")
    ex = QwenExecutor(qwen_settings(qwen_checkpoints("qwen2"), dtype="auto"))
    ex.load()
    assert ex.dtype == torch.float32
    cpu_flags("avx512f", "avx512_bf16")
    with caplog.at_level(logging.WARNING, logger="pypto_kernels"):
        ex = QwenExecutor(qwen_settings(qwen_checkpoints("qwen2"), dtype="auto"))
        ex.load()
    assert ex.dtype == torch.bfloat16 and ex.model is not None and ex.model.embed.dtype == torch.bfloat16
    assert any("float32 checkpoint runs in bfloat16" in r.getMessage() for r in caplog.records)
    kept = QwenExecutor(qwen_settings(qwen_checkpoints("qwen2"), dtype="float32"))
    kept.load()
    assert kept.dtype == torch.float32


def test_executor_info(qwen_checkpoints: Callable[[str], Path]) -> None:
    ex = QwenExecutor(qwen_settings(qwen_checkpoints("qwen3_moe"), block_size=8, max_model_len=100))
    info = ex.load()
    cfg = ex.config
    assert cfg is not None
    assert info.architecture == "Qwen3MoeForCausalLM"
    assert info.vocab_size == 320 and info.max_model_len == 100
    assert info.eos_token_ids == [2, 3]
    assert info.generation_defaults == {"temperature": 0.7, "top_p": 0.8, "top_k": 20}
    assert info.supports_pipelining
    (group,) = info.cache_groups
    assert group.name == "kv" and group.block_size == 8
    assert group.bytes_per_block == 2 * cfg.num_layers * 8 * cfg.num_kv_heads * cfg.head_dim * 4
    # layer 1 is in mlp_only_layers: a dense MLP between two MoE layers
    assert [cfg.is_moe_layer(i) for i in range(cfg.num_layers)] == [True, False, True]
    ex.init_kv_cache({"kv": 5})
    assert len(ex.kv_caches) == cfg.num_layers
    assert ex.kv_caches[0][0].shape == (5, 8, cfg.num_kv_heads, cfg.head_dim)
    ex.shutdown()
    assert ex.model is None and not ex.kv_caches


def test_max_model_len_defaults_to_config(qwen_checkpoints: Callable[[str], Path]) -> None:
    info = QwenExecutor(qwen_settings(qwen_checkpoints("qwen3_yarn"))).load()
    assert info.max_model_len == 256


def test_tied_embeddings_share_storage(qwen_checkpoints: Callable[[str], Path]) -> None:
    ex = _executor(qwen_checkpoints("qwen2_tied"))
    assert ex.model is not None
    assert ex.model.lm_head_t.data_ptr() == ex.model.embed.data_ptr()
    assert ex.model.embed.shape == ex.model.lm_head_t.t().shape


@pytest.mark.parametrize("library", ["mkl", "onednn", "panels"])
@pytest.mark.parametrize("name", ["qwen2", "qwen3", "qwen2_tied"])
def test_packed_linears_parity(
    name: str,
    library: str,
    qwen_checkpoints: Callable[[str], Path],
    hf_reference: Callable[[Path], Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every projection and the output projection packed (MKL for a 3-row batch, or oneDNN or the
    native panels at every row count): the mixed schedule's logits still match transformers, and the
    packed kernels ran."""
    if library == "panels" and pypto_kernels.native.library() is None:
        pytest.skip("no native CPU kernels on this machine")
    calls: list[int] = []
    for op in ("mkl._mkl_linear", "mkldnn._linear_pointwise"):
        space, attr = op.split(".")
        real = getattr(getattr(torch.ops, space), attr)
        monkeypatch.setattr(
            getattr(torch.ops, space), attr, lambda *a, _real=real, **k: calls.append(a[0].shape[0]) or _real(*a, **k)
        )
    _count_panel_rows(monkeypatch, calls)
    path = qwen_checkpoints(name)
    ex = _executor(path, max_num_seqs=3, executor_options={"cpu_linear": library})
    assert ex.model is not None
    attn, mlp = ex.model.layers[0].self_attn, ex.model.layers[0].mlp
    head = ex.model.lm_head_packed
    for weight in (attn.qkv_weight, attn.o_weight, mlp.gate_up_weight, mlp.down_weight, head):
        assert isinstance(weight, pypto_kernels.PackedLinearWeight) and weight.library == library
    assert head is not None
    if library != "mkl" and name != "qwen2_tied":  # an untied head's copy replaces it
        assert head.weight is None and ex.model.lm_head_t.numel() == 0
    else:  # MKL's copy, and a copy of a tied head (the embedding), sit beside the plain matrix
        assert head.weight is not None and head.weight.data_ptr() == ex.model.lm_head_t.data_ptr()
        assert head.min_rows == (3 if library == "mkl" else pypto_kernels.tied_head_min_rows(torch.float32))
    seqs = dict(zip("abc", _prompts(ex.info.vocab_size, [13, 21, 9], seed=1), strict=True))  # type: ignore[attr-defined]
    schedule = [[("a", 9), ("b", 6)], [("a", 1), ("b", 8), ("c", 5)], [("b", 6), ("a", 1), ("c", 1)]]
    schedule += [[("a", 1), ("b", 1), ("c", 1)], [("c", 1), ("a", 1)]]
    _run_schedule(ex, hf_reference(path), seqs, schedule, FP32_TOL)
    # MKL's copy serves exactly the 3-row steps (the all-decode step's layers and its 3 logits rows).
    assert calls and (set(calls) == {3} if library == "mkl" else len(set(calls)) > 3)


def test_cpu_linear_auto_and_reference(qwen_checkpoints: Callable[[str], Path]) -> None:
    """auto: bfloat16 projections and output projection packed for oneDNN (in place of the plain
    weights) on CPUs with its bf16 instructions, plain elsewhere; the tiny float32 ones plain."""
    path = qwen_checkpoints("qwen3")
    bf16 = _executor(path, dtype="bfloat16")
    assert bf16.model is not None
    qkv, head = bf16.model.layers[0].self_attn.qkv_weight, bf16.model.lm_head_packed
    if pypto_kernels.onednn_supports(torch.bfloat16):
        assert isinstance(qkv, pypto_kernels.PackedLinearWeight) and (qkv.library, qkv.weight) == ("onednn", None)
        assert head is not None and (head.weight, head.min_rows) == (None, 1)  # untied: packed in place
    else:  # packing would fail in torch's reorder on this CPU
        assert isinstance(qkv, torch.nn.Parameter) and head is None
    fp32 = _executor(path)
    assert fp32.model is not None and isinstance(fp32.model.layers[0].self_attn.qkv_weight, torch.nn.Parameter)
    assert fp32.model.lm_head_packed is None  # the tiny weights are below the float32 rule's size
    plain = _executor(path, dtype="bfloat16", executor_options={"cpu_linear": "reference"})
    assert plain.model is not None and plain.model.lm_head_packed is None
    assert isinstance(plain.model.layers[0].self_attn.qkv_weight, torch.nn.Parameter)
    with pytest.raises(ValueError, match="cpu_linear must be one of"):
        _executor(path, executor_options={"cpu_linear": "blas"})

    for options in ({"tied_head_copy": "no"}, {"tied_head_copy": 0, "cpu_linear": "reference"}):
        with pytest.raises(ValueError, match="tied_head_copy must be true or false"):
            _executor(path, executor_options=options)  # refused even where nothing is packed


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
@pytest.mark.parametrize("name", ["qwen3", "qwen2_tied"])
def test_cpu_linear_auto_float32_on_avx2(
    name: str,
    qwen_checkpoints: Callable[[str], Path],
    hf_reference: Callable[[Path], Any],
    cpu_flags: Callable[..., None],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """auto on an x86 CPU without AVX-512: float32 projections of the rule's size go to oneDNN in place
    of their plain matrices, an untied output projection too (its plain matrix freed), a tied one gets
    a copy beside its plain matrix (the embedding) for 2+ rows unless ``tied_head_copy`` is false; the
    logits still match transformers. On an AVX-512 CPU all stay plain."""
    monkeypatch.setattr(pypto_kernels.dense, "ONEDNN_FLOAT32_MIN_ELEMENTS", 1)  # the tiny weights qualify
    cpu_flags("avx2", "fma")
    path = qwen_checkpoints(name)
    ex = _executor(path, max_num_seqs=3)
    assert ex.model is not None
    qkv = ex.model.layers[0].self_attn.qkv_weight
    assert isinstance(qkv, pypto_kernels.PackedLinearWeight) and (qkv.library, qkv.weight) == ("onednn", None)
    head = ex.model.lm_head_packed
    assert head is not None and head.library == "onednn"
    if name == "qwen2_tied":
        assert head.weight is not None and head.weight.data_ptr() == ex.model.embed.data_ptr()
        assert head.min_rows == 2
        # Stored [vocab, hidden] (rows dense) where the native GEMV reads it, else as loaded.
        assert head.weight.is_contiguous() == (pypto_kernels.native.library() is not None)
    else:
        assert head.weight is None and ex.model.lm_head_t.numel() == 0
    heads: list[int] = []  # rows of the output projection's packed calls
    plain_rows: list[int] = []  # rows of its calls through oneDNN on the plain (tied) matrix
    real = torch.ops.mkldnn._linear_pointwise

    def counted(x: torch.Tensor, w: torch.Tensor, *a: Any) -> torch.Tensor:
        if w is head.packed:
            heads.append(x.shape[0])
        elif head.weight is not None and not w.is_mkldnn and w.data_ptr() == head.weight.data_ptr():
            plain_rows.append(x.shape[0])
        return real(x, w, *a)

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", counted)
    gemv_rows: list[int] = []  # rows of its calls through the native GEMV on the plain (tied) matrix
    gemv = pypto_kernels.native.gemv
    monkeypatch.setattr(pypto_kernels.native, "gemv", lambda x, w, **k: gemv_rows.append(x.shape[0]) or gemv(x, w, **k))
    seqs = dict(zip("abc", _prompts(ex.info.vocab_size, [12, 7, 4], seed=2), strict=True))  # type: ignore[attr-defined]
    schedule = [[("a", 11), ("b", 6), ("c", 3)], [("a", 1), ("b", 1)], [("c", 1)]]
    assert _run_schedule(ex, hf_reference(path), seqs, schedule, FP32_TOL) == 23
    # The head ran packed on the 20- and 2-row logits; a one-row call runs packed when untied, and
    # tied over the plain matrix (the embedding): through the native GEMV where the native kernels are
    # built, else oneDNN's GEMV, not MKL's.
    native = name == "qwen2_tied" and pypto_kernels.native.library() is not None
    assert heads == ([20, 2] if name == "qwen2_tied" else [20, 2, 1])
    assert gemv_rows == ([1] if native else [])
    assert plain_rows == ([1] if name == "qwen2_tied" and not native else [])
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", real)
    if name == "qwen2_tied":
        kept = _executor(path, max_num_seqs=3, executor_options={"tied_head_copy": False})
        assert kept.model is not None and kept.model.lm_head_packed is None
    cpu_flags("avx2", "avx512f")
    wide = _executor(path, max_num_seqs=3)
    assert wide.model is not None and wide.model.lm_head_packed is None
    assert isinstance(wide.model.layers[0].self_attn.qkv_weight, torch.nn.Parameter)


@pytest.mark.skipif(pypto_kernels.native.library() is None, reason="no native CPU kernels on this machine")
@pytest.mark.parametrize("name", ["qwen3", "qwen2_tied"])
def test_cpu_linear_auto_float32_panels_on_amd_avx512(
    name: str,
    qwen_checkpoints: Callable[[str], Path],
    hf_reference: Callable[[Path], Any],
    cpu_flags: Callable[..., None],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """auto on a non-Intel CPU with AVX-512: float32 projections of the rule's size go into the native
    column panels in place of their plain matrices, the output projection too (a tied one beside its
    plain matrix, whose one-row calls take the native GEMV); the logits still match transformers and
    every product ran through the panels (the decode steps' layers inside the native decoder)."""
    monkeypatch.setattr(pypto_kernels.dense, "ONEDNN_FLOAT32_AVX512_MIN_ELEMENTS", 1)  # the tiny weights qualify
    cpu_flags("avx2", "avx512f", vendor="AuthenticAMD")
    path = qwen_checkpoints(name)
    ex = _executor(path, max_num_seqs=3)
    assert ex.model is not None
    attn, mlp, head = ex.model.layers[0].self_attn, ex.model.layers[0].mlp, ex.model.lm_head_packed
    for weight in (attn.qkv_weight, attn.o_weight, mlp.gate_up_weight, mlp.down_weight):
        assert isinstance(weight, pypto_kernels.PackedLinearWeight) and (weight.library, weight.weight) == (
            "panels",
            None,
        )
    assert head is not None and head.library == "panels" and head.out_features == ex.info.vocab_size  # type: ignore[attr-defined]
    assert (head.weight is not None) == (name == "qwen2_tied")
    rows: list[int] = []
    _count_panel_rows(monkeypatch, rows)
    onednn: list[int] = []
    real = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda x, *a: onednn.append(x.shape[0]) or real(x, *a))
    seqs = dict(zip("abc", _prompts(ex.info.vocab_size, [19, 7, 4], seed=2), strict=True))  # type: ignore[attr-defined]
    schedule = [[("a", 18), ("b", 6), ("c", 3)], [("a", 1), ("b", 1)], [("c", 1)]]
    assert _run_schedule(ex, hf_reference(path), seqs, schedule, FP32_TOL) == 30
    # The prefill's four products a layer over its 27 rows (a run of more than 16 queries: kernel by
    # kernel; the decode steps' inside the native decoder), the head over every step's logits rows (a
    # tied head's one row too: the embedding's plain matrix beside the copy serves no product).
    assert sorted(rows) == sorted([27] * 4 * len(ex.model.layers) + [27, 2, 1])
    assert ex.graph_stats.native_decoder_steps == 2
    assert onednn == []


def test_output_projection_transposed_product_parity(
    qwen_checkpoints: Callable[[str], Path], hf_reference: Callable[[Path], Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Float32 defaults: the output projection runs pypto_kernels.linear, whose CPU fast path takes
    the 21-row prefill's logits (transposed, in chunks) and not the 3-row decode's; both match
    transformers. ``cpu_linear = "reference"`` keeps the plain matmul."""
    from pypto_kernels.backends import cpu

    calls: list[int] = []
    real = cpu.transposed_linear
    monkeypatch.setattr(cpu, "transposed_linear", lambda x, *a: calls.append(x.shape[0]) or real(x, *a))
    path = qwen_checkpoints("qwen3")
    ex = _executor(path)
    assert ex.model is not None and ex.model.lm_head_kernel and ex.model.lm_head_packed is None
    seqs = dict(zip("abc", _prompts(ex.info.vocab_size, [13, 1, 7]), strict=True))  # type: ignore[attr-defined]
    schedule = [[("a", 12), ("b", 1), ("c", 6)], [("a", 1), ("c", 1)]]
    assert _run_schedule(ex, hf_reference(path), seqs, schedule, FP32_TOL) == 21
    assert calls == [19]  # the prefill's logits rows; the 2-row decode stays below the threshold
    plain = _executor(path, executor_options={"cpu_linear": "reference"})
    assert plain.model is not None and not plain.model.lm_head_kernel


def test_decoder_projections_transposed_product_parity(
    qwen_checkpoints: Callable[[str], Path], hf_reference: Callable[[Path], Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Float32 defaults: the decoder's plain projections run pypto_kernels.linear, whose CPU fast path
    multiplies large [out, in] weights transposed at 2-128 rows (the threshold lowered here so the
    tiny checkpoint's weights qualify); outputs match transformers, and every projection of the
    19-row prefill and the 2-row decode really took the transposed product."""
    from pypto_kernels.backends import cpu

    monkeypatch.setattr(cpu, "TRANSPOSED_OUT_IN_MIN_ELEMENTS", 1)
    calls: list[tuple[int, int]] = []
    real = cpu.transposed_linear
    monkeypatch.setattr(
        cpu, "transposed_linear", lambda x, w, *a: calls.append((x.shape[0], w.shape[0])) or real(x, w, *a)
    )
    path = qwen_checkpoints("qwen3")
    ex = _executor(path)
    assert ex.model is not None and ex.model.layers[0].self_attn.kernel_linear and ex.model.layers[0].mlp.kernel_linear
    seqs = dict(zip("abc", _prompts(ex.info.vocab_size, [13, 1, 7]), strict=True))  # type: ignore[attr-defined]
    schedule = [[("a", 12), ("b", 1), ("c", 6)], [("a", 1), ("c", 1)]]
    assert _run_schedule(ex, hf_reference(path), seqs, schedule, FP32_TOL) == 21
    per_layer = 4  # qkv, o, gate_up, down
    decoder = [c for c in calls if c[1] != ex.info.vocab_size]  # type: ignore[attr-defined]
    layers = len(ex.model.layers)
    assert sorted(r for r, _ in decoder) == [2] * (per_layer * layers) + [19] * (per_layer * layers)
    calls.clear()
    plain = _executor(path, executor_options={"cpu_linear": "reference"})
    assert plain.model is not None and not plain.model.layers[0].self_attn.kernel_linear
    _run_schedule(plain, hf_reference(path), seqs, schedule, FP32_TOL)
    assert calls == []
