"""The OpenAI-compatible HTTP server: :func:`build_app` over an :class:`AsyncLLM` (engine thread)."""

from .app import build_app, served_model_name
from .async_llm import AsyncLLM, EngineFailure

__all__ = ["AsyncLLM", "EngineFailure", "build_app", "served_model_name"]
