"""KV offload tiers: time to first token of later conversation turns with the prefix on the device,
in host memory, on disk, or recomputed.

``--conversations`` multi-turn chats (each turn resends the whole conversation plus a new user
message) run round-robin, one request at a time, so that the KV of all conversations is several times
the device cache (``--num-kv-blocks``) and every earlier turn's prefix has left the device by the
time its next turn comes. Four engines serve the same workload:

* ``device``: a device cache large enough for everything (the prefix is always on the device);
* ``host``: the small device cache over a host-memory tier (``kv_offload_host_bytes``);
* ``disk``: the small device cache over a disk tier only (``kv_offload_disk_path``);
* ``recompute``: the small device cache alone (the prefix is computed again).

Prints, per engine, the mean and median TTFT of turns after the first, the prefix tokens hit per
tier over the prompt tokens of those turns, and the bytes moved::

    python benchmarks/kv_tiers.py                      # the embedded tiny Qwen3 on the CPU
    python benchmarks/kv_tiers.py --model /path/to/qwen3 --device cuda --block-size 256
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
from typing import Any

from pypto_serving import LLM, SamplingParams


def _conversations(args: argparse.Namespace) -> list[list[list[int]]]:
    """Per conversation, the user messages of its turns (token ids)."""
    rng = random.Random(0)

    def msg(n: int) -> list[int]:
        return [rng.randrange(3, 2000) for _ in range(n)]

    return [[msg(args.first_len)] + [msg(args.turn_len) for _ in range(args.turns - 1)] for _ in range(args.conversations)]


def run_engine(args: argparse.Namespace, name: str, **tiers: Any) -> dict[str, Any]:
    blocks = args.num_kv_blocks * (8 if name == "device" else 1)
    llm = LLM(
        model=args.model,
        device=args.device,
        worker_mode="inproc",
        block_size=args.block_size,
        num_kv_blocks=blocks,
        max_model_len=args.max_model_len,
        **tiers,
    )
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate([[1] * args.first_len] * 2, params, use_tqdm=False)  # warm up (allocators, kernels)
    history: list[list[int]] = [[] for _ in range(args.conversations)]
    ttft: list[float] = []
    later_prompt_tokens = 0
    try:
        for turn in range(args.turns):
            for c, messages in enumerate(_conversations(args)):
                prompt = history[c] + messages[turn]
                out = llm.generate([prompt], params, use_tqdm=False)[0]
                history[c] = prompt + list(out.outputs[0].token_ids)
                m = out.metrics
                if turn > 0 and m is not None and m.first_token_time is not None:
                    ttft.append(m.first_token_time - m.arrival_time)
                    later_prompt_tokens += len(prompt)
        stats = llm._engine().stats()
    finally:
        llm.shutdown()
    hits = stats.get("kv_offload_hits_per_tier", {})
    return {
        "engine": name,
        "device_blocks": blocks,
        "ttft_mean_ms": round(1000 * statistics.mean(ttft), 2),
        "ttft_median_ms": round(1000 * statistics.median(ttft), 2),
        "prefix_hit_rate": round(stats["prefix_cache_hits"] / max(1, stats["prefix_cache_queries"]), 3),
        "tier_hit_rate": {t: round(n / max(1, later_prompt_tokens), 3) for t, n in hits.items()},
        "bytes_down": stats.get("kv_offload_bytes_down", 0),
        "bytes_up": stats.get("kv_offload_bytes_up", 0),
        "mean_load_ms": round(
            1000 * stats.get("kv_offload_load_seconds", 0.0) / max(1, stats.get("kv_offload_loads", 0)), 2
        ),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-qwen3")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--conversations", type=int, default=20)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--first-len", type=int, default=160, help="tokens of a conversation's first message")
    ap.add_argument("--turn-len", type=int, default=32, help="tokens of each later user message")
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-kv-blocks", type=int, default=80, help="the small device cache (blocks)")
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--host-bytes", type=int, default=1 << 30)
    ap.add_argument("--disk-bytes", type=int, default=4 << 30)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as disk:
        engines = [
            ("device", {}),
            ("host", {"kv_offload_host_bytes": args.host_bytes}),
            ("disk", {"kv_offload_disk_path": disk, "kv_offload_disk_bytes": args.disk_bytes}),
            ("recompute", {}),
        ]
        for name, tiers in engines:
            print(json.dumps(run_engine(args, name, **tiers)), flush=True)


if __name__ == "__main__":
    main()
