"""The plugin contract of pypto-serving.

Plugins are pluggy hook implementations registered under the entry-point group ``pypto_serving``.
Each registration hook returns *descriptors* (small dataclasses); the core picks one by the name the
settings give. A plugin module typically looks like::

    from pypto_serving import hookimpl, ExecutorSpec

    @hookimpl
    def pypto_serving_register_executors():
        return [ExecutorSpec(name="mine", factory=make_executor, architectures=("MyForCausalLM",))]

The docstrings of the hook specs below are the contract: the core relies on nothing else.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from .config import ServingSettings

__all__ = [
    "PROJECT_NAME",
    "ExecutorSpec",
    "SchedulerSpec",
    "SpecPolicySpec",
    "hookimpl",
    "hookspec",
]

PROJECT_NAME = "pypto_serving"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@dataclass(frozen=True, slots=True)
class ExecutorSpec:
    """An executor a plugin offers.

    ``factory(settings)`` is called *inside the worker process* and returns an object implementing
    :class:`pypto_serving.executor.Executor`; it must therefore be importable by reference (a
    module-level function, not a lambda). ``architectures`` lists the Hugging Face
    ``config.json`` ``architectures`` values it serves; ``executor = "auto"`` matches the first entry
    of the checkpoint's list against it.
    """

    name: str
    factory: Callable[[ServingSettings], Any]
    architectures: tuple[str, ...] = ()
    description: str = ""


@dataclass(frozen=True, slots=True)
class SchedulerSpec:
    """A scheduling strategy: ``factory(engine_core)`` returns an object with ``step() -> list[RequestOutput]``
    and ``has_unfinished() -> bool`` that drives the engine's scheduler and worker.
    ``pipelined`` says the strategy keeps more than one step in flight (needs executor support)."""

    name: str
    factory: Callable[[Any], Any]
    pipelined: bool = False
    description: str = ""


@dataclass(frozen=True, slots=True)
class SpecPolicySpec:
    """A speculative-token policy: ``factory(settings)`` returns a callable
    ``(request, num_new_tokens, token_budget_left) -> int`` giving ``k`` for one request and step."""

    name: str
    factory: Callable[[ServingSettings], Any]
    description: str = ""


@hookspec
def pypto_serving_register_executors() -> list[ExecutorSpec]:  # type: ignore[empty-body]
    """Return the executors this plugin provides.

    Called once at start-up in the engine process. Names must be unique across all installed
    plugins: a duplicate is a start-up error naming both distributions.
    """


@hookspec
def pypto_serving_register_schedulers() -> list[SchedulerSpec]:  # type: ignore[empty-body]
    """Return the scheduling strategies this plugin provides (the built-in ones are ``sync`` and
    ``async``). Selected by ``settings.scheduler`` / ``settings.async_scheduling``."""


@hookspec
def pypto_serving_register_spec_policies() -> list[SpecPolicySpec]:  # type: ignore[empty-body]
    """Return speculative-token policies. A policy decides, per request and step, how many draft
    tokens ``k`` the scheduler reserves KV capacity for. The core ships ``none`` and ``greedy``."""


@hookspec
def pypto_serving_configure(settings: ServingSettings) -> None:
    """Validate or adjust settings before the engine starts.

    Raise ``ValueError`` with a message naming the offending field to refuse the configuration;
    mutate ``settings`` (e.g. ``settings.executor_options``) to fill plugin defaults. Called for every
    plugin, in registration order, after the executor and scheduler have been chosen.
    """


@hookspec
def pypto_serving_add_routes(app: Any) -> None:
    """Add HTTP routes to the OpenAI-compatible FastAPI ``app`` before the server starts."""
