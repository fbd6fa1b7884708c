"""Registers the Qwen test fixtures (defined in :mod:`qwen_fixtures`) for this folder."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("pypto_serving_qwen", reason="plugin qwen (pip install pypto-serving-qwen) not installed")

# Explicit so the helpers import the same way under any pytest import mode.
sys.path.insert(0, str(Path(__file__).resolve().parent))

from qwen_fixtures import (  # noqa: F401 - re-exported as fixtures
    batch_builder,
    hf_reference,
    qwen_chat_checkpoint,
    qwen_chat_llm,
    qwen_checkpoints,
    qwen_tiktoken_reference,
    qwen_tokenizer_dir,
)
