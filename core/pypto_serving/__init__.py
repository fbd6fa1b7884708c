"""pypto-serving: an LLM serving engine with a pluggy plugin contract.

Public API: :class:`LLM` (offline generation), :class:`SamplingParams`, :class:`RequestOutput`,
:class:`ServingSettings`, and the plugin surface (:data:`hookimpl`, the ``*Spec`` descriptors, the
:class:`Executor` contract, the :class:`StrategyHost` / :class:`StepStrategy` seam with the
:class:`SchedulerOutput` and :class:`StepResult` a strategy passes along, :data:`SpecPolicy`, and the
:class:`ToolParserSpec` / :class:`ReasoningParserSpec` of the server's output parsers in
:mod:`pypto_serving.parsers`).
"""

from .config import ServingSettings, SettingsError
from .engine import LLM, EngineCore, EngineDeadError
from .executor import BatchInput, CacheGroupSpec, Executor, ExecutorInfo
from .hookspecs import (
    ExecutorSpec,
    ModelSpec,
    ReasoningParserSpec,
    SchedulerSpec,
    SpecPolicySpec,
    ToolParserSpec,
    hookimpl,
)
from .messages import StepResult
from .model_files import read_generation_config
from .plugins import PluginError, PluginManager
from .request import CompletionOutput, Request, RequestOutput, SamplingParams
from .scheduler import SchedulerOutput
from .speculative import SpecPolicy
from .strategy import StepStrategy, StrategyHost

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "BatchInput",
    "CacheGroupSpec",
    "CompletionOutput",
    "EngineCore",
    "EngineDeadError",
    "Executor",
    "ExecutorInfo",
    "ExecutorSpec",
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
    "StepResult",
    "StepStrategy",
    "StrategyHost",
    "ToolParserSpec",
    "__version__",
    "hookimpl",
    "read_generation_config",
]
