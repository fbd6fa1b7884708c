"""The sampler before and after it moved to the device, side by side in one run.

64 rows x the Qwen vocabulary (151,936): greedy, sampled with Qwen3's non-thinking defaults
(temperature 0.7, top-k 20, top-p 0.8), top-p only, and sampled with presence/frequency penalties
over a 300-token history. The "before" sampler is read from git (``--before``, the commit before
the change) into a temporary module.

Logits come in two shapes: ``peaked`` (normal with standard deviation 4, so the top-p mass lies in a
few hundred tokens, as in a trained model) and ``flat`` (standard normal, where top-p 0.8 keeps most
of the vocabulary: the worst case, which takes the full-vocabulary fallback).

Usage: python benchmarks/sampler.py [--rows 64] [--vocab 151936] [--steps 5] [--before 4154b1e]
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "core"))

import pypto_serving.sampler as after  # noqa: E402

WORKLOADS: dict[str, dict[str, Any]] = {
    "greedy": dict(temperature=0.0),
    "sampled (top-k 20, top-p 0.8)": dict(temperature=0.7, top_k=20, top_p=0.8),
    "top-p 0.8 only": dict(temperature=0.7, top_p=0.8),
    "sampled + penalties": dict(temperature=0.7, top_k=20, top_p=0.8, presence_penalty=0.5, frequency_penalty=0.3),
}
BASE: dict[str, Any] = dict(
    temperature=1.0,
    top_k=0,
    top_p=1.0,
    min_p=0.0,
    presence_penalty=0.0,
    frequency_penalty=0.0,
    repetition_penalty=1.0,
    num_logprobs=None,
    banned=(),
)


def load_before(ref: str) -> ModuleType:
    src = subprocess.run(
        ["git", "show", f"{ref}:core/pypto_serving/sampler.py"], cwd=ROOT, check=True, capture_output=True, text=True
    ).stdout
    path = Path(tempfile.mkdtemp()) / "sampler_before.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("sampler_before", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while building the class
    spec.loader.exec_module(module)
    return module


def make_rows(module: ModuleType, kw: dict[str, Any], rows: int, step: int, vocab: int) -> list[Any]:
    """Rows of ``module``'s RowParams; a request with penalties carries its history in the form that
    module takes (a token list before, device counts after)."""
    names = {f.name for f in dataclasses.fields(module.RowParams)}
    penalised = bool(kw.get("presence_penalty") or kw.get("frequency_penalty"))
    gen = torch.Generator().manual_seed(0)
    out = []
    for r in range(rows):
        history = torch.randint(0, vocab, (300,), generator=gen).tolist() if penalised else None
        row = {**BASE, **kw, "seed": r, "draw_index": step}
        if "counts" in names:
            row["counts"] = after.TokenCounts(prompt=history[:100], outputs=history[100:]) if history else None
        else:
            row.update(history=history, num_prompt=100)
        out.append(module.RowParams(**row))
    return out


def seconds(fn: Callable[[], object], steps: int) -> float:
    fn()  # warm-up: first-touch allocations and, after, the penalty counts
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--before", default="4154b1e", help="git ref of the sampler before the change")
    args = ap.parse_args()
    before = load_before(args.before)
    gen = torch.Generator().manual_seed(1)
    shapes = {
        "peaked": torch.randn(args.rows, args.vocab, generator=gen) * 4,
        "flat": torch.randn(args.rows, args.vocab, generator=gen),
    }
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}")
    print(f"command: python benchmarks/sampler.py --rows {args.rows} --vocab {args.vocab} --steps {args.steps}\n")
    print("| logits | workload | before (ms) | after (ms) | speed-up | after / after greedy |")
    print("|---|---|---:|---:|---:|---:|")
    for shape, logits in shapes.items():
        greedy_after = 0.0
        for name, kw in WORKLOADS.items():
            ms = []
            for module in (before, after):
                rows = [make_rows(module, kw, args.rows, s, args.vocab) for s in range(2)]
                ms.append(1e3 * seconds(lambda m=module, r=rows, x=logits: m.sample(x, r[1]), args.steps))
            greedy_after = greedy_after or ms[1]
            ratio = ms[1] / greedy_after
            print(f"| {shape} | {name} | {ms[0]:.1f} | {ms[1]:.1f} | {ms[0] / ms[1]:.1f}x | {ratio:.2f} |")


if __name__ == "__main__":
    main()
