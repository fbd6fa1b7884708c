"""Grouped MoE (``grouped_moe_experts``) against the per-expert loop (``looped_moe_experts``) in one run,
or (``--native``) against the CPU's native grouped products
(:func:`pypto_kernels.backends.cpu.native_moe_experts`), with each one's read rate of the routed
experts' weights beside this machine's copy bandwidth, measured in the same run; or (``--block``) a
whole routed block as torch ops around the native products (the router's ``F.linear``,
``topk_routing``, ``moe_experts``) against its one native call (:func:`pypto_kernels.native.moe_block`)
over the plain experts and over the experts packed as panels (:func:`pypto_kernels.native.pack_experts`).

Random float32 experts and softmax top-k routing at decode (few tokens) and prefill (hundreds of
tokens) token counts on three shapes: the plugin tests' tiny Qwen3-MoE, a small many-expert one and
a mid one (64 experts, top-8, hidden 1024, intermediate 768). Each repeat times both kernels back to
back, alternating which goes first, so load from other jobs hits both alike; the table shows medians.

    python3 benchmarks/moe.py                    # all shapes, markdown table
    python3 benchmarks/moe.py --repeats 5 --shapes tiny mid --threads 1
    python3 benchmarks/moe.py --native --dtype bfloat16 --shapes small mid --tokens 1 8 64 128 256
    python3 benchmarks/moe.py --block --dtype bfloat16 --shapes qwen3-moe --tokens 1 8 64
"""

from __future__ import annotations

import argparse
import functools
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pypto_kernels import topk_routing
from pypto_kernels.moe import grouped_moe_experts, looped_moe_experts


@dataclass(frozen=True)
class Shape:
    experts: int
    top_k: int
    hidden: int
    intermediate: int


SHAPES = {
    "tiny": Shape(experts=4, top_k=2, hidden=64, intermediate=32),
    "small": Shape(experts=128, top_k=8, hidden=256, intermediate=128),
    "mid": Shape(experts=64, top_k=8, hidden=1024, intermediate=768),
    "qwen3-moe": Shape(experts=64, top_k=8, hidden=1024, intermediate=384),  # make_models.py's moe
}
TOKENS = {"decode": (1, 8, 64), "prefill": (256, 512)}


def _operands(shape: Shape, tokens: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, shape.hidden, generator=gen).to(dtype)
    gate_up = (torch.randn(shape.experts, 2 * shape.intermediate, shape.hidden, generator=gen) * 0.02).to(dtype)
    down = (torch.randn(shape.experts, shape.hidden, shape.intermediate, generator=gen) * 0.02).to(dtype)
    weights, ids = topk_routing(torch.randn(tokens, shape.experts, generator=gen), shape.top_k, True)
    return x, gate_up, down, weights, ids


