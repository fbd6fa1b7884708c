"""CUDA fast paths.

Small on purpose: the batched references already run on GPU, so only kernels with a fused
primitive that keeps their numerics are swapped in here.

Paged attention goes through FlashAttention-2's ``flash_attn_varlen_func`` with a block table,
as documented in ``flash_attn/flash_attn_interface.py`` (Dao-AILab/flash-attention, 2.x)::

    flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                           ..., block_table=None)

``q`` is ``(total_q, nheads, headdim)``; with ``block_table`` (``(batch, max_blocks)`` int32), ``k``
and ``v`` are the paged caches ``(num_blocks, page_block_size, nheads_k, headdim)``; ``cu_seqlens_*``
are int32 ``(batch + 1,)`` cumulative lengths (for paged K/V, of each request's cached keys). The
causal mask is aligned to the bottom right (query ``i`` of a request sees keys up to
``i + seqlen_k - seqlen_q``) and a window ``(left, right)`` keeps keys in
``[i + seqlen_k - seqlen_q - left, i + seqlen_k - seqlen_q + right]``: the reference's window ``w``
(keys ``> pos - w``) is ``(w - 1, 0)``. ``csrc/flash_attn/flash_api.cpp`` (``mha_varlen_fwd``)
checks that the paged block size is divisible by 256, that q/k/v are float16 or bfloat16 of one
dtype, head dims at most 256, query heads a multiple of KV heads, and an Ampere or newer GPU.
Sinks have no counterpart there. Calls outside these limits run the reference (``supports``).
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from ..quant_moe import gathered_quant_moe_experts
from . import paged_attention_features, unknown_options, write_kv_cache_features

#: FlashAttention-2 paged KV: "Paged KV cache block size must be divisible by 256" (mha_varlen_fwd).
FLASH_ATTN_BLOCK_MULTIPLE = 256
_FLASH_ATTN_DTYPES = (torch.float16, torch.bfloat16)
_FLASH_ATTN_MAX_HEAD_DIM = 256

PAGED_ATTENTION_LABEL = "cuda: flash-attn varlen (block table)"
QUANT_MOE_LABEL = "cuda: routed experts gathered and dequantised per step, grouped matmuls (no host read)"
WRITE_KV_CACHE_LABEL = "cuda: index_copy_ scatter by slot"


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Fused float32 RMSNorm (torch's rms_norm kernel), then cast and scale in HF order."""
    normed = F.rms_norm(x.to(torch.float32), (x.shape[-1],), eps=eps)
    return weight * normed.to(x.dtype)


@functools.cache
def _load_flash_attn_varlen() -> Callable[..., Any] | None:
    """``flash_attn.flash_attn_varlen_func`` if it imports and takes ``block_table`` (flash-attn >= 2.6);
    cached, so a missing package costs one failed import."""
    try:
        fn = importlib.import_module("flash_attn").flash_attn_varlen_func
        takes_block_table = "block_table" in inspect.signature(fn).parameters
    except Exception:  # not installed, built for another torch/CUDA, or an older API
        return None
    return fn if takes_block_table else None  # type: ignore[no-any-return]


def flash_attn_varlen() -> Callable[..., Any] | None:
    """``flash_attn.flash_attn_varlen_func`` with paged-KV support, else None."""
    return _load_flash_attn_varlen()


def _explain_dtypes_and_shapes(f: dict[str, Any]) -> str | None:
    dtypes = {f[k] for k in ("dtype", "cache_dtype", "value_dtype") if f.get(k) is not None}
    if len(dtypes) > 1 or not dtypes <= set(_FLASH_ATTN_DTYPES):
        return "needs float16 or bfloat16 query and caches of one dtype"
    block = f.get("block_size")
    if block is not None and block % FLASH_ATTN_BLOCK_MULTIPLE:
        return f"block size {block} is not a multiple of {FLASH_ATTN_BLOCK_MULTIPLE}"
    head_dim, value_dim = f.get("head_dim"), f.get("value_head_dim")
    if head_dim is not None and (head_dim > _FLASH_ATTN_MAX_HEAD_DIM or head_dim % 8):
        return f"head dim {head_dim} is not a multiple of 8 up to {_FLASH_ATTN_MAX_HEAD_DIM}"
    if value_dim is not None and head_dim is not None and value_dim != head_dim:
        return "needs equal key and value head dims"
    heads, kv_heads = f.get("num_heads"), f.get("num_kv_heads")
    if heads is not None and kv_heads is not None and heads % kv_heads:
        return "query heads must be a multiple of KV heads"
    if f.get("contiguous_cache") is False:
        return "needs contiguous caches"
    return None


