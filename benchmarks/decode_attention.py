"""CPU decode attention: the per-request loop (the reference) against the batched fast paths, in one run.

Two measurements, each interleaving the paths and keeping the best of N (the machine may be
shared): ``loop`` (the reference), ``torch`` (the batched torch paths: a float32 cache read in place
by a sampled product and ``embedding_bag``, others gathered) and ``native`` (the C kernel of
:mod:`pypto_kernels.native`, where a C compiler built it). The kernel: one ``paged_attention`` call
of 64 decode rows with ragged contexts of 32..384 tokens, small-shape heads (4 query / 2 KV heads,
head_dim 64; ``--heads 16 8 128`` for Qwen3-0.6B's), block size 16, shuffled block tables, caches in
the layout the engine allocates for each ``--dtype``, one thread (``--cold``: the caches evicted before
each call, as a step's other layers leave them); on an AVX-512 build ``native per-key`` is the same
kernel through its per-key passes instead of its blocked ones. The engine: the Qwen executor with a
Qwen3-shaped checkpoint (``benchmarks/make_models.py``), 64 requests prefilled to the same ragged
contexts, then decode steps of all 64, alternating between the paths.

    python benchmarks/decode_attention.py [--model /work/models/qwen3-small] [--reps 15] [--threads 1] \
        [--dtype float32 bfloat16] [--cold]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for tests.plugins.qwen.qwen_fixtures

from pypto_kernels import attention, native, registry

BLOCK = 16
ROWS = 64


def _lengths(seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(32, 385, (ROWS,), generator=gen).tolist()


def _best(fn: Callable[[], object], reps: int, before: Callable[[], object] | None = None) -> tuple[float, float]:
    """Best wall time and best process CPU time of ``reps`` calls (CPU time counts no time spent
    waiting for a core a neighbour holds, so it is the steadier of the two on a shared machine), with
    ``before`` (untimed) ahead of each."""
    wall = cpu = float("inf")
    for _ in range(reps):
        if before is not None:
            before()
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        wall, cpu = min(wall, time.perf_counter() - t0), min(cpu, time.process_time() - c0)
    return wall, cpu


def _interleaved(
    paths: dict[str, Callable[[], object]], rounds: int, reps: int, before: Callable[[], object] | None = None
) -> dict[str, tuple[float, float]]:
    best = dict.fromkeys(paths, (float("inf"), float("inf")))
    for _ in range(rounds):
        for name, fn in paths.items():
            wall, cpu = _best(fn, reps, before)
            best[name] = (min(best[name][0], wall), min(best[name][1], cpu))
    return best


def _report(title: str, best: dict[str, tuple[float, float]]) -> None:
    loop_wall, loop_cpu = best["loop"]
    parts = [f"loop {loop_wall * 1e3:.2f} ms wall / {loop_cpu * 1e3:.2f} ms CPU"]
    for name, (wall, cpu) in best.items():
        if name != "loop":
            parts.append(f"{name} {wall * 1e3:.2f} / {cpu * 1e3:.2f} ms ({loop_wall / wall:.2f}x wall)")
    print(f"{title}: " + "; ".join(parts))


@contextlib.contextmanager
def _native_off() -> Iterator[None]:
    """The torch paths (in-place sampled product, padded gathers), as without a C compiler."""
    real = native.library
    native.library = lambda: None  # type: ignore[assignment]
    try:
        yield
    finally:
        native.library = real  # type: ignore[assignment]


def _within(
    context: Callable[[], contextlib.AbstractContextManager[None]], fn: Callable[[], object]
) -> Callable[[], object]:
    """``fn`` run inside a fresh ``context()`` each call."""

    def run() -> object:
        with context():
            return fn()

    return run


@contextlib.contextmanager
def _per_key() -> Iterator[None]:
    """The native kernel's per-key passes where its blocked ones would run (AVX-512 builds)."""
    real = native.paged_attention
    native.paged_attention = functools.partial(real, blocked=False)  # type: ignore[assignment]
    try:
        yield
    finally:
        native.paged_attention = real  # type: ignore[assignment]


