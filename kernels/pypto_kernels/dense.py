"""Dense linear layers whose weights may carry a copy packed once, at load, for a CPU GEMM library.

:func:`linear` is ``F.linear``; its reference ignores any packed copy. A weight wrapped by
:func:`pack_linear` as a :class:`PackedLinearWeight` keeps the plain ``[out, in]`` matrix (the
reference's operand, and what calls outside the packed copy's row counts multiply) beside one packed
layout of it, which the CPU fast path (:mod:`pypto_kernels.backends.cpu`) multiplies:

- ``mkl``: MKL's packed SGEMM (``torch.ops.mkl._mkl_reorder_linear_weight`` / ``_mkl_linear``),
  float32. MKL packs for one row count, and torch's op runs it only at exactly that count (any other
  falls back to the plain matrix), so it serves the batch the engine runs most, ``max_num_seqs``
  decode rows, and the plain matrix stays beside it: twice the weight memory.
- ``panels``: the native kernels' column panels (:func:`pypto_kernels.native.pack_panels`, float32
  or bfloat16 with an even input count): 64 outputs side by side per input (per input pair in
  bfloat16), read by :func:`pypto_kernels.native.panel_linear` at any row count, each output summed
  in one fixed order (a row's result is the same in any batch and on any
  number of threads). It serves every call, so the plain matrix is dropped (no extra memory beyond
  padding the outputs to a multiple of 64); the reference rebuilds it when asked.
- ``onednn``: oneDNN's blocked layout (``torch.ops.mkldnn._reorder_linear_weight`` /
  ``_linear_pointwise``), any row count, float32 or bfloat16. It serves every call, so the plain
  matrix is dropped (no extra memory); the reference rebuilds it (``to_dense``) when asked. A copy
  packed with ``min_rows`` > 1 keeps the plain matrix for the fewer-row calls (twice the memory).

The packed and plain products accumulate in different orders, so they agree to float rounding, not
bit for bit. Which layout a weight gets is a rule on its dtype, its size and the CPU's class
(:func:`packing_rule`), not a timing taken at load: a measurement on a shared machine would choose
differently from run to run, and with it the rounding of every logit. The measurements behind the
rule are in docs/benchmarks.md ("Packed matrix products on the CPU").
"""

from __future__ import annotations

import mmap
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import device, native
from .registry import dispatch

__all__ = [
    "HUGE_PAGE",
    "LIBRARIES",
    "NEVER",
    "ONEDNN_FLOAT32_AVX512_MIN_ELEMENTS",
    "ONEDNN_FLOAT32_MIN_ELEMENTS",
    "PackedLinearWeight",
    "linear",
    "linear_takes_maxima",
    "on_huge_pages",
    "onednn_supports",
    "pack_linear",
    "packing_rule",
    "tied_head_min_rows",
]

#: A row count no call reaches: ``max_rows`` of a copy serving every count from ``min_rows`` on.
NEVER = 1 << 62

#: Transparent huge pages' size on x86-64 and arm64 Linux (2 MiB).
HUGE_PAGE = 2 << 20
#: Each tensor's start in :func:`on_huge_pages`' buffer is a multiple of this (a cache line: what the
#: native kernels' aligned loads of a panel row assume of a fresh tensor).
_ALIGN = 64

#: The packed layouts :func:`pack_linear` makes.
LIBRARIES = ("mkl", "onednn", "panels")


