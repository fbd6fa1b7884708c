"""The plugin contract of pypto-serving.

Plugins are pluggy hook implementations registered under the entry-point group ``pypto_serving``.
Each registration hook returns *descriptors* (small dataclasses); the core picks one by the name the
settings give. A plugin module typically looks like::

    from pypto_serving import hookimpl, ExecutorSpec

    @hookimpl
    def pypto_serving_register_executors():
        return [ExecutorSpec(name="mine", factory=make_executor, architectures=("MyForCausalLM",))]

Every hook is called through pluggy: implementations run last registered first, ``tryfirst`` /
``trylast`` reorder them and wrappers (``hookwrapper=True`` or ``wrapper=True``) wrap them. The
``register`` hooks are called once per implementing plugin, so that each descriptor is attributed to
its plugin: a wrapper of a ``register`` hook sees one plugin's list at a time.

The core calls plugins only through these hooks and the descriptors' factories, and uses what the
factories return only through their contracts: :class:`pypto_serving.Executor`,
:class:`pypto_serving.StepStrategy` (driving a :class:`pypto_serving.StrategyHost`) and
:data:`pypto_serving.SpecPolicy`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from .config import ServingSettings
    from .executor import Executor
    from .kv_transfer import KVConnectorFactory
    from .parsers import ReasoningParser, ToolParser
    from .spec_policy import SpecPolicy
    from .strategy import StepStrategy, StrategyHost

__all__ = [
    "PROJECT_NAME",
    "ExecutorSpec",
    "KVConnectorSpec",
    "ModelSpec",
    "ReasoningParserSpec",
    "SchedulerSpec",
    "SpecPolicySpec",
    "ToolParserSpec",
    "hookimpl",
    "hookspec",
]

PROJECT_NAME = "pypto_serving"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@dataclass(frozen=True, slots=True)
class ExecutorSpec:
    """An executor a plugin offers.

    ``factory`` runs in the worker process, which imports it by reference: a module-level function.
    ``executor = "auto"`` matches the checkpoint's first ``config.json`` architecture against
    ``architectures``, in the order the ``register`` hooks were called.

    :param name: the name ``settings.executor`` selects it by; unique across installed plugins.
    :param factory: ``factory(settings) -> Executor``, called once inside the worker process.
    :param architectures: the ``config.json`` ``architectures`` values it serves.
    :param description: one line for ``pypto-serving plugins``.
    """

    name: str
    factory: Callable[[ServingSettings], Executor]
    architectures: tuple[str, ...] = ()
    description: str = ""


@dataclass(frozen=True, slots=True)
class SchedulerSpec:
    """A scheduling strategy a plugin offers.

    A pipelined strategy keeps more than one step in flight, which needs
    ``ExecutorInfo.supports_pipelining``; ``async_scheduling`` and ``scheduler = "auto"`` choose by it.

    :param name: the name ``settings.scheduler`` selects it by; unique across installed plugins.
    :param factory: ``factory(host) -> StepStrategy``, called once in the engine process.
    :param pipelined: whether the strategy keeps more than one step in flight.
    :param description: one line for ``pypto-serving plugins``.
    """

    name: str
    factory: Callable[[StrategyHost], StepStrategy]
    pipelined: bool = False
    description: str = ""


@dataclass(frozen=True, slots=True)
class SpecPolicySpec:
    """A speculative-token policy a plugin offers.

    The policy is called as ``policy(request, max_k) -> k`` for each decode of a step on an executor
    that drafts, and must return ``0 <= k <= max_k`` (see :data:`pypto_serving.SpecPolicy`).

    :param name: the name ``speculative_config.policy`` selects it by; unique across installed plugins.
    :param factory: ``factory(settings) -> SpecPolicy``, called once in the engine process.
    :param description: one line for ``pypto-serving plugins``.
    """

    name: str
    factory: Callable[[ServingSettings], SpecPolicy]
    description: str = ""


@dataclass(frozen=True, slots=True)
class KVConnectorSpec:
    """A KV connector a plugin offers: it moves KV blocks between engines (see :mod:`pypto_serving.kv_transfer`).

    :param name: the name ``kv_transfer_config.kv_connector`` selects it by; unique across installed plugins.
    :param factory: ``factory(config) -> KVConnector``, called once in the worker process (a module-level
        function: the worker imports it by reference).
    :param description: one line for ``pypto-serving plugins``.
    """

    name: str
    factory: KVConnectorFactory
    description: str = ""


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A named model a plugin ships: a local Hugging Face model directory selected by name.

    ``--model NAME`` (or ``model = "NAME"``) resolves to ``path`` wherever a model directory is
    accepted, unless a directory of that name exists. With no model at all, ``serve`` and ``generate``
    use the named model of the highest ``priority`` (ties: the first by name).

    :param name: the name ``settings.model`` selects it by; unique across installed plugins.
    :param path: the model directory (config.json, weights, tokenizer), usually package data.
    :param description: one line for ``pypto-serving plugins`` and ``pypto-serving models``.
    :param priority: rank as the default model when none is given.
    :param prepare: called each time the name is resolved, before ``path`` is used: a model derived
        from another (e.g. a quantized copy) writes ``path`` there at first use
        (:func:`pypto_serving.model_files.write_model_dir`); ``None`` for a directory that exists.
    """

    name: str
    path: str
    description: str = ""
    priority: int = 0
    prepare: Callable[[], object] | None = None