def kernel(heads: tuple[int, int, int], reps: int, dtype: torch.dtype, cold: bool = False) -> None:
    num_q, num_kv, dim = heads
    lens = _lengths(0)
    blocks = sum(-(-n // BLOCK) for n in lens)
    gen = torch.Generator().manual_seed(1)
    shape = (blocks, BLOCK, num_kv, dim)
    # In the layout the engine allocates for this dtype (head-major where a CPU path reads it in place).
    key_cache = attention.empty_paged_cache(shape, dtype=dtype, device="cpu").copy_(torch.randn(shape, generator=gen))
    value_cache = attention.empty_paged_cache(shape, dtype=dtype, device="cpu").copy_(torch.randn(shape, generator=gen))
    tables = torch.full((ROWS, -(-max(lens) // BLOCK)), -1, dtype=torch.int32)
    perm, used = torch.randperm(blocks, generator=gen).to(torch.int32), 0
    for r, n in enumerate(lens):
        tables[r, : -(-n // BLOCK)] = perm[used : used + -(-n // BLOCK)]
        used += -(-n // BLOCK)
    args = (torch.randn(ROWS, num_q, dim, generator=gen).to(dtype), key_cache, value_cache, tables)
    rest = (torch.arange(ROWS + 1, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32), dim**-0.5)
    host = {"query_lens_host": [1] * ROWS, "seq_lens_host": lens}
    loop = attention.paged_attention.reference  # type: ignore[attr-defined]
    batched = attention.batched_decode_paged_attention
    paths = {
        "loop": lambda: loop(*args, *rest, **host),
        "torch": _within(_native_off, lambda: batched(*args, *rest, **host)),
    }
    if native.library() is not None:
        paths["native"] = lambda: batched(*args, *rest, **host)
        if native.blocked_attention_available():
            paths["native per-key"] = _within(_per_key, paths["native"])
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    for name in paths:
        torch.testing.assert_close(paths["loop"](), paths[name](), atol=tolerance, rtol=tolerance)
    evict = torch.empty(64 << 20, dtype=torch.uint8)  # more than the last-level cache: touched, it evicts the K/V
    best = _interleaved(paths, 5, reps, (lambda: evict.add_(1)) if cold else None)
    kv_bytes = 2 * sum(lens) * num_kv * dim * key_cache.element_size()
    title = f"kernel, {ROWS} decode rows of 32..384 tokens, heads {num_q}/{num_kv}x{dim}, {dtype} cache"
    title += ", evicted before each call" if cold else ""
    _report(title, best)
    for name in ("native", "native per-key"):
        if name in best:
            rate = kv_bytes / best[name][0] / 1e9
            print(f"  {name} reads the rows' K/V ({kv_bytes / 1e6:.1f} MB) at {rate:.1f} GB/s")


def engine(model: Path, reps: int) -> None:
    from pypto_serving_qwen.executor import QwenExecutor
    from tests.plugins.qwen.qwen_fixtures import PagedBatchBuilder, qwen_settings

    lens = _lengths(0)
    steps = 5 * 3 * reps + 4  # rounds x paths x reps, and the warm-up
    blocks = sum(-(-(n + steps) // BLOCK) for n in lens) + 8
    ex = QwenExecutor(qwen_settings(model, block_size=BLOCK))
    ex.load()
    ex.init_kv_cache({"kv": blocks})
    builder = PagedBatchBuilder(BLOCK, blocks)
    gen = torch.Generator().manual_seed(0)
    ids = {f"r{i}": torch.randint(10, 1000, (n,), generator=gen).tolist() for i, n in enumerate(lens)}
    for rid, prompt in ids.items():
        ex.execute(builder.step([(rid, prompt)], all_logits=False))
    fast = registry.CPU_FAST_KERNELS

    def step(kernels: frozenset[str]) -> Callable[[], object]:
        def run() -> object:
            registry.CPU_FAST_KERNELS = kernels  # the dispatcher reads it per call
            return ex.execute(builder.step([(rid, [7]) for rid in ids], all_logits=False))

        return run

    paths = {"loop": step(fast - {"paged_attention"}), "torch": _within(_native_off, step(fast))}
    if native.library() is not None:
        paths["native"] = step(fast)
    best = _interleaved(paths, 5, reps)
    registry.CPU_FAST_KERNELS = fast
    _report(f"engine, {model.name}, {ROWS}-stream decode step, {torch.get_num_threads()} thread(s)", best)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, help="a Qwen3-shaped checkpoint for the engine measurement")
    ap.add_argument("--heads", type=int, nargs=3, default=(4, 2, 64), metavar=("Q", "KV", "DIM"))
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], nargs="+", default=["float32"], help="cache dtypes")
    ap.add_argument("--cold", action="store_true", help="evict the caches (a 64 MiB pass) before each kernel call")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    for dtype in args.dtype:
        kernel(tuple(args.heads), args.reps, getattr(torch, dtype), args.cold)
    if args.model is not None:
        engine(args.model, max(1, args.reps // 5))


if __name__ == "__main__":
    main()
