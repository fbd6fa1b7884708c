"""Kernel registry: maps a kernel name and a device type to an implementation.

Every kernel has a pure-torch *reference* implementation that runs on any device. Device
specific *fast paths* (NPU, CUDA) are registered per backend and are picked by
:func:`get_kernel` for tensors living on that device type. Built-in fast paths are loaded
lazily, the first time a device type is seen, so importing this package never imports
vendor extensions such as ``torch_npu``.

A fast path may declare what it supports with a ``supports(*args, **kwargs) -> bool`` predicate
(same arguments as the kernel): calls it declines run the reference, so a library's limits (block
sizes, sinks, sliding windows, missing host lengths) never change results. An optional
``explain(**features) -> str | None`` gives the reason a described call would fall back, which
:func:`describe_kernel` reports so executors can log which implementation each layer kind runs.
"""

from __future__ import annotations

import functools
import importlib
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

logger = logging.getLogger("pypto_kernels")

F = TypeVar("F", bound=Callable[..., Any])

#: Every kernel name the registry knows about. Fixed so that typos fail loudly.
KERNEL_NAMES: frozenset[str] = frozenset(
    {
        "rms_norm",
        "add_rms_norm",
        "rope_cos_sin",
        "apply_rope",
        "silu_and_mul",
        "write_kv_cache",
        "qk_norm_rope_write_kv",
        "paged_attention",
        "varlen_attention",
        "topk_routing",
        "moe_experts",
        "routed_moe",
        "interleaved_rope_cos_sin",
        "apply_interleaved_rope",
        "grouped_linear",
        "hc_sinkhorn_mix",
        "hc_merge",
        "hc_head",
        "compressor_pool",
        "indexer_topk",
        "sink_attention",
        "quant_linear",
        "quant_moe_experts",
        "linear",
    }
)

#: Device types that may carry fast paths.
BACKENDS: frozenset[str] = frozenset({"npu", "cuda", "cpu"})

#: Kernels whose CPU calls look up a fast path; every other kernel runs its reference on the CPU
#: directly, so the CPU decode loop pays no registry lookup per call.
CPU_FAST_KERNELS: frozenset[str] = frozenset(
    {
        "quant_linear",
        "linear",
        "paged_attention",
        "quant_moe_experts",
        "moe_experts",
        "routed_moe",
        "rms_norm",
        "add_rms_norm",
        "qk_norm_rope_write_kv",
        "silu_and_mul",
    }
)


@dataclass(frozen=True)
class FastPath:
    """One registered fast path: ``call`` is what :func:`get_kernel` returns (``fn`` itself when
    every call is supported, else a guard that runs the reference for calls ``supports`` declines)."""

    fn: Callable[..., Any]
    call: Callable[..., Any]
    label: str
    supports: Callable[..., bool] | None = None
    explain: Callable[..., str | None] | None = None


_REFERENCES: dict[str, Callable[..., Any]] = {}
_FAST_PATHS: dict[str, dict[str, FastPath]] = {}
_LOADED_DEVICE_TYPES: set[str] = set()
_LOAD_LOCK = threading.Lock()


def _check_name(name: str) -> None:
    if name not in KERNEL_NAMES:
        raise ValueError(f"unknown kernel {name!r}; known kernels: {', '.join(sorted(KERNEL_NAMES))}")


def _check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; fast paths may be registered for: {sorted(BACKENDS)}")


def _device_type(device: torch.device | str) -> str:
    # Parse strings by hand: torch.device("npu") fails until torch_npu is imported.
    return device.type if isinstance(device, torch.device) else device.split(":", 1)[0]


def _guard(name: str, fn: Callable[..., Any], supports: Callable[..., bool]) -> Callable[..., Any]:
    """``fn`` for calls ``supports`` accepts, the reference (looked up per call) for the others."""

    @functools.wraps(fn)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        if supports(*args, **kwargs):
            return fn(*args, **kwargs)
        return _REFERENCES[name](*args, **kwargs)

    guarded.fast = fn  # type: ignore[attr-defined]
    guarded.supports = supports  # type: ignore[attr-defined]
    return guarded


def _make_fast_path(
    name: str,
    backend: str,
    fn: Callable[..., Any],
    supports: Callable[..., bool] | None,
    label: str | None,
    explain: Callable[..., str | None] | None,
) -> FastPath:
    _check_name(name)
    _check_backend(backend)
    for what, value in (("fast path", fn), ("supports", supports), ("explain", explain)):
        if value is not None and not callable(value):
            raise TypeError(f"{what} for {name!r} must be callable, got {type(value).__name__}")
    call = fn if supports is None else _guard(name, fn, supports)
    text = label if label is not None else f"{backend}: {getattr(fn, '__qualname__', repr(fn))}"
    return FastPath(fn=fn, call=call, label=text, supports=supports, explain=explain)


