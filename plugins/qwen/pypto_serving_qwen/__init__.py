"""pypto-serving executor plugin for Qwen2, Qwen3 and Qwen3-MoE checkpoints."""

from __future__ import annotations

from .loader import SUPPORTED_ARCHITECTURES, CheckpointError, QwenConfig, read_config

__version__ = "0.1.0"

__all__ = ["SUPPORTED_ARCHITECTURES", "CheckpointError", "QwenConfig", "__version__", "read_config"]
