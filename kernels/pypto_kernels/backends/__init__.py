"""Device fast paths, imported lazily by :func:`pypto_kernels.registry.load_backends`.

Each module exposes ``register(add)`` where ``add(name, backend, fn, supports=None, *, label=None,
explain=None)`` registers one fast path (see :func:`pypto_kernels.registry.register_kernel`).

The helpers below turn a kernel call into the *features* a backend's ``explain`` judges, so that
the per-call ``supports`` check and :func:`pypto_kernels.describe_kernel` apply the same rules.
Keyword options the reference may gain later are collected as ``options``: a fast path that does
not know them declines the call (see :func:`unknown_options`), so it never ignores one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..attention import is_head_major


def paged_attention_features(
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
    **options: Any,
) -> dict[str, Any]:
    """The features of a ``paged_attention`` call (same signature as the reference)."""
    return {
        "device": query.device,
        "dtype": query.dtype,
        "cache_dtype": key_cache.dtype,
        "value_dtype": value_cache.dtype,
        "block_size": key_cache.shape[1],
        "num_heads": query.shape[1],
        "num_kv_heads": key_cache.shape[2],
        "head_dim": query.shape[-1],
        "value_head_dim": value_cache.shape[-1],
        "contiguous_cache": key_cache.is_contiguous() and value_cache.is_contiguous(),
        "head_major_cache": is_head_major(key_cache) and is_head_major(value_cache),
        "sliding_window": sliding_window,
        "sinks": sinks is not None,
        "host_lengths": query_lens_host is not None and seq_lens_host is not None,
        "options": sorted(options),
    }


def write_kv_cache_features(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    **options: Any,
) -> dict[str, Any]:
    """The features of a ``write_kv_cache`` call (same signature as the reference)."""
    return {
        "device": key_cache.device,
        "dtype": key.dtype,
        "cache_dtype": key_cache.dtype,
        "value_dtype": value_cache.dtype,
        "contiguous_cache": key_cache.is_contiguous() and value_cache.is_contiguous(),
        "options": sorted(options),
    }


def unknown_options(features: dict[str, Any]) -> str | None:
    """The reason to decline a call that passes keyword options a fast path does not implement."""
    options = features.get("options")
    return f"options it does not implement: {', '.join(options)}" if options else None
