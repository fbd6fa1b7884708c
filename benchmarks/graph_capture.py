"""Decode step time of the Qwen executor, eager against graph-captured, in one run.

Loads the checkpoint twice (an eager executor and one with ``executor_options={"graph_mode": MODE,
"graph_batch_sizes": [...]}``), times the captured executor's warm-up (compilation of every bucket,
per bucket), then for each batch size prefills that many requests to about ``--context`` tokens in
both executors and alternates their decode steps (eager, captured, eager, ...), so both see the same
load on shared cores. Prints the median step time of each and the ratio, and checks that both
decode the same greedy tokens.

    python benchmarks/graph_capture.py --model /work/models/qwen3-small --batch-sizes 1 8 32
    python benchmarks/graph_capture.py --model /work/models/qwen3-small --fresh-cache   # cold compile

``--fresh-cache`` points inductor's on-disk cache at an empty folder, so the warm-up shows the
cold start-up cost; without it a second run reuses the compiled kernels of the first.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for tests.plugins.qwen.qwen_fixtures

from tests.plugins.qwen.qwen_fixtures import PagedBatchBuilder, qwen_settings

BLOCK = 16


def _executor(args: argparse.Namespace, options: dict[str, Any], blocks: int) -> Any:
    from pypto_serving_qwen.executor import QwenExecutor

    settings = qwen_settings(
        args.model, block_size=BLOCK, max_model_len=args.max_model_len, max_num_seqs=max(args.batch_sizes)
    )
    settings.executor_options = options
    ex = QwenExecutor(settings)
    ex.load()
    start = time.perf_counter()
    ex.init_kv_cache({"kv": blocks})
    ex.init_seconds = time.perf_counter() - start
    return ex


def _prefill(ex: Any, builder: PagedBatchBuilder, prompts: dict[str, list[int]]) -> list[int]:
    last = []
    for rid, prompt in prompts.items():
        last += ex.execute(builder.step([(rid, prompt)], all_logits=False)).argmax(-1).tolist()
    return last


def _decode_step(ex: Any, builder: PagedBatchBuilder, rids: list[str], tokens: list[int]) -> tuple[float, list[int]]:
    batch = builder.step([(rid, [tok]) for rid, tok in zip(rids, tokens, strict=True)], all_logits=False)
    start = time.perf_counter()
    nxt = ex.execute(batch).argmax(-1).tolist()
    return time.perf_counter() - start, nxt


def _compare(args: argparse.Namespace, eager: Any, captured: Any, batch: int) -> tuple[float, float, int]:
    """Median eager and captured step seconds at ``batch`` requests, and the steps whose tokens differ."""
    gen = torch.Generator().manual_seed(batch)
    prompts = {f"r{i}": torch.randint(10, 1000, (args.context,), generator=gen).tolist() for i in range(batch)}
    builders = {"eager": PagedBatchBuilder(BLOCK, args.blocks), "captured": PagedBatchBuilder(BLOCK, args.blocks)}
    executors = {"eager": eager, "captured": captured}
    tokens = {name: _prefill(ex, builders[name], prompts) for name, ex in executors.items()}
    times: dict[str, list[float]] = {"eager": [], "captured": []}
    differ = 0
    for _ in range(args.steps):
        for name, ex in executors.items():
            seconds, tokens[name] = _decode_step(ex, builders[name], list(prompts), tokens[name])
            times[name].append(seconds)
        if tokens["eager"] != tokens["captured"]:
            differ += 1
            tokens["captured"] = list(tokens["eager"])  # keep both on the same sequence
    return statistics.median(times["eager"]), statistics.median(times["captured"]), differ


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--mode", default="inductor", help="graph_mode of the captured executor")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--context", type=int, default=64, help="prompt tokens per request")
    ap.add_argument("--steps", type=int, default=20, help="decode steps timed per batch size")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--fresh-cache", action="store_true", help="compile with an empty inductor cache")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.fresh_cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="inductor-cold-")
    args.blocks = max(args.batch_sizes) * (-(-(args.context + args.steps + 2) // BLOCK)) + 8
    eager = _executor(args, {"graph_mode": "eager"}, args.blocks)
    captured = _executor(args, {"graph_mode": args.mode, "graph_batch_sizes": args.batch_sizes}, args.blocks)
    per_bucket = ", ".join(f"{b}: {s:.1f} s" for b, s in sorted(captured.graph_stats.first_call_seconds.items()))
    print(f"{args.model.name}, {args.mode}, torch threads {torch.get_num_threads()}")
    print(f"start-up: warm-up of every bucket {captured.init_seconds:.1f} s ({per_bucket})")
    print("| batch | eager ms/step | captured ms/step | eager / captured | steps whose tokens differ |")
    print("|---|---|---|---|---|")
    for batch in args.batch_sizes:
        t_eager, t_captured, differ = _compare(args, eager, captured, batch)
        ratio = t_eager / t_captured
        print(f"| {batch} | {t_eager * 1e3:.2f} | {t_captured * 1e3:.2f} | {ratio:.2f} | {differ}/{args.steps} |")
    stats = captured.graph_stats
    print(f"captured steps per bucket {stats.graph_steps}, eager steps (prefill) {stats.eager_steps}")


if __name__ == "__main__":
    main()
