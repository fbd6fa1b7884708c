"""Fake CUDA tensors on a CPU-only torch, for tests that prove code stays on the device.

``FakeTensorMode`` traces tensors by shape, dtype and device only: mixing a CPU tensor into a
``cuda`` op raises a device-mismatch error, and any read of a value on the host (``.item()``,
``.tolist()``, ``int(t)``, ``nonzero``, boolean-mask indexing, ``repeat_interleave`` without an output
size) raises, since a fake tensor has no values to read.

A CPU-only torch cannot run a few *Python bindings* on a fake ``cuda`` tensor, though: indexing
(``t[...]``, ``t[...] = v``), ``~t``, ``.contiguous()``, ``.copy_()``, ``.new_tensor()`` and ``.to("cuda")``
open a CUDA device guard before dispatching and fail with "not linked with support for cuda". The
aten ops underneath trace fine, so :class:`CudaBindings` routes those calls to the same aten ops that
the C++ bindings would run (``select``/``slice``/``unsqueeze`` views, then ``index``/``index_put_``).
It reads no value either, so it hides no host read: a boolean mask still reaches ``aten.nonzero``
and raises there. Python number conversions (``int(t)``, ``float(t)``, ``operator.index(t)``) and
``nonzero`` are routed the same way, so every host read fails as a data-dependent read
(``DataDependentOutputException`` or ``DynamicOutputShapeException``), never as the missing CUDA
support that would also stop harmless calls.

:class:`HostReads` lets a test run code whose one allowed host read is a ``.tolist()`` (e.g. a
verification's final read): it records each read's shape and returns zeros in its place.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch._subclasses import fake_tensor
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.overrides import TorchFunctionMode

aten = torch.ops.aten
CUDA = torch.device("cuda", 0)


def _is_fake_cuda(x: Any) -> bool:
    return isinstance(x, FakeTensor) and x.device.type == "cuda"


def _views(x: torch.Tensor, key: Any) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """Basic indexing (ints, slices, None, Ellipsis) as views, as PyTorch's C++ ``applySlicing`` does
    (an int is always a ``select``); returns the view and ``aten.index``'s per-dim tensor list."""
    key = key if isinstance(key, tuple) else (key,)
    used = sum(k.dim() if isinstance(k, torch.Tensor) and k.dtype == torch.bool else 1 for k in key if k is not None)
    used -= sum(1 for k in key if k is Ellipsis)
    view, dim, adv = x, 0, []
    for k in key:
        if k is Ellipsis:
            n = x.dim() - used
            adv += [None] * n
            dim += n
        elif k is None:
            view = aten.unsqueeze.default(view, dim)
            adv.append(None)
            dim += 1
        elif isinstance(k, bool):
            raise NotImplementedError("indexing with a Python bool")
        elif isinstance(k, int):
            view = aten.select.int(view, dim, k)
        elif isinstance(k, slice):
            view = aten.slice.Tensor(view, dim, k.start, k.stop, 1 if k.step is None else k.step)
            adv.append(None)
            dim += 1
        else:
            t = k if isinstance(k, torch.Tensor) else torch.tensor(k, device=x.device)
            if t.dtype == torch.bool:  # a mask selects its nonzero positions: a data-dependent shape
                aten.nonzero.default(t)
            adv.append(t)
            dim += t.dim() if t.dtype == torch.bool else 1
    return view, adv


def _getitem(x: torch.Tensor, key: Any) -> torch.Tensor:
    view, adv = _views(x, key)
    return aten.index.Tensor(view, adv) if any(a is not None for a in adv) else view


def _setitem(x: torch.Tensor, key: Any, value: Any) -> None:
    view, adv = _views(x, key)
    if not isinstance(value, torch.Tensor):
        value = torch.tensor(value, dtype=view.dtype, device=view.device)
    if any(a is not None for a in adv):
        aten.index_put_.default(view, adv, value)
    else:
        aten.copy_.default(view, value)


