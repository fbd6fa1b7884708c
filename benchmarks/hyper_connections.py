"""DeepSeek-V4's ``hc_sinkhorn_mix``: the kernel against its torch formulations, in one run.

The Sinkhorn projection of the ``[T, N, N]`` mixing matrix is 20 rounds of a row and a column
normalisation; each op is tiny, so a call costs what its ops' dispatch costs. Three versions, each
after the same projection: the first torch formulation (``sum``, ``add_``, ``div_`` per half-round:
"previous"), the torch ops with each "sum + eps" one ``baddbmm`` against a ones vector (the native
pass's reference, ``mix_from_logits``: "torch ops") and the kernel as the executor calls it (the
native C pass on the CPU where it is built). Each repeat times them back to back, rotating which goes
first, so load from other jobs hits all alike; the table shows medians.

    python3 benchmarks/hyper_connections.py
    python3 benchmarks/hyper_connections.py --repeats 7 --threads 1 --hidden 256 4096
    python3 benchmarks/hyper_connections.py --decode-steps --threads 1 --repeats 3

``--decode-steps`` times whole DeepSeek-V4 decode steps instead (``benchmarks/mtp.py``'s checkpoint,
hidden 256, 4 layers and an MTP layer: ten hc_sinkhorn_mix calls a step; ``mtp.time_steps``, process
CPU time, so run it on one thread), the kernel's native pass against its torch ops, alternated.
"""

from __future__ import annotations

import argparse
import functools
import platform
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pypto_kernels import hc_sinkhorn_mix, native
from pypto_kernels.hyper_connections import mix_from_logits

ITERS, EPS = 20, 1e-6


def previous_mix(
    streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel as it was before the baddbmm rounds (the baseline)."""
    t, n, _ = streams.shape
    h = streams.flatten(1).float()
    flat = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)
    mixes = F.linear(flat, fn.float())
    b, s = base.float(), scale.float()
    pre = torch.sigmoid(mixes[:, :n] * s[0] + b[:n]) + EPS
    post = 2 * torch.sigmoid(mixes[:, n : 2 * n] * s[1] + b[n : 2 * n])
    comb = torch.softmax(mixes[:, 2 * n :].view(t, n, n) * s[2] + b[2 * n :].view(n, n), dim=-1) + EPS
    comb = comb / (comb.sum(dim=-2, keepdim=True) + EPS)
    for _ in range(ITERS - 1):
        comb.div_(comb.sum(dim=-1, keepdim=True).add_(EPS))
        comb.div_(comb.sum(dim=-2, keepdim=True).add_(EPS))
    collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
    return post, comb, collapsed


def torch_ops_mix(
    streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's torch ops (its path where the native pass is not built)."""
    h = streams.flatten(1).float()
    flat = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)
    return mix_from_logits(F.linear(flat, fn.float()), streams, base, scale, ITERS, EPS)


def _time(fn: Callable[[], object], calls: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def decode_steps(repeats: int) -> None:
    """Median ms of a plain decode step at concurrency 1 and 16, native pass against torch ops."""
    import sys
    import tempfile
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from benchmarks.mtp import build, time_steps

    takes = native.hc_takes
    times: dict[tuple[str, int], list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = build(Path(tmp))
        for r in range(repeats):
            for name in ("torch ops", "native") if r % 2 == 0 else ("native", "torch ops"):
                native.hc_takes = takes if name == "native" else lambda streams: False  # type: ignore[assignment]
                for concurrency in (1, 16):
                    times.setdefault((name, concurrency), []).append(time_steps(path, concurrency, 20)["plain"])
    native.hc_takes = takes  # type: ignore[assignment]
    print(f"# {torch.get_num_threads()} threads; median of {repeats} (each the best of two in mtp.time_steps)")
    print("| concurrency | torch ops ms/step | native ms/step | speed-up |")
    print("|---:|---:|---:|---:|")
    for concurrency in (1, 16):
        t, k = (statistics.median(times[(n, concurrency)]) * 1e3 for n in ("torch ops", "native"))
        print(f"| {concurrency} | {t:.2f} | {k:.2f} | {t / k:.2f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 3, 32, 64, 512])
    parser.add_argument("--hidden", type=int, nargs="+", default=[256, 4096])
    parser.add_argument("--streams", type=int, default=4, help="hc_mult (DeepSeek-V4: 4)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--decode-steps", action="store_true", help="time DeepSeek-V4 decode steps instead")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.decode_steps:
        decode_steps(args.repeats)
        return
    cpu = platform.processor() or platform.machine()
    built = "native pass built" if native.library() is not None else "native pass NOT built: kernel = torch ops"
    print(f"# {cpu}, torch {torch.__version__}, {torch.get_num_threads()} threads, {built}")
    print(
        "| hidden | tokens | previous µs/call | torch ops µs/call | kernel µs/call | kernel vs torch ops "
        "| max abs diff |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|")
    gen = torch.Generator().manual_seed(0)
    n = args.streams
    for hidden in args.hidden:
        fn = torch.randn(n * (n + 2), n * hidden, generator=gen) * 0.02
        base, scale = torch.randn(n * (n + 2), generator=gen) * 0.1, torch.rand(3, generator=gen) + 0.5
        for tokens in args.tokens:
            streams = torch.randn(tokens, n, hidden, generator=gen)
            args_ = (streams, fn, base, scale)
            versions = [
                functools.partial(previous_mix, *args_),
                functools.partial(torch_ops_mix, *args_),
                functools.partial(hc_sinkhorn_mix, *args_, ITERS, EPS, EPS),
            ]
            diff = max((a - b).abs().max().item() for a, b in zip(versions[2](), versions[0](), strict=True))
            times: list[list[float]] = [[], [], []]
            for r in range(args.repeats):
                for i in range(3):
                    k = (i + r) % 3
                    times[k].append(_time(versions[k], args.calls))
            o, t, k = (statistics.median(x) for x in times)
            print(f"| {hidden} | {tokens} | {o:.0f} | {t:.0f} | {k:.0f} | {t / k:.2f}x | {diff:.1e} |")


if __name__ == "__main__":
    main()