@dataclass(slots=True)
class PackedLinearWeight:
    """A float ``[out, in]`` linear weight and its copy packed for ``library``.

    :param weight: the plain matrix (may be a transposed view, e.g. of an output projection stored
        ``[in, out]``); calls outside ``min_rows..max_rows`` multiply it. None for ``onednn`` and
        ``panels``, which serve every call: :meth:`plain` rebuilds it from the packed copy.
    :param packed: the packed copy (an opaque oneDNN tensor, or the ``panels`` of
        :func:`pypto_kernels.native.pack_panels`).
    :param library: ``mkl``, ``onednn`` or ``panels`` (see the module doc).
    :param min_rows: the fewest rows (product of the leading dimensions) a call runs packed with.
    :param max_rows: the most (for ``mkl``, equal to ``min_rows``: the one count it was packed for).
    :param out_features: the matrix's outputs (``panels`` pads them to a multiple of 64).
    """

    weight: torch.Tensor | None
    packed: torch.Tensor
    library: str
    min_rows: int
    max_rows: int
    out_features: int

    def plain(self) -> torch.Tensor:
        """The ``[out, in]`` matrix (rebuilt from the packed copy when it was dropped: a full copy)."""
        if self.weight is not None:
            return self.weight
        if self.library == "panels":
            return native.unpack_panels(self.packed, self.out_features)
        return self.packed.to_dense()

    @property
    def dtype(self) -> torch.dtype:
        return self.packed.dtype

    def serves(self, rows: int) -> bool:
        """Whether a call of ``rows`` rows runs the packed copy (``min_rows <= rows <= max_rows``)."""
        return self.min_rows <= rows <= self.max_rows


def onednn_supports(dtype: torch.dtype) -> bool:
    """Whether this torch and CPU run oneDNN's packed linear in ``dtype``: float32 wherever torch has
    oneDNN; bfloat16 only on CPUs with oneDNN's bf16 instructions (AVX-512 BW/VL/DQ, AVX-NE-CONVERT
    or AMX), where torch's reorder otherwise fails at load."""
    if not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        return False
    if dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return dtype == torch.float32


#: Fewest elements of a float32 weight :func:`packing_rule` packs for oneDNN on a CPU without
#: AVX-512 (512 Ki, 2 MiB): smaller ones were slower packed at one row (0.4-0.6x on the 256-wide
#: projections of the AVX2 machine, docs/benchmarks.md), larger ones 1.1-1.6x from 4 rows on.
ONEDNN_FLOAT32_MIN_ELEMENTS = 1 << 19
#: Fewest elements of a float32 weight packed (the native panels, else oneDNN) on a non-Intel CPU
#: with AVX-512 (64 Ki, a 256 x 256 projection): there MKL's products took 1.2-4.9x oneDNN's packed
#: ones at one and at 64 rows on every Qwen-shaped projection from 256 x 256 to 6144 x 1024, cold
#: (0.9x at 8 rows on 256 x 256 alone; the AMD EPYC with AVX-512, docs/benchmarks.md, "The AVX-512
#: AMD machine"); smaller ones are not measured. A bfloat16 weight of this size or more takes the
#: native panels there where the CPU has AVX512-BF16 (256 x 256: 1.05-1.23x oneDNN's copy at 1-64
#: rows on the Zen 4 EPYC); smaller ones keep oneDNN's.
ONEDNN_FLOAT32_AVX512_MIN_ELEMENTS = 1 << 16


