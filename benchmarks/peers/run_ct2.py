"""CTranslate2 peer: the checkpoint converted once with ``ct2-transformers-converter`` (float32, or
the job's ``ct2_quantization``, e.g. ``int8``: int8 weights run with ``compute_type="int8"``;
cached under the job's ``work_dir``), then ``Generator.generate_batch`` greedy with the prompt
forwarded at once (``include_prompt_in_result=False``), EOS ignored (``end_token=[]``).

    /work/peers/ct2/bin/python benchmarks/peers/run_ct2.py JOB.json OUT.json
"""

from __future__ import annotations

import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common


def convert(model: str, work_dir: str, quantization: str = "float32") -> str:
    suffix = "" if quantization == "float32" else "-" + quantization
    out = os.path.join(work_dir, "ct2-" + os.path.basename(os.path.normpath(model)) + suffix)
    if not os.path.isfile(os.path.join(out, "model.bin")):
        converter = os.path.join(os.path.dirname(sys.executable), "ct2-transformers-converter")
        cmd = [converter, "--model", model, "--output_dir", out, "--quantization", quantization, "--force"]
        subprocess.run(cmd, check=True, stdout=sys.stderr)
    return out


def load(job: dict) -> _common.Generate:
    import ctranslate2
    from tokenizers import Tokenizer

    quantization = job.get("ct2_quantization", "float32")
    path = convert(job["model"], job.get("work_dir", "/tmp"), quantization)
    gen = ctranslate2.Generator(path, device="cpu", intra_threads=job.get("threads", 2), compute_type=quantization)
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
