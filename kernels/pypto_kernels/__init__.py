"""pypto-kernels: LLM serving kernels with batched torch references and device fast paths.

Public functions dispatch on the device of their first tensor argument through
:mod:`pypto_kernels.registry`; importing this package never imports ``torch_npu``.
"""

from __future__ import annotations

import os

# torch >= 2.5 imports installed device extensions (torch_npu) on `import torch` unless this is 0.
# Effective only when pypto_kernels is imported before torch; NPU support is loaded explicitly
# (and guarded) by device.npu_available() instead.
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

from . import native
from .activation import silu_and_mul
from .attention import (
    empty_paged_cache,
    memory_order,
    paged_attention,
    paged_cache_layout,
    qk_norm_rope_write_kv,
    varlen_attention,
    write_kv_cache,
)
from .compressed_attention import compressor_pool, indexer_topk, sink_attention
from .deepseek import apply_interleaved_rope, grouped_linear, interleaved_rope_cos_sin
from .dense import (
    HUGE_PAGE,
    PackedLinearWeight,
    linear,
    linear_takes_maxima,
    on_huge_pages,
    onednn_supports,
    pack_linear,
    packing_rule,
    tied_head_min_rows,
)
from .device import auto_dtype, cpu_computes_natively, npu_available, select_device, upload
from .hyper_connections import hc_head, hc_merge, hc_sinkhorn_mix
from .moe import moe_experts, routed_moe, topk_routing
from .mxfp4 import dequantize_mxfp4
from .native_decoder import DecoderLayerWeights, GreedyTail, NativeDecoder, RoutedExperts, SampledRun
from .norm import add_rms_norm, rms_norm
from .quant import (
    AbsmaxReduce,
    PackedInt8Weight,
    QuantizedLinearWeight,
    dequantize_weight,
    pack_quant_linear,
    quant_linear,
    quantize_per_token,
)
from .quant_moe import dequantize_experts, quant_moe_experts
from .registry import (
    KERNEL_NAMES,
    available_kernels,
    describe_kernel,
    dispatch,
    get_kernel,
    load_backends,
    reference_kernel,
    register_kernel,
)
from .rope import RopeTable, apply_rope, rope_cos_sin, rope_inv_freq

__version__ = "0.1.0"

__all__ = [
    "HUGE_PAGE",
    "KERNEL_NAMES",
    "AbsmaxReduce",
    "DecoderLayerWeights",
    "GreedyTail",
    "NativeDecoder",
    "PackedInt8Weight",
    "PackedLinearWeight",
    "QuantizedLinearWeight",
    "RopeTable",
    "RoutedExperts",
    "SampledRun",
    "__version__",
    "add_rms_norm",
    "apply_interleaved_rope",
    "apply_rope",
    "auto_dtype",
    "available_kernels",
    "compressor_pool",
    "cpu_computes_natively",
    "dequantize_experts",
    "dequantize_mxfp4",
    "dequantize_weight",
    "describe_kernel",
    "dispatch",
    "empty_paged_cache",
    "get_kernel",
    "grouped_linear",
    "hc_head",
    "hc_merge",
    "hc_sinkhorn_mix",
    "indexer_topk",
    "interleaved_rope_cos_sin",
    "linear",
    "linear_takes_maxima",
    "load_backends",
    "memory_order",
    "moe_experts",
    "native",
    "npu_available",
    "on_huge_pages",
    "onednn_supports",
    "pack_linear",
    "pack_quant_linear",
    "packing_rule",
    "paged_attention",
    "paged_cache_layout",
    "qk_norm_rope_write_kv",
    "quant_linear",
    "quant_moe_experts",
    "quantize_per_token",
    "reference_kernel",
    "register_kernel",
    "rms_norm",
    "rope_cos_sin",
    "rope_inv_freq",
    "routed_moe",
    "select_device",
    "silu_and_mul",
    "sink_attention",
    "tied_head_min_rows",
    "topk_routing",
    "upload",
    "varlen_attention",
    "write_kv_cache",
]
