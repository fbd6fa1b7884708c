"""Files of a Hugging Face model directory that every executor reads the same way.

``generation_config.json`` holds the checkpoint's end-of-sequence ids and its sampling defaults;
executors report both through :class:`~pypto_serving.ExecutorInfo`, and the engine and the server
apply the defaults to requests that leave those fields unset (:func:`sampling_defaults`).
``config.json`` bounds the context length a checkpoint was trained for (:func:`check_max_model_len`).
A model that is neither a directory nor a named model fails with the closest name
(:func:`check_model_exists`). Named models derived from another (a quantized copy of an embedded
model) are written at first use under :func:`model_cache_dir` (:func:`write_model_dir`).
"""

from __future__ import annotations

import difflib
import json
import os
import shutil
import tempfile
import uuid
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .config import SettingsError

if TYPE_CHECKING:
    from .config import ServingSettings

__all__ = [
    "GENERATION_CONFIG_KEYS",
    "check_max_model_len",
    "check_model_exists",
    "checkpoint_max_len",
    "model_cache_dir",
    "read_generation_config",
    "sampling_defaults",
    "write_model_dir",
]

# The SamplingParams fields a checkpoint may default, under the names generation_config.json uses.
GENERATION_CONFIG_KEYS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)


def read_generation_config(model_dir: str | Path) -> tuple[list[int], dict[str, Any]]:
    """``(eos token ids, sampling defaults)`` from ``model_dir/generation_config.json``.

    The defaults hold the :data:`GENERATION_CONFIG_KEYS` the file sets to a value (``null`` counts as
    unset); both are empty when the file is absent. A file that is not a JSON object, or whose
    ``eos_token_id`` is neither an int nor a list of ints, raises ``ValueError`` naming it."""
    path = Path(model_dir).expanduser() / "generation_config.json"
    if not path.is_file():
        return [], {}
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path} must hold a JSON object")
    eos = raw.get("eos_token_id")
    if isinstance(eos, int) and not isinstance(eos, bool):
        eos = [eos]
    elif eos is None:
        eos = []
    elif not (isinstance(eos, list) and all(isinstance(e, int) and not isinstance(e, bool) for e in eos)):
        raise ValueError(f"{path}: eos_token_id must be an int or a list of ints, got {eos!r}")
    return list(eos), sampling_defaults(raw)


def sampling_defaults(values: Mapping[str, Any]) -> dict[str, Any]:
    """The :data:`GENERATION_CONFIG_KEYS` of ``values`` that are set: the keyword arguments of
    ``SamplingParams`` a checkpoint's defaults (``ExecutorInfo.generation_defaults``) supply."""
    return {k: values[k] for k in GENERATION_CONFIG_KEYS if values.get(k) is not None}


def check_model_exists(model: str, named_models: Iterable[str]) -> None:
    """Raise :class:`SettingsError` when ``model`` is neither an existing path nor one of
    ``named_models``; the message names the closest named model (a mistyped ``tiny-qwen`` is
    ``tiny-qwen3``) and the command that lists them."""
    if Path(model).expanduser().exists():
        return
    names = sorted(named_models)
    if model in names:
        return
    close = difflib.get_close_matches(model, names, n=1, cutoff=0.6)
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise SettingsError(
        f"model {model!r} does not exist: it is neither a directory nor a named model; {hint}"
        f"'pypto-serving models' lists the named models ({', '.join(names) or 'none installed'})"
    )


# Positions a rope_scaling of these types stretches by its factor (YaRN, linear and dynamic NTK
# interpolation); other types (llama3, longrope) already state the stretched length.
_STRETCHING_ROPE = ("yarn", "linear", "dynamic")


def checkpoint_max_len(model_dir: str | Path) -> int | None:
    """The longest sequence ``config.json`` says the model handles: ``max_position_embeddings``,
    stretched by a YaRN / linear / dynamic ``rope_scaling`` (``rope_parameters``) factor over its
    ``original_max_position_embeddings`` where given. None when the file does not say."""
    path = Path(model_dir).expanduser() / "config.json"
    if not path.is_file():
        return None
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError:
        return None  # the executor reports the broken file when it loads it
    cfg = raw.get("text_config", raw) if isinstance(raw, dict) else {}
    limit = cfg.get("max_position_embeddings") if isinstance(cfg, dict) else None
    if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
        return None
    scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}  # transformers 5 renamed it
    kind = scaling.get("rope_type", scaling.get("type")) if isinstance(scaling, dict) else None
    factor = scaling.get("factor") if kind in _STRETCHING_ROPE else None
    if isinstance(factor, int | float) and factor > 1:
        base = scaling.get("original_max_position_embeddings") or limit
        limit = max(limit, int(base * factor))
    return limit


def check_max_model_len(settings: ServingSettings) -> None:
    """Refuse a ``max_model_len`` beyond what the checkpoint was trained for (positions past it give
    wrong outputs) unless ``allow_long_max_model_len`` is set."""
    asked = settings.max_model_len
    if asked is None or settings.model is None or settings.allow_long_max_model_len:
        return
    limit = checkpoint_max_len(settings.model)
    if limit is not None and asked > limit:
        raise SettingsError(
            f"max_model_len={asked} is longer than the model's {limit} positions (max_position_embeddings in "
            f"{Path(settings.model) / 'config.json'}); lower max_model_len, or set allow_long_max_model_len=true "
            f"(--allow-long-max-model-len true) if the model handles longer sequences"
        )


#: The file in a written model directory that records what it was written from.
SOURCE_STAMP = ".pypto-serving-source"


def model_cache_dir() -> Path:
    """Where named models written at first use live: ``$XDG_CACHE_HOME/pypto-serving/models``, or
    ``~/.cache/pypto-serving/models`` when ``XDG_CACHE_HOME`` is unset."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base).expanduser() / "pypto-serving" / "models"


def write_model_dir(dest: str | Path, source_key: str, write: Callable[[Path], object]) -> Path:
    """``dest``, written by ``write(directory)`` unless it already holds ``source_key``'s copy.

    ``source_key`` names what the copy derives from (e.g. a hash of the source files and of the
    writer's version): a directory written from another source is replaced. The copy is written into
    a temporary directory beside ``dest`` and renamed into place, so a reader (or a second process
    writing the same copy) never sees a half-written model."""
    dest = Path(dest)
    if _holds(dest, source_key):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        write(tmp)
        (tmp / SOURCE_STAMP).write_text(source_key)
        _swap_in(tmp, dest, source_key)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def _holds(dest: Path, source_key: str) -> bool:
    stamp = dest / SOURCE_STAMP
    return stamp.is_file() and stamp.read_text() == source_key


def _swap_in(tmp: Path, dest: Path, source_key: str) -> None:
    """Rename ``tmp`` to ``dest``, moving a stale ``dest`` away first; a racing writer's finished copy
    of the same source is kept instead."""
    if _holds(dest, source_key):
        return
    if dest.exists():
        old = dest.with_name(f".{dest.name}.old-{uuid.uuid4().hex}")
        dest.rename(old)
        shutil.rmtree(old, ignore_errors=True)
    try:
        tmp.rename(dest)
    except OSError:
        if not _holds(dest, source_key):
            raise
