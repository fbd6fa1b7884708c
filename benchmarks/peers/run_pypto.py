"""pypto-serving through its offline ``LLM`` API, with the project's own python: greedy,
``ignore_eos``, prefix caching off, the job's ``scheduler`` (sync or async) and ``threads`` worker
threads, on the job's ``device`` (the engine's default where unset); everything else (the KV cache size
too) the engine's defaults, except on an accelerator, where the KV cache takes 0.9 of the device's
memory (``gpu_memory_utilization``, vLLM's default) instead of the fixed 512 MiB.

    python benchmarks/peers/run_pypto.py JOB.json OUT.json
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common


def load(job: dict) -> _common.Generate:
    from pypto_serving import LLM, SamplingParams

    device = job.get("device")
    placed = {} if device is None else {"device": device}
    if device not in (None, "cpu"):
        placed["gpu_memory_utilization"] = 0.9
    llm = LLM(
        model=job["model"],
        scheduler=job.get("scheduler", "sync"),
        dtype=job.get("dtype", "float32"),
        max_num_seqs=job.get("max_num_seqs", 64),
        worker_threads=job.get("threads", 2),
        enable_prefix_caching=False,
        log_level="warning",
        # The engine's own KV cache size unless the job names one (an unset size fits the batch on
        # the CPU: devices.cpu_kv_cache_memory).
        **({"kv_cache_memory": job["kv_cache_memory"]} if "kv_cache_memory" in job else {}),
        **placed,
    )

    def generate(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    return generate


def main() -> None:
    import pypto_serving

    job, out = _common.read_job()
    name = f"pypto-serving-{job.get('scheduler', 'sync')}"
    _common.run(name, pypto_serving.__version__, lambda: load(job), job, out)


if __name__ == "__main__":
    main()