def packing_rule(
    dtype: torch.dtype,
    batch_rows: int,
    *,
    elements: int | None = None,
    flags: frozenset[str] | None = None,
    vendor: str | None = None,
    native_kernels: bool | None = None,
    inputs: int | None = None,
) -> tuple[str, int, int] | None:
    """``(library, min_rows, max_rows)`` for a CPU weight of ``dtype`` (and ``elements`` values) in an
    engine whose full decode batch is ``batch_rows``, or None (plain products everywhere); ``inputs``
    is the weight's input count (bfloat16 panels pair the inputs: an odd count keeps oneDNN);
    ``flags``, ``vendor`` and ``native_kernels`` stand in for this CPU's feature flags, its vendor id
    and whether the native kernels are built (tests). Measured per CPU class (docs/benchmarks.md):

    - bfloat16 on a non-Intel x86 CPU with AVX-512 and AVX512-BF16 (the Zen 4 EPYC): the native
      column panels where they are built, for weights of :data:`ONEDNN_FLOAT32_AVX512_MIN_ELEMENTS`
      or more and an even input count (1.0-1.8x oneDNN's packed products at 1-8 rows, 0.95-1.11x at
      64-256 on the Qwen-shaped projections and output projections).
    - other bfloat16 through oneDNN at every row count (1.2-2x ``F.linear`` at 1-16 rows, about even
      at 64, on an AVX-512 CPU); on a CPU without oneDNN's bf16 instructions (:func:`onednn_supports`)
      it stays plain.
    - float32 on an x86 CPU without AVX-512 (the AVX2 AMD EPYC): oneDNN for weights of
      :data:`ONEDNN_FLOAT32_MIN_ELEMENTS` or more, in place of the plain matrix: 1.1-1.6x the plain
      product from 4 to 128 rows, even at one row on the largest; a 64-row decode step 1.05-1.07x.
    - float32 on a non-Intel x86 CPU with AVX-512 (the AMD EPYCs with AVX-512): the native column
      panels where the native kernels are built (on the Zen 4 EPYC 1.3-2.2x oneDNN's packed products
      at one and two rows on Qwen3-0.6B's matrices, 0.98-1.11x at 8-64, 0.93-1.00x at 256: a decode
      step's row counts gain, a long prefill chunk's are about even), else oneDNN, for weights of
      :data:`ONEDNN_FLOAT32_AVX512_MIN_ELEMENTS` or more: MKL, which torch's ``F.linear`` runs, takes
      a slow path off Intel CPUs (1.2-4.9x oneDNN's time at 1-64 rows).
    - float32 elsewhere stays plain: on the Intel AVX-512 CPU oneDNN's float32 path was slower than
      MKL's GEMV at one row (0.5-0.85x), and MKL's packed SGEMM (1.1-1.7x at exactly its batch) keeps
      the plain matrix beside its copy, twice the weights' memory, so it is opt-in
      (``pack_linear(..., library="mkl")``)."""
    del batch_rows  # float32's MKL packing, the one rule that needs it, is opt-in
    if dtype == torch.bfloat16:
        paired = inputs is not None and inputs % 2 == 0
        if paired and _bf16_panels(elements, flags, vendor, native_kernels):
            return ("panels", 1, NEVER)
        return ("onednn", 1, NEVER) if onednn_supports(dtype) else None
    if dtype != torch.float32 or elements is None or not onednn_supports(dtype):
        return None
    have = device.cpu_flags() if flags is None else flags
    if device.avx2_without_avx512(have):
        return ("onednn", 1, NEVER) if elements >= ONEDNN_FLOAT32_MIN_ELEMENTS else None
    if "avx512f" not in have or not _non_intel(vendor) or elements < ONEDNN_FLOAT32_AVX512_MIN_ELEMENTS:
        return None
    return ("panels" if _native_built(native_kernels) else "onednn", 1, NEVER)


def _non_intel(vendor: str | None) -> bool:
    return (device.cpu_vendor() if vendor is None else vendor) != "GenuineIntel"


def _native_built(native_kernels: bool | None) -> bool:
    return native.library() is not None if native_kernels is None else native_kernels


def _bf16_panels(
    elements: int | None, flags: frozenset[str] | None, vendor: str | None, native_kernels: bool | None
) -> bool:
    """Whether a bfloat16 weight of ``elements`` values takes the native panels (see :func:`packing_rule`):
    their pair dot products need AVX512-BF16, which the native build then compiles in."""
    have = device.cpu_flags() if flags is None else flags
    big = elements is not None and elements >= ONEDNN_FLOAT32_AVX512_MIN_ELEMENTS
    return big and {"avx512f", "avx512_bf16"} <= have and _non_intel(vendor) and _native_built(native_kernels)


def tied_head_min_rows(dtype: torch.dtype, *, flags: frozenset[str] | None = None) -> int:
    """Fewest rows a tied output projection's packed copy serves (the plain matrix, kept as the
    embedding, serves fewer): 2 for float32 on an x86 CPU without AVX-512, where one row through
    oneDNN's GEMV on the plain ``[in, out]`` matrix was as fast or faster than the packed copy (0.9x);
    1 elsewhere (on the AVX-512 AMD CPU the packed copy read Qwen3-0.6B's 151,936-row projection 2.5x
    faster at one row: 9.3 against 23.2 ms, docs/benchmarks.md)."""
    have = device.cpu_flags() if flags is None else flags
    return 2 if dtype == torch.float32 and device.avx2_without_avx512(have) else 1