def register_kernel(
    name: str,
    backend: str,
    fn: Callable[..., Any],
    supports: Callable[..., bool] | None = None,
    *,
    label: str | None = None,
    explain: Callable[..., str | None] | None = None,
) -> None:
    """Register ``fn`` as the fast path of ``name`` on ``backend``; replaces any earlier one.

    ``supports(*args, **kwargs)`` (optional) says whether ``fn`` handles a call; declined calls run
    the reference. ``label`` names the implementation in :func:`describe_kernel` (default: backend
    and function name); ``explain(**features)`` returns why calls with those features fall back
    (None: they run ``fn``).
    """
    _FAST_PATHS.setdefault(name, {})[backend] = _make_fast_path(name, backend, fn, supports, label, explain)


def _register_builtin(
    name: str,
    backend: str,
    fn: Callable[..., Any],
    supports: Callable[..., bool] | None = None,
    *,
    label: str | None = None,
    explain: Callable[..., str | None] | None = None,
) -> None:
    """Register a built-in fast path without overriding one the user registered first."""
    fast = _make_fast_path(name, backend, fn, supports, label, explain)
    _FAST_PATHS.setdefault(name, {}).setdefault(backend, fast)


def load_backends(device: torch.device | str) -> None:
    """Import and register built-in fast paths for ``device``'s type, once; failures fall back to references.

    Called by :func:`get_kernel` the first time a device type is seen, so vendor extensions
    are only imported once a tensor actually lives on that device.
    """
    device_type = _device_type(device)
    if device_type in _LOADED_DEVICE_TYPES:
        return
    with _LOAD_LOCK:
        if device_type in _LOADED_DEVICE_TYPES:
            return
        _LOADED_DEVICE_TYPES.add(device_type)
        if device_type not in BACKENDS:
            return
        if device_type == "npu":
            from .device import npu_available

            if not npu_available():
                logger.info("NPU fast paths not loaded: torch_npu unavailable; using references")
                return
        try:
            module = importlib.import_module(f"{__package__}.backends.{device_type}")
            module.register(_register_builtin)
        except Exception as exc:  # a broken vendor stack must not break the reference path
            logger.warning("could not load %s fast paths (%s); using reference kernels", device_type, exc)
        else:
            logger.debug("loaded %s fast paths: %s", device_type, available_kernels())


def get_kernel(name: str, device: torch.device | str) -> Callable[..., Any]:
    """Return the fast path registered for ``device``'s type if any, else the reference.

    A fast path registered with ``supports`` comes back guarded: calls it declines run the reference.
    """
    _check_name(name)
    device_type = _device_type(device)
    if device_type not in _LOADED_DEVICE_TYPES:
        load_backends(device_type)
    fast = _FAST_PATHS.get(name, {}).get(device_type)
    if fast is not None:
        return fast.call
    try:
        return _REFERENCES[name]
    except KeyError:
        raise ValueError(f"kernel {name!r} has no reference implementation registered") from None


def reference_kernel(name: str) -> Callable[..., Any]:
    """Return the reference implementation of ``name`` (fast paths use it as their fallback)."""
    _check_name(name)
    return _REFERENCES[name]


def describe_kernel(name: str, device: torch.device | str, **features: Any) -> str:
    """Which implementation runs ``name`` on ``device``, for logging: the fast path's label, or
    ``"reference"`` with the reason the fast path declines.

    ``features`` describe the call (kernel-specific, e.g. ``sliding_window=128``, ``sinks=True``,
    ``block_size=16``, ``dtype=torch.bfloat16``; the built-in backends read the keys that
    :mod:`pypto_kernels.backends` derives from a real call); features left out are assumed
    supported. A fast path with a ``supports`` check but no ``explain`` is reported as running
    where supported.
    """
    _check_name(name)
    device_type = _device_type(device)
    if device_type not in _LOADED_DEVICE_TYPES:
        load_backends(device_type)
    fast = _FAST_PATHS.get(name, {}).get(device_type)
    if fast is None:
        return "reference"
    if fast.explain is not None:
        # The fast path's rules may depend on the device (e.g. its compute capability) like a real call's do.
        reason = fast.explain(**{"device": device, **features})
        if reason is not None:
            return f"reference ({fast.label} declines: {reason})"
        return fast.label
    if fast.supports is not None:
        return f"{fast.label} where supported, else reference"
    return fast.label


def available_kernels() -> dict[str, list[str]]:
    """Map each kernel to the backends that currently have a fast path (loaded backends only)."""
    return {name: sorted(_FAST_PATHS.get(name, {})) for name in sorted(KERNEL_NAMES)}


def _first_tensor_device(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.device | None:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return value.device
    return None


def dispatch(name: str) -> Callable[[F], F]:
    """Decorator: register the function as ``name``'s reference and dispatch calls by device.

    The returned wrapper looks at the device of the first tensor argument and calls
    :func:`get_kernel` for it; the undecorated reference stays reachable as ``.reference``.
    """
    _check_name(name)

    def decorator(ref: F) -> F:
        if name in _REFERENCES:
            raise ValueError(f"kernel {name!r} already has a reference implementation")
        _REFERENCES[name] = ref

        @functools.wraps(ref)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            device = _first_tensor_device(args, kwargs)
            if device is None or (device.type == "cpu" and name not in CPU_FAST_KERNELS):
                return ref(*args, **kwargs)
            return get_kernel(name, device)(*args, **kwargs)

        wrapper.reference = ref  # type: ignore[attr-defined]
        return wrapper  # type: ignore[return-value]

    return decorator
