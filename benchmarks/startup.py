"""Start-up to the first request: construct ``LLM`` (worker spawn, weights, KV cache) and generate one token.

python benchmarks/startup.py /work/models/qwen3-0.6b            # 6 GiB KV cache
"""

from __future__ import annotations

import sys
import time

from pypto_serving import LLM, SamplingParams

if __name__ == "__main__":  # the worker process imports this file
    t0 = time.perf_counter()
    llm = LLM(model=sys.argv[1], kv_cache_memory=6 << 30, dtype="float32", scheduler="sync")
    t1 = time.perf_counter()
    llm.generate([[100, 200, 300]], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    t2 = time.perf_counter()
    print(f"construct {t1 - t0:.2f} s, first request {t2 - t1:.2f} s, total {t2 - t0:.2f} s")
    llm.shutdown()
