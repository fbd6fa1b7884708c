"""Manifold-constrained hyper-connections (mHC) of DeepSeek-V4.

The residual stream is widened to ``N`` parallel streams ``[T, N, D]``. Before a block,
:func:`hc_sinkhorn_mix` collapses them into the block input and computes how the block output is
spread back (``post``) and how the streams mix (``comb``, projected towards a doubly-stochastic
matrix with Sinkhorn iterations); :func:`hc_merge` applies both after the block and
:func:`hc_head` collapses the streams once before the LM head. All mixing maths runs in float32.

On the CPU, where the native kernels are built (:mod:`pypto_kernels.native`), everything of
:func:`hc_sinkhorn_mix` after its one projection runs in one C call per step (``csrc/hyper_connections.c``):
in torch it is about 80 ops on tensors of a few values each, so a call costs their dispatch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import native
from .registry import dispatch


def _rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)


@dispatch("hc_sinkhorn_mix")
def hc_sinkhorn_mix(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    iters: int,
    eps: float,
    norm_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mixing weights for ``streams [T, N, D]``.

    ``fn [N * (N + 2), N * D]``, ``base [N * (N + 2)]`` and ``scale [3]`` produce (pre, post, comb)
    logits. Returns ``(post [T, N], comb [T, N, N], collapsed [T, D])`` with ``post``/``comb`` float32
    and ``collapsed`` (the pre-weighted stream sum) in the stream dtype.
    """
    flat = _rms_normalize(streams.flatten(1), norm_eps)
    mixes = F.linear(flat, fn.float())
    if native.hc_takes(streams):
        return native.hc_sinkhorn_mix(mixes, streams, base, scale, iters, eps)
    return mix_from_logits(mixes, streams, base, scale, iters, eps)


def mix_from_logits(
    mixes: torch.Tensor, streams: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`hc_sinkhorn_mix` after its projection, in torch: the reference of the native kernel.

    :param mixes: float32 ``[T, N * (N + 2)]`` projected logits (pre, post, comb).
    :return: ``(post [T, N], comb [T, N, N], collapsed [T, D])`` as :func:`hc_sinkhorn_mix`'s.
    """
    t, n, _ = streams.shape
    pre_w, post_w, comb_w = mixes[:, :n], mixes[:, n : 2 * n], mixes[:, 2 * n : n * (n + 2)]
    b = base.float()
    pre_b, post_b, comb_b = b[:n], b[n : 2 * n], b[2 * n : n * (n + 2)]
    s = scale.float()
    pre = torch.sigmoid(pre_w * s[0] + pre_b) + eps
    post = 2 * torch.sigmoid(post_w * s[1] + post_b)
    comb = torch.softmax(comb_w.reshape(t, n, n) * s[2] + comb_b.view(n, n), dim=-1) + eps
    # Column normalisation first, then (iters - 1) rounds of row + column normalisation. Each
    # "sum + eps" is one baddbmm against a ones vector (eps as its input term): two ops of each
    # half-round instead of three; the sums of N <= 4 values are bitwise those of ``sum()``. In place
    # on the fresh tensor, since each allocation shows too.
    ones_col = comb.new_ones(1, n, 1).expand(t, n, 1)
    ones_row = comb.new_ones(1, 1, n).expand(t, 1, n)
    eps_t = comb.new_full((1, 1, 1), eps)
    comb = comb / torch.baddbmm(eps_t, ones_row, comb)
    for _ in range(iters - 1):
        comb.div_(torch.baddbmm(eps_t, comb, ones_col))
        comb.div_(torch.baddbmm(eps_t, ones_row, comb))
    collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
    return post, comb, collapsed


@dispatch("hc_merge")
def hc_merge(streams: torch.Tensor, block_out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """``post[t, i] * block_out[t] + sum_j comb[t, j, i] * streams[t, j]`` -> ``[T, N, D]`` (stream dtype)."""
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * block_out.unsqueeze(-2) + torch.matmul(
        comb.to(dtype).transpose(-1, -2), streams
    )


@dispatch("hc_head")
def hc_head(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    eps: float,
    norm_eps: float,
) -> torch.Tensor:
    """Final collapse of ``streams [T, N, D]`` into ``[T, D]`` with sigmoid weights (``fn [N, N * D]``)."""
    flat = _rms_normalize(streams.flatten(1), norm_eps)
    pre = torch.sigmoid(F.linear(flat, fn.float()) * scale.float() + base.float()) + eps
    return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
