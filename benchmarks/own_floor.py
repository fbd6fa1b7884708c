"""Concurrency 1's time per token against a plain read of the very weights it reads, in one process.

``compare.py`` puts a concurrency-1 token over a floor read from tensors of its own (before and after
each engine's run). On a machine whose memory reads at different speeds by where a page lands (the
virtual machine of docs/benchmarks.md: 27-35 GB/s in one state, 45-65 in another, by page and over
minutes), that floor and the engine's weights can sit on different pages, so the ratio moves with
placement, not with the engine. Here the floor is the engine's own weights: one request (a 128-token
prompt of random ids, greedy) decodes through ``LLM(worker_mode="inproc")`` in rounds, and right
before and after each round the tensors a one-request decode token reads are read once more with
torch's ``sum`` on the same threads (best of ``--reads``; each buffer under them whole, in one call, as
float32): the decoder
projections' packed copies (``PackedLinearWeight.packed`` of the panels library, what the native
decoder reads) or their plain matrices, the other parameters of the decoder layers, and the output
projection's one-row matrix (its panels copy; the plain rows where a one-row GEMV reads them); buffers under
64 KiB (norm weights) are left out. Each round prints the time per token (the difference between
``--tokens`` and one token's generate, over ``--tokens - 1``), the reads' times and the token over
their mean; a round whose two reads differ by more than 15 % (the memory changed state during it) is
left out of the summary. torch allocates on transparent huge pages here (``THP_MEM_ALLOC_ENABLE=1``,
unless the environment sets it), as the engine's spawned worker does (``worker_huge_pages``, on by
default): the in-process engine's weights then lie on the pages they lie on when served.

    python benchmarks/own_floor.py --model models/qwen3-small --dtype bfloat16 --rounds 8
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from typing import Any

# Read by torch's CPU allocator once, at its first allocation (torch's import makes some): set first.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

import torch


def token_tensors(model: Any) -> list[torch.Tensor]:
    """What one request's decode token reads of ``model`` (a dense Qwen model after ``pack_linears``):
    each projection's panels (or its plain matrix), every other parameter of the decoder layers and the
    final norm, and the output projection's one-row matrix; the embedding's one row is left out."""
    from pypto_kernels import PackedLinearWeight

    tensors: list[torch.Tensor] = []  # repeats are fine: storages() reads each buffer once
    for module in model.layers.modules():
        for value in vars(module).values():
            if isinstance(value, PackedLinearWeight):
                t = value.packed if value.library == "panels" else value.weight
                if t is None:  # an opaque packed copy (oneDNN's): no plain read of the same bytes
                    raise SystemExit(f"a {value.library} projection has no readable copy: panels or plain only")
                tensors.append(t)
        tensors += [p.data for p in module.parameters(recurse=False)]
    head = model.lm_head_packed
    if head is not None and head.library == "panels" and head.min_rows <= 1:
        matrix = head.packed  # one row runs the panels copy, tied or not
    elif head is not None and head.weight is not None:
        matrix = head.weight  # the one-row GEMV over the plain matrix beside a oneDNN copy
    else:
        matrix = model.lm_head_t.data.t()
    return [*tensors, model.norm.data, matrix]


def storages(tensors: list[torch.Tensor], least: int = 1 << 16) -> list[torch.Tensor]:
    """The memory under ``tensors`` as one flat tensor a storage (views into one buffer, as the small
    panels moved onto huge pages are, read as that buffer), float32 where its bytes allow; storages
    under ``least`` bytes left out (norm weights: their bytes are nothing beside the matrices', a
    call's overhead is not)."""
    flat: dict[int, torch.Tensor] = {}
    for t in tensors:
        storage = t.untyped_storage()
        if storage.nbytes() >= least:
            whole = torch.empty(0, dtype=torch.uint8).set_(storage)
            flat[storage.data_ptr()] = whole[: whole.numel() // 4 * 4].view(torch.float32)
    return list(flat.values())


def read_time(flat: list[torch.Tensor], reads: int) -> float:
    """The best of ``reads`` passes of ``sum`` over every tensor of ``flat``, one after another
    (subnormals flushed for it, as bytes read as float32 can be)."""
    flushed = torch.set_flush_denormal(True)
    try:
        best = float("inf")
        for _ in range(reads):
            start = time.perf_counter()
            for t in flat:
                t.sum()
            best = min(best, time.perf_counter() - start)
    finally:
        if flushed:
            torch.set_flush_denormal(False)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--tokens", type=int, default=129)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--reads", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--scheduler", default="sync")
    args = p.parse_args()

    from pypto_serving import LLM, SamplingParams

    llm = LLM(
        model=args.model, scheduler=args.scheduler, dtype=args.dtype, worker_threads=args.threads,
        enable_prefix_caching=False, log_level="warning", worker_mode="inproc",
    )  # fmt: skip
    model = llm.engine.worker._runner.executor.model  # type: ignore[union-attr]
    tensors = token_tensors(model)
    flat = storages(tensors)
    nbytes = sum(t.numel() * 4 for t in flat)
    prompt = [random.Random(0).randrange(100, 150_000) for _ in range(128)]

    def generate(tokens: int) -> float:
        start = time.perf_counter()
        llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True), use_tqdm=False)
        return time.perf_counter() - start

    generate(args.tokens)  # warm: the first decode steps build the native decoder
    steady: list[tuple[float, float]] = []  # (token, floor) of the rounds whose reads agree
    print(f"{len(tensors)} tensors in {len(flat)} buffers, {nbytes / 1e6:.1f} MB; threads {torch.get_num_threads()}")
    for r in range(args.rounds):
        before = read_time(flat, args.reads)
        tpot = (generate(args.tokens) - generate(1)) / (args.tokens - 1)
        after = read_time(flat, args.reads)
        floor, moved = (before + after) / 2, max(before, after) / min(before, after) > 1.15
        if not moved:
            steady.append((tpot, floor))
        note = " (the reads differ by more than 15 %: the state moved, left out)" if moved else ""
        print(
            f"round {r}: {tpot * 1e3:.2f} ms a token, own weights read in {before * 1e3:.2f} / {after * 1e3:.2f} ms "
            f"({nbytes / floor / 1e9:.1f} GB/s): {tpot / floor:.3f}x{note}"
        )
    if steady:
        ratios = [t / f for t, f in steady]
        print(
            f"{len(steady)} steady rounds: ratio median {statistics.median(ratios):.3f}x "
            f"({min(ratios):.3f}-{max(ratios):.3f}x), tokens {min(t for t, _ in steady) * 1e3:.2f}-"
            f"{max(t for t, _ in steady) * 1e3:.2f} ms"
        )


if __name__ == "__main__":
    main()
