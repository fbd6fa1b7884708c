"""Entry point of the ``pypto_serving`` plugin group: registers the ``qwen`` executor and the
embedded ``tiny-qwen3`` model."""

from __future__ import annotations

from pathlib import Path

from pypto_serving import Executor, ExecutorSpec, ModelSpec, ServingSettings, hookimpl

from .loader import SUPPORTED_ARCHITECTURES

__all__ = ["TINY_QWEN3", "make_executor", "pypto_serving_register_executors", "pypto_serving_register_models"]

#: The embedded model's directory (package data; trained by tools/train_tiny.py, docs/training.md).
TINY_QWEN3 = Path(__file__).resolve().parent / "models" / "tiny-qwen3"


def make_executor(settings: ServingSettings) -> Executor:
    """Executor factory; module level so the spawned worker process can import it by reference."""
    # Imported lazily: the engine process only needs the descriptor, the worker builds the model.
    from .executor import QwenExecutor

    return QwenExecutor(settings)


@hookimpl
def pypto_serving_register_executors() -> list[ExecutorSpec]:
    return [
        ExecutorSpec(
            name="qwen",
            factory=make_executor,
            architectures=SUPPORTED_ARCHITECTURES,
            description="Qwen2 / Qwen3 / Qwen3-MoE on pypto-kernels (paged KV, mixed prefill+decode)",
        )
    ]


@hookimpl
def pypto_serving_register_models() -> list[ModelSpec]:
    return [
        ModelSpec(
            name="tiny-qwen3",
            path=str(TINY_QWEN3),
            description="Qwen3, 1.8M parameters trained on the Python standard library's source (a CPU demo)",
            priority=5,
        )
    ]
