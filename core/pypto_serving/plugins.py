"""PluginManager: loads built-in hook implementations and the ``pypto_serving`` entry points, and
selects executors, schedulers, speculative-token policies and output parsers by name."""

from __future__ import annotations

import json
import logging
import os
import traceback
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import pluggy

from . import hookspecs
from .config import SettingsError
from .devices import log_block_size
from .model_files import check_model_exists

if TYPE_CHECKING:
    from .config import ServingSettings
from .hookspecs import (
    PROJECT_NAME,
    ExecutorSpec,
    KVConnectorSpec,
    ModelSpec,
    ReasoningParserSpec,
    SchedulerSpec,
    SpecPolicySpec,
    ToolParserSpec,
)

__all__ = ["PluginError", "PluginInfo", "PluginManager", "require_model"]

ENTRY_POINT_GROUP = "pypto_serving"
logger = logging.getLogger(__name__)


class PluginError(RuntimeError):
    """A plugin could not be loaded or a name could not be resolved."""


@dataclass(slots=True)
class PluginInfo:
    """One loaded (or broken) plugin, as ``pypto-serving plugins`` shows it."""

    name: str
    distribution: str
    version: str
    status: str = "ok"  # "ok" or "broken: <error>"
    error: str | None = None
    provides: list[tuple[str, str]] = field(default_factory=list)  # (kind, name)


S = TypeVar(
    "S", ExecutorSpec, KVConnectorSpec, SchedulerSpec, SpecPolicySpec, ModelSpec, ToolParserSpec, ReasoningParserSpec
)


@dataclass(slots=True)
class _Registry(Generic[S]):
    kind: str
    spec_type: type[S]
    specs: dict[str, tuple[S, PluginInfo]] = field(default_factory=dict)
    hint: str = ""  # appended to "unknown name" errors: entry points PYPTO_SERVING_PLUGINS left out

    def add(self, spec: object, plugin: PluginInfo) -> None:
        if not isinstance(spec, self.spec_type):
            raise PluginError(
                f"plugin {plugin.name!r} (distribution {plugin.distribution}) registered {spec!r} as a {self.kind}; "
                f"expected a {self.spec_type.__name__}"
            )
        if spec.name in self.specs:
            _, other = self.specs[spec.name]
            raise PluginError(
                f"{self.kind} {spec.name!r} is registered twice: by plugin {other.name!r} "
                f"(distribution {other.distribution}) and by plugin {plugin.name!r} "
                f"(distribution {plugin.distribution}); uninstall one of them"
            )
        self.specs[spec.name] = (spec, plugin)
        plugin.provides.append((self.kind, spec.name))

    def get(self, name: str) -> S:
        if name in self.specs:
            return self.specs[name][0]
        raise PluginError(f"unknown {self.kind} {name!r}; installed {self.kind}s: {self.installed()}{self.hint}")

    def installed(self) -> str:
        return ", ".join(sorted(self.specs)) or "none"


