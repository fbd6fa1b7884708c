"""benchmarks/own_floor.py: the floor reads each buffer under the token's tensors once, whole, and
leaves the flush-denormal setting as it found it."""

from __future__ import annotations

from typing import Any

import torch

from tests.scripts import load_script


def _floor() -> Any:
    return load_script("benchmarks/own_floor.py")


def test_storages_read_each_buffer_once_whole_and_leave_small_ones_out() -> None:
    buffer = torch.zeros(1 << 19, dtype=torch.bfloat16)  # 1 MiB: two panels' views into one mapping
    first, second = buffer[: 1 << 18], buffer[1 << 18 :]
    head = torch.ones(300_000)  # a buffer of its own
    norm = torch.ones(256)  # 1 KiB: left out
    flat = _floor().storages([first, second, head, norm, head.view(600, 500)])
    assert len(flat) == 2
    assert all(t.dtype == torch.float32 for t in flat)
    assert sorted(t.numel() * 4 for t in flat) == sorted([buffer.numel() * 2, head.numel() * 4])
    assert {t.data_ptr() for t in flat} == {buffer.data_ptr(), head.data_ptr()}


def test_read_time_restores_the_flush_denormal_setting() -> None:
    mod = _floor()
    torch.set_flush_denormal(False)
    tiny = torch.full((1 << 16,), 1e-40)  # subnormal: 0 where flushed
    assert mod.read_time([torch.ones(1 << 16)], 2) > 0
    assert tiny.sum().item() > 0  # not flushed after the read
