"""Held-out text for the benchmarks: the split recorded next to the shipped models.

``tools/train_tiny.py`` writes ``training_split.json`` into every model directory it trains (and
``--write-split`` into existing ones): the standard-library files the model trained on and the ones it
held out. Every benchmark (and test) that wants text the model has not seen reads the held-out list
from there, rather than re-deriving the split, so all of them agree with the training run whatever
the running interpreter's sorting or file set.
"""

from __future__ import annotations

import json
import platform
import sysconfig
import warnings
from pathlib import Path

SPLIT_FILE = "training_split.json"


def model_dir(model: str) -> Path:
    """A model directory, or the directory of the embedded model named ``model``."""
    if Path(model).is_dir():
        return Path(model)
    from pypto_serving.plugins import PluginManager

    specs = PluginManager().models.specs
    if model not in specs:
        raise SystemExit(f"{model!r} is neither a directory nor an embedded model ({', '.join(sorted(specs))})")
    return Path(specs[model][0].path)


def held_out_files(model: str | Path) -> list[Path]:
    """The held-out corpus files of ``model`` (a directory or an embedded model's name), in corpus order,
    as paths into this interpreter's standard library."""
    directory = model if isinstance(model, Path) else model_dir(model)
    record = json.loads((directory / SPLIT_FILE).read_text())
    here = f"{platform.python_implementation()} {platform.python_version()}"
    if record["python"] != here:
        warnings.warn(
            f"{directory.name} was trained on the {record['python']} standard library; this is {here}, "
            "so the held-out files' text may differ from what was held out",
            stacklevel=2,
        )
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [root / rel for rel in record["held_out_files"]]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise SystemExit(f"held-out files of {directory.name} missing from this Python: {missing[:3]}...")
    return files


def held_out_texts(model: str | Path) -> list[str]:
    """The text of each held-out file of ``model``."""
    return [f.read_text(encoding="utf-8") for f in held_out_files(model)]
