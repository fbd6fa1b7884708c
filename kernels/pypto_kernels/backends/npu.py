"""Ascend NPU fast paths via ``torch_npu`` fused operators.

Only imported once an NPU tensor is dispatched and ``torch_npu`` is known to import, so
the module-level import below is safe.

Paged attention calls ``torch_npu.npu_fused_infer_attention_score`` the way vllm-ascend's
``AscendAttentionBackendImpl.forward_fused_infer_attention`` does for causal chunked prefill
(vllm_ascend/attention/attention_v1.py): query ``[T, N, D]`` with ``input_layout="TND"``; the paged
caches viewed as ``(num_blocks, block_size, KV_N * D)``; ``block_table`` int32 ``[B, max_blocks]``
with ``block_size``; ``actual_seq_lengths`` the cumulative query ends (B entries) and
``actual_seq_lengths_kv`` each request's cached length; ``num_heads``, ``num_key_value_heads``,
``scale``; the causal mask as ``sparse_mode=3`` (rightDownCausal: the last query of a request sees
its last key) with the compressed 2048 x 2048 upper-triangular ``atten_mask`` (1 = masked; int8 as
vllm-ascend's ``AttentionMaskBuilder.get_splitfuse_attn_mask`` builds it). Constraints from the
torch_npu API reference for this op (``torch_npu.npu_fused_infer_attention_score``; releases whose
signature names the scale ``scale``, as vllm-ascend calls it; the 6.0.RC3 / 6.0.0 references still
call it ``scale_value``, where the keyword should be rejected, not ignored): float16/bfloat16
inputs with D 16-aligned and at most 512; page attention needs
``actual_seq_lengths_kv``, a block size that is a multiple of 128 between 128 and 512, and, in the
``(blocknum, blocksize, H)`` layout, ``KV_N * D <= 65535``; ``num_heads / num_key_value_heads <= 64``;
under TND only ``sparse_mode`` 0 (no mask) or 3 (with mask). Sinks need the ``_v2`` op and sliding
windows its band mode (``sparse_mode=4`` with ``pre_tokens``), whose off-by-one against this
engine's window is unverified without hardware: both run the reference.

Cache writes use ``torch_npu._npu_reshape_and_cache(key, value, key_cache, value_cache, slots)``
with int32 slots and ``(num_blocks, block_size, KV_N, D)`` caches, as torch_npu's
``test_reshape_and_cache`` and vllm-ascend's 310P ``reshape_and_cache`` adaptor call it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch_npu

from ..quant import AbsmaxReduce, quantize_per_token
from ..registry import reference_kernel
from . import paged_attention_features, unknown_options, write_kv_cache_features

_NPU_DTYPES = (torch.float16, torch.bfloat16)
#: Page attention block sizes: a multiple of 128, from 128 to 512.
NPU_BLOCK_MULTIPLE, NPU_MAX_BLOCK_SIZE = 128, 512
_MAX_HEAD_DIM, _MAX_GROUP, _MAX_KV_HIDDEN = 512, 64, 65535
#: sparse_mode 2/3/4 take a fixed 2048 x 2048 compressed mask.
_MASK_SIZE = 2048
_CAUSAL_MASKS: dict[str, torch.Tensor] = {}

PAGED_ATTENTION_LABEL = "npu: npu_fused_infer_attention_score (TND, block table)"
WRITE_KV_CACHE_LABEL = "npu: _npu_reshape_and_cache"


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Fused RMSNorm; npu_rms_norm returns (y, rstd)."""
    out: torch.Tensor = torch_npu.npu_rms_norm(x, weight, epsilon=eps)[0]
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Fused SwiGLU: silu of the first half times the second half (op rejects empty/strided input)."""
    if x.numel() == 0:
        empty: torch.Tensor = reference_kernel("silu_and_mul")(x)
        return empty
    out: torch.Tensor = torch_npu.npu_swiglu(x.contiguous(), dim=-1)
    return out


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """rotate_half RoPE via npu_rotary_mul on [1, T, H, rotary_dim] views; extra dims pass through."""
    rotary_dim = cos.shape[-1]
    cos4 = cos.to(q.dtype)[None, :, None, :]
    sin4 = sin.to(q.dtype)[None, :, None, :]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x_rot = x[..., :rotary_dim].contiguous()[None]
        out: torch.Tensor = torch_npu.npu_rotary_mul(x_rot, cos4.to(x.dtype), sin4.to(x.dtype))[0]
        if rotary_dim == x.shape[-1]:
            return out
        return torch.cat((out, x[..., rotary_dim:]), dim=-1)

    return rotate(q), rotate(k)


def _causal_mask(device: torch.device) -> torch.Tensor:
    """The compressed rightDownCausal mask (1 above the diagonal), built once per device."""
    mask = _CAUSAL_MASKS.get(str(device))
    if mask is None:
        mask = torch.ones(_MASK_SIZE, _MASK_SIZE, dtype=torch.bool).triu_(1).to(torch.int8).to(device)
        _CAUSAL_MASKS[str(device)] = mask
    return mask


def _explain_shapes(f: dict[str, Any]) -> str | None:
    dtypes = {f[k] for k in ("dtype", "cache_dtype", "value_dtype") if f.get(k) is not None}
    if len(dtypes) > 1 or not dtypes <= set(_NPU_DTYPES):
        return "needs float16 or bfloat16 query and caches of one dtype"
    block = f.get("block_size")
    if block is not None and (block % NPU_BLOCK_MULTIPLE or not NPU_BLOCK_MULTIPLE <= block <= NPU_MAX_BLOCK_SIZE):
        return f"block size {block} is not a multiple of {NPU_BLOCK_MULTIPLE} in [128, {NPU_MAX_BLOCK_SIZE}]"
    head_dim, value_dim = f.get("head_dim"), f.get("value_head_dim")
    if head_dim is not None and (head_dim % 16 or head_dim > _MAX_HEAD_DIM):
        return f"head dim {head_dim} is not a multiple of 16 up to {_MAX_HEAD_DIM}"
    if value_dim is not None and head_dim is not None and value_dim != head_dim:
        return "needs equal key and value head dims"
    heads, kv_heads = f.get("num_heads"), f.get("num_kv_heads")
    if heads is not None and kv_heads is not None and (heads % kv_heads or heads // kv_heads > _MAX_GROUP):
        return f"query heads must be a multiple of KV heads, at most {_MAX_GROUP} per KV head"
    if kv_heads is not None and head_dim is not None and kv_heads * head_dim > _MAX_KV_HIDDEN:
        return f"KV heads x head dim exceeds {_MAX_KV_HIDDEN}"
    if f.get("contiguous_cache") is False:
        return "needs contiguous caches"
    return None


def explain_paged_attention(**features: Any) -> str | None:
    """Why a ``paged_attention`` call with these features runs the reference (None: the fused op runs it)."""
    if not hasattr(torch_npu, "npu_fused_infer_attention_score"):
        return "torch_npu has no npu_fused_infer_attention_score"
    if unknown_options(features):
        return unknown_options(features)
    if features.get("sinks"):
        return "sinks are not supported"
    if features.get("sliding_window") is not None:
        return "sliding windows are not supported"
    if features.get("host_lengths") is False:
        return "needs query_lens_host and seq_lens_host (actual_seq_lengths are host lists)"
    return _explain_shapes(features)


def supports_paged_attention(*args: Any, **kwargs: Any) -> bool:
    """Registry predicate: the call is one the fused op computes as the reference does."""
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
    """The reference's contract through one ``npu_fused_infer_attention_score`` call (TND, paged).

    Needs the host lengths, no sinks and no sliding window; the registry only routes such calls
    here. Rows past the last request are zero, as in the reference. ``prompt_rows_host`` changes
    nothing: the one fused op attends every row alike.
    """
    if sinks is not None or sliding_window is not None or query_lens_host is None or seq_lens_host is None:
        raise ValueError("NPU paged_attention needs host lengths, no sinks, no window; call it via the registry")
    q_lens, kv_lens = [int(n) for n in query_lens_host], [int(n) for n in seq_lens_host]
    num_tokens, (num_heads, value_dim) = sum(q_lens), (query.shape[1], value_cache.shape[-1])
    out = query.new_zeros((query.shape[0], num_heads, value_dim))
    if num_tokens == 0 or not kv_lens:
        return out
    num_blocks, block_size, num_kv_heads = key_cache.shape[:3]
    attn, _ = torch_npu.npu_fused_infer_attention_score(
        query[:num_tokens].contiguous(),
        key_cache.view(num_blocks, block_size, -1),
        value_cache.view(num_blocks, block_size, -1),
        atten_mask=_causal_mask(query.device),
        block_table=block_tables.to(torch.int32).contiguous(),
        input_layout="TND",
        block_size=block_size,
        actual_seq_lengths=list(itertools.accumulate(q_lens)),
        actual_seq_lengths_kv=kv_lens,
        num_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        scale=scale,
        sparse_mode=3,
    )
    out[:num_tokens] = attn.view(num_tokens, num_heads, value_dim)
    return out


def explain_write_kv_cache(**features: Any) -> str | None:
    """Why a ``write_kv_cache`` call with these features runs the reference (None: the NPU op runs it)."""
    if not hasattr(torch_npu, "_npu_reshape_and_cache"):
        return "torch_npu has no _npu_reshape_and_cache"
    if unknown_options(features):
        return unknown_options(features)
    cache_dtypes = {features.get("cache_dtype"), features.get("value_dtype")} - {None}
    if len(cache_dtypes) > 1 or not cache_dtypes <= set(_NPU_DTYPES):
        return "needs float16 or bfloat16 caches of one dtype"
    if features.get("contiguous_cache") is False:
        return "needs contiguous caches"
    return None


def supports_write_kv_cache(*args: Any, **kwargs: Any) -> bool:
    """Registry predicate for :func:`write_kv_cache`."""
    return explain_write_kv_cache(**write_kv_cache_features(*args, **kwargs)) is None


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Row ``t`` of K/V [T, Hkv, D] to slot ``slot_mapping[t]`` of both caches in one NPU op, no host sync.

    The reference's contract: every slot is real (no padding rows) and distinct.
    """
    torch_npu._npu_reshape_and_cache(
        key.to(key_cache.dtype).contiguous(),
        value.to(value_cache.dtype).contiguous(),
        key_cache,
        value_cache,
        slot_mapping.to(device=key_cache.device, dtype=torch.int32),
    )