def _to(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    def fix(a: Any) -> Any:
        if isinstance(a, str | torch.device) and torch.device(a) == torch.device("cuda"):
            return CUDA
        return a

    return torch.Tensor.to(x, *(fix(a) for a in args), **{k: fix(v) for k, v in kwargs.items()})


def _contiguous(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return x if x.is_contiguous() else aten.clone.default(x, memory_format=torch.contiguous_format)


_BINDINGS: dict[Any, Callable[..., Any]] = {
    torch.Tensor.__getitem__: _getitem,
    torch.Tensor.__setitem__: _setitem,
    torch.Tensor.contiguous: _contiguous,
    torch.Tensor.copy_: lambda x, src, non_blocking=False: aten.copy_.default(x, src),
    torch.Tensor.new_tensor: lambda x, data, **kw: torch.tensor(data, **{"dtype": x.dtype, "device": x.device, **kw}),
    torch.Tensor.to: _to,
    torch.Tensor.__invert__: lambda x: aten.bitwise_not.default(x),
    # Conversions to Python numbers read the value: the same aten op as ``.item()``.
    torch.Tensor.__int__: lambda x: int(aten._local_scalar_dense.default(x)),
    torch.Tensor.__float__: lambda x: float(aten._local_scalar_dense.default(x)),
    torch.Tensor.__index__: lambda x: int(aten._local_scalar_dense.default(x)),
    torch.Tensor.nonzero: lambda x, *a, **kw: aten.nonzero.default(x),
    torch.nonzero: lambda x, *a, **kw: aten.nonzero.default(x),
}


class CudaBindings(TorchFunctionMode):
    """Route the guard-opening Python bindings of fake cuda tensors to their aten ops."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        impl = _BINDINGS.get(func)
        if impl is not None and args and _is_fake_cuda(args[0]):
            return impl(*args, **kwargs)
        return func(*args, **kwargs)


def _zeros(shape: list[int]) -> Any:
    """Nested lists of zeros (built on the host: a tensor made here would be a fake one)."""
    return 0 if not shape else [_zeros(shape[1:]) for _ in range(shape[0])]


class HostReads:
    """Count ``.tolist()`` reads of fake cuda tensors (their shapes, in :attr:`shapes`), answering each
    with zeros of its shape; every other host read still raises. (``tolist`` does not dispatch through
    ``__torch_function__``, so the fake tensor class's method is swapped while this is entered.)"""

    def __init__(self) -> None:
        self.shapes: list[tuple[int, ...]] = []
        self._saved: Any = None

    def _tolist(self, x: torch.Tensor) -> Any:
        if x.device.type != "cuda":
            return self._saved(x)
        self.shapes.append(tuple(x.shape))
        return _zeros(list(x.shape))

    def __enter__(self) -> HostReads:
        self._saved = FakeTensor.tolist
        reads = self

        def tolist(x: torch.Tensor) -> Any:
            return reads._tolist(x)

        FakeTensor.tolist = tolist  # type: ignore[method-assign,assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        FakeTensor.tolist = self._saved  # type: ignore[method-assign]


def fake_cuda(x: Any, memo: dict[int, Any] | None = None) -> Any:
    """An empty fake cuda tensor like ``x`` (same shape and dtype), recursively through dicts, lists,
    tuples and dataclasses (stored-precision weights); call inside the fake mode. Shared tensors stay
    shared."""
    memo = {} if memo is None else memo
    if id(x) in memo:
        return memo[id(x)]
    if isinstance(x, torch.Tensor):
        out: Any = torch.empty(x.shape, dtype=x.dtype, device=CUDA)
    elif isinstance(x, dict):
        out = {k: fake_cuda(v, memo) for k, v in x.items()}
    elif isinstance(x, list | tuple):
        out = type(x)(fake_cuda(v, memo) for v in x)
    elif dataclasses.is_dataclass(x) and not isinstance(x, type):  # a QuantizedWeight: its tensors
        out = dataclasses.replace(x, **{f.name: fake_cuda(getattr(x, f.name), memo) for f in dataclasses.fields(x)})
    else:
        return x
    memo[id(x)] = out
    return out


@contextmanager
def fake_mode() -> Iterator[FakeTensorMode]:
    """``FakeTensorMode`` without constant tracking: by default it keeps the value of one-element
    tensors made from host data and runs ops on them for real, which a CPU-only torch cannot do for
    ``cuda`` (``torch.tensor([n], device="cuda")``); it would also let a host read of such a tensor
    pass, which on a device is a sync like any other."""
    saved = fake_tensor.CONSTANT_NUMEL_LIMIT
    fake_tensor.CONSTANT_NUMEL_LIMIT = 0
    try:
        with FakeTensorMode(allow_non_fake_inputs=False) as mode:
            yield mode
    finally:
        fake_tensor.CONSTANT_NUMEL_LIMIT = saved
