"""Where a decode step's time goes: torch.profiler over the Qwen executor's forward.

Loads a Qwen checkpoint (e.g. ``benchmarks/make_models.py``'s ``qwen3-0.6b``) into the Qwen
executor, prefills N requests to about C tokens of context each, then profiles decode steps of all N
(one token each) and prints the wall time per step, the share of the time inside
``paged_attention``, and the operators with the most self CPU time.

    python benchmarks/decode_profile.py --model /work/models/qwen3-0.6b --requests 64 --context 260
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for tests.plugins.qwen.qwen_fixtures

import pypto_kernels as K
from tests.plugins.qwen.qwen_fixtures import PagedBatchBuilder, qwen_settings


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--context", type=int, default=260)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from pypto_serving_qwen.executor import QwenExecutor

    block = 16
    blocks = args.requests * (-(-(args.context + args.steps + 2) // block)) + 8
    ex = QwenExecutor(qwen_settings(args.model, block_size=block))
    ex.load()
    ex.init_kv_cache({"kv": blocks})
    builder = PagedBatchBuilder(block, blocks)
    gen = torch.Generator().manual_seed(0)
    ids = {f"r{i}": torch.randint(10, 1000, (args.context,), generator=gen).tolist() for i in range(args.requests)}
    for rid, prompt in ids.items():  # one prefill per request, so no step is larger than one prompt
        ex.execute(builder.step([(rid, prompt)], all_logits=False))
    attention = [0.0]
    inner = K.paged_attention

    def timed(*a: object, **kw: object) -> torch.Tensor:
        t0 = time.perf_counter()
        out = inner(*a, **kw)
        attention[0] += time.perf_counter() - t0
        return out

    K.paged_attention = timed  # type: ignore[assignment]
    walls = []
    for _ in range(args.steps):
        batch = builder.step([(rid, [7]) for rid in ids], all_logits=False)
        attention[0] = 0.0
        t0 = time.perf_counter()
        ex.execute(batch)
        walls.append((time.perf_counter() - t0, attention[0]))
    K.paged_attention = inner  # type: ignore[assignment]
    wall = statistics.median(w for w, _ in walls)
    att = statistics.median(a for _, a in walls)
    print(f"{args.requests} decodes at ~{args.context} tokens of context, {torch.get_num_threads()} thread(s)")
    print(f"decode step: {wall * 1e3:.1f} ms median of {args.steps}; paged_attention {att / wall:.0%} of it")
    batch = builder.step([(rid, [7]) for rid in ids], all_logits=False)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        ex.execute(batch)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


if __name__ == "__main__":
    main()
