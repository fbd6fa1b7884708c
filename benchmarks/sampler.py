"""The sampler's torch ops against the executor's native draw (``pypto_kernels.native.sample_rows``),
side by side in one run: one ``sample()`` call, and whole engines.

Step: ``--rows`` rows x the Qwen vocabulary (151,936, float32 logits), one ``sample()`` call each way
(median of ``--steps`` after a warm-up): greedy; a temperature alone (the OpenAI API's default
request, temperature 1); Qwen3's non-thinking defaults (temperature 0.7, top-k 20, top-p 0.8); top-p
0.95 alone; min-p 0.05; the defaults with presence and frequency penalties over a 300-token history.
Two logit shapes: ``peaked`` (normal with standard deviation 4: top-p keeps a few tokens, as in a
trained model) and ``flat`` (standard normal: top-p keeps most of the vocabulary, which the torch
ops draw after a sort of the whole row).

Engine (``--model``): an in-process engine generating ``--engine-prompts`` prompts of 32..256 random
tokens x ``--max-tokens`` with each workload (output tokens a second), and a lone request's time per
token (``--c1-tokens``), two ways alternated by round on its runner: the sampler's torch ops with a
sampled request's forwards one by one (as before the native draw), and the executor's native draw
with a lone sampled request's forwards as the native loop (``Executor.sampled_steps``). Run it with
the environment a spawned worker gets (``GLIBC_TUNABLES`` and ``THP_MEM_ALLOC_ENABLE``, see
``worker_heap_reuse`` and ``worker_huge_pages``) to time what a server's worker runs.

Usage: python benchmarks/sampler.py [--rows 64 1] [--steps 5] [--model models/qwen3-small --rounds 3]
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "core"))
sys.path.insert(0, str(ROOT / "kernels"))

from pypto_kernels import native  # noqa: E402
from pypto_serving.sampler import RowParams, TokenCounts, sample  # noqa: E402

WORKLOADS: dict[str, dict[str, Any]] = {
    "greedy": dict(temperature=0.0),
    "temperature 1 alone": dict(temperature=1.0),
    "Qwen3 defaults (0.7, top-k 20, top-p 0.8)": dict(temperature=0.7, top_k=20, top_p=0.8),
    "top-p 0.95 alone": dict(temperature=1.0, top_p=0.95),
    "min-p 0.05": dict(temperature=1.0, min_p=0.05),
    "defaults + penalties": dict(temperature=0.7, top_k=20, top_p=0.8, presence_penalty=0.5, frequency_penalty=0.3),
}


def make_rows(kw: dict[str, Any], rows: int, step: int, vocab: int) -> list[RowParams]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for r in range(rows):
        row: dict[str, Any] = {**kw, "seed": r, "draw_index": step}
        if kw.get("presence_penalty") or kw.get("frequency_penalty"):
            history = torch.randint(0, vocab, (300,), generator=gen).tolist()
            row["counts"] = TokenCounts(prompt=history[:100], outputs=history[100:])
        out.append(RowParams(**row))
    return out


def seconds(fn: Callable[[], object], steps: int) -> float:
    fn()  # warm-up: first-touch allocations and, for penalties, the request's counts
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def step_table(rows: int, vocab: int, steps: int) -> None:
    gen = torch.Generator().manual_seed(1)
    shapes = {"peaked": torch.randn(rows, vocab, generator=gen) * 4, "flat": torch.randn(rows, vocab, generator=gen)}
    kernel = native.SampleDraw()
    print(f"\n{rows} rows x {vocab}: one sample() call, median of {steps}\n")
    print("| logits | workload | torch ops (ms) | native draw (ms) | speed-up | native / greedy |")
    print("|---|---|---:|---:|---:|---:|")
    for shape, logits in shapes.items():
        greedy = 0.0
        for name, kw in WORKLOADS.items():
            params = make_rows(kw, rows, 1, vocab)
            torch_ms = 1e3 * seconds(lambda p=params, x=logits: sample(x, p), steps)
            native_ms = 1e3 * seconds(lambda p=params, x=logits: sample(x, p, draw=kernel), steps)
            greedy = greedy or native_ms
            speed = torch_ms / native_ms
            print(f"| {shape} | {name} | {torch_ms:.2f} | {native_ms:.2f} | {speed:.1f}x | {native_ms / greedy:.2f} |")
    if not kernel.rows:
        raise SystemExit("the native draw drew no row: the C kernels did not build")


def engine_table(args: argparse.Namespace) -> None:
    from pypto_serving import LLM, SamplingParams

    llm = LLM(model=args.model, worker_mode="inproc", enable_prefix_caching=False, log_level="warning")
    runner = llm.engine.worker._runner
    kernel, loops = runner.draw, runner._sampled_loops
    if kernel is None or not loops:
        raise SystemExit("this executor hands the runner no draw kernel or no sampled loop")
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 150_000) for _ in range(rng.randrange(32, 257))] for _ in range(args.engine_prompts)]
    lone = [[rng.randrange(100, 150_000) for _ in range(128)] for _ in range(3)]
    names = [n for n in WORKLOADS if "penalties" not in n]
    rates: dict[tuple[str, str], list[float]] = {}
    tpots: dict[tuple[str, str], list[float]] = {}

    def params(kw: dict[str, Any], tokens: int) -> SamplingParams:
        return SamplingParams(**kw, max_tokens=tokens, ignore_eos=True, seed=7)

    llm.generate(prompts[:4], params({}, 8), use_tqdm=False)  # warm-up
    for r in range(args.rounds):
        for name in names:
            for way in ("torch ops", "native draw") if r % 2 == 0 else ("native draw", "torch ops"):
                runner.draw, runner._sampled_loops = (kernel, True) if way == "native draw" else (None, False)
                t0 = time.perf_counter()
                outs = llm.generate(prompts, params(WORKLOADS[name], args.max_tokens), use_tqdm=False)
                done = sum(len(o.outputs[0].token_ids) for o in outs)
                rates.setdefault((name, way), []).append(done / (time.perf_counter() - t0))
                for p in lone:
                    t0 = time.perf_counter()
                    out = llm.generate([p], params(WORKLOADS[name], args.c1_tokens), use_tqdm=False)[0]
                    spent = (time.perf_counter() - t0) / len(out.outputs[0].token_ids)
                    tpots.setdefault((name, way), []).append(1e3 * spent)
    llm.shutdown()
    print(f"\nengine: {args.model}, {args.engine_prompts} prompts of 32..256 tokens x {args.max_tokens}, ")
    print(f"medians of {args.rounds} alternated rounds; concurrency 1: 128-token prompts x {args.c1_tokens}\n")
    print("| workload | tok/s torch ops | tok/s native draw | x | c=1 ms/token torch ops | native draw | x |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name in names:
        a, b = statistics.median(rates[(name, "torch ops")]), statistics.median(rates[(name, "native draw")])
        c, d = statistics.median(tpots[(name, "torch ops")]), statistics.median(tpots[(name, "native draw")])
        print(f"| {name} | {a:,.1f} | {b:,.1f} | {b / a:.2f}x | {c:.3f} | {d:.3f} | {c / d:.2f}x |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[64, 1])
    ap.add_argument("--vocab", type=int, default=151_936)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--model", help="also time whole engines on this checkpoint directory")
    ap.add_argument("--engine-prompts", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--c1-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if native.library() is None:
        raise SystemExit("the native CPU kernels did not build")
    cpu = platform.processor() or platform.machine()
    print(f"machine: {cpu}, {os.cpu_count()} cores, {torch.get_num_threads()} threads, torch {torch.__version__}")
    print("command: python benchmarks/sampler.py " + " ".join(sys.argv[1:]))
    for rows in args.rows:
        step_table(rows, args.vocab, args.steps)
    if args.model:
        engine_table(args)


if __name__ == "__main__":
    main()
