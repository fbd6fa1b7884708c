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
import torch

import pypto_kernels as K
from tests.scripts import load_script

BENCH = Path(__file__).resolve().parents[3] / "benchmarks" / "quant_load.py"


def _bench() -> ModuleType:
    return load_script("benchmarks/quant_load.py")


@pytest.mark.parametrize(
    ("shape", "fmt", "options"),
    [
        ("small", "float32", {}),
        ("small", "float32", {"tied_head_copy": False}),
        ("small", "fp8", {}),
        ("small", "w8a8", {}),
        ("small", "w8a8-head", {}),  # an int8 output projection (prepacked where int8 products pay)
        ("small-moe", "fp8", {}),  # MoE: FP8 routed experts
    ],
)
def test_resident_weights_stay_within_the_checkpoint_bytes(
    tmp_path: Path, shape: str, fmt: str, options: dict[str, object]
) -> None:
    """Within 1.1x the checkpoint's bytes, plus the one copy made on purpose: a tied output projection's
    packed copy beside it (where the CPU's packing rule packs its dtype; ``tied_head_copy = false``
    makes none)."""
    written = _bench().write_checkpoint(tmp_path / fmt, shape, fmt)
    run = subprocess.run(
        [
            sys.executable,
            str(BENCH),
            "--measure",
            str(tmp_path / fmt),
            "--format",
            fmt,
            "--executor-options",
            json.dumps(options),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["checkpoint_bytes"] == written > 30 << 20
    # The model holds exactly the stored bytes (quantized data and scales, never a float copy) ...
    assert result["held_bytes"] <= written
    copy = result["copy_bytes"]
    # The head runs in the load's dtype (a 16-bit checkpoint in float32 on a CPU without instructions
    # for it, pypto_kernels.auto_dtype) and is copied where the packing rule packs that dtype.
    dtype = getattr(torch, result["dtype"].removeprefix("torch."))
    elements = _bench().SHAPES[shape]["vocab"] * _bench().SHAPES[shape]["hidden"]
    tied = fmt != "w8a8-head"  # an untied int8 head has no float copy beside it
    packs = tied and options.get("tied_head_copy", True) and K.packing_rule(dtype, 64, elements=elements)
    head = elements * dtype.itemsize
    assert copy == (head if packs else 0)
    # ... and the process holds no more than 1.1x them (and the copy) once loaded.
    assert result["resident_bytes"] <= 1.1 * (written + copy), result
