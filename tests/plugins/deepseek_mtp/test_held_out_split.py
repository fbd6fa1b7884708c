"""One held-out split: the one ``tools/train_tiny.py`` trained the embedded models with, recorded next to
each model (``training_split.json``), and the one every benchmark reads (``benchmarks/held_out.py``)."""

from __future__ import annotations

import importlib.util
import json
import platform
import re
import sys
from pathlib import Path

import pytest

from pypto_serving_deepseek_mtp.plugin import TINY_DEEPSEEK_V4
from tests.scripts import load_script

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))  # benchmarks.* (the benchmarks do the same for themselves)

from benchmarks import held_out, speculation  # noqa: E402


def _shipped() -> list[Path]:
    dirs = [TINY_DEEPSEEK_V4]
    if importlib.util.find_spec("pypto_serving_qwen") is not None:
        from pypto_serving_qwen.plugin import TINY_QWEN3

        dirs.append(TINY_QWEN3)
    return dirs


def _train_tiny() -> object:
    return load_script("tools/train_tiny.py")


@pytest.mark.parametrize("model_dir", _shipped(), ids=lambda p: p.name)
def test_each_shipped_model_records_the_split_it_trained_with(model_dir: Path) -> None:
    record = json.loads((model_dir / held_out.SPLIT_FILE).read_text())
    assert record["train_files"] and record["held_out_files"]
    assert not set(record["train_files"]) & set(record["held_out_files"])
    here = f"{platform.python_implementation()} {platform.python_version()}"
    if record["python"] != here:
        pytest.skip(f"the models trained on the {record['python']} standard library; this is {here}")
    train_tiny = _train_tiny()
    assert record == train_tiny.split_record(train_tiny.corpus_files())  # type: ignore[attr-defined]


def _fake_model(tmp_path: Path, files: list[str]) -> Path:
    record = {"python": f"{platform.python_implementation()} {platform.python_version()}", "held_out_files": files}
    (tmp_path / held_out.SPLIT_FILE).write_text(json.dumps(record))
    return tmp_path


def test_the_benchmarks_read_the_recorded_split(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Prompts come from the files the record lists, whatever they are, not from a split re-derived
    from the standard library: a record naming two files that no rule would pick gives prompts from
    those two only; and no benchmark holds a split rule of its own."""
    model = _fake_model(tmp_path, ["json/decoder.py", "textwrap.py"])
    texts = held_out.held_out_texts(model)
    assert [t.splitlines()[0] for t in texts] == [f.read_text().splitlines()[0] for f in held_out.held_out_files(model)]
    monkeypatch.setattr(speculation, "held_out_texts", lambda name: held_out.held_out_texts(model))
    snippets = speculation.held_out_code(8, 12)
    assert snippets and all(any(s in t for t in texts) for s in snippets)
    for bench in sorted((ROOT / "benchmarks").glob("*.py")):
        if bench.name != "held_out.py":
            source = bench.read_text()
            assert not re.search(r"% *50\b|HELD_OUT_EVERY|rglob\(\"\*\.py\"\)", source), bench.name
    assert "held_out_texts(" in (ROOT / "benchmarks" / "mtp.py").read_text()


def test_a_split_for_another_python_warns_and_missing_files_refuse(tmp_path: Path) -> None:
    record = {"python": "CPython 0.0", "held_out_files": ["no/such/file.py"]}
    (tmp_path / held_out.SPLIT_FILE).write_text(json.dumps(record))
    with pytest.warns(UserWarning, match="CPython 0.0"), pytest.raises(SystemExit, match="missing"):
        held_out.held_out_files(tmp_path)
