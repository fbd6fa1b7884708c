"""The native grouped products of the routed experts (``csrc/gemv.c``'s ``pypto_grouped_gemv``,
:func:`pypto_kernels.backends.cpu.native_moe_experts`): each output the native GEMV's of its row alone
(itself checked against float64 and the documented order), so a token's result depends neither on the
other tokens of its batch nor on the threads; the whole against a float64 loop."""

from __future__ import annotations

import ctypes
import platform
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import pypto_kernels as K
from pypto_kernels import native
from pypto_kernels.backends import cpu
from pypto_kernels.device import cpu_flags
from pypto_kernels.moe import looped_moe_experts

from .test_kernels_moe import ACTIVATIONS, TOP_K, E, H, naive_experts, random_moe, routing

needs_native = pytest.mark.skipif(
    native.library() is None, reason="no native CPU kernels on this machine (no C compiler; see the log)"
)

# Rows per expert: empty experts first, last and between, and every remainder of the four-row blocks.
COUNTS = [0, 1, 2, 3, 0, 4, 5, 9]


@pytest.fixture
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _counted(monkeypatch: pytest.MonkeyPatch, name: str) -> list[int]:
    """The rows of each call of ``native.<name>`` from now on (the calls still run)."""
    calls: list[int] = []
    inner = getattr(native, name)

    def counted(x: torch.Tensor, *args: Any) -> torch.Tensor:
        calls.append(x.shape[0])
        return inner(x, *args)

    monkeypatch.setattr(native, name, counted)
    return calls


def _grouped_case(dtype: torch.dtype, out: int, width: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Rows for :data:`COUNTS`, a ``[experts, out, width]`` weight whose rows are views into wider ones
    (a row stride other than the width), and the experts' end rows."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(len(COUNTS), out, width + 3, generator=gen).to(dtype)[:, :, 3:]
    x = torch.randn(sum(COUNTS), width, generator=gen).to(dtype)
    return x, weight, torch.tensor(COUNTS).cumsum(0)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("out", "width"), [(1, 16), (70, 100), (129, 256), (65, 300), (64, 1024)])
def test_each_grouped_row_is_the_gemv_of_that_row_alone(
    dtype: torch.dtype, out: int, width: int, one_thread: None
) -> None:
    x, weight, ends = _grouped_case(dtype, out, width, seed=out + width)
    got = native.grouped_gemv(x, weight, ends)
    assert got.shape == (x.shape[0], out) and got.dtype == dtype
    starts = [0, *ends.tolist()[:-1]]
    for expert, (start, end) in enumerate(zip(starts, ends.tolist(), strict=True)):
        for row in range(start, end):
            assert torch.equal(got[row], native.gemv(x[row : row + 1], weight[expert])[0]), (expert, row)
    torch.set_num_threads(2)
    assert torch.equal(native.grouped_gemv(x, weight, ends), got)  # the threads change no output


