"""pypto-serving: an LLM serving engine with a pluggy plugin contract.

Public API: :class:`LLM` (offline generation), :class:`SamplingParams`, :class:`RequestOutput`,
:class:`ServingSettings`, and the plugin surface (:data:`hookimpl`, the ``*Spec`` descriptors, the
:class:`Executor` contract with the :class:`DraftSampler` it drafts with and the :class:`StepInterrupt`
that ends its greedy loops early, the :class:`StrategyHost` /
:class:`StepStrategy` seam with the :class:`SchedulerOutput` and :class:`StepResult` a strategy passes
along, :data:`SpecPolicy` with the :class:`StepObservation` a policy observes, and the
:class:`ToolParserSpec` / :class:`ReasoningParserSpec` of the server's output parsers).

Besides this root, plugins import the ``__all__`` of five public submodules:
:mod:`pypto_serving.parallel`, :mod:`pypto_serving.quantization`, :mod:`pypto_serving.parsers`,
:mod:`pypto_serving.kv_transfer` and :mod:`pypto_serving.lora_weights`
(see docs/plugins.md, "The public surface"); every other module is internal.
"""

from .config import ServingSettings, SettingsError
from .engine import LLM, EngineCore, EngineDeadError
from .executor import BatchInput, CacheGroupSpec, Executor, ExecutorInfo, LoopDraw, StepInterrupt
from .hookspecs import (
    ExecutorSpec,
    KVConnectorSpec,
    ModelSpec,
    ReasoningParserSpec,
    SchedulerSpec,
    SpecPolicySpec,
    ToolParserSpec,
    hookimpl,
)
from .messages import StepResult
from .model_files import model_cache_dir, read_generation_config, write_model_dir
from .plugins import PluginError, PluginManager
from .request import CompletionOutput, Request, RequestOutput, SamplingParams
from .sampler import argmax_rows
from .scheduler import SchedulerOutput
from .spec_decode import DraftSampler
from .spec_policy import SpecPolicy, StepObservation
from .strategy import StepStrategy, StrategyHost

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "BatchInput",
    "CacheGroupSpec",
    "CompletionOutput",
    "DraftSampler",
    "EngineCore",
    "EngineDeadError",
    "Executor",
    "ExecutorInfo",
    "ExecutorSpec",
    "KVConnectorSpec",
    "LoopDraw",
    "ModelSpec",
    "PluginError",
    "PluginManager",
    "ReasoningParserSpec",
    "Request",
    "RequestOutput",
    "SamplingParams",
    "SchedulerOutput",
    "SchedulerSpec",
    "ServingSettings",
    "SettingsError",
    "SpecPolicy",
    "SpecPolicySpec",
    "StepInterrupt",
    "StepObservation",
    "StepResult",
    "StepStrategy",
    "StrategyHost",
    "ToolParserSpec",
    "__version__",
    "argmax_rows",
    "hookimpl",
    "model_cache_dir",
    "read_generation_config",
    "write_model_dir",
]
