"""Files of a Hugging Face model directory that every executor reads the same way.

``generation_config.json`` holds the checkpoint's end-of-sequence ids and its sampling defaults;
executors report both through :class:`~pypto_serving.ExecutorInfo`, and the engine and the server
apply the defaults to requests that leave those fields unset (:func:`sampling_defaults`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["GENERATION_CONFIG_KEYS", "read_generation_config", "sampling_defaults"]

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
