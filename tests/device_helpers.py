"""Helpers for tests that build batches on the host and run them on another (real or fake) device."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch


def batch_on(batch: Any, device: torch.device | str) -> Any:
    """``batch`` (a ``BatchInput``) with every tensor, and every tensor of its per-group dicts, copied to
    ``device`` as the runner places it; the host lists are kept."""
    moved: dict[str, Any] = {}
    for f in dataclasses.fields(batch):
        value = getattr(batch, f.name)
        if isinstance(value, torch.Tensor):
            moved[f.name] = value.to(device)
        elif isinstance(value, dict):
            moved[f.name] = {k: t.to(device) for k, t in value.items()}
    return dataclasses.replace(batch, **moved)


@contextmanager
def no_host_sync() -> Iterator[None]:
    """On a real CUDA device: any synchronising call inside (a device-to-host copy, ``.item()``,
    ``nonzero``, a blocking host-to-device copy from pageable memory) raises."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")
