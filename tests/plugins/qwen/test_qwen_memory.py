"""Resident weight memory after loading is at most 1.1x the checkpoint's tensor bytes, per format.

Each checkpoint (about 30 M parameters: 40 to 120 MB, so the weights dominate RSS noise) is loaded
in a fresh process by ``benchmarks/quant_load.py --measure``, which first loads a tiny checkpoint of
the same format (one-time costs: lazy imports, allocator arenas) and then reports the process RSS
(anonymous + file-backed + shared) after the load minus before it. A dequantising load (FP8 into
bfloat16 holds 2x), a file mapping kept beside the loaded copy, or load buffers kept by the
allocator all show up here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.scripts import load_script

BENCH = Path(__file__).resolve().parents[3] / "benchmarks" / "quant_load.py"


def _bench() -> ModuleType:
    return load_script("benchmarks/quant_load.py")


@pytest.mark.parametrize(
    ("shape", "fmt"),
    [("small", "float32"), ("small", "fp8"), ("small", "w8a8"), ("small-moe", "fp8")],  # MoE: FP8 routed experts
)
def test_resident_weights_stay_within_the_checkpoint_bytes(tmp_path: Path, shape: str, fmt: str) -> None:
    written = _bench().write_checkpoint(tmp_path / fmt, shape, fmt)
    run = subprocess.run(
        [sys.executable, str(BENCH), "--measure", str(tmp_path / fmt), "--format", fmt],
        capture_output=True,
        text=True,
        check=True,
    )
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["checkpoint_bytes"] == written > 30 << 20
    # The model holds exactly the stored bytes (quantized data and scales, never a float copy) ...
    assert result["held_bytes"] <= written
    # ... and the process holds no more than 1.1x them once loaded.
    assert result["resident_bytes"] <= 1.1 * written, result
