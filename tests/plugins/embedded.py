"""Checks shared by the tests of the embedded (shipped, trained) models of both plugins.

Golden tokens are what ``tools/train_tiny.py`` reports for its fixed prompt (transformers' greedy,
by full recompute); regenerate them only with ``python tools/train_tiny.py --golden DIR`` after a new
training run, never from our own engine's output.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

GOLDEN_PROMPT = "def main():\n"


def engine_greedy(model: str, ids: list[int], n: int, **settings: Any) -> list[int]:
    from pypto_serving import LLM, SamplingParams

    with LLM(model=model, device="cpu", worker_mode="inproc", **settings) as llm:
        out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
    return list(out[0].outputs[0].token_ids)


@torch.no_grad()
def transformers_greedy(path: Path, ids: list[int], n: int, device: str = "cpu") -> list[int]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval().to(device)
    seq = list(ids)
    for _ in range(n):
        seq.append(int(model(input_ids=torch.tensor([seq], device=device)).logits[0, -1].argmax()))
    return seq[len(ids) :]


def check_shipped_directory(path: Path) -> None:
    """A Hugging Face model directory under 20 MB, with every file serving needs."""
    files = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json")
    for name in files:
        assert (path / name).is_file(), f"{path} lacks {name}"
    size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
    assert size < 20 * 2**20, f"{path} is {size / 2**20:.1f} MiB"


def tokenize(path: Path, text: str) -> list[int]:
    """``text`` in the token ids of the model directory's own tokenizer (our loader)."""
    from pypto_serving.tokenizer import load_tokenizer

    tok = load_tokenizer(path)
    assert tok is not None, f"{path} has no tokenizer"
    return tok.encode(text)


def check_golden(name: str, path: Path, prompt_ids: list[int], golden: list[int]) -> None:
    """By name and by path, our greedy tokens of the fixed prompt are the stored golden ones, and the
    prompt tokenizes as it did when they were made."""
    assert tokenize(path, GOLDEN_PROMPT) == prompt_ids
    for model in (name, str(path)):
        assert engine_greedy(model, prompt_ids, len(golden)) == golden, model


def check_serve_without_a_model(name: str, tmp_path: Path) -> None:
    """``pypto-serving serve`` with no ``--model`` serves the default embedded model: ``/v1/models``
    names it and a chat request gets non-empty text."""
    import os
    import subprocess
    import sys

    import httpx

    from tests.core.server.server_helpers import free_port, wait_for

    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYPTO_SERVING_")}
    log = tmp_path / "serve.log"
    cmd = [sys.executable, "-m", "pypto_serving.cli", "serve", "--port", str(port), "--device", "cpu"]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        assert proc.poll() is None, log.read_text()
        try:
            return httpx.get(url + "/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_for(healthy, 120, "serve with no --model")
        models = httpx.get(url + "/v1/models", timeout=10).json()
        assert [m["id"] for m in models["data"]] == [name]
        body = {"model": name, "messages": [{"role": "user", "content": "import os"}], "max_tokens": 16}
        reply = httpx.post(url + "/v1/chat/completions", json=body, timeout=60).json()
        assert reply["choices"][0]["message"]["content"].strip(), reply
    finally:
        proc.terminate()
        proc.wait(30)
    assert f"default named model {name}" in log.read_text()
