"""``pypto-serving generate`` end to end in a subprocess on a tiny random Qwen3 with the real Qwen
tokenizer: the printed completion equals ``LLM.generate`` for the same greedy request, ``--json`` and
``--input``/``--output`` JSONL work, ``--log-level`` sets what is logged to stderr, and a missing model
directory or a checkpoint without weights fails with one error line."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pypto_serving import SamplingParams

# Every run pins the device and dtype the in-process reference (qwen_chat_llm) uses.
COMMON = ["--device", "cpu", "--dtype", "float32", "--num-kv-blocks", "64"]


def _cli(*args: str | Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYPTO_SERVING_")}
    env.update(PYTHONIOENCODING="utf-8", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    return subprocess.run(
        [sys.executable, "-m", "pypto_serving.cli", "generate", *map(str, args)],
        capture_output=True,
        text=True,
        encoding="utf-8",
        timeout=timeout,
        env=env,
        check=False,
    )


def _reference(llm: Any, prompts: list[str | list[int]], max_tokens: int) -> list[Any]:
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
    return [o.outputs[0] for o in outs]


def test_generate_prints_the_greedy_completion(qwen_chat_checkpoint: Path, qwen_chat_llm: Any) -> None:
    """The documented command line (default worker mode: a separate worker process)."""
    (ref,) = _reference(qwen_chat_llm, ["Hello"], max_tokens=5)
    assert ref.text and ref.text == qwen_chat_llm.tokenizer.decode(ref.token_ids)
    proc = _cli("--model", qwen_chat_checkpoint, "Hello", "--max-tokens", "5", "--log-level", "info", *COMMON)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == ref.text + "\n"
    # Logged like serve does, so a user sees the model load finish.
    assert re.search(r"^\S+ \S+ INFO pypto_serving\.engine: engine ready", proc.stderr, re.M), proc.stderr


def test_generate_json(qwen_chat_checkpoint: Path, qwen_chat_llm: Any) -> None:
    prompts: list[str | list[int]] = ["Hello", "你好，世界"]
    refs = _reference(qwen_chat_llm, prompts, max_tokens=4)
    proc = _cli(
        "--model",
        qwen_chat_checkpoint,
        *prompts,
        "--max-tokens",
        "4",
        "--json",
        "--worker-mode",
        "inproc",
        "--log-level",
        "warning",
        *COMMON,
    )
    assert proc.returncode == 0, proc.stderr
    assert " INFO " not in proc.stderr  # --log-level warning hides the info lines
    lines = [json.loads(line) for line in proc.stdout.splitlines()]
    assert lines == [
        {"prompt": p, "text": r.text, "token_ids": r.token_ids, "finish_reason": r.finish_reason}
        for p, r in zip(prompts, refs)
    ]
    assert all(line["finish_reason"] == "length" and len(line["token_ids"]) == 4 for line in lines)


def test_generate_jsonl_input_and_output(qwen_chat_checkpoint: Path, qwen_chat_llm: Any, tmp_path: Path) -> None:
    tok = qwen_chat_llm.tokenizer
    src = tmp_path / "prompts.jsonl"
    src.write_text(
        "\n".join(
            [
                json.dumps("def main():"),
                "",  # blank lines are skipped
                json.dumps({"prompt": "Emoji 😀 and 中文"}),
                json.dumps(tok.encode("Hello world")),
                json.dumps({"prompt_token_ids": tok.encode("<|im_start|>user\nHi<|im_end|>\n")}),
            ]
        )
        + "\n",
        encoding="utf-8",
    )
    dst = tmp_path / "out.jsonl"
    proc = _cli(
        "--model", qwen_chat_checkpoint, "Hello", "--input", src, "--output", dst,
        "--max-tokens", "3", "--worker-mode", "inproc", *COMMON,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == ""
    prompts: list[str | list[int]] = [
        "Hello",  # arguments first, then the file's lines in order
        "def main():",
        "Emoji 😀 and 中文",
        tok.encode("Hello world"),
        tok.encode("<|im_start|>user\nHi<|im_end|>\n"),
    ]
    refs = _reference(qwen_chat_llm, prompts, max_tokens=3)
    rows = [json.loads(line) for line in dst.read_text(encoding="utf-8").splitlines()]
    assert [r["prompt"] for r in rows] == prompts
    assert [(r["text"], r["token_ids"], r["finish_reason"]) for r in rows] == [
        (c.text, c.token_ids, c.finish_reason) for c in refs
    ]
    for row in rows:
        assert row["text"] == tok.decode(row["token_ids"])


def test_generate_missing_model_dir(tmp_path: Path) -> None:
    missing = tmp_path / "no_such_model"
    proc = _cli("--model", missing, "Hello", "--max-tokens", "2", "--worker-mode", "inproc", timeout=60)
    assert proc.returncode != 0
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("pypto-serving: error:")
    assert str(missing) in lines[0] and "does not exist" in lines[0]


def test_generate_checkpoint_without_weights(qwen_chat_checkpoint: Path, tmp_path: Path) -> None:
    """A valid config.json and tokenizer but no safetensors: the worker process fails to load, and
    the command says why in one line (exit 2), as serve does, instead of a traceback; the lines before
    it are the worker's log at the command's level (INFO), in the command's format."""
    import shutil

    model = tmp_path / "no_weights"
    model.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(qwen_chat_checkpoint / name, model / name)
    proc = _cli("--model", model, "Hello", "--max-tokens", "2", *COMMON, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    assert "Traceback" not in proc.stderr
    *logged, line = proc.stderr.strip().splitlines()
    assert line.startswith("pypto-serving: error: the executor failed to load") and "safetensors" in line
    assert all(re.match(r"\d{4}-\d\d-\d\d [\d:,]+ (INFO|WARNING) \S+: ", entry) for entry in logged), logged


@pytest.mark.parametrize(
    ("bad", "message"),
    [("42", r"bad\.jsonl:2: expected a string, a token-id list"), ("{", "Expecting property name")],
)
def test_generate_bad_input_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], bad: str, message: str) -> None:
    """A broken JSONL line is one error line (exit 2), raised before any model is loaded; in-process
    through ``main`` since no engine starts."""
    from pypto_serving.cli import main

    src = tmp_path / "bad.jsonl"
    src.write_text(json.dumps("fine") + "\n" + bad + "\n")
    assert main(["generate", "--input", str(src), "--model", str(tmp_path / "unused")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("pypto-serving: error:")
    assert re.search(message, err[0])
