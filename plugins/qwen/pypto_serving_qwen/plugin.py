"""Entry point of the ``pypto_serving`` plugin group: registers the ``qwen`` executor."""

from __future__ import annotations

from pypto_serving import Executor, ExecutorSpec, ServingSettings, hookimpl

from .loader import SUPPORTED_ARCHITECTURES

__all__ = ["make_executor", "pypto_serving_register_executors"]


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
