"""CPU prefill attention: the request loop of torch's fused attention against the native C prefill
kernel, in one run.

One ``paged_attention`` call of one layer of a prefill step: ``--prompts`` whole prompts of
``--input-len`` tokens (32..256 by default, seeded), their K/V in a paged cache of the layout the
engine allocates (block size 16, blocks in table order), the heads of ``--heads`` (Qwen3-0.6B's 16
query / 8 KV heads of 128 by default) or of ``--model``'s config. ``torch`` gathers each request's blocks and runs
``scaled_dot_product_attention`` per request (the path without the native kernels); ``native`` is
:func:`pypto_kernels.native.prefill_attention`, all requests in one call. The paths alternate,
best of ``--reps`` per round; GFLOP/s counts the causal products (4 x heads x dim per visible pair).
``--libs A.so,B.so`` times the native kernel of each of these builds of the C sources in its place
(say, a change's before and after, built with the flags of ``pypto_kernels.native``, or an AVX2
build on an AVX-512 CPU), alternated the same way, the last against torch and against the first (and
whether their outputs are the same bits).

    python benchmarks/prefill_attention.py [--model models/qwen3-0.6b] [--prompts 12] [--threads 2] \
        [--dtype float32 bfloat16] [--input-len 32 256] [--libs before.so,after.so]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch

from pypto_kernels import attention, native

BLOCK = 16


def _heads(args: argparse.Namespace) -> tuple[int, int, int]:
    if args.model is None:
        q, kv, dim = args.heads
        return q, kv, dim
    cfg = json.loads((Path(args.model) / "config.json").read_text())
    q = cfg["num_attention_heads"]
    return q, cfg.get("num_key_value_heads", q), cfg.get("head_dim", cfg["hidden_size"] // q)


def _batch(lengths: list[int], heads: tuple[int, int, int], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    num_q, num_kv, dim = heads
    gen = torch.Generator().manual_seed(1)
    blocks = sum(-(-n // BLOCK) for n in lengths)
    caches = [attention.empty_paged_cache((blocks, BLOCK, num_kv, dim), dtype=dtype, device="cpu") for _ in "kv"]
    for cache in caches:
        cache.copy_(torch.randn(cache.shape, generator=gen))
    tables = torch.zeros((len(lengths), max(-(-n // BLOCK) for n in lengths)), dtype=torch.int64)
    used = 0
    for r, n in enumerate(lengths):
        count = -(-n // BLOCK)
        tables[r, :count] = torch.arange(used, used + count)
        used += count
    lens = torch.tensor(lengths)
    starts = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    starts[1:] = lens.cumsum(0)
    query = torch.randn(int(starts[-1]), num_q, dim, generator=gen).to(dtype)
    return {"query": query, "k": caches[0], "v": caches[1], "tables": tables, "starts": starts, "lens": lens}


def _paths(b: dict[str, torch.Tensor], scale: float) -> dict[str, Callable[[], object]]:
    query, starts, lens = b["query"], b["starts"], b["lens"]
    tables, spans = attention._tables_and_spans(query, b["k"], b["tables"], starts, lens, None, None, None)

    def loop() -> torch.Tensor:
        out = b["query"].new_zeros(b["query"].shape)
        attention._attend_spans(b["query"], b["k"], b["v"], tables, spans, out, scale, None, None, None, None)
        return out

    def fast() -> torch.Tensor:
        out = b["query"].new_zeros(b["query"].shape)
        attention._native_prefill(b["query"], b["k"], b["v"], tables, spans, out, scale, None, None)
        return out

    return {"torch": loop, "native": fast}


def _library(path: str) -> ctypes.CDLL:
    """The library at ``path`` with the built library's argument and result types."""
    real = native.library()
    lib = ctypes.CDLL(str(Path(path).resolve()))
    for name in dir(real):
        if name.startswith("pypto_"):
            getattr(lib, name).restype = getattr(real, name).restype
            getattr(lib, name).argtypes = getattr(real, name).argtypes
    return lib


def _with_libraries(fast: Callable[[], object], paths: list[str]) -> dict[str, Callable[[], object]]:
    """The native path once per library of ``paths``, each run with that library in place of the built one."""
    built = native.library

    def runner(lib: ctypes.CDLL) -> Callable[[], object]:
        def run() -> object:
            native.library = lambda: lib  # type: ignore[assignment]
            try:
                return fast()
            finally:
                native.library = built  # type: ignore[assignment]

        return run

    return {Path(path).name: runner(_library(path)) for path in paths}


def _best(paths: dict[str, Callable[[], object]], rounds: int, reps: int) -> dict[str, float]:
    best = dict.fromkeys(paths, float("inf"))
    for _ in range(rounds):
        for name, fn in paths.items():
            for _ in range(reps):
                start = time.perf_counter()
                fn()
                best[name] = min(best[name], time.perf_counter() - start)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="read the heads from this checkpoint's config.json")
    p.add_argument("--heads", type=int, nargs=3, default=[16, 8, 128], metavar=("Q", "KV", "DIM"))
    p.add_argument("--prompts", type=int, default=12)
    p.add_argument("--input-len", type=int, nargs=2, default=[32, 256], metavar=("LO", "HI"))
    p.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--libs", default="", help="comma list of native kernel libraries to alternate")
    args = p.parse_args()
    if native.library() is None:
        raise SystemExit("the native CPU kernels are not built here (no C compiler?): nothing to compare")
    torch.set_num_threads(args.threads)
    heads = _heads(args)
    lo, hi = args.input_len
    lengths = torch.randint(lo, hi + 1, (args.prompts,), generator=torch.Generator().manual_seed(0)).tolist()
    flops = sum(4 * heads[0] * heads[2] * n * (n + 1) / 2 for n in lengths)
    print(f"heads {heads}, {len(lengths)} prompts, {sum(lengths)} tokens, {args.threads} threads")
    libs = [path for path in args.libs.split(",") if path]
    names = ["torch (request loop)", *([Path(path).name for path in libs] or ["native"])]
    ratios = [f"{names[-1]} vs torch (max diff)"] + ([f"{names[-1]} vs {names[1]} (bits)"] if len(libs) > 1 else [])
    print(f"| dtype | {' | '.join(names + ratios)} |\n|---|{'---:|' * (len(names) + len(ratios))}")
    for name in args.dtype:
        batch = _batch(lengths, heads, getattr(torch, name))
        paths = _paths(batch, heads[2] ** -0.5)
        if libs:
            paths = {"torch": paths["torch"], **_with_libraries(paths["native"], libs)}
        outs = [fn() for fn in paths.values()]
        diff = (outs[0].float() - outs[-1].float()).abs().max().item()  # type: ignore[attr-defined]
        best = list(_best(paths, args.rounds, args.reps).values())
        cells = [f"{t * 1e3:.2f} ms ({flops / t / 1e9:.0f} GFLOP/s)" for t in best]
        cells.append(f"{best[0] / best[-1]:.2f}x ({diff:.1e})")
        if len(libs) > 1:  # the two builds' outputs: the same bits, or their largest difference
            same = torch.equal(outs[1], outs[-1])  # type: ignore[arg-type]
            bits = "same" if same else f"differ by {(outs[1].float() - outs[-1].float()).abs().max().item():.1e}"  # type: ignore[attr-defined]
            cells.append(f"{best[1] / best[-1]:.2f}x ({bits})")
        print(f"| {name} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
