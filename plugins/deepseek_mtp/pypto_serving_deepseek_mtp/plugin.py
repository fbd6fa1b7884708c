"""pluggy registration of the DeepSeek-V4 (MTP) executor."""

from __future__ import annotations

from pypto_serving import ExecutorSpec, hookimpl

from .executor import ARCHITECTURE, make_executor


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
