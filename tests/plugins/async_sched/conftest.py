"""Makes ``tests.fakes`` importable for this folder under any invocation directory."""

from __future__ import annotations

import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[3]
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))


import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(autouse=True)
def _single_torch_thread():
    """The fake executor's tensors are tiny; intra-op threads only add latency (~40x per op here)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
