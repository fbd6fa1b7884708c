"""CTranslate2 peer: the checkpoint converted once with ``ct2-transformers-converter`` to the job's
precision (float32, bfloat16 or int8: int8 weights, activations quantised at run time; cached under
the job's ``work_dir``) and run in it, then ``Generator.generate_batch`` greedy with the prompt
forwarded at once (``include_prompt_in_result=False``), EOS ignored (``end_token=[]``).

    /work/peers/ct2/bin/python benchmarks/peers/run_ct2.py JOB.json OUT.json
"""

from __future__ import annotations

import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common


def convert(model: str, work_dir: str, precision: str) -> str:
    out = os.path.join(work_dir, f"ct2-{precision}-" + os.path.basename(os.path.normpath(model)))
    if not os.path.isfile(os.path.join(out, "model.bin")):
        converter = os.path.join(os.path.dirname(sys.executable), "ct2-transformers-converter")
        cmd = [converter, "--model", model, "--output_dir", out, "--quantization", precision, "--force"]
        subprocess.run(cmd, check=True, stdout=sys.stderr)
    return out


def load(job: dict) -> _common.Generate:
    import ctranslate2
    from tokenizers import Tokenizer

    precision = job.get("precision", "float32")
    supported = ctranslate2.get_supported_compute_types("cpu")
    if precision not in supported:  # bfloat16 on CPUs without it: the Generator would refuse to load
        raise _common.Unsupported(f"no {precision} compute type on this CPU (it has {', '.join(sorted(supported))})")
    path = convert(job["model"], job.get("work_dir", "/tmp"), precision)
    gen = ctranslate2.Generator(path, device="cpu", intra_threads=job.get("threads", 2), compute_type=precision)
    tok = Tokenizer.from_file(os.path.join(job["model"], "tokenizer.json"))
    batch = job.get("max_num_seqs", 64)

    def generate(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        tokens = [[tok.id_to_token(t) for t in p] for p in prompts]
        results = gen.generate_batch(
            tokens,
            max_batch_size=batch,
            max_length=max_tokens,
            sampling_topk=1,
            include_prompt_in_result=False,
            end_token=[],
        )
        return [list(r.sequences_ids[0]) for r in results]

    return generate


def main() -> None:
    import ctranslate2

    job, out = _common.read_job()
    _common.run("ctranslate2", ctranslate2.__version__, lambda: load(job), job, out)


if __name__ == "__main__":
    main()
