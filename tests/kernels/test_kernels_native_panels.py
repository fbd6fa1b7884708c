"""The native column-panel product (``csrc/panel_gemm.c``): bitwise against a chain of fused
multiply-adds written out in float64 (the documented order), close to a float64 product, the same
for a row in any batch and on any number of threads, over ragged shapes around its 64-output panels,
6-row tiles, 96-row blocks and 512-input blocks; and how :func:`pypto_kernels.linear` reaches it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import pypto_kernels as K
from pypto_kernels import native
from pypto_kernels.dense import NEVER

needs_native = pytest.mark.skipif(
    native.library() is None, reason="no native CPU kernels on this machine (no C compiler; see the log)"
)


def _fma_chain(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ w.T (+ bias)`` as the kernel documents it: per output, ``acc = fma(x[i], w[i], acc)`` for
    i = 0, 1, ... from zero in float32, then ``+ bias``. A float32 product is exact in float64, so
    each step is the exact ``x * w + acc`` rounded to float64, then to float32 (the double rounding
    can differ from one rounding only when the float64 sum lands on a float32 midpoint: about 2**-28
    per step; the inputs are fixed by seed)."""
    xs, ws = x.double().numpy(), w.double().numpy()
    acc = np.zeros((xs.shape[0], ws.shape[0]), dtype=np.float32)
    for i in range(xs.shape[1]):
        acc = (np.outer(xs[:, i], ws[:, i]) + acc.astype(np.float64)).astype(np.float32)
    if bias is not None:
        acc = acc + bias.numpy()  # float32 + float32: one rounding, as the kernel's add
    return torch.from_numpy(acc)


def _case(rows: int, out: int, inner: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, inner, generator=gen)
    w = torch.randn(out, inner, generator=gen) / inner**0.5
    return x, w, torch.randn(out, generator=gen)


@needs_native
@pytest.mark.parametrize(
    ("rows", "out", "inner"),
    [
        (1, 1, 1),
        (1, 64, 16),
        (2, 63, 7),
        (5, 65, 100),
        (6, 128, 64),
        (7, 200, 513),
        (13, 300, 33),
        (23, 130, 600),
        (64, 200, 40),
        (97, 70, 1100),
    ],
)
@pytest.mark.parametrize("with_bias", [False, True])
def test_panel_product_is_the_documented_chain(rows: int, out: int, inner: int, with_bias: bool) -> None:
    """Bitwise the fused multiply-add chain in input order (tiles of 1-6 rows, a partial last panel,
    an input count past the 512-input block and a row count past the 96-row block; blocks of one, four
    and eight or more tiles, which prefetch differently), and within float rounding of a float64
    product."""
    x, w, bias = _case(rows, out, inner, seed=rows * 7919 + out * 31 + inner)
    b = bias if with_bias else None
    got = native.panel_linear(x, native.pack_panels(w), out, b)
    assert got.shape == (rows, out) and got.dtype == torch.float32
    assert torch.equal(got, _fma_chain(x, w, b))
    # As logits (streamed past the caches where the rows are 64-byte aligned: out 64, 128): the same.
    assert torch.equal(native.panel_linear(x, native.pack_panels(w), out, b, logits=True), got)
    exact = F.linear(x.double(), w.double(), None if b is None else b.double())
    torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=1e-5)


@needs_native
def test_a_row_is_the_same_in_any_batch_and_on_any_thread_count() -> None:
    x, w, bias = _case(200, 333, 600, seed=11)
    panels = native.pack_panels(w)
    full = native.panel_linear(x, panels, 333, bias)
    for start, stop in [(0, 1), (5, 6), (3, 9), (90, 100), (0, 97), (150, 200)]:
        assert torch.equal(native.panel_linear(x[start:stop], panels, 333, bias), full[start:stop])
    threads = torch.get_num_threads()
    try:
        for count in (1, 3):
            torch.set_num_threads(count)
            assert torch.equal(native.panel_linear(x, panels, 333, bias), full)
            assert torch.equal(native.panel_linear(x[:1], panels, 333, bias), full[:1])
    finally:
        torch.set_num_threads(threads)