def _seconds(fn: Callable[[], torch.Tensor], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def _alternated(fns: list[Callable[[], torch.Tensor]], repeats: int) -> list[float]:
    """Median seconds per call of each of ``fns``, timed in turn (the order rotated every repeat), each
    timing about 0.2 s of calls."""
    calls = max(1, int(0.2 / max(_seconds(fns[0], 1), 1e-6)))
    times: list[list[float]] = [[] for _ in fns]
    for r in range(repeats):
        for i in [(r + j) % len(fns) for j in range(len(fns))]:
            times[i].append(_seconds(fns[i], calls))
    return [statistics.median(t) for t in times]


def measure(shape: Shape, tokens: int, repeats: int) -> tuple[float, float]:
    """Median seconds per call of (loop, grouped); asserts both give the same result first."""
    x, gate_up, down, weights, ids = _operands(shape, tokens)

    def loop() -> torch.Tensor:
        return looped_moe_experts(x, gate_up, down, weights, ids)

    def grouped() -> torch.Tensor:
        return grouped_moe_experts(x, gate_up, down, weights, ids)

    torch.testing.assert_close(grouped(), loop(), atol=1e-5, rtol=1e-5)
    loop_s, grouped_s = _alternated([loop, grouped], repeats)
    return loop_s, grouped_s


def native_row(shape: Shape, tokens: int, repeats: int, dtype: torch.dtype) -> str:
    """One table row: grouped and native ms, their ratio, and each one's read rate of the weights of
    the experts the call routes to (GB/s) and FLOP rate, after checking the two agree."""
    from pypto_kernels.backends.cpu import native_moe_experts

    x, gate_up, down, weights, ids = _operands(shape, tokens, dtype)
    grouped = functools.partial(grouped_moe_experts, x, gate_up, down, weights, ids)
    native = functools.partial(native_moe_experts, x, gate_up, down, weights, ids)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(native(), grouped(), atol=tolerance, rtol=tolerance)
    g, n = _alternated([grouped, native], repeats)
    read = ids.unique().numel() * 3 * shape.hidden * shape.intermediate * gate_up.element_size()
    flops = 2 * ids.numel() * 3 * shape.hidden * shape.intermediate
    rates = f"{read / g / 1e9:.1f} / {read / n / 1e9:.1f} | {flops / g / 1e9:.0f} / {flops / n / 1e9:.0f}"
    return f"{tokens} | {ids.numel() / shape.experts:.1f} | {g * 1e3:.3f} | {n * 1e3:.3f} | {g / n:.2f}x | {rates}"


def block_row(shape: Shape, tokens: int, repeats: int, dtype: torch.dtype) -> str:
    """One table row: the block as torch ops around the native products and as one native call, ms
    and their ratio, after checking the two agree; eight layers' weights in turn, as a step reads them
    (so a call's experts are not left in the caches by the call before)."""
    import torch.nn.functional as F

    from pypto_kernels import moe_experts, native

    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, shape.hidden, generator=gen).to(dtype)
    layers = [
        tuple((torch.randn(*dims, generator=gen) * 0.05).to(dtype) for dims in (
            (shape.experts, shape.hidden), (shape.experts, 2 * shape.intermediate, shape.hidden),
            (shape.experts, shape.hidden, shape.intermediate),
        ))
        for _ in range(8)
    ]  # fmt: skip

    def torch_ops() -> torch.Tensor:
        for router, gate_up, down in layers:
            weights, ids = topk_routing(F.linear(x, router), shape.top_k, True)
            out = moe_experts(x, gate_up, down, weights, ids)
        return out

    def one_call() -> torch.Tensor:
        for router, gate_up, down in layers:
            out = native.moe_block(x, router, gate_up, down, shape.top_k, True)
        return out

    packed = [(router, native.pack_experts(gate_up), native.pack_experts(down)) for router, gate_up, down in layers]

    def panels() -> torch.Tensor:
        for router, gate_up, down in packed:
            out = native.moe_block(x, router, gate_up, down, shape.top_k, True)
        return out

    # Tokens may differ where their router logits tie at the k-th expert (common in bfloat16): torch's
    # topk breaks ties in its own order, the native block to the lower expert.
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    theirs = torch_ops().float()
    alike = min(
        ((ours.float() - theirs).abs() <= tolerance * (1 + theirs.abs())).all(dim=1).float().mean().item()
        for ours in (one_call(), panels())
    )
    assert alike >= 0.9, f"only {alike:.0%} of the tokens agree"
    t, n, p = (s / len(layers) for s in _alternated([torch_ops, one_call, panels], repeats))
    flops = 2 * tokens * shape.top_k * 3 * shape.hidden * shape.intermediate
    times = f"{t * 1e3:.3f} | {n * 1e3:.3f} | {p * 1e3:.3f} | {t / p:.2f}x"
    return f"{tokens} | {alike:.0%} | {times} | {flops / p / 1e9:.0f}"


def _rows(args: argparse.Namespace, row: Callable[[Shape, int, int, torch.dtype], str]) -> None:
    """One table row a shape and token count (``--shapes``, ``--tokens``), as ``row`` makes it."""
    for name in args.shapes:
        shape = SHAPES[name]
        dims = f"{name} ({shape.experts}, {shape.top_k}, {shape.hidden}, {shape.intermediate})"
        for tokens in args.tokens:
            print(f"| {dims} | {row(shape, tokens, args.repeats, getattr(torch, args.dtype))} |", flush=True)


def block_table(args: argparse.Namespace) -> None:
    print("| shape (E, top-k, H, I) | tokens | tokens alike | torch ops + native products ms | one native call ms |"
          " one native call, experts as panels ms | torch ops / panels | panels' expert GFLOP/s |")  # fmt: skip
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    _rows(args, block_row)


def native_table(args: argparse.Namespace) -> None:
    from compare import memory_bandwidth  # benchmarks/compare.py: the floors' copy bandwidth

    print(f"copy bandwidth before: {max(memory_bandwidth(256, torch.get_num_threads())) / 1e9:.1f} GB/s")
    print("| shape (E, top-k, H, I) | tokens | routes an expert | grouped ms | native ms | grouped / native |"
          " GB/s grouped / native | GFLOP/s grouped / native |")  # fmt: skip
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    _rows(args, native_row)
    print(f"copy bandwidth after: {max(memory_bandwidth(256, torch.get_num_threads())) / 1e9:.1f} GB/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=list(SHAPES))
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    parser.add_argument("--native", action="store_true", help="grouped against the CPU's native grouped products")
    parser.add_argument("--block", action="store_true", help="a routed block's torch ops against its native call")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="with --native/--block")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64, 128, 256], help="with --native/--block")
    args = parser.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.processor() or platform.machine()}")
    if args.native or args.block:
        (native_table if args.native else block_table)(args)
        return
    print("| shape (E, top-k, H, I) | phase | tokens | loop ms | grouped ms | loop / grouped |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for name in args.shapes:
        shape = SHAPES[name]
        dims = f"{name} ({shape.experts}, {shape.top_k}, {shape.hidden}, {shape.intermediate})"
        for phase, counts in TOKENS.items():
            for tokens in counts:
                loop, grouped = measure(shape, tokens, args.repeats)
                times = f"{loop * 1e3:.3f} | {grouped * 1e3:.3f} | {loop / grouped:.2f}x"
                print(f"| {dims} | {phase} | {tokens} | {times} |")


if __name__ == "__main__":
    main()
