"""DeepSeek-V4 executor plugin for pypto-serving, with MTP speculative decoding."""

from __future__ import annotations

from .config import DeepseekConfigError, DeepseekV4Config, load_config, parse_config
from .executor import ARCHITECTURE, DeepseekMTPExecutor, MtpConfigError, make_executor

__all__ = [
    "ARCHITECTURE",
    "DeepseekConfigError",
    "DeepseekMTPExecutor",
    "DeepseekV4Config",
    "MtpConfigError",
    "load_config",
    "make_executor",
    "parse_config",
]
