"""Async (depth-2 pipelined) vs sync scheduling on the same decode-heavy workload.

Builds a tiny random Qwen3 checkpoint in a temp dir (``tests/plugins/qwen/qwen_fixtures.py``), then
runs the workload once per strategy through a worker process and prints one table: throughput, time
per output token (TPOT), steps, and the host share of a step, i.e. the part of the engine's wall time
per step that the worker did not spend in ``ModelRunner.step`` (its reported ``execute_seconds``).
With sync that host time is serialized with the model; async overlaps it with the next step.

    python3 benchmarks/async_vs_sync.py                       # 64 requests x 128 new tokens
    python3 benchmarks/async_vs_sync.py --requests 16 --max-tokens 32 --device cuda

``--worker-threads 1 2`` runs the pair once per worker thread count (on the CPU: whether the worker
leaves a core to the engine), ``--rounds N`` N times each, alternating which strategy goes first; the
tables show medians.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(_ROOT))  # for tests.plugins.qwen.qwen_fixtures


def _plugins() -> Any:
    if "qwen" in {ep.name for ep in metadata.entry_points(group="pypto_serving")}:
        return None
    from pypto_serving.plugins import PluginManager
    from pypto_serving_qwen import plugin

    return PluginManager(extra_plugins=[plugin])


def run_once(model: Path, scheduler: str, args: argparse.Namespace, worker_threads: int = 0) -> dict[str, Any]:
    import torch

    from pypto_serving import LLM, SamplingParams

    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(4, 320, (args.prompt_len,), generator=gen).tolist() for _ in range(args.requests)]
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    llm = LLM(
        model=str(model),
        plugins=_plugins(),
        scheduler=scheduler,
        worker_mode="process",
        device=args.device,
        dtype=args.dtype,
        block_size=16,
        max_model_len=args.prompt_len + args.max_tokens + 8,
        max_num_seqs=args.requests,
        max_num_batched_tokens=max(2048, args.requests * args.prompt_len),
        seed=0,
        **({"worker_threads": worker_threads} if worker_threads else {}),
    )
    try:
        eng = llm.engine
        llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)  # warm up
        execute: list[float] = []
        wait_result = eng.wait_result

        def timed_wait() -> Any:
            result = wait_result()
            execute.append(result.execute_seconds)
            return result

        eng.wait_result = timed_wait
        steps0 = eng.stats()["num_steps"]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        wall = time.perf_counter() - t0
        steps = eng.stats()["num_steps"] - steps0
        ntok = sum(len(o.outputs[0].token_ids) for o in outs)
        tpots = [
            (o.metrics.last_token_time - o.metrics.first_token_time) / (len(o.outputs[0].token_ids) - 1)
            for o in outs
            if len(o.outputs[0].token_ids) > 1
        ]
        return {
            "tokens": [o.outputs[0].token_ids for o in outs],
            "wall": wall,
            "num_tokens": ntok,
            "throughput": ntok / wall,
            "tpot_ms": 1e3 * statistics.mean(tpots),
            "steps": steps,
            "step_ms": 1e3 * wall / steps,
            "execute_ms": 1e3 * sum(execute) / len(execute),
            "host_share": 1.0 - sum(execute) / wall,
        }
    finally:
        llm.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", help="the engine's dtype ('auto': bfloat16 where the CPU has it)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads in this process (0: leave)")
    ap.add_argument("--model", type=Path, help="an existing Qwen checkpoint (default: a tiny random one)")
    ap.add_argument("--worker-threads", type=int, nargs="+", default=[0], help="worker threads (0: the default)")
    ap.add_argument("--rounds", type=int, default=1, help="runs of each strategy (median reported)")
    args = ap.parse_args()
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from tests.plugins.qwen.qwen_fixtures import make_qwen_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or make_qwen_checkpoint(Path(tmp) / "qwen3", "qwen3", max_position_embeddings=1024)
        for threads in args.worker_threads:
            runs: dict[str, list[dict[str, Any]]] = {"sync": [], "async": []}
            for r in range(args.rounds):
                for name in ("sync", "async") if r % 2 == 0 else ("async", "sync"):
                    runs[name].append(run_once(model, name, args, threads))
            if not _report(args, threads, runs):
                sys.exit(1)


def _report(args: argparse.Namespace, threads: int, runs: dict[str, list[dict[str, Any]]]) -> bool:
    """One table of medians over the rounds; whether every run's tokens were the same."""
    res = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0] if k != "tokens"} for name, rs in runs.items()}
    same = all(r["tokens"] == runs["sync"][0]["tokens"] for rs in runs.values() for r in rs)
    print(
        f"\nworkload: {args.requests} requests x {args.prompt_len} prompt tokens -> "
        f"{args.max_tokens} new tokens (greedy), {args.model or 'tiny Qwen3 (hidden 64, 3 layers)'}, "
        f"worker_mode=process, device={args.device}, dtype={args.dtype}, worker_threads={threads or 'default'}, "
        f"median of {args.rounds} round(s)"
    )
    rows = [
        ("throughput (tok/s)", "throughput", "{:.0f}"),
        ("TPOT (ms)", "tpot_ms", "{:.2f}"),
        ("steps", "steps", "{:.0f}"),
        ("wall per step (ms)", "step_ms", "{:.2f}"),
        ("worker execute per step (ms)", "execute_ms", "{:.2f}"),
        ("host share of a step", "host_share", "{:.1%}"),
    ]
    print(f"| {'metric':<30} | {'sync':>10} | {'async':>10} | {'async/sync':>10} |")
    print(f"|{'-' * 32}|{'-' * 12}|{'-' * 12}|{'-' * 12}|")
    for name, key, fmt in rows:
        a, s = res["async"][key], res["sync"][key]
        ratio = f"{a / s:.3f}" if s else "-"
        print(f"| {name:<30} | {fmt.format(s):>10} | {fmt.format(a):>10} | {ratio:>10} |")
    print(f"\noutputs identical: {same}")
    return same


if __name__ == "__main__":
    main()