@dataclass(frozen=True, slots=True)
class ToolParserSpec:
    """A tool-call parser a plugin offers: it turns the model's tool-call syntax into OpenAI
    ``tool_calls``.

    ``tool_call_parser = "auto"`` picks the first parser whose ``architectures`` hold the loaded
    executor's architecture, in the order the ``register`` hooks were called.

    :param name: the name ``settings.tool_call_parser`` selects it by; unique across installed plugins.
    :param factory: ``factory(tools) -> ToolParser``, called in the server process once per choice of a
        request that sends ``tools`` (the request's tool definitions, as OpenAI dicts).
    :param description: one line for ``pypto-serving plugins``.
    :param architectures: the architectures ``auto`` picks it for.
    """

    name: str
    factory: Callable[[list[dict[str, Any]]], ToolParser]
    description: str = ""
    architectures: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class ReasoningParserSpec:
    """A reasoning parser a plugin offers: it separates the model's thinking into ``reasoning_content``.

    :param name: the name ``settings.reasoning_parser`` selects it by; unique across installed plugins.
    :param factory: ``factory(prompt_text) -> ReasoningParser``, called in the server process once per
        chat choice; the rendered prompt tells whether the output opens inside the reasoning.
    :param description: one line for ``pypto-serving plugins``.
    :param architectures: the architectures ``reasoning_parser = "auto"`` picks it for.
    """

    name: str
    factory: Callable[[str], ReasoningParser]
    description: str = ""
    architectures: tuple[str, ...] = ()


@hookspec
def pypto_serving_register_executors() -> list[ExecutorSpec]:  # type: ignore[empty-body]
    """Return the executors this plugin provides.

    Called once at start-up in the engine process. A name registered twice is a start-up error
    naming both plugins.

    :return: the plugin's executor descriptors.
    """


@hookspec
def pypto_serving_register_schedulers() -> list[SchedulerSpec]:  # type: ignore[empty-body]
    """Return the scheduling strategies this plugin provides.

    Called once at start-up in the engine process. ``settings.scheduler`` selects one by name;
    ``scheduler = "auto"`` picks by :attr:`SchedulerSpec.pipelined` among the installed ones.

    :return: the plugin's scheduler descriptors.
    """


@hookspec
def pypto_serving_register_spec_policies() -> list[SpecPolicySpec]:  # type: ignore[empty-body]
    """Return speculative-token policies.

    A policy decides, per request and step, how many draft tokens ``k`` the scheduler reserves KV
    capacity for. The core registers ``none``, ``greedy``, ``fixed`` and ``adaptive`` through this hook as well.

    :return: the plugin's policy descriptors.
    """


@hookspec
def pypto_serving_register_kv_connectors() -> list[KVConnectorSpec]:  # type: ignore[empty-body]
    """Return the KV connectors this plugin provides (disaggregated prefill and decode).

    Called once at start-up in the engine process. The core registers ``torch_p2p`` through this hook
    as well.

    :return: the plugin's KV-connector descriptors.
    """


@hookspec
def pypto_serving_register_models() -> list[ModelSpec]:  # type: ignore[empty-body]
    """Return the named models this plugin ships.

    Called once at start-up in the engine process. A name registered twice is a start-up error
    naming both plugins.

    :return: the plugin's named-model descriptors.
    """


@hookspec
def pypto_serving_register_tool_parsers() -> list[ToolParserSpec]:  # type: ignore[empty-body]
    """Return the tool-call parsers this plugin provides.

    Called once at start-up. The core registers ``hermes``, ``deepseek_v3`` and ``deepseek_v4`` through this hook
    as well.

    :return: the plugin's tool-parser descriptors.
    """


@hookspec
def pypto_serving_register_reasoning_parsers() -> list[ReasoningParserSpec]:  # type: ignore[empty-body]
    """Return the reasoning parsers this plugin provides.

    Called once at start-up. The core registers ``qwen3``, ``deepseek_r1`` and ``deepseek_v4`` through this hook
    as well.

    :return: the plugin's reasoning-parser descriptors.
    """


@hookspec(firstresult=True)
def pypto_serving_chat_encoder(architecture: str, model_dir: str) -> Callable[..., str] | None:
    """Return the chat encoder of a checkpoint that ships no chat template, or None.

    Called in the engine and server processes when the tokenizer is loaded; the first non-None
    answer is used, and only while the checkpoint has no chat template (a template always wins). The
    encoder is called as a template is rendered: ``encoder(messages, add_generation_prompt=...,
    **variables)`` with the request's ``tools`` and ``chat_template_kwargs``, and returns the prompt text.

    :param architecture: the checkpoint's first ``config.json`` architecture.
    :param model_dir: the model directory.
    :return: the encoder, or None when this plugin has none for the checkpoint.
    """


@hookspec
def pypto_serving_configure(settings: ServingSettings) -> None:
    """Validate or adjust settings before the worker starts.

    Called once per engine start, after the executor is chosen and the scheduler and speculative
    policy names are checked, and before the worker process loads the executor (which reads the
    settings as this hook leaves them). With ``scheduler = "auto"`` the strategy is not chosen yet:
    that needs the loaded executor's ``supports_pipelining``.

    :param settings: the engine's settings; mutate them (e.g. ``settings.executor_options``) to fill plugin defaults.
    :raises ValueError: to refuse the configuration, with a message naming the offending field.
    """


@hookspec
def pypto_serving_add_routes(app: Any) -> None:
    """Add HTTP routes to the OpenAI-compatible server, once, after its own routes.

    :param app: the server's ``fastapi.FastAPI`` application.
    """