class PluginManager:
    """Owns the pluggy manager and the name -> descriptor registries."""

    def __init__(self, *, load_entry_points: bool = True, extra_plugins: Iterable[Any] = ()) -> None:
        self.pm = pluggy.PluginManager(PROJECT_NAME)
        self.pm.add_hookspecs(hookspecs)
        self.plugins: list[PluginInfo] = []
        self.excluded: list[str] = []  # entry points PYPTO_SERVING_PLUGINS leaves out
        self._register(_core_plugin(), PluginInfo("core", "pypto-serving", _version("pypto-serving")))
        for i, plugin in enumerate(extra_plugins):
            self._register(plugin, PluginInfo(getattr(plugin, "__name__", f"extra{i}"), "(in-process)", ""))
        if load_entry_points:
            self._load_entry_points()
        self.executors = _Registry("executor", ExecutorSpec)
        self.schedulers = _Registry("scheduler", SchedulerSpec)
        self.spec_policies = _Registry("speculative policy", SpecPolicySpec)
        self.models = _Registry("model", ModelSpec)
        self.tool_parsers = _Registry("tool parser", ToolParserSpec)
        self.reasoning_parsers = _Registry("reasoning parser", ReasoningParserSpec)
        self.kv_connectors = _Registry("KV connector", KVConnectorSpec)
        self._collect()

    # -- loading
    def _register(self, obj: Any, info: PluginInfo) -> None:
        self.pm.register(obj, name=info.name)
        self.plugins.append(info)

    def _load_entry_points(self) -> None:
        allowed = _allowed_names()
        for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
            if allowed is not None and ep.name not in allowed:
                self.excluded.append(ep.name)
                continue
            dist = ep.dist.name if ep.dist is not None else "?"
            version = ep.dist.version if ep.dist is not None else "?"
            info = PluginInfo(ep.name, dist, version)
            if self.pm.has_plugin(ep.name):
                # same plugin name from two distributions
                other = next(p for p in self.plugins if p.name == ep.name)
                raise PluginError(
                    f"plugin name {ep.name!r} is used by two distributions: {other.distribution} and {dist}"
                )
            try:
                obj = ep.load()
            except Exception as e:  # a broken plugin must not hide the others
                info.status = f"broken: {type(e).__name__}: {e}"
                info.error = "".join(traceback.format_exception(e))
                self.plugins.append(info)
                logger.warning("plugin %s (%s) failed to load: %s", ep.name, dist, e)
                continue
            self._register(obj, info)

    def _collect(self) -> None:
        # A plain ``hook()`` call returns every plugin's list without saying whose each one is, which
        # the duplicate-name error and ``pypto-serving plugins`` need. So each implementing plugin is
        # called on its own, still through pluggy (a subset caller): wrappers, tryfirst/trylast and
        # the call order apply as for any hook, and each call's result belongs to one plugin.
        left_out = ", ".join(self.excluded)
        hint = f"; PYPTO_SERVING_PLUGINS leaves out the installed plugins {left_out}" if left_out else ""
        registries: tuple[tuple[str, _Registry[Any]], ...] = (
            ("pypto_serving_register_executors", self.executors),
            ("pypto_serving_register_schedulers", self.schedulers),
            ("pypto_serving_register_spec_policies", self.spec_policies),
            ("pypto_serving_register_models", self.models),
            ("pypto_serving_register_tool_parsers", self.tool_parsers),
            ("pypto_serving_register_reasoning_parsers", self.reasoning_parsers),
            ("pypto_serving_register_kv_connectors", self.kv_connectors),
        )
        for hook_name, registry in registries:
            registry.hint = hint
            for plugin, specs in self._call_each(hook_name):
                info = self._info_for(plugin)
                for spec in specs:
                    registry.add(spec, info)

    def _call_each(self, hook_name: str) -> Iterator[tuple[object, list[object]]]:
        """``(plugin, what its implementation returned)`` in pluggy's call order: ``tryfirst`` ones,
        then the last registered first, then ``trylast`` ones."""
        impls = getattr(self.pm.hook, hook_name).get_hookimpls()
        plain = [i.plugin for i in reversed(impls) if not (i.hookwrapper or i.wrapper)]
        for plugin in plain:
            caller = self.pm.subset_hook_caller(hook_name, remove_plugins=[p for p in plain if p is not plugin])
            yield plugin, [spec for result in caller() for spec in (result or ())]

    def _info_for(self, obj: object) -> PluginInfo:
        name = self.pm.get_name(obj)
        return next(p for p in self.plugins if p.name == name)

    # -- queries
    @property
    def broken(self) -> list[PluginInfo]:
        return [p for p in self.plugins if p.error is not None]

    def check_healthy(self) -> None:
        """Start-up refuses to run with a broken plugin: its name and the original error."""
        if self.broken:
            p = self.broken[0]
            raise PluginError(
                f"plugin {p.name!r} (distribution {p.distribution}) failed to load: {p.status[len('broken: ') :]}. "
                f"Fix or uninstall it, or exclude it with PYPTO_SERVING_PLUGINS=<names to load>"
            )

    def select_executor(self, name: str, architecture: str | None) -> ExecutorSpec:
        """The executor named ``name``; ``auto``: the first serving ``architecture``, in hook call order."""
        if name != "auto":
            return self.executors.get(name)
        if architecture is None:
            raise PluginError("executor='auto' needs a model directory whose config.json names its architectures")
        for spec, _ in self.executors.specs.values():
            if architecture in spec.architectures:
                return spec
        served = sorted({a for s, _ in self.executors.specs.values() for a in s.architectures})
        raise PluginError(
            f"no installed executor serves the architecture {architecture!r}; "
            f"installed executors serve: {', '.join(served) or 'nothing'}{self.executors.hint}"
        )

    def select_scheduler(
        self, name: str, *, pipelined: bool | None = None, executor_pipelines: bool = True
    ) -> SchedulerSpec:
        """The strategy the settings ask for (``auto``: see :meth:`_auto_scheduler`).

        :param name: ``settings.scheduler``: a registered name, or ``auto``.
        :param pipelined: ``settings.async_scheduling``: True asks for a pipelined strategy, False for
            a non-pipelined one, None for either.
        :param executor_pipelines: whether the executor supports pipelining; before it is loaded, True
            (the most permissive guess), so that what the settings alone decide fails early.
        :return: the chosen strategy's descriptor.
        :raises SettingsError: the named strategy contradicts ``pipelined``.
        :raises PluginError: no strategy fits.
        """
        if name == "auto":
            return self._auto_scheduler(pipelined, executor_pipelines)
        spec = self.schedulers.get(name)
        if pipelined is not None and spec.pipelined != pipelined:
            does = "pipelines" if spec.pipelined else "does not pipeline"
            raise SettingsError(
                f"scheduler={name!r} {does} steps, which contradicts async_scheduling={pipelined}; set one of them"
            )
        return spec

    def _auto_scheduler(self, pipelined: bool | None, executor_pipelines: bool) -> SchedulerSpec:
        """A pipelined strategy if ``pipelined`` is True, or is None and the executor pipelines; else a
        non-pipelined one. With ``pipelined`` None and no pipelined strategy installed, a non-pipelined
        one. Among several that fit, the first by name, so the choice does not depend on install order."""
        want = executor_pipelines if pipelined is None else pipelined
        fits = sorted(n for n, (s, _) in self.schedulers.specs.items() if s.pipelined == want)
        if not fits and want and pipelined is None:
            fits = sorted(self.schedulers.specs)  # all of them are non-pipelined
        if fits:
            return self.schedulers.get(fits[0])
        if not self.schedulers.specs:
            raise PluginError(f"no scheduling strategy is installed{self.schedulers.hint}")
        kind = "a pipelined" if want else "a non-pipelined"
        why = (
            f"async_scheduling={pipelined} asks for"
            if pipelined is not None
            else "the executor cannot pipeline: it needs"
        )
        installed = ", ".join(
            f"{n} ({'pipelined' if s.pipelined else 'not pipelined'})"
            for n, (s, _) in sorted(self.schedulers.specs.items())
        )
        raise PluginError(
            f"scheduler='auto': {why} {kind} strategy and none is installed; "
            f"installed schedulers: {installed}{self.schedulers.hint}"
        )

    def default_model(self) -> ModelSpec | None:
        """The named model used when the settings name none: highest priority, then first by name."""
        specs = sorted((s for s, _ in self.models.specs.values()), key=lambda s: (-s.priority, s.name))
        return specs[0] if specs else None

    def resolve_model(self, settings: ServingSettings) -> ServingSettings:
        """``settings`` with ``model`` as a directory: a registered name becomes its path (a directory
        of that name wins), and no model at all becomes the default named model's (with
        ``executor = "auto"``; an explicit executor may need none). The API reports the name unless
        ``served_model_name`` says otherwise.

        :return: the same object when nothing changes, else an updated copy.
        """
        name = settings.model
        if name is None:
            spec = self.default_model() if settings.executor == "auto" else None
            if spec is None:
                return settings
            logger.info("no model given: serving the default named model %s (%s)", spec.name, spec.path)
        elif name in self.models.specs and not Path(name).exists():
            spec = self.models.specs[name][0]
        else:
            check_model_exists(name, self.models.specs)
            return settings
        if spec.prepare is not None:
            spec.prepare()
        changes: dict[str, Any] = {"model": str(spec.path)}
        if settings.served_model_name is None:
            changes["served_model_name"] = spec.name
        return settings.with_overrides(origin=f"named model {spec.name}", **changes)

    def select_tool_parser(self, name: str, architecture: str) -> ToolParserSpec | None:
        """The tool-call parser named ``name``; ``auto``: the first registered for ``architecture``
        (None when there is none); ``none``: None."""
        return _select_parser(self.tool_parsers, name, architecture)

    def select_reasoning_parser(self, name: str, architecture: str) -> ReasoningParserSpec | None:
        """The reasoning parser named ``name``, chosen as :meth:`select_tool_parser` chooses."""
        return _select_parser(self.reasoning_parsers, name, architecture)

    def chat_encoder(self, model: str | None) -> Any:
        """The chat encoder a plugin gives the checkpoint in ``model`` (``pypto_serving_chat_encoder``),
        for when it ships no chat template; None without a model, an architecture or an encoder."""
        cfg = Path(model) / "config.json" if model else None
        if cfg is None or not cfg.is_file():
            return None
        architectures = json.loads(cfg.read_text()).get("architectures") or []
        if not architectures:
            return None
        return self.pm.hook.pypto_serving_chat_encoder(architecture=architectures[0], model_dir=str(model))

    def select_spec_policy(self, name: str) -> SpecPolicySpec:
        return self.spec_policies.get(name)

    def configure(self, settings: Any) -> None:
        """Run the plugins' ``pypto_serving_configure`` hooks (once per engine start, before the worker
        loads), then log the KV block size the worker will load with: a default that depends on the
        device, or a set one that may turn off the device's fused attention."""
        self.pm.hook.pypto_serving_configure(settings=settings)
        log_block_size(settings.device, settings.block_size)

    def add_routes(self, app: Any) -> None:
        self.pm.hook.pypto_serving_add_routes(app=app)


