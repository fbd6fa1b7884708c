"""CPU fast paths: linears over stored-precision weights (:func:`pypto_kernels.quant_linear`).

- ``fp8_block``: weight-only. The weight is dequantised a band of output rows at a time (a few
  scale-block rows, at most :data:`BAND_ELEMENTS` values) inside the matmul, so no full-size float
  copy of any weight exists at any time; the band is multiplied in the activation's dtype.
- ``w8a8_dynamic``: activations quantised per token (with the whole row's scale where a
  row-parallel rank passes ``reduce_absmax``), then ``torch._int_mm`` (int8 x int8 -> int32,
  oneDNN's VNNI kernels) and one float rescale: the same arithmetic as the reference, exact up to
  float rounding. Chosen over ``torch._weight_int8pack_mm`` (weight-only, bfloat16 activations) by
  measurement, see docs/benchmarks.md. On an x86 CPU without int8 dot products
  (:func:`pypto_kernels.device.cpu_int8_products_pay`) the int8 weight is instead converted to float
  a band of rows at a time (as FP8's) and multiplied by the int8 activations in float32: the same
  integer products (exact below 2**24), at float32's speed instead of oneDNN's non-VNNI int8
  kernels' (40x slower on the output projection there).
- ``w8a8_static`` runs the reference.

Routed W8A8 experts (:func:`pypto_kernels.quant_moe_experts`, scheme ``w8a8_dynamic``) multiply the
per-token int8 activations by each routed expert's int8 weight through ``torch._int_mm``, without
dequantising it, for calls of at most :data:`INT8_MOE_MAX_ROUTES` routes (decode of a few requests):
measured 4-5x the reference at one token and 2.5x at eight, not faster from 16 tokens on a CPU
without VNNI (docs/benchmarks.md), where the reference's one dequantisation per expert is shared by
more rows.

Dense linears (:func:`pypto_kernels.linear`) whose weight carries a packed copy
(:func:`pypto_kernels.pack_linear`) multiply it, through MKL's packed SGEMM, oneDNN or the native
column panels (:func:`pypto_kernels.native.panel_linear`), for calls within the copy's row counts;
other calls run ``F.linear``. A float32 weight stored ``[in, out]``
(passed as its ``[out, in]`` transposed view, as the Qwen output projection is) is multiplied
transposed, in output chunks, at :data:`TRANSPOSED_MIN_ROWS` rows or more
(:func:`transposed_linear`): on two threads MKL's product with the few rows as the GEMM's short
side was 1.05-1.7x ``x @ W_t`` on the 151,936-row output projection at 16-64 rows on a quiet machine
(even on one thread; slower beside a busy process, docs/benchmarks.md, "The output projection
computed transposed on the CPU"). A contiguous ``[out, in]`` weight (a decoder projection) is
multiplied so too at 2-128 rows when it holds :data:`TRANSPOSED_OUT_IN_MIN_ELEMENTS` or more: 1.04-2.6x
on Qwen3-0.6B's projections, slower on smaller ones. It is a rule on the call's shape,
not a timing, so the rounding of a given batch does not change from run to run.

``paged_attention`` attends a step's decode rows at once
(:func:`pypto_kernels.attention.batched_decode_paged_attention`). Where the native CPU kernels
are built (:mod:`pypto_kernels.native`, a C compiler present) a float32 or bfloat16 cache is read
in place by one C call for every run of up to 16 queries (decode rows, speculative verification),
each row a pass over its keys and one over its values with the next rows prefetched across block
boundaries (docs/benchmarks.md, "Decode attention in C"), and by a second C call for every longer
run (prefill chunks), tiles of queries sharing each chunk of keys and values (docs/benchmarks.md,
"Prefill attention in C"). Without them a float32 cache is read in
place: the scores are one sampled sparse-dense product over the cache rows each decode row sees,
the values one weighted ``embedding_bag``, and no K/V is copied (docs/benchmarks.md, "Decode
attention read in place"). Other caches (bfloat16, FP8: torch's sampled product takes float32 and
float64 only) take a few padded gathers and one bmm per KV head: a win where a cached token is
narrow (per-request overhead dominates the loop: 1.2-2.2x at 512 bytes per token); where it is wide
the gather's memory traffic dominates both and padding makes the batch the slower (0.93x at 4 KiB),
so those caches keep the loop.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from .. import device, native
from ..activation import silu_and_mul
from ..attention import batched_decode_paged_attention, in_place_caches
from ..dense import PackedLinearWeight, fill_maxima
from ..moe import routes_by_expert, sorted_routes
from ..quant import AbsmaxReduce, PackedInt8Weight, QuantizedLinearWeight, fp8_values, quantize_per_token
from ..quant_moe import QuantizedExperts
from . import paged_attention_features

#: Values of one dequantised band of an FP8 weight (4 MiB in float32): large enough that the matmul
#: per band stays efficient, small against any real weight.
BAND_ELEMENTS = 1 << 20

QUANT_LINEAR_LABEL = "cpu: fp8 band-wise dequantising matmul / int8 _int_mm (band-wise float on x86 without VNNI)"
PAGED_ATTENTION_LABEL = (
    "cpu: decode rows batched (float32/bfloat16 caches read in place by the native C kernel, runs of up to "
    "16 queries; without it float32 caches read in place by sampled_addmm scores and embedding_bag values, "
    "others padded gathers and one bmm per KV head)"
)
LINEAR_LABEL = (
    "cpu: weights packed at load (mkl._mkl_linear / mkldnn._linear_pointwise / native column panels); "
    "plain float32 weights multiplied transposed in output chunks (stored [in, out]: from 16 rows; "
    "[out, in] of 512 Ki elements or more: at 2-128 rows)"
)


def _band_rows(weight: QuantizedLinearWeight) -> int:
    rows, inp = weight.block[0], weight.data.shape[1]
    return rows * max(1, BAND_ELEMENTS // max(rows * inp, 1))


def _dequantized_band(weight: QuantizedLinearWeight, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``start:stop`` (``start`` on a block boundary) of the FP8 weight, in ``dtype``."""
    br, bc = weight.block
    band = fp8_values(weight.data[start:stop], dtype)
    scale = weight.scale[start // br : -(-stop // br)].to(dtype)
    n, k = band.shape
    if n % br == 0 and k % bc == 0:  # whole blocks: broadcast the grid, no spread copy
        return (band.view(n // br, br, k // bc, bc) * scale[:, None, :, None]).view(n, k)
    return band * scale.repeat_interleave(br, 0)[:n].repeat_interleave(bc, 1)[:, :k]


def _by_bands(
    xs: torch.Tensor, weight: QuantizedLinearWeight, band: Callable[[int, int], torch.Tensor]
) -> torch.Tensor:
    """``xs @ W.T`` where ``band(start, stop)`` makes rows ``start:stop`` of ``W`` (a few scale-block
    rows, at most :data:`BAND_ELEMENTS` values at a time)."""
    out_rows, step = int(weight.data.shape[0]), _band_rows(weight)
    parts = [F.linear(xs, band(r, min(r + step, out_rows))) for r in range(0, out_rows, step)]
    return torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0]


def _fp8_block(x: torch.Tensor, weight: QuantizedLinearWeight, bias: torch.Tensor | None) -> torch.Tensor:
    dtype = x.dtype if x.dtype in (torch.float32, torch.bfloat16) else torch.float32
    xs = x.reshape(-1, x.shape[-1]).to(dtype)
    out_rows = int(weight.data.shape[0])
    out = _by_bands(xs, weight, lambda start, stop: _dequantized_band(weight, start, stop, dtype))
    if bias is not None:
        out = out + bias.to(dtype)
    return out.reshape(*x.shape[:-1], out_rows).to(x.dtype)


def _banded_int8(x_q: torch.Tensor, weight: QuantizedLinearWeight) -> torch.Tensor:
    """``x_q @ weight.data.T`` in float32 (int8 values, converted a band of weight rows at a time)."""
    return _by_bands(x_q.float(), weight, lambda start, stop: weight.data[start:stop].float())


def _packed_int8(
    x: torch.Tensor, x_q: torch.Tensor, x_scale: torch.Tensor, packed: PackedInt8Weight, bias: torch.Tensor | None
) -> torch.Tensor:
    """The int8 rows ``x_q`` (per-row ``x_scale``) times a prepacked weight: oneDNN takes unsigned
    activations with a zero point, so each int8 value ``v`` goes in as ``v + 128`` (its bits with the
    top one flipped) and zero point 128; the weight's scales apply inside the product, the rows'
    after it, in place."""
    unsigned = x_q.view(torch.uint8).bitwise_xor(128)
    out: torch.Tensor = torch.ops.onednn.qlinear_pointwise(
        unsigned, 1.0, 128, packed.tensor, packed.scale, packed.zero_points, None, 1.0, 0, torch.float32, "none", [], ""
    )
    out.mul_(x_scale)
    if bias is not None:
        out += bias.float()
    return out.reshape(*x.shape[:-1], -1).to(x.dtype)


def _w8a8_dynamic(
    x: torch.Tensor, weight: QuantizedLinearWeight, bias: torch.Tensor | None, reduce_absmax: AbsmaxReduce | None
) -> torch.Tensor:
    xs = x.reshape(-1, x.shape[-1])
    x_q, x_scale = quantize_per_token(xs, reduce_absmax)
    if weight.packed is not None:
        return _packed_int8(x, x_q, x_scale, weight.packed, bias)
    acc = torch._int_mm(x_q, weight.data.t()).float() if device.cpu_int8_products_pay() else _banded_int8(x_q, weight)
    if weight.offset is not None:  # (w - o) . x = w . x - o * sum(x)
        acc = acc - x_q.float().sum(dim=-1, keepdim=True) * weight.offset.float().reshape(1, -1)
    out = acc * weight.scale.float().reshape(1, -1) * x_scale
    if bias is not None:
        out = out + bias.float()
    return out.reshape(*x.shape[:-1], -1).to(x.dtype)


def quant_linear(
    x: torch.Tensor,
    weight: QuantizedLinearWeight,
    bias: torch.Tensor | None = None,
    reduce_absmax: AbsmaxReduce | None = None,
) -> torch.Tensor:
    """The CPU path of :func:`pypto_kernels.quant_linear` (schemes ``supports_quant_linear`` accepts;
    FP8 is weight-only, so ``reduce_absmax`` concerns W8A8 alone)."""
    if weight.scheme == "fp8_block":
        return _fp8_block(x, weight, bias)
    return _w8a8_dynamic(x, weight, bias, reduce_absmax)


def explain_quant_linear(**features: Any) -> str | None:
    scheme = features.get("scheme")
    if scheme is not None and scheme not in ("fp8_block", "w8a8_dynamic"):
        return f"scheme {scheme!r} has no CPU fast path"
    return None


def supports_quant_linear(x: torch.Tensor, weight: QuantizedLinearWeight, *args: Any, **kwargs: Any) -> bool:
    return explain_quant_linear(scheme=weight.scheme) is None


#: Fewest rows (product of the leading dimensions) a plain ``[in, out]``-stored weight is multiplied
#: transposed at: below it MKL's transposed product takes a slow path (2-3x ``x @ W_t`` at 4-8 rows).
TRANSPOSED_MIN_ROWS = 16
#: Values of one chunk's transposed product (4 MiB of float32; 16,384 output features at 64 rows). Each
#: chunk is two parallel regions (its product and its transpose), and beside a busy process every
#: region waits for a descheduled thread: 256 KiB chunks, as fast on a quiet machine, were 2-5x
#: slower there in the median (docs/benchmarks.md), so the chunks are 16x that, as fast when quiet.
TRANSPOSED_CHUNK_ELEMENTS = 1 << 20
#: Fewest elements of a contiguous ``[out, in]`` weight multiplied transposed (512 Ki, 2 MiB of
#: float32): MKL's ``x @ W.T`` at 2-128 rows was 1.04-2.6x slower than ``W @ x.T`` from there up
#: (a 512 x 1024 projection to Qwen3-0.6B's 1024 x 6144) and 1.1-3x faster below it (the small
#: shape's 256-wide projections), on 2 threads (docs/benchmarks.md).
TRANSPOSED_OUT_IN_MIN_ELEMENTS = 1 << 19
#: Row counts (inclusive) a contiguous ``[out, in]`` weight is multiplied transposed at: one row is a
#: GEMV either way (the reference 1.15x faster), and from 256 rows the reference is as fast or faster.
TRANSPOSED_OUT_IN_ROWS = (2, 128)


def transposed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` computed as ``weight @ x.T`` a chunk of output features at a
    time, each chunk transposed into place: no copy of the weight, one chunk-sized buffer."""
    xs = x.reshape(-1, x.shape[-1])
    rows, features = xs.shape[0], weight.shape[0]
    out = torch.empty(rows, features, dtype=x.dtype, device=x.device)
    step = max(256, TRANSPOSED_CHUNK_ELEMENTS // max(rows, 1))
    buf = torch.empty(min(step, features), rows, dtype=x.dtype, device=x.device)
    xt = xs.t()
    for start in range(0, features, step):
        n = min(step, features - start)
        torch.mm(weight[start : start + n], xt, out=buf[:n])
        out[:, start : start + n].copy_(buf[:n].t())
    if bias is not None:
        out += bias
    return out.reshape(*x.shape[:-1], features)


def transposed_rule(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether :func:`transposed_linear` runs this call, by the shape measured to gain: a float32
    weight stored ``[in, out]`` (its ``[out, in]`` view has unit stride down the output features) at
    :data:`TRANSPOSED_MIN_ROWS` rows or more, or a contiguous ``[out, in]`` one of at least
    :data:`TRANSPOSED_OUT_IN_MIN_ELEMENTS` at :data:`TRANSPOSED_OUT_IN_ROWS` rows; eager only (a
    compiled graph keeps the reference's one product)."""
    if x.dtype != torch.float32 or weight.dtype != torch.float32 or weight.dim() != 2 or x.dim() < 1:
        return False
    if bias is not None and bias.dtype != x.dtype:
        return False
    # mm's out= takes no part in autograd: a differentiated call keeps F.linear.
    grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    if grad or torch.compiler.is_compiling():
        return False
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if weight.stride(0) == 1 and weight.stride(1) >= weight.shape[0]:  # stored [in, out]
        return rows >= TRANSPOSED_MIN_ROWS
    lo, hi = TRANSPOSED_OUT_IN_ROWS
    return weight.is_contiguous() and weight.numel() >= TRANSPOSED_OUT_IN_MIN_ELEMENTS and lo <= rows <= hi


def _plain_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return transposed_linear(x, weight, bias) if transposed_rule(x, weight, bias) else F.linear(x, weight, bias)


def _onednn_gemv(x: torch.Tensor, plain: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """One row through oneDNN's product on the plain matrix as it is stored (no packing): its GEMV
    read a 151,936-row output projection stored ``[in, out]`` 1.1-1.5x faster than MKL's ``x @ W``
    (8.5 vs 12.9 ms at hidden 256, 27.1 vs 40.5 ms at 1024), and Qwen3-0.6B's decoder matrices
    ``[out, in]`` 1.5x faster than both ``F.linear`` and their packed copies, cold (docs/benchmarks.md)."""
    out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(x.reshape(1, x.shape[-1]), plain, bias, "none", [], "")
    return out.reshape(*x.shape[:-1], plain.shape[0])


def packed_linear(
    x: torch.Tensor,
    weight: PackedLinearWeight | torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    float_out: bool = False,
    maxima: tuple[torch.Tensor, torch.Tensor] | None = None,
    store_logits: bool = True,
) -> torch.Tensor:
    """The CPU path of :func:`pypto_kernels.linear` for weights ``supports_linear`` accepts: one row
    (float32 or bfloat16) over a plain matrix held with dense rows beside a oneDNN copy (a tied output
    projection) through :func:`pypto_kernels.native.gemv` where the native kernels are built; else a
    packed copy for calls within its row counts (a panels copy at one row too, held matrix or not: its
    sums are a row's in any batch, the GEMV's are not), the plain matrix for the others (one float32
    row beside a oneDNN copy through oneDNN's GEMV on it, :func:`_onednn_gemv`; else transposed in
    chunks where :func:`transposed_rule` says so, else ``F.linear``). ``float_out``: the result widened to float32,
    a panels product's stored so by the product itself as logits (:func:`pypto_kernels.native.panel_linear`),
    which takes ``maxima`` as it writes them (every other path: from the result after it), and with
    ``store_logits`` False writes none of them (:func:`pypto_kernels.native.panel_linear`)."""
    if maxima is not None and not float_out:
        raise ValueError("maxima are those of a float32 result: pass float_out=True")
    out, taken = _packed_linear(x, weight, bias, float_out, maxima, store_logits=store_logits)
    wide = out.float() if float_out else out  # a float32 result is returned as it is
    if maxima is not None and not taken:
        fill_maxima(wide, maxima, float_out)
    return wide


def _packed_linear(
    x: torch.Tensor,
    weight: PackedLinearWeight | torch.Tensor,
    bias: torch.Tensor | None,
    logits: bool,
    maxima: tuple[torch.Tensor, torch.Tensor] | None,
    *,
    store_logits: bool = True,
) -> tuple[torch.Tensor, bool]:
    """The product, and whether it filled ``maxima`` (the panels product and the one-row GEMV take a
    logits product's as they go; the panels product stores no logits where ``store_logits`` is False)."""
    if not isinstance(weight, PackedLinearWeight):
        return transposed_linear(x, weight, bias), False
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    # A plain matrix held beside a copy that does not run one row as it runs a batch anyway (oneDNN's),
    # or does not serve one row (panels from two rows on): the row's GEMV over it.
    beside = weight.library == "onednn" or (weight.library == "panels" and not weight.serves(rows))
    one_row = rows == 1 and beside and weight.weight is not None and not torch.compiler.is_compiling()
    flat = _flat_maxima(maxima, logits, rows, weight.out_features)  # what a native product takes
    if one_row and native.gemv_takes(x, weight.weight, bias):  # type: ignore[arg-type]
        return native.gemv(x, weight.weight, logits=logits, maxima=flat), flat is not None  # type: ignore[arg-type]
    if not weight.serves(rows):
        if rows == 1 and weight.library == "onednn" and weight.dtype == torch.float32:
            return _onednn_gemv(x, weight.plain(), bias), False
        return _plain_linear(x, weight.plain(), bias), False
    out: torch.Tensor
    if weight.library == "panels":
        out = native.panel_linear(
            x,
            weight.packed,
            weight.out_features,
            bias,
            logits=logits,
            maxima=flat,
            store_logits=store_logits or flat is None,
        )
        return out, flat is not None
    if weight.library == "mkl":
        out = torch.ops.mkl._mkl_linear(x, weight.packed, weight.plain(), bias, weight.max_rows)
    else:
        out = torch.ops.mkldnn._linear_pointwise(x, weight.packed, bias, "none", [], "")
    return out, False


def _flat_maxima(
    maxima: tuple[torch.Tensor, torch.Tensor] | None, logits: bool, rows: int, outputs: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``maxima`` as the native logits products take them (one element a row), or None where none is
    taken: not asked, not logits, or an empty product."""
    if maxima is None or not logits or rows == 0 or outputs == 0:
        return None
    return maxima[0].view(-1), maxima[1].view(-1)


def explain_linear(**features: Any) -> str | None:
    """Why a described call would run the reference; a plain (unpacked) weight is described by
    ``stored_in_out`` (bool), ``elements`` (its size) and ``rows``."""
    dtype = features.get("dtype")
    if not features.get("packed", True):
        if dtype not in (None, torch.float32):
            return f"the weight has no packed copy (pypto_kernels.pack_linear) and dtype {dtype} is not float32"
        return _explain_transposed(features.get("stored_in_out", False), features.get("elements"), features.get("rows"))
    if dtype is not None and dtype not in (torch.float32, torch.bfloat16):
        return f"dtype {dtype} is not packed"
    return None


def _explain_transposed(stored_in_out: bool, elements: int | None, rows: int | None) -> str | None:
    if stored_in_out:
        if rows is not None and rows < TRANSPOSED_MIN_ROWS:
            return f"{rows} rows: the transposed product is slower below {TRANSPOSED_MIN_ROWS}"
        return None
    if elements is None or elements < TRANSPOSED_OUT_IN_MIN_ELEMENTS:
        return (
            f"{elements or 'an unknown number of'} elements: the weight has no packed copy and the transposed "
            f"product is slower below {TRANSPOSED_OUT_IN_MIN_ELEMENTS}"
        )
    lo, hi = TRANSPOSED_OUT_IN_ROWS
    if rows is not None and not lo <= rows <= hi:
        return f"{rows} rows: an [out, in] weight is multiplied transposed at {lo}-{hi} rows"
    return None


def supports_linear(
    x: torch.Tensor,
    weight: object,
    bias: torch.Tensor | None = None,
    *,
    float_out: bool = False,
    maxima: tuple[torch.Tensor, torch.Tensor] | None = None,
    store_logits: bool = True,
) -> bool:
    if isinstance(weight, torch.Tensor):
        return transposed_rule(x, weight, bias)
    if not isinstance(weight, PackedLinearWeight) or x.dtype != weight.dtype:
        return False
    if weight.library == "panels" and torch.compiler.is_compiling():
        return False  # dynamo cannot trace the ctypes call; the reference rebuilds the plain matrix
    return bias is None or bias.dtype == x.dtype


#: Widest cached token (bytes of one token's K over all KV heads) the padded decode path takes.
BATCHED_DECODE_MAX_TOKEN_BYTES = 1024


def explain_paged_attention(**features: Any) -> str | None:
    heads, dim, dtype = features.get("num_kv_heads"), features.get("head_dim"), features.get("cache_dtype")
    if heads is None or dim is None or dtype is None:
        return None
    dense = features.get("contiguous_cache", True) or features.get("head_major_cache", False)
    value_dtype = features.get("value_dtype", dtype)
    if native.reads_dtypes(dtype, value_dtype) or in_place_caches(dtype, value_dtype, dense):
        return None
    width = heads * dim * torch.empty((), dtype=dtype).element_size()
    if width > BATCHED_DECODE_MAX_TOKEN_BYTES:
        return f"{width} bytes per cached token: the request loop is faster above {BATCHED_DECODE_MAX_TOKEN_BYTES}"
    return None


def supports_paged_attention(*args: Any, **kwargs: Any) -> bool:
    key_cache, value_cache = args[1:3] if len(args) >= 3 else (kwargs.get("key_cache"), kwargs.get("value_cache"))
    caches = isinstance(key_cache, torch.Tensor) and isinstance(value_cache, torch.Tensor)
    if caches and native.reads_dtypes(key_cache.dtype, value_cache.dtype):  # explain's first rule, no features built
        return True
    return explain_paged_attention(**paged_attention_features(*args, **kwargs)) is None


#: Most routes (tokens x top-k) a call may have for the int8 expert path (see the module docstring).
INT8_MOE_MAX_ROUTES = 32
INT8_MOE_LABEL = "cpu: int8 experts through torch._int_mm (few routes)"


def _int8_expert_matmul(q: torch.Tensor, q_scale: torch.Tensor, w: QuantizedExperts, e: int) -> torch.Tensor:
    """Per-token int8 rows ``q`` (scales ``q_scale [rows, 1]``) times expert ``e`` of the stack ``w``."""
    acc = torch._int_mm(q, w.data[e].t()).float()
    if w.offset is not None:  # (w - o) . x = w . x - o * sum(x)
        acc = acc - q.float().sum(dim=-1, keepdim=True) * w.offset[e].float()
    return acc * w.scale[e].float() * q_scale


def int8_moe_experts(
    x: torch.Tensor,
    gate_up: QuantizedExperts,
    down: QuantizedExperts,
    weights: torch.Tensor,
    ids: torch.Tensor,
    activation: Callable[[torch.Tensor], torch.Tensor] = silu_and_mul,
    reduce_absmax: AbsmaxReduce | None = None,
) -> torch.Tensor:
    """:func:`pypto_kernels.quant_moe_experts` for W8A8 experts with int8 matmuls (module docstring):
    every expert's hidden rows first, quantised in one call (one ``reduce_absmax`` for a
    tensor-parallel rank's slices), then the down matmuls."""
    out = torch.zeros_like(x)
    if ids.numel() == 0:
        return out
    x_q, x_scale = quantize_per_token(x)
    routes = routes_by_expert(ids, weights, gate_up.data.shape[0], torch.float32)
    hidden = [
        activation(_int8_expert_matmul(x_q[tokens], x_scale[tokens], gate_up, expert).to(x.dtype))
        for expert, _, tokens, _ in routes
    ]
    if not hidden:
        return out
    h_q, h_scale = quantize_per_token(torch.cat(hidden), reduce_absmax)
    start = 0
    for expert, count, tokens, route_weights in routes:
        rows = slice(start, start + count)
        routed = _int8_expert_matmul(h_q[rows], h_scale[rows], down, expert) * route_weights[:, None]
        out.index_add_(0, tokens, routed.to(out.dtype))
        start += count
    return out


def explain_quant_moe_experts(**features: Any) -> str | None:
    scheme, routes = features.get("scheme"), features.get("routes")
    if scheme is not None and scheme != "w8a8_dynamic":
        return f"scheme {scheme!r} has no CPU fast path (dequantised per routed expert)"
    if routes is not None and routes > INT8_MOE_MAX_ROUTES:
        return f"{routes} routes: the reference is faster above {INT8_MOE_MAX_ROUTES}"
    return None


def supports_quant_moe_experts(
    x: torch.Tensor,
    gate_up: QuantizedExperts,
    down: QuantizedExperts,
    weights: torch.Tensor,
    ids: torch.Tensor,
    *args: Any,
    **kwargs: Any,
) -> bool:
    same = gate_up.scheme == down.scheme
    return same and explain_quant_moe_experts(scheme=gate_up.scheme, routes=ids.numel()) is None


MOE_LABEL = "cpu: routed rows sorted by expert, each expert's matrix read once for its rows (pypto_kernels.native)"
ROUTED_MOE_LABEL = "cpu: router, routing and both expert products in one C call (pypto_kernels.native)"


def native_moe_experts(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    activation: Callable[[torch.Tensor], torch.Tensor] = silu_and_mul,
) -> torch.Tensor:
    """:func:`pypto_kernels.moe_experts` through :func:`pypto_kernels.native.grouped_gemv`: the routes
    sorted by expert (stable) as the grouped path sorts them, the dropped ones (id ``E``) cut off the
    end, both products native, weighted and summed per token in the same order."""
    out = torch.zeros_like(x)
    if ids.shape[0] == 0:
        return out
    experts = gate_up.shape[0]
    ends = torch.bincount(ids.reshape(-1), minlength=experts + 1)[:experts].cumsum(0)
    _, token_of, flat_weights = sorted_routes(ids, weights, x.dtype)
    kept = int(ends[-1])  # a host read, free on the CPU
    token_of, flat_weights = token_of[:kept], flat_weights[:kept]
    hidden = activation(native.grouped_gemv(x.index_select(0, token_of), gate_up, ends)).contiguous()
    hidden = native.grouped_gemv(hidden, down, ends) * flat_weights.unsqueeze(1)
    return out.index_add_(0, token_of, hidden.to(out.dtype))


def supports_moe_experts(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
    *args: Any, **kwargs: Any,
) -> bool:  # fmt: skip
    return (
        not torch.compiler.is_compiling()
        and ids.numel() <= native.MOE_ROUTES_PER_EXPERT.get(x.dtype, 0) * gate_up.shape[0]
        and native.grouped_gemv_takes(x.reshape(-1, x.shape[-1]), gate_up)
        and down.dtype == x.dtype
        and down.dim() == 3
        and down.shape[0] == gate_up.shape[0]
        and down.shape[1] == x.shape[-1]
        and down.stride(2) == 1
        and x.dim() == 2
        and x.is_contiguous()
    )


def native_routed_moe(
    x: torch.Tensor,
    router_weight: torch.Tensor,
    gate_up: torch.Tensor | native.PackedExperts,
    down: torch.Tensor | native.PackedExperts,
    top_k: int,
    norm_topk_prob: bool,
) -> torch.Tensor:
    """:func:`pypto_kernels.routed_moe` as one native call (:func:`pypto_kernels.native.moe_block`)."""
    return native.moe_block(x, router_weight, gate_up, down, top_k, norm_topk_prob)


def supports_routed_moe(
    x: torch.Tensor, router_weight: torch.Tensor, gate_up: torch.Tensor | native.PackedExperts,
    down: torch.Tensor | native.PackedExperts, top_k: int, *args: Any, **kwargs: Any,
) -> bool:  # fmt: skip
    """The native block for experts packed as panels at any row count (their products reach the FLOP
    peak); for plain experts within the grouped GEMV's limit
    (:data:`pypto_kernels.native.MOE_ROUTES_PER_EXPERT`: beyond it torch's grouped GEMM is faster)."""
    packed = isinstance(gate_up, native.PackedExperts)
    within = packed or x.shape[0] * top_k <= native.MOE_ROUTES_PER_EXPERT.get(x.dtype, 0) * gate_up.shape[0]
    return (
        not torch.compiler.is_compiling()
        and x.dim() == 2
        and 0 < top_k <= gate_up.shape[0]
        and within
        and native.moe_block_takes(x, router_weight, gate_up, down)
    )


NORM_LABEL = "cpu: one C pass per row (pypto_kernels.native)"
QK_ROPE_LABEL = "cpu: one C pass per token, norms, rotation and cache write (pypto_kernels.native)"


def native_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return native.rms_norm(x, weight, eps)[0]


def supports_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> bool:
    # A traced forward (torch.compile, graph.py) keeps the torch ops: dynamo cannot trace a ctypes call.
    return not torch.compiler.is_compiling() and native.norm_takes(x, weight)


def native_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return native.silu_mul(x)


def supports_silu_and_mul(x: torch.Tensor) -> bool:
    return not torch.compiler.is_compiling() and native.silu_takes(x)


def native_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    out, summed = native.rms_norm(x, weight, eps, residual)
    assert summed is not None
    return out, summed


def supports_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> bool:
    return not torch.compiler.is_compiling() and native.norm_takes(x, weight, residual)


def _qk_arguments(
    qkv: torch.Tensor,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    norms: tuple[torch.Tensor | None, torch.Tensor | None],
    eps: float,
    rotary: tuple[torch.Tensor, torch.Tensor],
    caches: tuple[torch.Tensor, torch.Tensor],
    slot_mapping: torch.Tensor,
    *,
    k_scale: Any = None,
    v_scale: Any = None,
) -> tuple[tuple[Any, ...], bool]:
    """A :func:`pypto_kernels.qk_norm_rope_write_kv` call's arguments in order, and whether it
    carries an FP8 cache's scales."""
    args = (qkv, num_q_heads, num_kv_heads, head_dim, norms, eps, rotary, caches, slot_mapping)
    return args, k_scale is not None or v_scale is not None


def native_qk_norm_rope_write_kv(*args: Any, **kwargs: Any) -> torch.Tensor:
    return native.qk_norm_rope_write_kv(*_qk_arguments(*args, **kwargs)[0])


def supports_qk_norm_rope_write_kv(*args: Any, **kwargs: Any) -> bool:
    # Scales belong to FP8 caches, which the C pass does not write; a traced forward keeps the torch ops.
    (qkv, _, _, head_dim, norms, _, rotary, caches, _), scaled = _qk_arguments(*args, **kwargs)
    if scaled or torch.compiler.is_compiling():
        return False
    return native.qk_rope_takes(qkv, head_dim, norms, rotary[0], *caches)


def register(add: Callable[..., None]) -> None:
    add("rms_norm", "cpu", native_rms_norm, supports_rms_norm, label=NORM_LABEL)
    add("add_rms_norm", "cpu", native_add_rms_norm, supports_add_rms_norm, label=NORM_LABEL)
    add("silu_and_mul", "cpu", native_silu_and_mul, supports_silu_and_mul, label=NORM_LABEL)
    add("moe_experts", "cpu", native_moe_experts, supports_moe_experts, label=MOE_LABEL)
    add("routed_moe", "cpu", native_routed_moe, supports_routed_moe, label=ROUTED_MOE_LABEL)
    add(
        "qk_norm_rope_write_kv",
        "cpu",
        native_qk_norm_rope_write_kv,
        supports_qk_norm_rope_write_kv,
        label=QK_ROPE_LABEL,
    )
    add(
        "paged_attention",
        "cpu",
        batched_decode_paged_attention,
        supports_paged_attention,
        label=PAGED_ATTENTION_LABEL,
        explain=explain_paged_attention,
    )
    add("linear", "cpu", packed_linear, supports_linear, label=LINEAR_LABEL, explain=explain_linear)
    add(
        "quant_linear",
        "cpu",
        quant_linear,
        supports_quant_linear,
        label=QUANT_LINEAR_LABEL,
        explain=explain_quant_linear,
    )
    add(
        "quant_moe_experts",
        "cpu",
        int8_moe_experts,
        supports_quant_moe_experts,
        label=INT8_MOE_LABEL,
        explain=explain_quant_moe_experts,
    )