@needs_native
def test_panels_take_strided_and_shaped_rows_and_leave_their_inputs() -> None:
    gen = torch.Generator().manual_seed(5)
    wide = torch.randn(4, 3, 300, generator=gen)
    x = wide[..., 20:148]  # rows of stride 300, leading dimensions kept
    w = torch.randn(130, 128, generator=gen)
    panels, before = native.pack_panels(w), wide.clone()
    got = native.panel_linear(x, panels, 130)
    assert got.shape == (4, 3, 130) and torch.equal(wide, before)
    assert torch.equal(got, native.panel_linear(x.contiguous(), panels, 130))
    columns = torch.randn(128, 5, generator=gen).t()  # last dimension strided: copied first
    dense = native.panel_linear(columns.contiguous(), panels, 130)
    assert torch.equal(native.panel_linear(columns, panels, 130), dense)
    assert native.panel_linear(torch.empty(0, 128), panels, 130).shape == (0, 130)


def test_pack_panels_layout_round_trips() -> None:
    w = torch.arange(70 * 3, dtype=torch.float32).reshape(70, 3)
    panels = native.pack_panels(w)
    assert panels.shape == (2, 3, 64) and panels.is_contiguous()
    assert torch.equal(panels[1, 2, 5], w[69, 2]) and torch.equal(panels[0, 1, :], w[:64, 1])
    assert not panels[1, :, 6:].any()  # outputs past 70 are zero
    assert torch.equal(native.unpack_panels(panels, 70), w)
    with pytest.raises(ValueError, match="2-D float32 or bfloat16 CPU matrix"):
        native.pack_panels(w.double())


@needs_native
def test_panel_linear_refuses_what_it_cannot_take() -> None:
    w = torch.randn(70, 32)
    panels = native.pack_panels(w)
    with pytest.raises(ValueError, match="does not take"):
        native.panel_linear(torch.randn(2, 31), panels, 70)  # wrong width
    with pytest.raises(ValueError, match="does not take"):
        native.panel_linear(torch.randn(2, 32).double(), panels, 70)
    with pytest.raises(ValueError, match="does not take"):
        native.panel_linear(torch.randn(2, 32), panels, 70, torch.randn(71))  # bias of another size
    for outputs in (64, 129, -1):
        with pytest.raises(ValueError, match="not pack_panels' layout"):
            native.panel_linear(torch.randn(2, 32), panels, outputs)
    with pytest.raises(ValueError, match="not pack_panels' layout"):
        native.panel_linear(torch.randn(2, 32), panels.transpose(0, 1).contiguous().transpose(0, 1), 70)