def pack_linear(
    weight: torch.Tensor,
    batch_rows: int,
    *,
    library: str | None = None,
    min_rows: int = 1,
    keep_plain: bool = False,
) -> PackedLinearWeight | None:
    """``weight`` with a packed copy (:func:`packing_rule` for ``batch_rows``, or ``library`` at every
    row count it serves); None where nothing is packed: a weight off the CPU, of another dtype, or a
    torch without the library. A ``onednn`` or ``panels`` result serving every row count no longer
    references ``weight``: once the caller drops it, only the packed copy is held. ``min_rows`` > 1 (a
    oneDNN or panels copy, asked for or the rule's) keeps ``weight`` beside the copy for the calls of fewer rows (an
    output projection that is also the embedding, whose one-row product is a GEMV best run on the
    plain matrix); ``keep_plain`` keeps it referenced at any ``min_rows`` (a matrix the caller holds
    anyway, which the reference then multiplies instead of a rebuilt copy)."""
    if min_rows > 1 and library not in (None, "onednn", "panels"):
        raise ValueError(f"min_rows applies to library='onednn' or 'panels' only, got library={library!r}")
    if weight.device.type != "cpu" or weight.dim() != 2 or weight.dtype not in (torch.float32, torch.bfloat16):
        return None
    if library is None:
        rule = packing_rule(weight.dtype, batch_rows, elements=weight.numel(), inputs=weight.shape[1])
        if rule is not None and rule[0] in ("onednn", "panels"):
            rule = (rule[0], min_rows, rule[2])
    elif library == "mkl":
        mkl = weight.dtype == torch.float32 and torch.backends.mkl.is_available()  # type: ignore[no-untyped-call]
        rule = ("mkl", batch_rows, batch_rows) if mkl else None
    elif library == "onednn":
        if torch.backends.mkldnn.is_available() and not onednn_supports(weight.dtype):  # type: ignore[no-untyped-call]
            raise ValueError(
                f"oneDNN cannot pack {weight.dtype} weights on this CPU (its bf16 path needs AVX-512 BW/VL/DQ, "
                "AVX-NE-CONVERT or AMX); use float32 or leave the choice to the default rule"
            )
        rule = ("onednn", min_rows, NEVER)
    elif library == "panels":
        if native.library() is None:
            raise ValueError("the native panels need the native CPU kernels, which are not built here (see the log)")
        rule = ("panels", min_rows, NEVER)
    else:
        raise ValueError(f"unknown packing library {library!r}; choose from {list(LIBRARIES)}")
    if rule is None or (rule[0] != "panels" and not torch.backends.mkldnn.is_available()):  # type: ignore[no-untyped-call]
        return None
    kind, lo, hi = rule
    with torch.inference_mode():
        plain = weight.detach()
        if kind == "mkl":
            packed = torch.ops.mkl._mkl_reorder_linear_weight(plain, lo)
            return PackedLinearWeight(weight, packed, kind, lo, hi, weight.shape[0])
        if kind == "panels":
            packed = native.pack_panels(plain)
        else:
            packed = torch.ops.mkldnn._reorder_linear_weight(plain, None)
    return PackedLinearWeight(weight if lo > 1 or keep_plain else None, packed, kind, lo, hi, weight.shape[0])


@dispatch("linear")
def linear(
    x: torch.Tensor,
    weight: torch.Tensor | PackedLinearWeight,
    bias: torch.Tensor | None = None,
    *,
    float_out: bool = False,
    maxima: tuple[torch.Tensor, torch.Tensor] | None = None,
    store_logits: bool = True,
) -> torch.Tensor:
    """``x @ weight.T + bias`` (``F.linear``); a :class:`PackedLinearWeight`'s plain matrix is used.
    ``float_out``: the result (rounded to ``x``'s dtype, as ever) returned as float32, as
    ``.float()`` of it (a fast path may store it so directly: an output projection's logits).
    ``maxima`` (with ``float_out``): a float32 and an int64 tensor of one element per row of ``x``,
    filled with ``amax`` and ``argmax`` of each row of the float32 result: its maximum and that
    maximum's lowest index, or its first NaN where it has one (a fast path may take them as it
    writes the result: an output projection's logits for greedy rows). ``store_logits`` False (with
    ``maxima``): the caller reads only the maxima, so a fast path that takes them may write no
    result and return ``[..., 0]`` instead (the reference returns the whole result)."""
    plain = weight.plain() if isinstance(weight, PackedLinearWeight) else weight
    out = F.linear(x, plain, bias)
    wide = out.float() if float_out else out
    if maxima is not None:
        fill_maxima(wide, maxima, float_out)
    return wide


