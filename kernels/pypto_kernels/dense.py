"""Dense linear layers whose weights may carry a copy packed once, at load, for a CPU GEMM library.

:func:`linear` is ``F.linear``; its reference ignores any packed copy. A weight wrapped by
:func:`pack_linear` as a :class:`PackedLinearWeight` keeps the plain ``[out, in]`` matrix (the
reference's operand, and what calls outside the packed copy's row counts multiply) beside one packed
layout of it, which the CPU fast path (:mod:`pypto_kernels.backends.cpu`) multiplies:

- ``mkl``: MKL's packed SGEMM (``torch.ops.mkl._mkl_reorder_linear_weight`` / ``_mkl_linear``),
  float32. MKL packs for one row count, and torch's op runs it only at exactly that count (any other
  falls back to the plain matrix), so it serves the batch the engine runs most: ``max_num_seqs``
  decode rows.
- ``onednn``: oneDNN's blocked layout (``torch.ops.mkldnn._reorder_linear_weight`` /
  ``_linear_pointwise``), any row count, float32 or bfloat16.

The packed and plain products accumulate in different orders, so they agree to float rounding, not
bit for bit. Which layout a weight gets is a rule on its dtype and the engine's batch
(:func:`packing_rule`), not a timing taken at load: a measurement on a shared machine would choose
differently from run to run, and with it the rounding of every logit. The measurements behind the
rule are in docs/benchmarks.md ("Packed matrix products on the CPU").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .registry import dispatch

__all__ = ["LIBRARIES", "NEVER", "PackedLinearWeight", "linear", "pack_linear", "packing_rule"]

#: A row count no call reaches: ``max_rows`` of a copy serving every count from ``min_rows`` on.
NEVER = 1 << 62

#: The packed layouts :func:`pack_linear` makes.
LIBRARIES = ("mkl", "onednn")


@dataclass(slots=True)
class PackedLinearWeight:
    """A float ``[out, in]`` linear weight and its copy packed for ``library``.

    :param weight: the plain matrix (may be a transposed view, e.g. of an output projection stored
        ``[in, out]``); the reference, and calls outside ``min_rows..max_rows``, multiply it.
    :param packed: the packed copy (an opaque oneDNN tensor).
    :param library: ``mkl`` or ``onednn`` (see the module doc).
    :param min_rows: the fewest rows (product of the leading dimensions) a call runs packed with.
    :param max_rows: the most (for ``mkl``, equal to ``min_rows``: the one count it was packed for).
    """

    weight: torch.Tensor
    packed: torch.Tensor
    library: str
    min_rows: int
    max_rows: int

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.weight.dtype


def packing_rule(dtype: torch.dtype, batch_rows: int) -> tuple[str, int, int] | None:
    """``(library, min_rows, max_rows)`` for a CPU weight of ``dtype`` in an engine whose full decode
    batch is ``batch_rows``, or None (plain ``F.linear`` everywhere). Measured on AVX-512 CPUs
    (docs/benchmarks.md): bfloat16 through oneDNN at every row count; float32 through MKL's packed
    SGEMM at the full batch only (oneDNN's float32 path was slower than MKL's GEMV at one row and no
    faster than ``F.linear`` elsewhere)."""
    if dtype == torch.bfloat16:
        return ("onednn", 1, NEVER)
    if dtype == torch.float32 and batch_rows >= 2 and torch.backends.mkl.is_available():  # type: ignore[no-untyped-call]
        return ("mkl", batch_rows, batch_rows)
    return None


def pack_linear(weight: torch.Tensor, batch_rows: int, *, library: str | None = None) -> PackedLinearWeight | None:
    """``weight`` with a packed copy (:func:`packing_rule` for ``batch_rows``, or ``library`` at every
    row count it serves); None where nothing is packed: a weight off the CPU, of another dtype, or a
    torch without the library."""
    if weight.device.type != "cpu" or weight.dim() != 2 or weight.dtype not in (torch.float32, torch.bfloat16):
        return None
    if library is None:
        rule = packing_rule(weight.dtype, batch_rows)
    elif library == "mkl":
        rule = ("mkl", batch_rows, batch_rows) if weight.dtype == torch.float32 else None
    elif library == "onednn":
        rule = ("onednn", 1, NEVER)
    else:
        raise ValueError(f"unknown packing library {library!r}; choose from {list(LIBRARIES)}")
    if rule is None or not torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        return None
    kind, lo, hi = rule
    with torch.inference_mode():
        plain = weight.detach()
        if kind == "mkl":
            packed = torch.ops.mkl._mkl_reorder_linear_weight(plain, lo)
        else:
            packed = torch.ops.mkldnn._reorder_linear_weight(plain, None)
    return PackedLinearWeight(weight, packed, kind, lo, hi)


@dispatch("linear")
def linear(
    x: torch.Tensor, weight: torch.Tensor | PackedLinearWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ weight.T + bias`` (``F.linear``); a :class:`PackedLinearWeight`'s plain matrix is used."""
    plain = weight.weight if isinstance(weight, PackedLinearWeight) else weight
    return F.linear(x, plain, bias)