def register(add: Callable[..., None]) -> None:
    """Register the NPU fast paths."""
    add("rms_norm", "npu", rms_norm, label="npu: npu_rms_norm")
    add("silu_and_mul", "npu", silu_and_mul, label="npu: npu_swiglu")
    add("apply_rope", "npu", apply_rope, label="npu: npu_rotary_mul")
    add(
        "paged_attention",
        "npu",
        paged_attention,
        supports_paged_attention,
        label=PAGED_ATTENTION_LABEL,
        explain=explain_paged_attention,
    )
    add(
        "write_kv_cache",
        "npu",
        write_kv_cache,
        supports_write_kv_cache,
        label=WRITE_KV_CACHE_LABEL,
        explain=explain_write_kv_cache,
    )
    add(
        "quant_linear",
        "npu",
        quant_linear_w8a8,
        supports_quant_linear,
        label=QUANT_LINEAR_LABEL,
        explain=explain_quant_linear,
    )


# --------------------------------------------------------------------------- W8A8 linears

QUANT_LINEAR_LABEL = "npu: npu_dynamic_quant + npu_quant_matmul (W8A8 per-token)"


def explain_quant_linear(**features: Any) -> str | None:
    """Why a ``quant_linear`` call runs the reference on the NPU (None: the W8A8 path runs).

    ``npu_quant_matmul``'s ``offset`` applies to int8 outputs only, so weights with a non-zero
    offset (asymmetric) decline; the loader drops all-zero offsets (msModelSlim writes them for
    symmetric weights). Static W8A8 and FP8 run the reference.
    """
    if features.get("scheme") != "w8a8_dynamic":
        return f"scheme {features.get('scheme')!r} has no NPU fast path"
    if features.get("offset"):
        return "asymmetric weights (weight_offset) are not supported by npu_quant_matmul's float output"
    if features.get("dtype", torch.bfloat16) not in _NPU_DTYPES:
        return "needs float16 or bfloat16 activations"
    return None


