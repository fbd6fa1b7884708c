"""DeepSeek-V4 specific tensor ops as plain torch functions.

These have no counterpart in ``pypto_kernels`` yet (interleaved partial RoPE, mHC Sinkhorn mixing,
window pooling of the compressors, lightning-indexer scoring, sink attention over a sliding window
plus compressed entries). They are written batch-first and side-effect free so they can move to
``pypto_kernels`` unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm in float32; V4 keeps norm weights in float32, so scale before casting back once."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        h = weight.float() * h
    return h.to(dtype)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float) -> tuple[torch.Tensor, ...]:
    """Half-size float32 cos/sin tables ``[T, rope_dim // 2]``: V4 rotates interleaved channel pairs."""
    freqs = positions.to(torch.float32)[:, None] * inv_freq.to(positions.device)[None, :]
    return freqs.cos() * scaling, freqs.sin() * scaling


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the trailing ``2 * cos.shape[-1]`` channels of ``x [T, ..., D]`` pairwise (interleaved).

    ``cos``/``sin`` are ``[T, rope_dim // 2]``; heads (if any) broadcast. Pass ``-sin`` to undo.
    """
    rd = 2 * cos.shape[-1]
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    c, s = cos.reshape(shape), sin.reshape(shape)
    rope = x[..., -rd:].float()
    even, odd = rope[..., 0::2], rope[..., 1::2]
    rotated = torch.stack((even * c - odd * s, odd * c + even * s), dim=-1).flatten(-2)
    return torch.cat([x[..., :-rd], rotated.to(x.dtype)], dim=-1)


def hc_weights(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    iters: int,
    eps: float,
    norm_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Manifold-constrained hyper-connection mixing for ``streams [T, N, D]``.

    Returns ``(post [T, N], comb [T, N, N], collapsed [T, D])``; ``comb`` is projected towards a
    doubly-stochastic matrix with Sinkhorn iterations so the residual mixing cannot blow up.
    """
    t, n, _ = streams.shape
    flat = rms_norm(streams.flatten(1).float(), None, norm_eps)
    mixes = F.linear(flat, fn.float())
    pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.float().split([n, n, n * n])
    s = scale.float()
    pre = torch.sigmoid(pre_w * s[0] + pre_b) + eps
    post = 2 * torch.sigmoid(post_w * s[1] + post_b)
    comb = torch.softmax(comb_w.view(t, n, n) * s[2] + comb_b.view(n, n), dim=-1) + eps
    # Column normalisation first, then (iters - 1) rounds of row + column normalisation.
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
    return post, comb, collapsed


def hc_merge(streams: torch.Tensor, block_out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """Expand a block output back to N streams and add the Sinkhorn-mixed residual (comb^T @ streams)."""
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * block_out.unsqueeze(-2) + torch.matmul(
        comb.to(dtype).transpose(-1, -2), streams
    )


def hc_head(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    eps: float,
    norm_eps: float,
) -> torch.Tensor:
    """Final collapse of the N streams into one hidden vector per token."""
    flat = rms_norm(streams.flatten(1).float(), None, norm_eps)
    pre = torch.sigmoid(F.linear(flat, fn.float()) * scale.float() + base.float()) + eps
    return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, groups: int) -> torch.Tensor:
    """Block-diagonal projection: ``x [T, G, in]`` with ``weight [G * out, in]`` -> ``[T, G * out]``."""
    w = weight.view(groups, -1, x.shape[-1])
    return torch.einsum("tgi,goi->tgo", x, w).flatten(1)


def clamped_swiglu(gate_up: torch.Tensor, limit: float) -> torch.Tensor:
    """SiLU(gate) * up with V4's clamps (gate from above, up both sides) against activation spikes."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


def router_scores(logits: torch.Tensor, scoring: str) -> torch.Tensor:
    logits = logits.float()
    if scoring == "softmax":
        return torch.softmax(logits, dim=-1)
    if scoring == "sigmoid":
        return torch.sigmoid(logits)
    return torch.sqrt(F.softplus(logits))


def pool_windows(
    kv: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor, rate: int, first_window: int, overlap: bool
) -> torch.Tensor:
    """Softmax-gated pooling of complete windows.

    ``kv``/``gate`` ``[L, W]`` hold consecutive source tokens starting at absolute position
    ``first_window * rate - (rate if overlap and first_window > 0 else 0)``; every complete window
    from ``first_window`` on yields one entry. Without overlap an entry pools its own ``rate`` tokens
    (``W`` = head dim). With overlap (CSA) ``W`` = 2 * head dim: entry ``w`` pools the first halves of
    window ``w - 1`` together with the second halves of window ``w`` (2 * rate slots); window -1 does
    not exist, its slots get zero weight. ``bias [rate, W]`` is the per-slot position bias.
    """
    has_prev = overlap and first_window > 0
    start = rate if has_prev else 0
    n_win = (kv.shape[0] - start) // rate
    if n_win <= 0:
        return kv.new_zeros((0, kv.shape[1] // (2 if overlap else 1)))
    # The tensor starts on a window boundary, so row i sits in window slot i % rate.
    g = gate.float() + bias.float().repeat(kv.shape[0] // rate + 1, 1)[: kv.shape[0]]
    cur_kv = kv[start : start + n_win * rate].view(n_win, rate, -1)
    cur_g = g[start : start + n_win * rate].view(n_win, rate, -1)
    if not overlap:
        w = torch.softmax(cur_g, dim=1).to(kv.dtype)
        return (cur_kv * w).sum(dim=1)
    hd = kv.shape[1] // 2
    prev_kv = kv.new_zeros((n_win, rate, hd))
    prev_g = g.new_full((n_win, rate, hd), float("-inf"))
    if has_prev:
        prev_kv = kv[: n_win * rate].view(n_win, rate, -1)[..., :hd]
        prev_g = g[: n_win * rate].view(n_win, rate, -1)[..., :hd]
    elif n_win > 1:
        prev_kv[1:] = cur_kv[:-1, :, :hd]
        prev_g[1:] = cur_g[:-1, :, :hd]
    all_kv = torch.cat([prev_kv, cur_kv[..., hd:]], dim=1)
    all_g = torch.cat([prev_g, cur_g[..., hd:]], dim=1)
    w = torch.softmax(all_g, dim=1).to(kv.dtype)
    return (all_kv * w).sum(dim=1)


def sink_attention(
    q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor, sinks: torch.Tensor, scale: float
) -> torch.Tensor:
    """Single-KV-head attention with a learned per-head sink logit.

    ``q [S, H, D]``, ``keys [L, D]`` (K and V are the same tensor in V4), ``mask [S, L]`` bool
    (True = may attend). The sink joins the softmax and is then dropped, so heads can attend to
    "nothing". Returns ``[S, H, D]``.
    """
    logits = torch.einsum("shd,ld->hsl", q.float(), keys.float()) * scale
    logits = logits.masked_fill(~mask.unsqueeze(0), float("-inf"))
    sink = sinks.float().view(-1, 1, 1).expand(-1, q.shape[0], 1)
    combined = torch.cat([logits, sink], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = torch.softmax(combined, dim=-1)[..., :-1]
    return torch.einsum("hsl,ld->shd", probs.to(keys.dtype), keys)
