"""Prefix-cache hit rate on DeepSeek-V4's hybrid caches: a shared-system-prompt workload.

One request computes the system prompt (plus its own question), an unrelated request then evicts the
first ``swa`` (sliding-window) blocks of that chain, and ``--requests`` requests sharing the system
prompt arrive together. Prints the prefix-cache hit rate of those requests (hit tokens / prompt
tokens), the hits each cache group alone could have served, and their wall time.

``--rule chain`` emulates the rule before exact hybrid hits in this checkout (every group's whole
chain of blocks from block 0, MTP groups excepted); run on a checkout without exact hybrid hits, the
script measures that version as it is. Uses only the public API, so it runs on any version::

    python benchmarks/hybrid_prefix.py                 # the embedded tiny DeepSeek-V4, MTP k = 1
    python benchmarks/hybrid_prefix.py --rule chain
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

from pypto_serving import LLM, SamplingParams


def _chain_rule() -> None:
    """Make every group except the MTP ones need its whole chain from block 0 (the old rule)."""
    from pypto_serving.executor import CacheGroupSpec

    exact = CacheGroupSpec.hit_lookback

    def chain(self: CacheGroupSpec) -> int | None:
        return 0 if exact.fget(self) == 0 else None  # type: ignore[attr-defined]

    CacheGroupSpec.hit_lookback = property(chain)  # type: ignore[method-assign,assignment]


def run(args: argparse.Namespace) -> dict[str, Any]:
    from pypto_serving_deepseek_mtp.plugin import TINY_DEEPSEEK_V4

    if args.rule == "chain":
        _chain_rule()
    rng = random.Random(0)
    system = [rng.randrange(3, 1000) for _ in range(args.system_len)]

    def tail() -> list[int]:
        return [rng.randrange(3, 1000) for _ in range(args.tail_len)]

    spec = {"method": "mtp", "num_speculative_tokens": args.mtp, "policy": "fixed"} if args.mtp else None
    llm = LLM(
        model=str(TINY_DEEPSEEK_V4),
        device="cpu",
        dtype="float32",
        worker_mode="inproc",
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        speculative_config=spec,
    )
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    try:
        engine = llm.engine
        assert engine is not None
        llm.generate([system + tail()], params, use_tqdm=False)
        llm.generate([[rng.randrange(3, 1000) for _ in range(args.filler_len)]], params, use_tqdm=False)
        before = engine.stats()
        prompts = [system + tail() for _ in range(args.requests)]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0
        after = engine.stats()
    finally:
        llm.shutdown()
    queries = after["prefix_cache_queries"] - before["prefix_cache_queries"]
    hits = after["prefix_cache_hits"] - before["prefix_cache_hits"]
    groups = {
        g: n - before.get("prefix_cache_hits_per_group", {}).get(g, 0)
        for g, n in after.get("prefix_cache_hits_per_group", {}).items()
    }
    served = sum(o.num_cached_tokens or 0 for o in outs) / sum(len(p) for p in prompts)
    rate = hits / queries if queries else 0.0
    drafted = after["spec_drafted"] - before["spec_drafted"]
    accepted = after["spec_accepted"] - before["spec_accepted"]
    return {
        "served": served,
        "queries": queries,
        "hits": hits,
        "rate": rate,
        "groups": groups,
        "wall": wall,
        "drafted": drafted,
        "accepted": accepted,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--system-len", type=int, default=300)
    ap.add_argument("--tail-len", type=int, default=20)
    ap.add_argument("--filler-len", type=int, default=300, help="the unrelated request that evicts early blocks")
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=2)
    ap.add_argument("--block-size", type=int, default=4)
    ap.add_argument("--num-kv-blocks", type=int, default=128, help="per cache group")
    ap.add_argument("--mtp", type=int, default=1, help="MTP draft tokens (0: off)")
    ap.add_argument("--rule", choices=["exact", "chain"], default="exact")
    args = ap.parse_args()
    out = run(args)
    print(f"rule={args.rule} mtp={args.mtp}: {out['served']:.1%} of the prompt tokens served from the prefix cache")
    print(f"  engine hit rate {out['rate']:.1%} ({out['hits']} of {out['queries']} looked-up prompt tokens)")
    if out["queries"]:
        print("  per group (alone):", ", ".join(f"{g} {n / out['queries']:.0%}" for g, n in out["groups"].items()))
    print(f"  {args.requests} requests in {out['wall']:.2f} s")
    print(f"  drafts verified {out['drafted']}, accepted {out['accepted']}")


if __name__ == "__main__":
    main()
