"""pluggy registration of the DeepSeek-V4 (MTP) executor and the embedded ``tiny-deepseek-v4`` model."""

from __future__ import annotations

from pathlib import Path

from pypto_serving import ExecutorSpec, ModelSpec, hookimpl, model_cache_dir, write_model_dir

from .encoding import DeepSeekV4ChatEncoder
from .executor import ARCHITECTURE, make_executor

#: The embedded model's directory (package data; trained by tools/train_tiny.py, docs/training.md).
TINY_DEEPSEEK_V4 = Path(__file__).resolve().parent / "models" / "tiny-deepseek-v4"
#: The embedded model in DeepSeek-V4's release layout, written at first use (:mod:`.release`).
TINY_DEEPSEEK_V4_FP8 = "tiny-deepseek-v4-fp8"


def write_tiny_fp8(dest: Path) -> Path:
    """``dest`` holding the embedded model in the release layout, written unless it already does."""
    from .release import source_key, write_release_layout

    return write_model_dir(dest, source_key(TINY_DEEPSEEK_V4), lambda d: write_release_layout(TINY_DEEPSEEK_V4, d))


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
    fp8 = model_cache_dir() / TINY_DEEPSEEK_V4_FP8
    return [
        ModelSpec(
            name="tiny-deepseek-v4",
            path=str(TINY_DEEPSEEK_V4),
            description="DeepSeek-V4 with one trained MTP layer, 4.2M parameters trained on the Python "
            "standard library's source (a CPU demo)",
            priority=10,
        ),
        ModelSpec(
            name=TINY_DEEPSEEK_V4_FP8,
            path=str(fp8),
            description="tiny-deepseek-v4 as DeepSeek-V4 is released: FP8 weights with UE8M0 block scales, "
            "MXFP4 experts, DeepSeek's names (written at first use)",
            prepare=lambda: write_tiny_fp8(fp8),
        ),
    ]


@hookimpl
def pypto_serving_chat_encoder(architecture: str, model_dir: str) -> DeepSeekV4ChatEncoder | None:
    # The release ships its chat format as code, not a template: a DeepSeek-V4 checkpoint without a
    # chat template renders chats with it (the core asks only when the template is missing).
    del model_dir
    return DeepSeekV4ChatEncoder() if architecture == ARCHITECTURE else None