@needs_native
def test_linear_runs_a_panels_copy_at_every_row_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """``pack_linear(..., library="panels")`` drops the plain matrix (rebuilt for the reference) and
    every call, with or without bias, runs the panels; beside a held plain matrix (``keep_plain``, a
    tied output projection) too, so one row's result is bitwise that row's in a batch (the one-row GEMV
    over the held matrix, which summed in another order, took it before)."""
    x, w, bias = _case(9, 260, 96, seed=2)
    packed = K.pack_linear(w, 64, library="panels")
    assert packed is not None and (packed.library, packed.weight, packed.out_features) == ("panels", None, 260)
    assert torch.equal(packed.plain(), w)
    rows: list[int] = []
    inner = native.panel_linear
    monkeypatch.setattr(
        native, "panel_linear", lambda x, *a, **k: rows.append(x.numel() // x.shape[-1]) or inner(x, *a, **k)
    )
    for count in (1, 2, 9):
        got = K.linear(x[:count], packed, bias)
        assert torch.equal(got, _fma_chain(x[:count], w, bias))
    assert rows == [1, 2, 9]
    held = K.pack_linear(w, 64, library="panels", keep_plain=True)
    assert held is not None and held.weight is w
    rows.clear()
    for dtype in (torch.float32, torch.bfloat16):
        copy = K.pack_linear(w.to(dtype), 64, library="panels", keep_plain=True)
        assert copy is not None and copy.weight is not None
        one = K.linear(x[:1].to(dtype), copy, float_out=True)
        assert torch.equal(one, K.linear(x[:4].to(dtype), copy, float_out=True)[:1])
    assert rows == [1, 4, 1, 4]
    assert torch.equal(K.reference_kernel("linear")(x, packed), F.linear(x, w))
    bf16 = K.pack_linear(w.bfloat16(), 64, library="panels")
    assert bf16 is not None and bf16.packed.dtype == torch.bfloat16 and torch.equal(bf16.plain(), w.bfloat16())
    torch.testing.assert_close(K.linear(x.bfloat16(), bf16), F.linear(x.bfloat16(), w.bfloat16()), rtol=8e-3, atol=8e-3)
    with pytest.raises(ValueError, match="odd"):
        K.pack_linear(w[:, :95].bfloat16(), 64, library="panels")


def _dot_chain(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The bfloat16 product as the kernel documents it: per output, over the input pairs in order,
    ``acc += x[2i+1] * w[2i+1]`` then ``acc += x[2i] * w[2i]`` in float32 (AVX512-BF16's VDPBF16PS: a
    product of two bfloat16 values is exact in float32, each addition rounded), then ``+ bias`` in
    float32, rounded once to bfloat16."""
    xs, ws = x.float().numpy(), w.float().numpy()
    acc = np.zeros((xs.shape[0], ws.shape[0]), dtype=np.float32)
    for i in range(0, xs.shape[1], 2):
        acc = acc + np.outer(xs[:, i + 1], ws[:, i + 1])
        acc = acc + np.outer(xs[:, i], ws[:, i])
    if bias is not None:
        acc = acc + bias.float().numpy()
    return torch.from_numpy(acc).to(torch.bfloat16)


@needs_native
@pytest.mark.parametrize(
    ("rows", "out", "inner"),
    [(1, 64, 2), (2, 63, 16), (7, 200, 514), (13, 130, 96), (23, 200, 1100), (64, 130, 256), (97, 70, 1100)],
)
@pytest.mark.parametrize("with_bias", [False, True])
def test_bfloat16_panel_product_is_the_documented_chain(rows: int, out: int, inner: int, with_bias: bool) -> None:
    """bfloat16 panels: bitwise the pair dot-product chain in input order, rounded once, and as close
    to a float64 product as torch's own bfloat16 product (each within a bfloat16 rounding of it)."""
    x, w, bias = (t.to(torch.bfloat16) for t in _case(rows, out, inner, seed=rows * 131 + out + inner))
    b = bias if with_bias else None
    panels = native.pack_panels(w)
    assert panels.shape == (-(-out // 64), inner // 2, 128) and torch.equal(native.unpack_panels(panels, out), w)
    got = native.panel_linear(x, panels, out, b)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out)
    assert torch.equal(got, _dot_chain(x, w, b))
    exact = F.linear(x.double(), w.double(), None if b is None else b.double())
    torch.testing.assert_close(got.double(), exact, rtol=8e-3, atol=8e-3)
    for start in range(0, rows, 5):  # any batch
        assert torch.equal(native.panel_linear(x[start : start + 1], panels, out, b), got[start : start + 1])
    wide = native.panel_linear(x, panels, out, b, logits=True)  # float32 from the kernel (streamed where aligned)
    assert wide.dtype == torch.float32 and torch.equal(wide, got.float())
    with pytest.raises(ValueError, match="odd"):
        native.pack_panels(torch.zeros(4, 3, dtype=torch.bfloat16))


def test_panels_asked_for_without_the_native_kernels_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native, "library", lambda: None)
    with pytest.raises(ValueError, match="need the native CPU kernels"):
        K.pack_linear(torch.randn(64, 64), 64, library="panels")
    amd = {"flags": frozenset({"avx512f"}), "vendor": "AuthenticAMD"}
    rule = K.packing_rule(torch.float32, 64, elements=1 << 20, **amd)  # type: ignore[arg-type]
    assert rule == (("onednn", 1, NEVER) if torch.backends.mkldnn.is_available() else None)  # oneDNN's copy instead


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_float_out_is_the_product_widened(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """``linear(..., float_out=True)``: bitwise ``.float()`` of the product in ``x``'s dtype, on every
    path (the panels, the one-row GEMV beside a held matrix whose panels serve two rows and more, the
    reference); a bfloat16 panels product stores float32 itself (no bfloat16 result made)."""
    x, w, bias = (t.to(dtype) for t in _case(11, 130, 96, seed=5))
    held = K.pack_linear(w, 8, library="panels", keep_plain=True)
    from_two = K.pack_linear(w, 8, library="panels", min_rows=2, keep_plain=True)
    assert held is not None and from_two is not None
    stored: list[torch.dtype] = []
    inner = native.panel_linear

    def spy(*args: object, **kwargs: object) -> torch.Tensor:
        out = inner(*args, **kwargs)  # type: ignore[arg-type]
        stored.append(out.dtype)
        return out

    monkeypatch.setattr(native, "panel_linear", spy)
    for weight in (held, from_two):
        for count in (1, 3, 11):  # from_two's one row: the GEMV (no bias) or the plain matrix
            for b in (None, bias):
                got = K.linear(x[:count], weight, b, float_out=True)
                assert got.dtype == torch.float32
                assert torch.equal(got, K.linear(x[:count], weight, b).float())
    assert stored == [torch.float32, dtype] * 10  # the panels calls: widened, then in x's dtype
    ref = K.reference_kernel("linear")(x, w, bias, float_out=True)
    assert ref.dtype == torch.float32 and torch.equal(ref, F.linear(x, w, bias).float())


def _first_maxima(logits: torch.Tensor) -> tuple[list[float], list[int]]:
    """Each row's maximum and its index by enumeration, the documented rule: the first NaN where the
    row has one, else the maximum's lowest index."""
    peaks, where = [], []
    for row in logits.tolist():
        nans = [j for j, v in enumerate(row) if v != v]
        at = nans[0] if nans else max(range(len(row)), key=lambda j: (row[j], -j))
        peaks.append(row[at])
        where.append(at)
    return peaks, where


def _maxima_case(rows: int, out: int, inner: int, dtype: torch.dtype, pattern: str) -> tuple[torch.Tensor, ...]:
    """Weights and bias whose logits hold ``pattern``: ``ties`` (two identical outputs far apart, the
    largest of most rows), ``nan`` (a NaN output after a large one, another later), ``-inf`` (every
    logit -inf) or ``plain``."""
    x, w, bias = _case(rows, out, inner, seed=rows * 131 + out + inner)
    if pattern == "ties" and out > 1:
        w[out - 1] = w[0]
        bias[0] = bias[out - 1] = 50.0  # the largest logit of every row, at 0 and out - 1
    elif pattern == "nan" and out > 2:
        bias[out // 3] = 50.0
        w[out // 2, 0] = float("nan")
        w[out - 1, 0] = float("nan")
    elif pattern == "-inf":
        bias[:] = float("-inf")
    return x.to(dtype), w.to(dtype), bias.to(dtype)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("rows", "out", "inner"), [(1, 1, 16), (1, 200, 32), (5, 63, 16), (6, 65, 96), (7, 1000, 32), (97, 130, 16)]
)
@pytest.mark.parametrize("pattern", ["plain", "ties", "nan", "-inf"])
def test_logits_maxima_are_each_rows_first_maximum(
    dtype: torch.dtype, rows: int, out: int, inner: int, pattern: str
) -> None:
    """``panel_linear(..., logits=True, maxima=...)``: the logits unchanged, and each row's maximum
    and its index as an enumeration over the logits finds them (ties: the lowest index, across
    panels; a NaN: the first, even after a larger value; all -inf: index 0), over a partial last
    panel, one- to six-row tiles, two 96-row blocks, on one thread and on two (the same bits); and
    the same maxima where no logit is stored (``store_logits=False``)."""
    x, w, bias = _maxima_case(rows, out, inner, dtype, pattern)
    panels = native.pack_panels(w)
    plain = native.panel_linear(x, panels, out, bias, logits=True)
    expected_peaks, expected_where = _first_maxima(plain)
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            peak, index = torch.full((rows,), 7.0), torch.full((rows,), -5, dtype=torch.long)
            got = native.panel_linear(x, panels, out, bias, logits=True, maxima=(peak, index))
            torch.testing.assert_close(got, plain, rtol=0, atol=0, equal_nan=True)
            assert index.tolist() == expected_where
            assert torch.equal(peak, torch.tensor(expected_peaks)) or pattern == "nan"
            assert torch.equal(peak.isnan(), torch.tensor(expected_peaks).isnan())
            # The maxima alone, no logits stored: the same bits, and nothing returned but the rows.
            alone = (torch.full((rows,), 7.0), torch.full((rows,), -5, dtype=torch.long))
            got = native.panel_linear(x, panels, out, bias, logits=True, maxima=alone, store_logits=False)
            assert got.shape == (rows, 0) and got.dtype == torch.float32
            assert alone[1].tolist() == expected_where
            torch.testing.assert_close(alone[0], peak, rtol=0, atol=0, equal_nan=True)
    finally:
        torch.set_num_threads(threads)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [6, 97])
@pytest.mark.parametrize("pattern", ["ties", "nan"])
def test_maxima_across_fixed_and_claimed_items(dtype: torch.dtype, rows: int, pattern: str) -> None:
    """Two threads split the first three quarters of a product's items (of 64 or more) in advance and
    claim the rest as they finish (either may take the last panel): two equal maxima, or two NaNs, one
    in the second thread's fixed range (panel 30 of 64) and one in the last panel give the lower index
    whichever thread took the last panel. Thirty products on two threads, so both claim orders occur."""
    x, w, bias = _case(rows, 4096, 32, seed=rows)
    early, late = 64 * 30 + 5, 64 * 63 + 9
    if pattern == "ties":
        w[late] = w[early]
        bias[early] = bias[late] = 50.0
    else:
        w[early, 0] = w[late, 0] = float("nan")
    x, w, bias = x.to(dtype), w.to(dtype), bias.to(dtype)
    panels = native.pack_panels(w)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        plain = native.panel_linear(x, panels, 4096, bias, logits=True)
        torch.set_num_threads(2)
        for _ in range(30):
            peak, index = torch.empty(rows), torch.empty(rows, dtype=torch.long)
            got = native.panel_linear(x, panels, 4096, bias, logits=True, maxima=(peak, index))
            torch.testing.assert_close(got, plain, rtol=0, atol=0, equal_nan=True)
            assert index.tolist() == [early] * rows
    finally:
        torch.set_num_threads(threads)


@needs_native
@pytest.mark.parametrize("rows", [1, 6, 64])
def test_unstored_bfloat16_maxima_compare_the_rounded_logits(rows: int) -> None:
    """Logits that are a maximum only once rounded to bfloat16: outputs 0 and 300 (panels 0 and 4) sum
    to float32 values a little apart that round to the same largest bfloat16 logit. With the logits
    unstored, each row's maximum is still the lowest index of the rounded maximum (as over the stored
    logits), also where output 300's float32 sum is the larger one (the rows checked to hold both
    kinds), on one thread and on two."""
    out, inner = 301, 64
    x, w, bias = _case(rows, out, inner, seed=rows + 5)
    x[:, 0] = torch.tensor([1.0, -1.0]).repeat(rows)[:rows]  # odd rows: output 0's sum the larger
    x[:, 1:] *= 2.0**-12  # the other inputs' products far below a bfloat16 step of the largest logits
    w[out - 1] = w[0]
    w[0, 0], w[out - 1, 0] = 0.5, 0.5 + 2.0**-6  # sums 50.5 and 50.515625: both round to 50.5
    bias[0] = bias[out - 1] = 50.0
    x, w, bias = x.to(torch.bfloat16), w.to(torch.bfloat16), bias.to(torch.bfloat16)
    panels = native.pack_panels(w)
    stored = native.panel_linear(x, panels, out, bias, logits=True)
    exact = F.linear(x.double(), w.double(), bias.double())
    tied = (stored[:, 0] == stored[:, out - 1]) & (stored[:, 0] == stored.amax(dim=1))
    later_larger = tied & (exact[:, out - 1] > exact[:, 0])
    assert bool(later_larger.any()), "no row whose later output is larger only before rounding"
    expected_peaks, expected_where = _first_maxima(stored)
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            peak, index = torch.empty(rows), torch.empty(rows, dtype=torch.long)
            native.panel_linear(x, panels, out, bias, logits=True, maxima=(peak, index), store_logits=False)
            assert index.tolist() == expected_where
            assert peak.tolist() == expected_peaks
            assert all(index[later_larger] == 0)
    finally:
        torch.set_num_threads(threads)


@needs_native
def test_linear_fills_maxima_on_every_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """``linear(..., float_out=True, maxima=...)`` fills each row's ``amax`` and ``argmax`` of its
    float32 result on every path: the panels (at every row count, a held matrix or not) and the one-row
    GEMV beside a held matrix whose panels serve two rows and more take them as they go (the calls
    spied: maxima handed to the product), the reference from the result after it;
    :func:`pypto_kernels.linear_takes_maxima` says which. Maxima without ``float_out``, or of the
    wrong size, are refused."""
    x, w, _ = _case(9, 300, 64, seed=11)
    bias = None  # one row beside panels from two rows on then takes the GEMV (which adds no bias)
    held = K.pack_linear(w, 16, library="panels", keep_plain=True)
    from_two = K.pack_linear(w, 16, library="panels", min_rows=2, keep_plain=True)
    assert held is not None and from_two is not None
    handed: list[bool] = []
    inner = native.panel_linear

    def spy(*args: object, **kwargs: object) -> torch.Tensor:
        handed.append(kwargs.get("maxima") is not None)
        return inner(*args, **kwargs)  # type: ignore[arg-type]

    gemv_handed: list[bool] = []
    gemv = native.gemv

    def gemv_spy(*args: object, **kwargs: object) -> torch.Tensor:
        gemv_handed.append(kwargs.get("maxima") is not None)
        return gemv(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(native, "panel_linear", spy)
    monkeypatch.setattr(native, "gemv", gemv_spy)
    for weight in (held, from_two):
        for count in (1, 2, 9):
            peak, index = torch.empty(count), torch.empty(count, dtype=torch.long)
            got = K.linear(x[:count], weight, bias, float_out=True, maxima=(peak, index))
            assert torch.equal(got, K.linear(x[:count], weight, bias, float_out=True))
            assert (peak.tolist(), index.tolist()) == _first_maxima(got)
            assert K.linear_takes_maxima(count, weight)
    # Each call, then its check without maxima: the panels at 1, 2 and 9 rows, then at 2 and 9 ...
    assert handed == [True, False] * 5
    assert gemv_handed == [True, False]  # ... where one row took the GEMV over the held matrix
    peak, index = torch.empty(9), torch.empty(9, dtype=torch.long)
    ref = K.reference_kernel("linear")(x, w, bias, float_out=True, maxima=(peak, index))
    assert (peak.tolist(), index.tolist()) == _first_maxima(ref)
    onednn = K.pack_linear(w, 16, library="onednn")
    assert not K.linear_takes_maxima(9, w) and (onednn is None or not K.linear_takes_maxima(9, onednn))
    with pytest.raises(ValueError, match="float_out"):
        K.linear(x, held, maxima=(peak, index))
    with pytest.raises(ValueError, match="one element per row"):
        native.panel_linear(x, held.packed, 300, logits=True, maxima=(peak[:3], index[:3]))


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out", [1, 63, 1000])
@pytest.mark.parametrize("pattern", ["plain", "ties", "nan", "-inf"])
def test_gemv_logits_and_maxima(dtype: torch.dtype, out: int, pattern: str) -> None:
    """``native.gemv(..., logits=True, maxima=...)``: float32 logits bitwise ``.float()`` of the plain
    product (a bfloat16 one's outputs rounded, then widened), and the row's maximum and index as an
    enumeration finds them (ties: the lowest index; a NaN: the first, even after a larger value; all
    -inf: index 0), on one thread and on two. The cases' bias rides in an extra input of 1."""
    x, w, bias = _maxima_case(1, out, 32, dtype, pattern)
    x = torch.cat([x, torch.ones(1, 1, dtype=dtype)], dim=1)
    w = torch.cat([w, bias[:, None]], dim=1).contiguous()
    plain = native.gemv(x, w).float()
    expected_peaks, expected_where = _first_maxima(plain)
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            peak, index = torch.full((1,), 7.0), torch.full((1,), -5, dtype=torch.long)
            got = native.gemv(x, w, logits=True, maxima=(peak, index))
            assert got.dtype == torch.float32
            torch.testing.assert_close(got, plain, rtol=0, atol=0, equal_nan=True)
            assert index.tolist() == expected_where
            torch.testing.assert_close(peak, torch.tensor(expected_peaks), rtol=0, atol=0, equal_nan=True)
    finally:
        torch.set_num_threads(threads)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pattern", ["ties", "nan"])
def test_gemv_maxima_across_fixed_and_claimed_chunks(dtype: torch.dtype, pattern: str) -> None:
    """``native.gemv`` on two threads splits the first three quarters of its 64-output chunks (of 64
    or more) in advance and claims the rest: equal maxima, or NaNs, in the second thread's fixed range
    (chunk 60 of 128) and in the last chunk give the lower index whichever thread took the last chunk,
    and the logits are those of one thread. Thirty products, so both claim orders occur."""
    out, early, late = 8192, 64 * 60 + 3, 64 * 127 + 5
    x, w, bias = _case(1, out, 32, seed=11)
    if pattern == "ties":
        w[late], bias[early], bias[late] = w[early], 50.0, 50.0
    else:
        w[early, 0] = w[late, 0] = float("nan")
    x = torch.cat([x, torch.ones(1, 1)], dim=1).to(dtype)
    w = torch.cat([w, bias[:, None]], dim=1).contiguous().to(dtype)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        plain = native.gemv(x, w, logits=True)
        torch.set_num_threads(2)
        for _ in range(30):
            peak, index = torch.empty(1), torch.empty(1, dtype=torch.long)
            got = native.gemv(x, w, logits=True, maxima=(peak, index))
            torch.testing.assert_close(got, plain, rtol=0, atol=0, equal_nan=True)
            assert index.tolist() == [early]
    finally:
        torch.set_num_threads(threads)