def explain_paged_attention(**features: Any) -> str | None:
    """Why a ``paged_attention`` call with these features runs the reference (None: flash-attn runs it)."""
    if flash_attn_varlen() is None:
        return "flash_attn (>= 2.6, with block_table) is not importable"
    if unknown_options(features):
        return unknown_options(features)
    if features.get("sinks"):
        return "sinks are not supported"
    if features.get("host_lengths") is False:
        return "needs query_lens_host and seq_lens_host for the max lengths"
    window = features.get("sliding_window")
    if window is not None and window < 1:
        return f"sliding window {window} < 1"
    reason = _explain_dtypes_and_shapes(features)
    if reason is not None:
        return reason
    device = features.get("device")
    if isinstance(device, torch.device) and device.type == "cuda" and _capability(device.index) < (8, 0):
        return "needs an Ampere (sm80) or newer GPU"
    return None


@functools.cache
def _capability(index: int | None) -> tuple[int, int]:
    """Compute capability of a CUDA device (cached: ``supports`` runs on every call)."""
    return torch.cuda.get_device_capability(index)


def supports_paged_attention(*args: Any, **kwargs: Any) -> bool:
    """Registry predicate: the call is one flash-attn's paged varlen kernel computes exactly."""
    return explain_paged_attention(**paged_attention_features(*args, **kwargs)) is None


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    *,
    query_lens_host: Sequence[int] | None = None,
    seq_lens_host: Sequence[int] | None = None,
    prompt_rows_host: Sequence[int] | None = None,
) -> torch.Tensor:
    """The reference's contract through one ``flash_attn_varlen_func`` call over the paged caches.

    Needs the host lengths (for ``max_seqlen_q``/``max_seqlen_k``, no device read) and no sinks;
    the registry only routes such calls here. Rows past the last request are zero, as in the reference.
    ``prompt_rows_host`` changes nothing: the one kernel attends every row alike.
    """
    if sinks is not None or query_lens_host is None or seq_lens_host is None:
        raise ValueError("flash-attn paged_attention needs host lengths and no sinks; call it via the registry")
    varlen = flash_attn_varlen()
    if varlen is None:
        raise RuntimeError("flash_attn is not importable")
    q_lens, kv_lens = [int(n) for n in query_lens_host], [int(n) for n in seq_lens_host]
    num_tokens = sum(q_lens)
    out_shape = (query.shape[0], query.shape[1], value_cache.shape[-1])
    if num_tokens == 0 or not kv_lens:
        return query.new_zeros(out_shape)
    cu_seqlens_k = F.pad(seq_lens.to(torch.int32).cumsum(0, dtype=torch.int32), (1, 0))
    attn: torch.Tensor = varlen(
        query[:num_tokens],
        key_cache,
        value_cache,
        query_start_loc.to(torch.int32).contiguous(),
        cu_seqlens_k,
        max(q_lens),
        max(kv_lens),
        softmax_scale=scale,
        causal=True,
        window_size=(sliding_window - 1, 0) if sliding_window is not None else (-1, -1),
        block_table=block_tables.to(torch.int32).contiguous(),
    )
    if num_tokens == query.shape[0]:
        return attn
    out = query.new_zeros(out_shape)
    out[:num_tokens] = attn
    return out


def explain_write_kv_cache(**features: Any) -> str | None:
    """Why a ``write_kv_cache`` call with these features runs the reference (None: the scatter runs it)."""
    if unknown_options(features):
        return unknown_options(features)
    if features.get("contiguous_cache") is False:
        return "needs contiguous caches"
    return None


