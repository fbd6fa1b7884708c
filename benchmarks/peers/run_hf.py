"""HF transformers peer: batched greedy ``generate`` (left padding, all prompts in batches of
``max_num_seqs``), EOS ignored (no eos_token_id), the job's precision (float32 or bfloat16),
``threads`` intra-op threads, on the job's ``device`` (default the CPU).

    /work/peers/hf/bin/python benchmarks/peers/run_hf.py JOB.json OUT.json
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common


def load(job: dict) -> _common.Generate:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(job.get("threads", 2))
    dtype = torch.bfloat16 if job.get("precision") == "bfloat16" else torch.float32
    device = job.get("device", "cpu")
    model = AutoModelForCausalLM.from_pretrained(job["model"], dtype=dtype).eval().to(device)
    pad = 151643 if model.config.vocab_size > 151643 else 0
    batch = job.get("max_num_seqs", 64)

    def generate_batch(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=pad,
            )
        return [row[width:].tolist() for row in out]

    def generate(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        return [o for i in range(0, len(prompts), batch) for o in generate_batch(prompts[i : i + batch], max_tokens)]

    return generate


def main() -> None:
    import transformers

    job, out = _common.read_job()
    _common.run("hf-transformers", transformers.__version__, lambda: load(job), job, out)


if __name__ == "__main__":
    main()