def linear_takes_maxima(rows: int, weight: torch.Tensor | PackedLinearWeight) -> bool:
    """Whether :func:`linear` of ``rows`` rows over ``weight`` with ``float_out`` takes ``maxima`` as it
    writes the result (the CPU panels product, or the one-row GEMV over the plain matrix held beside
    a panels copy that serves no single row: no pass over the logits after it) rather than from the
    result after it."""
    if not isinstance(weight, PackedLinearWeight) or weight.library != "panels" or torch.compiler.is_compiling():
        return False
    return (rows == 1 and weight.weight is not None) or weight.serves(rows)


def fill_maxima(out: torch.Tensor, maxima: tuple[torch.Tensor, torch.Tensor], float_out: bool) -> None:
    """``maxima`` (see :func:`linear`) from the float32 result ``out`` of a call with ``float_out``."""
    peak, index = maxima
    rows = out.numel() // out.shape[-1] if out.shape[-1] else 0
    if not float_out or out.shape[-1] == 0 or peak.numel() != rows or index.numel() != rows:
        raise ValueError(
            f"maxima need float_out and one element per row of a non-empty result: {rows} rows of "
            f"{out.shape[-1]}, maxima of {peak.numel()} and {index.numel()} elements"
        )
    flat = out.reshape(rows, out.shape[-1])
    peak.view(-1).copy_(flat.amax(dim=-1))
    index.view(-1).copy_(flat.argmax(dim=-1))


def on_huge_pages(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of CPU ``tensors`` side by side, in order, in one buffer of fresh anonymous memory (its
    own ``mmap``) advised onto transparent huge pages (``madvise(MADV_HUGEPAGE)`` of its 2 MiB-aligned
    span before any page of it is touched), each contiguous, of its tensor's shape and dtype and
    starting on a 64-byte boundary.

    Why: torch's CPU allocator puts a tensor under 2 MiB on 4 KiB pages wherever ``malloc`` finds room
    (with ``THP_MEM_ALLOC_ENABLE`` too, which aligns only larger ones, and a worker's glibc hands out
    memory it kept, already faulted in on small pages), and a small model's layer matrices are such
    tensors. A one-row decode step reads each once, cold, after the output projection's stream has
    evicted the caches and the TLB, so every 4 KiB page of them costs a page walk (in a virtual machine
    a nested one) before its lines come: on the Zen 4 EPYC of docs/benchmarks.md a small model's layers
    took 0.885x their time from huge pages. Laid out in the order a step reads them, they are also one
    stream. Off Linux, or where the kernel refuses the advice (THP off), the buffer is an ordinary
    allocation: only speed differs."""
    if not tensors:
        return []
    if any(t.device.type != "cpu" for t in tensors):
        raise ValueError("on_huge_pages takes CPU tensors")
    sizes = [t.numel() * t.element_size() for t in tensors]
    offsets, total = [], 0
    for size in sizes:
        offsets.append(total)
        total += -(-size // _ALIGN) * _ALIGN
    buffer, start = _huge_page_buffer(total)
    out = []
    for t, offset, size in zip(tensors, offsets, sizes, strict=True):
        view = buffer[start + offset : start + offset + size].view(t.dtype).view(t.shape)
        out.append(view.copy_(t))
    return out


def _huge_page_buffer(size: int) -> tuple[torch.Tensor, int]:
    """A uint8 tensor over fresh anonymous memory and the offset in it of ``size`` bytes starting on a
    huge-page boundary, advised onto huge pages (Linux; elsewhere a plain tensor, offset 0). The
    tensor holds its ``mmap``: the memory lives as long as a view of it does."""
    if not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(size, dtype=torch.uint8), 0
    region = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE)  # anonymous, private: THP-eligible
    buffer = torch.frombuffer(region, dtype=torch.uint8)
    start = -buffer.data_ptr() % HUGE_PAGE
    if size:
        region.madvise(mmap.MADV_HUGEPAGE, start, size)
    return buffer, start