@needs_native
def test_grouped_gemv_refuses_ends_that_do_not_cover_the_rows() -> None:
    x, weight, ends = _grouped_case(torch.float32, 8, 32, seed=1)
    with pytest.raises(ValueError, match="do not end at"):
        native.grouped_gemv(x, weight, ends - 1)
    with pytest.raises(ValueError, match="not non-decreasing"):
        native.grouped_gemv(x, weight, torch.tensor([5, 1, 3, 6, 6, 10, 15, 24]))
    with pytest.raises(ValueError, match="does not take"):
        native.grouped_gemv(x.t(), weight, ends)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_avx2_build_of_the_grouped_gemv_holds_the_same_sums(dtype: torch.dtype, tmp_path: Any) -> None:
    """Without AVX-512 the four-row blocks' 16-lane sums are held as 8-lane halves, and without
    AVX512-BF16 a pair dot product is widened and added as the instruction adds it: an AVX2 build
    gives this build's outputs bit for bit (as the one-row GEMV's test checks for its rows)."""
    compiler = native._compiler()
    if compiler is None or platform.machine() not in ("x86_64", "AMD64") or "avx2" not in cpu_flags():
        pytest.skip("needs x86 with AVX2 and a C compiler")
    target = tmp_path / "gemv_avx2.so"
    flags = [f for f in native._FLAGS if not f.startswith("-march")]
    subprocess.run([compiler, *flags, "-march=x86-64-v3", "-o", str(target), str(native._CSRC / "gemv.c")], check=True)
    other = ctypes.CDLL(str(target))
    declared = native.library()
    assert declared is not None
    other.pypto_grouped_gemv.restype = declared.pypto_grouped_gemv.restype
    other.pypto_grouped_gemv.argtypes = declared.pypto_grouped_gemv.argtypes
    # 272 inputs: four-chunk runs and a last 16-value run; a row's last few products (fewer than 16)
    # are added by scalar code whose rounding the two builds' compilers need not share.
    x, weight, ends = _grouped_case(dtype, 70, 272, seed=3)
    expected = native.grouped_gemv(x, weight, ends)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(native, "library", lambda: other)
        assert torch.equal(native.grouped_gemv(x, weight, ends), expected)


@needs_native
@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
@pytest.mark.parametrize("kind", ["random", "few_experts", "one_expert"])
@pytest.mark.parametrize("tokens", [1, 7, 40])
def test_native_experts_are_the_float64_loop(tokens: int, kind: str, activation: str) -> None:
    x, gate_up, down, _ = random_moe(torch.float32, tokens=tokens, seed=tokens)
    weights, ids = routing(kind, tokens, TOP_K, seed=tokens)
    act = ACTIVATIONS[activation]
    got = cpu.native_moe_experts(x, gate_up, down, weights, ids, act)
    expected = naive_experts(x, gate_up, down, weights, ids) if activation == "silu" else None
    if expected is not None:
        torch.testing.assert_close(got.double(), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got, looped_moe_experts(x, gate_up, down, weights, ids, act), atol=1e-5, rtol=1e-5)
    assert cpu.native_moe_experts(x[:0], gate_up, down, weights[:0], ids[:0]).shape == (0, x.shape[1])


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tokens_experts_do_not_depend_on_its_batch(dtype: torch.dtype) -> None:
    """Each token's result alone equals its result in a batch of 33 that routes other tokens to its
    experts, bit for bit, and dropped routes (id E) add nothing."""
    x, gate_up, down, router = random_moe(dtype, tokens=33, seed=5)
    weights, ids = K.topk_routing(torch.nn.functional.linear(x, router), TOP_K, True)
    batch = cpu.native_moe_experts(x, gate_up, down, weights, ids)
    for t in (0, 17, 32):
        alone = cpu.native_moe_experts(x[t : t + 1], gate_up, down, weights[t : t + 1], ids[t : t + 1])
        assert torch.equal(alone[0], batch[t]), t
    if dtype == torch.bfloat16:
        torch.testing.assert_close(batch, looped_moe_experts(x, gate_up, down, weights, ids), atol=1e-2, rtol=1e-2)
    drop = torch.rand(ids.shape, generator=torch.Generator().manual_seed(1)) < 0.5
    kept = cpu.native_moe_experts(x, gate_up, down, torch.where(drop, 0.0, weights), ids)
    assert torch.equal(cpu.native_moe_experts(x, gate_up, down, weights, torch.where(drop, E, ids)), kept)


