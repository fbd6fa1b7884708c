"""Speculative-decoding building blocks, timed per step on this machine's CPU (or ``--device``).

- The rejection sampler (``spec_decode.rejection``) at 16 and 64 requests with k = 2 drafts each over
  the Qwen vocabulary (151,936): sampled requests with point-mass drafts (n-gram, greedy MTP),
  sampled requests with dense draft distributions, and greedy requests. Beside it, in the same run,
  the plain sampler (``sampler.sample``, temperature 1, no filters) over the same ``R * (k + 1)``
  rows: what verification costs against sampling every row.
- The n-gram drafter (``spec_decode.ngram``) at 64 requests with 2,048-token histories, from Python
  lists (padding included, as the runner would call it) and from a prebuilt padded tensor.

Usage: python benchmarks/spec_decode.py [--vocab 151936] [--k 2] [--steps 7] [--threads N] [--device cpu]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core"))

from pypto_serving.sampler import RowParams, sample
from pypto_serving.spec_decode import NgramDrafter, SpecRow, read, rejection_sample
from pypto_serving.spec_decode.ngram import pad_histories, propose_ngram


def timed(fn: Callable[[], object], steps: int, device: torch.device) -> float:
    """Median seconds of ``steps`` calls after one warm-up."""
    fn()
    out = []
    for _ in range(steps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        out.append(time.perf_counter() - t)
    return statistics.median(out)


def rejection_cases(rows: int, k: int, vocab: int, steps: int, device: torch.device) -> dict[str, float]:
    g = torch.Generator().manual_seed(rows)
    n = rows * (k + 1)
    logits = (torch.randn(n, vocab, generator=g) * 4).to(device)  # peaked, as a trained model's
    probs = torch.softmax(logits, dim=-1)
    drafts = torch.randint(0, vocab, (rows * k,), generator=g).to(device)
    # Half the drafts take the target's argmax, so acceptance and rejection paths both run.
    best = probs.argmax(dim=-1).reshape(rows, k + 1)[:, :k].flatten()
    drafts = torch.where(torch.arange(rows * k, device=device) % 2 == 0, best, drafts)
    q = torch.softmax(torch.randn(rows * k, vocab, generator=g).to(device) * 4, dim=-1)
    sampled = [SpecRow(seed=r, first_index=100, num_drafts=k, greedy=False) for r in range(rows)]
    greedy = [SpecRow(seed=r, first_index=100, num_drafts=k, greedy=True) for r in range(rows)]
    plain = [RowParams(temperature=1.0, seed=i, draw_index=100) for i in range(n)]
    return {
        "rejection, point-mass drafts": timed(lambda: read(rejection_sample(probs, drafts, sampled)), steps, device),
        "rejection, dense draft probs": timed(lambda: read(rejection_sample(probs, drafts, sampled, q)), steps, device),
        "greedy verification": timed(lambda: read(rejection_sample(logits, drafts, greedy)), steps, device),
        f"plain sampler, {n} rows": timed(lambda: sample(logits, plain), steps, device),
        f"softmax of {n} rows (producing p)": timed(lambda: torch.softmax(logits, dim=-1), steps, device),
    }


def histories(rows: int, length: int) -> list[list[int]]:
    """Token histories with repeated spans (as in code or quoted text), over a 32k vocabulary."""
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(rows):
        h = torch.randint(0, 32000, (length,), generator=g)
        for _ in range(length // 64):  # copy a few spans of 16 tokens to later places
            src, dst = torch.randint(0, length - 16, (2,), generator=g).tolist()
            h[dst : dst + 16] = h[src : src + 16].clone()
        out.append(h.tolist())
    return out


def ngram_cases(rows: int, length: int, k: int, steps: int, device: torch.device) -> dict[str, float]:
    hs = histories(rows, length)
    drafter = NgramDrafter(num_speculative_tokens=k, prompt_lookup_min=2, prompt_lookup_max=5, device=str(device))
    padded = pad_histories(hs, device)
    return {
        "n-gram propose (lists -> drafts)": timed(lambda: drafter.propose(hs), steps, device),
        "  of which padding the lists": timed(lambda: pad_histories(hs, device), steps, device),
        "  of which the search (tensor in)": timed(
            lambda: propose_ngram(padded, k=k, lookup_min=2, lookup_max=5)[1].tolist(), steps, device
        ),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--k", type=int, default=2)
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, device {device}, vocab {args.vocab}, k {args.k}"
    )
    for rows in (16, 64):
        print(f"\n{rows} requests, k = {args.k} (median ms per step of {args.steps})")
        for name, sec in rejection_cases(rows, args.k, args.vocab, args.steps, device).items():
            print(f"  {name:<40} {sec * 1e3:9.2f}")
    print(f"\nn-gram drafter, 64 requests x 2048-token histories, k = {args.k}, n in 2..5 (median ms)")
    for name, sec in ngram_cases(64, 2048, args.k, args.steps, device).items():
        print(f"  {name:<40} {sec * 1e3:9.2f}")


if __name__ == "__main__":
    main()
