"""Paged attention of one engine step: the padded reference against the per-request path, in one run.

Qwen3-0.6B attention shapes (16 query heads, 8 KV heads, head_dim 128, block size 16, float32),
block tables shuffled through the cache as after some churn. Two steps: 64 decodes at about 260
tokens of context, and a 512-token prefill chunk beside 63 such decodes. Reports the median time
of one layer's ``paged_attention`` call for each path and their ratio. With ``--model small`` (or
``0.6b``) it also times whole decode steps of a random-weight Qwen3-shaped model (64 requests at
about 260 tokens of context) and reports the share of the step spent in paged attention.

    python benchmarks/attention.py [--reps 7] [--threads 2] [--model small|0.6b]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

import pypto_kernels
from pypto_kernels import paged_attention
from pypto_kernels.attention import _reference_paged_attention
from pypto_serving_qwen.loader import QwenConfig
from pypto_serving_qwen.model import AttentionMetadata, QwenForCausalLM

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 16, 8, 128, 16


def build_step(batch: list[tuple[int, int]], gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """Inputs of one step: (q_len, seq_len) per request; every request's blocks scattered through the cache."""
    blocks_per_req = [-(-seq // BLOCK) for _, seq in batch]
    num_blocks = sum(blocks_per_req) + 64
    shape = (num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    key_cache, value_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(batch), max(blocks_per_req), dtype=torch.int32)
    used = 0
    for r, n in enumerate(blocks_per_req):
        tables[r, :n] = perm[used : used + n].to(torch.int32)
        used += n
    q_lens = torch.tensor([q for q, _ in batch])
    query_start_loc = torch.cat((torch.zeros(1, dtype=torch.int64), q_lens.cumsum(0))).to(torch.int32)
    seq_lens = torch.tensor([s for _, s in batch], dtype=torch.int32)
    query = torch.randn(int(q_lens.sum()), HEADS, HEAD_DIM, generator=gen)
    return query, key_cache, value_cache, tables, query_start_loc, seq_lens


def median_ms(fn: Callable[[], torch.Tensor], reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def measure(name: str, batch: list[tuple[int, int]], reps: int, gen: torch.Generator) -> None:
    args = build_step(batch, gen)
    scale = HEAD_DIM**-0.5
    new = paged_attention(*args, scale)
    old = _reference_paged_attention(*args, scale)
    err = float((new - old).abs().max())
    old_ms = median_ms(lambda: _reference_paged_attention(*args, scale), reps)
    new_ms = median_ms(lambda: paged_attention(*args, scale), reps)
    pairs = sum(q * s for q, s in batch)
    print(f"| {name} | {len(args[0])} | {pairs:,} | {old_ms:.1f} | {new_ms:.1f} | {old_ms / new_ms:.1f}x | {err:.1e} |")


MODELS = {  # hidden, layers, heads, kv heads, head_dim, intermediate (the benchmark shapes)
    "small": (256, 4, 4, 2, 64, 768),
    "0.6b": (1024, 28, 16, 8, 128, 3072),
}


def random_model(name: str, gen: torch.Generator) -> QwenForCausalLM:
    hidden, layers, heads, kv_heads, head_dim, inter = MODELS[name]
    cfg = QwenConfig(
        architecture="Qwen3ForCausalLM",
        vocab_size=151_936,
        hidden_size=hidden,
        intermediate_size=inter,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        rope_scaling=None,
        rotary_dim=head_dim,
        max_position_embeddings=40_960,
        tie_word_embeddings=True,
        qkv_bias=False,
        o_bias=False,
        qk_norm=True,
        layer_windows=(None,) * layers,
    )
    model = QwenForCausalLM(cfg, torch.device("cpu"), torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * 0.02)
    return model


def _padded_reference(*args: Any, query_lens_host: object = None, seq_lens_host: object = None, **kwargs: Any) -> Any:
    """The padded reference as the model calls it: it takes no host lengths (it reads the tensors)."""
    return _reference_paged_attention(*args, **kwargs)


def decode_step_share(name: str, contexts: list[int], reps: int, gen: torch.Generator) -> None:
    """Median decode-step time of a random Qwen3-shaped model and the share spent in paged_attention."""
    model = random_model(name, gen)
    cfg, num_req = model.cfg, len(contexts)
    blocks = [-(-c // BLOCK) for c in contexts]
    num_blocks = num_req * max(blocks) + 8
    tables = torch.randperm(num_blocks, generator=gen)[: num_req * max(blocks)].view(num_req, -1).int()
    shape = (num_blocks, BLOCK, cfg.num_kv_heads, cfg.head_dim)
    caches = [(torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)) for _ in range(cfg.num_layers)]
    seq_lens = torch.tensor(contexts, dtype=torch.int32)
    last = (seq_lens - 1).long()
    slots = tables.long().gather(1, (last // BLOCK)[:, None])[:, 0] * BLOCK + last % BLOCK
    query_start_loc = torch.arange(num_req + 1, dtype=torch.int32)
    meta = AttentionMetadata(slots, tables, query_start_loc, seq_lens, [1] * num_req, list(contexts))
    input_ids = torch.randint(0, cfg.vocab_size, (num_req,), generator=gen)
    rows = torch.arange(num_req)
    spent = [0.0]

    def timed(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def wrapper(*args: object, **kwargs: object) -> torch.Tensor:
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            spent[0] += time.perf_counter() - start
            return out

        return wrapper

    for label, fn in (("padded", _padded_reference), ("per-request", paged_attention)):
        pypto_kernels.paged_attention = timed(fn)
        steps, shares = [], []
        with torch.inference_mode():
            model(input_ids, last, meta, caches, rows)
            for _ in range(reps):
                spent[0] = 0.0
                start = time.perf_counter()
                model(input_ids, last, meta, caches, rows)
                steps.append(time.perf_counter() - start)
                shares.append(spent[0] / steps[-1])
        pypto_kernels.paged_attention = paged_attention
        step_ms, share = statistics.median(steps) * 1e3, statistics.median(shares)
        print(f"| {name} decode step, {label} | {step_ms:.0f} | {share:.0%} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", choices=sorted(MODELS), help="also time whole decode steps of this model")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    contexts = torch.randint(200, 321, (64,), generator=gen).tolist()
    print("| step | query tokens | (query, key) pairs | padded ms | per-request ms | speed-up | max abs diff |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    measure("64 decodes, ~260 context", [(1, c) for c in contexts], args.reps, gen)
    measure("512-token prefill + 63 decodes", [(512, 512)] + [(1, c) for c in contexts[1:]], args.reps, gen)
    if args.model:
        print("\n| step | ms (median) | attention share |\n|---|---:|---:|")
        decode_step_share(args.model, contexts, args.reps, gen)


if __name__ == "__main__":
    main()
