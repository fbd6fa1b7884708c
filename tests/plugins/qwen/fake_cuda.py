"""A fake CUDA device for CPU-only machines: :func:`fake_cuda` runs code on tensors that say
``device="cuda"`` and hold no data.

``FakeTensorMode(allow_non_fake_inputs=False)`` traces ops by shape, dtype and device only: mixing
a real (CPU) tensor in raises, so does a CPU tensor meeting a CUDA one in an op
(``FakeTensorDeviceMismatchError``), and so does any host read of device data (``.item()``,
``.tolist()``, ``int(t)``, ``nonzero``, boolean-mask indexing), since a fake tensor has no values.

On a torch built without CUDA, a few hand-written Python entry points fail before they reach the
fake mode, in a device guard or device initialisation that the build lacks: ``Tensor.__getitem__``,
``Tensor.__setitem__``, ``Tensor.copy_`` and a copy to CUDA with ``Tensor.to``. :class:`_GuardFreeIndexing` runs
them through the aten ops they stand for (``select``, ``slice``, ``unsqueeze``, ``index``,
``index_put_``, ``copy_``, ``fill_``, ``_to_copy``), which the fake mode traces; everything else is untouched. Boolean
masks still go to ``aten.index``, where their data-dependent shape raises as it should.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.overrides import TorchFunctionMode

from tests.device_helpers import batch_on

__all__ = ["fake_cuda", "on_device"]

CUDA = torch.device("cuda", 0)  # fake tensors report an index


def on_device(batch: Any) -> Any:
    """A ``BatchInput`` with every tensor copied to the fake device, as the runner places it (host
    lists kept)."""
    return batch_on(batch, CUDA)


def _on_cuda(t: object) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type == "cuda"


def _indexed_dims(i: object) -> int:
    """Dimensions of the indexed tensor that index ``i`` consumes."""
    if i is None or i is Ellipsis:
        return 0
    if isinstance(i, torch.Tensor) and i.dtype == torch.bool:
        return i.dim()
    return 1


def _basic(t: torch.Tensor, index: Any) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """Apply ints, slices, None and Ellipsis as torch does (views); collect the tensor indices per dim."""
    index = index if isinstance(index, tuple) else (index,)
    rest = t.dim() - sum(_indexed_dims(i) for i in index)
    result, dim, tensors = t, 0, list[torch.Tensor | None]()
    for i in index:
        if i is Ellipsis:
            tensors += [None] * rest
            dim += rest
        elif i is None:
            result = result.unsqueeze(dim)
            tensors.append(None)
            dim += 1
        elif isinstance(i, int) and not isinstance(i, bool):
            result = result.select(dim, i)
        elif isinstance(i, slice):
            result = torch.ops.aten.slice.Tensor(result, dim, i.start, i.stop, i.step or 1)
            tensors.append(None)
            dim += 1
        elif isinstance(i, torch.Tensor):
            tensors.append(i)
            dim += _indexed_dims(i)
        else:
            raise TypeError(f"fake_cuda indexing does not handle {type(i).__name__} indices")
    while tensors and tensors[-1] is None:
        tensors.pop()
    return result, tensors


def _getitem(t: torch.Tensor, index: Any) -> torch.Tensor:
    result, tensors = _basic(t, index)
    return torch.ops.aten.index.Tensor(result, tensors) if tensors else result


def _setitem(t: torch.Tensor, index: Any, value: Any) -> None:
    view, tensors = _basic(t, index)
    if tensors:
        value = value if isinstance(value, torch.Tensor) else torch.full((), value, dtype=t.dtype, device=t.device)
        view.index_put_(tensors, value.to(t.dtype))
    elif isinstance(value, torch.Tensor):
        torch.ops.aten.copy_.default(view, value)  # Tensor.copy_ has the same device guard
    else:
        torch.ops.aten.fill_.Scalar(view, value)


def _to_cuda(t: torch.Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor | None:
    """``t.to(...)`` as ``aten._to_copy`` when it copies a non-CUDA tensor to CUDA, else None."""
    device, dtype = kwargs.get("device"), kwargs.get("dtype")
    for a in args:
        if isinstance(a, torch.dtype):
            dtype = a
        elif isinstance(a, torch.Tensor):
            device, dtype = a.device, a.dtype
        elif isinstance(a, str | torch.device):
            device = a
    if device is None or torch.device(device).type != "cuda" or t.device.type == "cuda":
        return None
    moved: torch.Tensor = torch.ops.aten._to_copy.default(t, dtype=dtype or t.dtype, device=CUDA)
    return moved


class _GuardFreeIndexing(TorchFunctionMode):
    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.__getitem__ and _on_cuda(args[0]):
            return _getitem(*args)
        if func is torch.Tensor.__setitem__ and _on_cuda(args[0]):
            return _setitem(*args)
        if func is torch.Tensor.copy_ and _on_cuda(args[0]):
            return torch.ops.aten.copy_.default(*args, **kwargs)
        if func is torch.Tensor.to:
            moved = _to_cuda(args[0], args[1:], kwargs)
            if moved is not None:
                return moved
        return func(*args, **kwargs)


@contextmanager
def fake_cuda() -> Iterator[FakeTensorMode]:
    """Fake tensors on a fake CUDA device: host reads and device mixing raise (see the module doc)."""
    with FakeTensorMode(allow_non_fake_inputs=False) as mode, _GuardFreeIndexing():
        yield mode
