"""benchmarks/toggle_in_worker.py: steps grouped by the setting they ran with, only consecutive steps
timed, and a path that names no boolean refused."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from tests.scripts import load_script


def _toggle() -> Any:
    return load_script("benchmarks/toggle_in_worker.py")


def test_periods_group_consecutive_steps_by_setting() -> None:
    stamps = [[0, 0.0, True], [1, 1.0, True], [2, 3.0, False], [3, 6.0, False], [7, 20.0, True], [8, 20.5, True]]
    # step 3 -> 7 is a gap between generate calls, not a step; the last step has no end
    assert _toggle().periods(stamps) == {True: [1.0, 2.0, 0.5], False: [3.0]}


def test_set_flips_a_nested_boolean_and_refuses_anything_else() -> None:
    mod = _toggle()
    runner = SimpleNamespace(input_batch=SimpleNamespace(host_tables=True, capacity=16))
    mod._set(runner, "input_batch.host_tables", False)
    assert runner.input_batch.host_tables is False
    with pytest.raises(TypeError, match=r"input_batch\.capacity is not a boolean"):
        mod._set(runner, "input_batch.capacity", True)
