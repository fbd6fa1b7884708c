"""pluggy registration of the DeepSeek-V4 (MTP) executor and the embedded ``tiny-deepseek-v4`` model."""

from __future__ import annotations

from pathlib import Path

from pypto_serving import ExecutorSpec, ModelSpec, hookimpl

from .encoding import DeepSeekV4ChatEncoder
from .executor import ARCHITECTURE, make_executor

#: The embedded model's directory (package data; trained by tools/train_tiny.py, docs/training.md).
TINY_DEEPSEEK_V4 = Path(__file__).resolve().parent / "models" / "tiny-deepseek-v4"


@hookimpl
def pypto_serving_register_executors() -> list[ExecutorSpec]:
    return [
        ExecutorSpec(
            name="deepseek_mtp",
            factory=make_executor,
            architectures=(ARCHITECTURE,),
            description="DeepSeek-V4 hybrid attention (sliding / CSA / HCA), mHC, MoE, with MTP drafting.",
        )
    ]


@hookimpl
def pypto_serving_register_models() -> list[ModelSpec]:
    # The default model: the product's own architecture, with a trained MTP layer for speculation.
    return [
        ModelSpec(
            name="tiny-deepseek-v4",
            path=str(TINY_DEEPSEEK_V4),
            description="DeepSeek-V4 with one trained MTP layer, 4.2M parameters trained on the Python "
            "standard library's source (a CPU demo)",
            priority=10,
        )
    ]


@hookimpl
def pypto_serving_chat_encoder(architecture: str, model_dir: str) -> DeepSeekV4ChatEncoder | None:
    # The release ships its chat format as code, not a template: a DeepSeek-V4 checkpoint without a
    # chat template renders chats with it (the core asks only when the template is missing).
    del model_dir
    return DeepSeekV4ChatEncoder() if architecture == ARCHITECTURE else None