@needs_native
def test_moe_experts_runs_native_up_to_its_routes_per_expert(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the CPU ``moe_experts`` takes the native products while a call's routes per expert stay
    within :data:`pypto_kernels.native.MOE_ROUTES_PER_EXPERT` (decode batches) and torch's grouped GEMM beyond."""
    calls = _counted(monkeypatch, "grouped_gemv")
    for dtype, limit in native.MOE_ROUTES_PER_EXPERT.items():
        tokens = limit * E // TOP_K
        x, gate_up, down, router = random_moe(dtype, tokens=tokens + 1, seed=2)
        assert tokens * TOP_K <= limit * E < (tokens + 1) * TOP_K
        weights, ids = K.topk_routing(torch.nn.functional.linear(x, router), TOP_K, True)
        calls.clear()
        K.moe_experts(x[:tokens], gate_up, down, weights[:tokens], ids[:tokens])
        assert calls == [tokens * TOP_K] * 2, dtype  # both products, every route
        calls.clear()
        K.moe_experts(x, gate_up, down, weights, ids)  # one token more: past the limit
        assert calls == [], dtype


def _float64_block(
    x: torch.Tensor, router: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, top_k: int, norm: bool
) -> torch.Tensor:
    """HF Qwen-MoE's block in float64, the router's logits rounded to the dtype as the model's product
    rounds them, ties in the top-k to the lower expert (a stable sort of the negated probabilities)."""
    logits = (x.double() @ router.double().T).to(x.dtype).double()
    probs = torch.softmax(logits, dim=-1)
    ids = torch.sort(-probs, dim=-1, stable=True).indices[:, :top_k]
    weights = probs.gather(1, ids)
    if norm:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return naive_experts(x, gate_up, down, weights, ids)


def _experts(
    gate_up: torch.Tensor, down: torch.Tensor, packed: bool
) -> tuple[torch.Tensor | native.PackedExperts, torch.Tensor | native.PackedExperts]:
    return (native.pack_experts(gate_up), native.pack_experts(down)) if packed else (gate_up, down)


@needs_native
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("tokens", [1, 7, 40])
def test_native_moe_block_is_the_float64_block(tokens: int, norm: bool, dtype: torch.dtype, packed: bool) -> None:
    """The router's product, softmax top-k routing, both expert products and the weighted sum in one
    call, experts plain or packed as panels, against the block in float64."""
    x, gate_up, down, router = random_moe(dtype, tokens=tokens, seed=tokens)
    out = native.moe_block(x, router, *_experts(gate_up, down, packed), TOP_K, norm)
    assert out.dtype == dtype and out.shape == x.shape
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.double(), _float64_block(x, router, gate_up, down, TOP_K, norm), atol=tol, rtol=tol)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_moe_block_ties_go_to_the_lower_experts(dtype: torch.dtype) -> None:
    """Equal probabilities (a zero router): the first ``top_k`` experts, ``1 / top_k`` each."""
    x, gate_up, down, router = random_moe(dtype, tokens=5, seed=3)
    out = native.moe_block(x, torch.zeros_like(router), gate_up, down, TOP_K, True)
    ids = torch.arange(TOP_K).expand(5, -1)
    expected = naive_experts(x, gate_up, down, torch.full(ids.shape, 1 / TOP_K), ids)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)


@needs_native
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tokens_block_does_not_depend_on_its_batch_or_the_threads(dtype: torch.dtype, packed: bool) -> None:
    """Each token's block alone equals its block in a batch of 33, bit for bit, on one thread or two,
    experts plain or packed as panels."""
    x, plain_gate_up, plain_down, router = random_moe(dtype, tokens=33, seed=6)
    gate_up, down = _experts(plain_gate_up, plain_down, packed)
    batch = native.moe_block(x, router, gate_up, down, TOP_K, True)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            for t in (0, 17, 32):
                assert torch.equal(native.moe_block(x[t : t + 1], router, gate_up, down, TOP_K, True)[0], batch[t])
            assert torch.equal(native.moe_block(x, router, gate_up, down, TOP_K, True), batch)
    finally:
        torch.set_num_threads(threads)


@needs_native
def test_native_moe_block_refuses_what_it_does_not_take() -> None:
    x, gate_up, down, router = random_moe(torch.float32, tokens=3)
    for k in (0, E + 1):
        with pytest.raises(ValueError, match=rf"top_k {k} is not in 1\.\.{E}"):
            native.moe_block(x, router, gate_up, down, k, True)
    with pytest.raises(ValueError, match="the native MoE block does not take"):
        native.moe_block(x, router.bfloat16(), gate_up, down, TOP_K, True)
    with pytest.raises(ValueError, match="the native MoE block does not take"):
        native.moe_block(x, router, gate_up, down[:, :, :-1], TOP_K, True)  # down narrower than gate_up's half
    assert native.moe_block(x[:0], router, gate_up, down, TOP_K, True).shape == (0, H)


