"""DeepSeek-V4's ``hc_sinkhorn_mix``: the kernel against its previous Sinkhorn loop, in one run.

The Sinkhorn projection of the ``[T, N, N]`` mixing matrix is 20 rounds of a row and a column
normalisation; each op is tiny, so a call costs what its ops' dispatch costs. The kernel forms each
"sum + eps" as one ``baddbmm`` against a ones vector (two ops per half-round); the baseline below is
the previous formulation (``sum``, ``add_``, ``div_``: three). Each repeat times both back to back,
alternating which goes first, so load from other jobs hits both alike; the table shows medians.

    python3 benchmarks/hyper_connections.py
    python3 benchmarks/hyper_connections.py --repeats 7 --threads 1 --hidden 256 4096
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

from pypto_kernels import hc_sinkhorn_mix

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


def _time(fn: Callable[[], object], calls: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 3, 32, 64, 512])
    parser.add_argument("--hidden", type=int, nargs="+", default=[256, 4096])
    parser.add_argument("--streams", type=int, default=4, help="hc_mult (DeepSeek-V4: 4)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cpu = platform.processor() or platform.machine()
    print(f"# {cpu}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| hidden | tokens | previous µs/call | kernel µs/call | speed-up | max abs diff |")
    print("|---:|---:|---:|---:|---:|---:|")
    gen = torch.Generator().manual_seed(0)
    n = args.streams
    for hidden in args.hidden:
        fn = torch.randn(n * (n + 2), n * hidden, generator=gen) * 0.02
        base, scale = torch.randn(n * (n + 2), generator=gen) * 0.1, torch.rand(3, generator=gen) + 0.5
        for tokens in args.tokens:
            streams = torch.randn(tokens, n, hidden, generator=gen)
            args_ = (streams, fn, base, scale)
            new = functools.partial(hc_sinkhorn_mix, *args_, ITERS, EPS, EPS)
            old = functools.partial(previous_mix, *args_)
            diff = max((a - b).abs().max().item() for a, b in zip(new(), old(), strict=True))
            olds, news = [], []
            for r in range(args.repeats):
                pair = [(olds, old), (news, new)] if r % 2 == 0 else [(news, new), (olds, old)]
                for out, f in pair:
                    out.append(_time(f, args.calls))
            o, k = statistics.median(olds), statistics.median(news)
            print(f"| {hidden} | {tokens} | {o:.0f} | {k:.0f} | {o / k:.2f}x | {diff:.1e} |")


if __name__ == "__main__":
    main()
