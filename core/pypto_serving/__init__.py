"""pypto-serving: an LLM serving engine with a pluggy plugin contract.

Public API: :class:`LLM` (offline generation), :class:`SamplingParams`, :class:`RequestOutput`,
:class:`ServingSettings`, and the plugin surface (:data:`hookimpl`, the ``*Spec`` descriptors and the
:class:`Executor` contract).
"""

from .config import ServingSettings, SettingsError
from .engine import LLM, EngineCore, EngineDeadError
from .executor import BatchInput, CacheGroupSpec, Executor, ExecutorInfo
from .hookspecs import ExecutorSpec, SchedulerSpec, SpecPolicySpec, hookimpl
from .model_files import read_generation_config
from .plugins import PluginError, PluginManager
from .request import CompletionOutput, RequestOutput, SamplingParams

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
    "PluginError",
    "PluginManager",
    "RequestOutput",
    "SamplingParams",
    "SchedulerSpec",
    "ServingSettings",
    "SettingsError",
    "SpecPolicySpec",
    "__version__",
    "hookimpl",
    "read_generation_config",
]
