"""Registers the Qwen test fixtures (defined in :mod:`qwen_fixtures`) for this folder."""

from __future__ import annotations

import pytest

pytest.importorskip("pypto_serving_qwen", reason="plugin qwen (pip install pypto-serving-qwen) not installed")

from tests.plugins.qwen.qwen_fixtures import (  # noqa: F401 - re-exported as fixtures
    batch_builder,
    hf_reference,
    qwen_chat_checkpoint,
    qwen_chat_llm,
    qwen_checkpoints,
    qwen_tiktoken_reference,
    qwen_tokenizer_dir,
)