def supports_quant_linear(x: torch.Tensor, weight: Any, *args: Any, **kwargs: Any) -> bool:
    features = {"scheme": weight.scheme, "offset": weight.offset is not None, "dtype": x.dtype}
    return explain_quant_linear(**features) is None


def quant_linear_w8a8(
    x: torch.Tensor, weight: Any, bias: torch.Tensor | None = None, reduce_absmax: AbsmaxReduce | None = None
) -> torch.Tensor:
    """Dynamic W8A8 as vllm-ascend runs it: ``npu_dynamic_quant`` quantises each token to int8 with
    scale ``absmax / 127`` (returned as float32 ``[tokens]``), and ``npu_quant_matmul(x1, x2, scale,
    pertoken_scale=..., output_dtype=...)`` computes ``(x1 @ x2) * scale * pertoken_scale`` with
    ``x2`` the ``[in, out]`` view of the int8 weight and ``scale`` its per-channel float32 scales.
    A row-parallel rank (``reduce_absmax``) quantises its slice with the whole row's scale instead:
    ``npu_dynamic_quant`` takes no scale, so the same arithmetic runs as tensor ops."""
    xs = x.reshape(-1, x.shape[-1])
    if reduce_absmax is None:
        x_q, token_scale = torch_npu.npu_dynamic_quant(xs)
    else:
        x_q, token_scale = quantize_per_token(xs, reduce_absmax)
    out: torch.Tensor = torch_npu.npu_quant_matmul(
        x_q,
        weight.data.t(),
        weight.scale.reshape(-1).float(),
        pertoken_scale=token_scale.reshape(-1),
        bias=None,
        output_dtype=x.dtype,
    )
    if bias is not None:
        out = out + bias.to(out.dtype)
    return out.reshape(*x.shape[:-1], -1)