def require_model(plugins: PluginManager, settings: ServingSettings, command: str) -> ServingSettings:
    """``settings`` with the model resolved (see :meth:`PluginManager.resolve_model`); a command that
    needs a model and has none fails with what it can take."""
    settings = plugins.resolve_model(settings)
    if settings.model is None and settings.executor == "auto":
        names = plugins.models.installed()
        raise SettingsError(
            f"{command} needs a model: pass --model DIR or a named model, or set model in the config file "
            f"(installed named models: {names})"
        )
    return settings


def _core_plugin() -> type:
    """The core's own hook implementations (speculative policies, output parsers) as one plugin."""
    from . import speculative
    from .kv_connectors import torch_p2p
    from .parsers import builtin

    hooks = {
        n: staticmethod(getattr(m, n))
        for m in (speculative, builtin, torch_p2p)
        for n in dir(m)
        if n.startswith("pypto_serving_")
    }
    return type("CorePlugin", (), hooks)


P = TypeVar("P", ToolParserSpec, ReasoningParserSpec)


def _select_parser(registry: _Registry[P], name: str, architecture: str) -> P | None:
    if name == "none":
        return None
    if name != "auto":
        return registry.get(name)
    return next((spec for spec, _ in registry.specs.values() if architecture in spec.architectures), None)


def _allowed_names() -> set[str] | None:
    raw = os.environ.get("PYPTO_SERVING_PLUGINS")
    if raw is None:
        return None
    return {n.strip() for n in raw.split(",") if n.strip()}


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "unknown"