@needs_native
def test_routed_moe_runs_the_native_block_up_to_its_routes_per_expert(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the CPU ``routed_moe`` is one native call within
    :data:`pypto_kernels.native.MOE_ROUTES_PER_EXPERT` and the reference (router, routing, experts)
    beyond, the two close."""
    calls = _counted(monkeypatch, "moe_block")
    for dtype, limit in native.MOE_ROUTES_PER_EXPERT.items():
        tokens = limit * E // TOP_K
        x, gate_up, down, router = random_moe(dtype, tokens=tokens + 1, seed=4)
        calls.clear()
        out = K.routed_moe(x[:tokens], router, gate_up, down, TOP_K, True)
        assert calls == [tokens], dtype
        reference = K.routed_moe.reference(x[:tokens], router, gate_up, down, TOP_K, True)  # type: ignore[attr-defined]
        tol = 1e-5 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(out, reference, atol=tol, rtol=tol)
        calls.clear()
        K.routed_moe(x, router, gate_up, down, TOP_K, True)  # one token more: past the limit
        assert calls == [], dtype


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_grouped_panel_row_is_the_panel_product_of_that_row_alone(dtype: torch.dtype) -> None:
    """Rows sorted by expert (:data:`COUNTS`: empty experts, every tile remainder) times their experts'
    panels: each row bitwise the one-row panel product of its expert (``panel_linear``), on one thread
    or two, close to float64; the packed experts unpack to the matrices they were made from."""
    gen = torch.Generator().manual_seed(8)
    weight = torch.randn(len(COUNTS), 130, 96, generator=gen).to(dtype)
    x = torch.randn(sum(COUNTS), 96, generator=gen).to(dtype)
    ends = torch.tensor(COUNTS).cumsum(0)
    packed = native.pack_experts(weight)
    assert packed.shape == tuple(weight.shape) and torch.equal(packed.plain(), weight)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            out = native.grouped_panel_linear(x, packed, ends)
            start = 0
            for e, count in enumerate(COUNTS):
                for i in range(start, start + count):
                    alone = native.panel_linear(x[i : i + 1], packed.panels[e], out_features=130)
                    assert torch.equal(out[i], alone[0]), (n, e, i)
                start += count
    finally:
        torch.set_num_threads(threads)
    expected = torch.cat(
        [x[s:t].double() @ weight[e].double().T for e, (s, t) in enumerate(zip([0, *ends[:-1]], ends))]
    )
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), expected, atol=tol * 10, rtol=tol)
    with pytest.raises(ValueError, match="are not non-decreasing from 0"):
        native.grouped_panel_linear(x, packed, torch.tensor([0, 5, 3, 9, 9, 13, 18, 24]))


@needs_native
def test_routed_moe_runs_packed_experts_natively_at_any_row_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """Experts packed as panels take the native block past the grouped GEMV's limit too (a prefill's
    rows), and the reference unpacks them: the two close."""
    calls = _counted(monkeypatch, "moe_block")
    x, gate_up, down, router = random_moe(torch.bfloat16, tokens=200, seed=9)
    assert native.MOE_ROUTES_PER_EXPERT[torch.bfloat16] * E < 200 * TOP_K
    packed = _experts(gate_up, down, True)
    out = K.routed_moe(x, router, *packed, TOP_K, True)
    assert calls == [200]
    reference = K.routed_moe.reference(x, router, *packed, TOP_K, True)  # type: ignore[attr-defined]
    alike = ((out.float() - reference.float()).abs() <= 3e-2 * (1 + reference.float().abs())).all(dim=1)
    assert alike.float().mean() >= 0.9  # the rest routed otherwise where bfloat16 logits tie at the k-th
