"""KV offload tiers: time to first token of later conversation turns with the prefix on the device,
in host memory, on disk, or recomputed.

``--conversations`` multi-turn chats (each turn resends the whole conversation plus a new user
message) run round-robin, one request at a time, so that the KV of all conversations is several times
the device cache (``--num-kv-blocks``) and every earlier turn's prefix has left the device by the
time its next turn comes. Four engines serve the same workload, request by request in turn (so
whatever else loads the machine weighs on them alike), and must give the same tokens:

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

    return [
        [msg(args.first_len)] + [msg(args.turn_len) for _ in range(args.turns - 1)] for _ in range(args.conversations)
    ]


def _engine(args: argparse.Namespace, name: str, tiers: dict[str, Any]) -> LLM:
    llm = LLM(
        model=args.model,
        device=args.device,
        worker_mode="inproc",
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks * (8 if name == "device" else 1),
        max_model_len=args.max_model_len,
        **tiers,
    )
    llm.generate([[1] * args.first_len] * 2, _params(args), use_tqdm=False)  # warm up (allocators, kernels)
    return llm


def _params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)


def run(args: argparse.Namespace, engines: dict[str, LLM]) -> list[dict[str, Any]]:
    """The workload on every engine, interleaved request by request (the engines share whatever else
    loads the machine alike); the outputs must agree."""
    conversations = _conversations(args)
    history: list[list[int]] = [[] for _ in conversations]
    ttft: dict[str, list[float]] = {name: [] for name in engines}
    later_prompt_tokens = 0
    for turn in range(args.turns):
        for c, messages in enumerate(conversations):
            prompt = history[c] + messages[turn]
            outs = {name: llm.generate([prompt], _params(args), use_tqdm=False)[0] for name, llm in engines.items()}
            tokens = {tuple(o.outputs[0].token_ids) for o in outs.values()}
            assert len(tokens) == 1, f"engines disagree on conversation {c} turn {turn}"
            history[c] = prompt + list(next(iter(tokens)))
            if turn == 0:
                continue
            later_prompt_tokens += len(prompt)
            for name, o in outs.items():
                assert o.metrics is not None and o.metrics.first_token_time is not None
                ttft[name].append(o.metrics.first_token_time - o.metrics.arrival_time)
    return [_report(name, llm, ttft[name], later_prompt_tokens) for name, llm in engines.items()]


def _report(name: str, llm: LLM, ttft: list[float], later_prompt_tokens: int) -> dict[str, Any]:
    stats = llm._engine().stats()
    hits = stats.get("kv_offload_hits_per_tier", {})
    loads = max(1, stats.get("kv_offload_loads", 0))
    return {
        "engine": name,
        "device_blocks": sum(p.num_blocks for p in llm._engine().kv.pools.values()),
        "ttft_later_turns_mean_ms": round(1000 * statistics.mean(ttft), 1),
        "ttft_later_turns_median_ms": round(1000 * statistics.median(ttft), 1),
        "prefix_hit_rate": round(stats["prefix_cache_hits"] / max(1, stats["prefix_cache_queries"]), 3),
        "tier_hit_rate_later_turns": {t: round(n / max(1, later_prompt_tokens), 3) for t, n in hits.items()},
        "bytes_down": stats.get("kv_offload_bytes_down", 0),
        "bytes_up": stats.get("kv_offload_bytes_up", 0),
        "mean_load_ms": round(1000 * stats.get("kv_offload_load_seconds", 0.0) / loads, 2),
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
        tiers: dict[str, dict[str, Any]] = {
            "device": {},
            "host": {"kv_offload_host_bytes": args.host_bytes},
            "disk": {"kv_offload_disk_path": disk, "kv_offload_disk_bytes": args.disk_bytes},
            "recompute": {},
        }
        engines = {name: _engine(args, name, t) for name, t in tiers.items()}
        try:
            for row in run(args, engines):
                print(json.dumps(row), flush=True)
        finally:
            for llm in engines.values():
                llm.shutdown()


if __name__ == "__main__":
    main()
