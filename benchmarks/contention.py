"""Time per output token with and without a competing CPU job, per worker thread setting.

Builds the issue's small random Qwen3 shape (hidden 256, 4 layers, 4/2 heads, head_dim 64,
intermediate 768, the real 151,936-token vocabulary) and decodes one request (128-token prompt) and,
optionally, a batch of concurrent ones, once on the machine as it is and once while a competing
process keeps one core busy with single-threaded float32 matmuls (an "other job"). Each worker thread
setting is measured in the same run, alternating quiet and contended, so the ratio
contended / quiet is what to read.

    python benchmarks/contention.py                      # threads 1 and 2, default OpenMP waiting
    python benchmarks/contention.py --threads 1 2 --wait-policy default passive --repeats 3
    python benchmarks/contention.py --threads 2 --cpu-bind auto off    # worker threads pinned or not
    python benchmarks/contention.py --threads 2 --shed auto off        # busy cores shed or not
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(_ROOT))  # for tests.plugins.qwen.qwen_fixtures

SMALL = {
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "intermediate_size": 768,
    "vocab_size": 151_936,
    "tie_word_embeddings": True,
    "max_position_embeddings": 4096,
}


def _burn(stop: Any) -> None:
    """The competing job: single-threaded float32 matmuls until ``stop`` is set."""
    import torch

    torch.set_num_threads(1)
    a = torch.randn(512, 512)
    while not stop.is_set():
        a = torch.tanh(a @ a)


def _plugins() -> Any:
    from importlib import metadata

    if "qwen" in {ep.name for ep in metadata.entry_points(group="pypto_serving")}:
        return None
    from pypto_serving.plugins import PluginManager
    from pypto_serving_qwen import plugin

    return PluginManager(extra_plugins=[plugin])


def _tpot_ms(llm: Any, prompts: list[list[int]], max_tokens: int) -> float:
    from pypto_serving import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    tpots = [(o.metrics.last_token_time - o.metrics.first_token_time) / (len(o.outputs[0].token_ids) - 1) for o in outs]
    return 1e3 * statistics.median(tpots)


def _measure(
    model: Path, threads: int, concurrency: int, args: argparse.Namespace, bind: str = "auto", shed: str = "auto"
) -> dict[str, list[float]]:
    import torch

    from pypto_serving import LLM

    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 150_000, (args.prompt_len,), generator=gen).tolist() for _ in range(concurrency)]
    llm = LLM(
        model=str(model),
        plugins=_plugins(),
        scheduler=args.scheduler,
        worker_mode="process",
        worker_threads=threads,
        worker_cpu_bind=bind,
        worker_shed_busy_cores=shed,
        dtype="float32",
        block_size=16,
        max_model_len=args.prompt_len + args.max_tokens + 8,
        max_num_seqs=max(concurrency, 1),
        seed=0,
    )
    times: dict[str, list[float]] = {"quiet": [], "contended": []}
    try:
        _tpot_ms(llm, prompts[:1], 8)  # warm-up
        for _ in range(args.repeats):
            times["quiet"].append(_tpot_ms(llm, prompts, args.max_tokens))
            stop = mp.get_context("spawn").Event()
            burner = mp.get_context("spawn").Process(target=_burn, args=(stop,), daemon=True)
            burner.start()
            time.sleep(1.0)  # let it import torch and start burning
            try:
                times["contended"].append(_tpot_ms(llm, prompts, args.max_tokens))
            finally:
                stop.set()
                burner.join(10)
    finally:
        llm.shutdown()
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--wait-policy", nargs="+", default=["default"], choices=["default", "passive", "active"])
    ap.add_argument("--cpu-bind", nargs="+", default=["auto"], help="worker_cpu_bind values to compare")
    ap.add_argument("--shed", nargs="+", default=["auto"], help="worker_shed_busy_cores values to compare")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--scheduler", default="sync")
    ap.add_argument("--model", type=Path, help="an existing checkpoint directory (default: build the small shape)")
    args = ap.parse_args()
    from tests.plugins.qwen.qwen_fixtures import make_qwen_checkpoint

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or make_qwen_checkpoint(Path(tmp) / "small", "qwen3", **SMALL)
        for policy in args.wait_policy:
            # Read by OpenMP when the worker process starts; spawned workers inherit it.
            os.environ.pop("OMP_WAIT_POLICY", None)
            if policy != "default":
                os.environ["OMP_WAIT_POLICY"] = policy.upper()
            for threads in args.threads:
                for conc in args.concurrency:
                    for bind in args.cpu_bind:
                        for shed in args.shed:
                            t = _measure(model, threads, conc, args, bind, shed)
                            q, c = statistics.median(t["quiet"]), statistics.median(t["contended"])
                            rows.append((policy, bind, shed, threads, conc, q, c, t))
                            what = f"policy={policy} bind={bind} shed={shed} threads={threads} concurrency={conc}"
                            print(f"{what}: {t}", file=sys.stderr)
    print(f"\nsmall Qwen3 shape, prompt {args.prompt_len}, {args.max_tokens} new tokens, median of {args.repeats}")
    print(
        "| OpenMP wait | cpu bind | shed busy cores | threads | concurrency | TPOT quiet ms | TPOT contended ms "
        "| contended / quiet |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for policy, bind, shed, threads, conc, q, c, _ in rows:
        print(f"| {policy} | {bind} | {shed} | {threads} | {conc} | {q:.2f} | {c:.2f} | {c / q:.2f}x |")


if __name__ == "__main__":
    main()