def supports_write_kv_cache(*args: Any, **kwargs: Any) -> bool:
    """Registry predicate: both caches are contiguous, so a flat [blocks * block_size, ...] view exists."""
    return explain_write_kv_cache(**write_kv_cache_features(*args, **kwargs)) is None


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Row ``t`` of K/V [T, Hkv, D] to flat slot ``slot_mapping[t]`` by ``index_copy_``: no host sync.

    The reference's contract: every slot is real (no padding rows) and distinct.
    """
    slots = slot_mapping.to(device=key_cache.device, dtype=torch.int64)
    for rows, cache in ((key, key_cache), (value, value_cache)):
        cache.view(-1, *cache.shape[2:]).index_copy_(0, slots, rows.to(cache.dtype))


def register(add: Callable[..., None]) -> None:
    """Register the CUDA fast paths."""
    add("rms_norm", "cuda", rms_norm, label="cuda: torch rms_norm (float32)")
    add(
        "paged_attention",
        "cuda",
        paged_attention,
        supports_paged_attention,
        label=PAGED_ATTENTION_LABEL,
        explain=explain_paged_attention,
    )
    add(
        "write_kv_cache",
        "cuda",
        write_kv_cache,
        supports_write_kv_cache,
        label=WRITE_KV_CACHE_LABEL,
        explain=explain_write_kv_cache,
    )
    add(
        "quant_linear",
        "cuda",
        quant_linear_fp8,
        supports_quant_linear,
        label=QUANT_LINEAR_LABEL,
        explain=explain_quant_linear,
    )
    add("quant_moe_experts", "cuda", gathered_quant_moe_experts, label=QUANT_MOE_LABEL)


# --------------------------------------------------------------------------- FP8 block-scaled linears

QUANT_LINEAR_LABEL = "cuda: torch._scaled_mm per 128-column block (row-wise scales)"
#: FP8 tensor cores: Ada (8.9) and Hopper (9.0) or newer.
_FP8_CAPABILITY = (8, 9)
_E4M3_MAX = 448.0


def _fp8_capable(device: torch.device | str | None) -> bool:
    dev = torch.device(device) if device is not None else None
    if dev is None or dev.type != "cuda":
        return False
    try:
        return torch.cuda.get_device_capability(dev) >= _FP8_CAPABILITY
    except Exception:  # no driver (a fake device in tests): nothing is known, so decline
        return False


def explain_quant_linear(**features: Any) -> str | None:
    """Why an FP8 ``quant_linear`` call runs the reference (None: it runs ``_scaled_mm``)."""
    if features.get("scheme", "fp8_block") != "fp8_block":
        return f"scheme {features.get('scheme')!r} has no CUDA fast path (dequantised per call)"
    if features.get("weight_dtype", torch.float8_e4m3fn) != torch.float8_e4m3fn:
        return "needs float8_e4m3fn weights"
    if not _fp8_capable(features.get("device")):
        return f"needs FP8 tensor cores (compute capability >= {_FP8_CAPABILITY[0]}.{_FP8_CAPABILITY[1]})"
    out, inp = features.get("shape", (16, 16))
    block_cols = features.get("block", (128, 128))[1]
    if out % 16 or inp % block_cols or block_cols % 16:
        return f"needs out features a multiple of 16 and in features a multiple of the {block_cols}-column block"
    return None


def supports_quant_linear(x: torch.Tensor, weight: Any, *args: Any, **kwargs: Any) -> bool:
    features = {
        "scheme": weight.scheme,
        "weight_dtype": weight.data.dtype,
        "device": weight.data.device,
        "shape": tuple(weight.data.shape),
        "block": weight.block,
    }
    return explain_quant_linear(**features) is None


def quant_linear_fp8(
    x: torch.Tensor, weight: Any, bias: torch.Tensor | None = None, reduce_absmax: Any = None
) -> torch.Tensor:
    """FP8 ``x @ W.T`` without dequantising ``W``: per block of ``bc`` input columns, the activations
    are quantised to e4m3 per token (DeepSeek's and Qwen3-FP8's dynamic 1 x 128 activation scheme)
    and ``torch._scaled_mm`` multiplies them by that column block of the weight with row-wise scales
    (per token for ``x``, per output row for ``W``: the block scale of the row's block); the partial
    products add up in float32. Everything stays on the device: no host reads. ``reduce_absmax``
    is not needed: a row-parallel rank's part holds whole column blocks (the loader dequantises
    parts that cut one), so each block's scale is one rank's alone."""
    br, bc = weight.block
    xs = x.reshape(-1, x.shape[-1])
    out_rows = weight.data.shape[0]
    # [in / bc, out]: row kb holds each output row's scale for column block kb, contiguous.
    row_scales = weight.scale.float().t().repeat_interleave(br, 1)[:, :out_rows]
    acc = torch.zeros(xs.shape[0], out_rows, dtype=torch.float32, device=x.device)
    for kb in range(weight.data.shape[1] // bc):
        a = xs[:, kb * bc : (kb + 1) * bc].float()
        a_scale = (a.abs().amax(dim=-1, keepdim=True) / _E4M3_MAX).clamp_min(1e-12)
        a_q = (a / a_scale).to(torch.float8_e4m3fn)
        b = weight.data[:, kb * bc : (kb + 1) * bc].t()  # column-major view, as _scaled_mm wants
        b_scale = row_scales[kb : kb + 1]
        acc += torch._scaled_mm(a_q, b, scale_a=a_scale, scale_b=b_scale, out_dtype=torch.bfloat16).float()
    if bias is not None:
        acc = acc + bias.float()
    return acc.reshape(*x.shape[:-1], out_rows).to(x.dtype)
