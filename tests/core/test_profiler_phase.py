"""``profiler.phase``: a step's named range in a profile's trace, and nothing of torch's profiler outside one."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch

from pypto_serving.profiler import phase


def test_phase_is_a_profiler_range_only_while_a_profile_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    entered: list[str] = []
    real = torch.profiler.record_function

    def counted(name: str) -> Any:
        entered.append(name)
        return real(name)

    monkeypatch.setattr(torch.profiler, "record_function", counted)
    with phase("outside"):
        torch.ones(2).add_(1)
    assert entered == []  # no dispatcher round trip per range on every step
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof, phase("inside"):
        torch.ones(2).add_(1)
    assert entered == ["inside"]
    assert "inside" in {e.name for e in prof.events()}
    assert isinstance(phase("after"), contextlib.nullcontext)
