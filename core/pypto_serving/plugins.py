"""PluginManager: loads built-in hook implementations and the ``pypto_serving`` entry points, and
selects executors, schedulers and speculative-token policies by name."""

from __future__ import annotations

import logging
import os
import traceback
from collections.abc import Iterable
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any, Generic, TypeVar

import pluggy

from . import hookspecs
from .hookspecs import PROJECT_NAME, ExecutorSpec, SchedulerSpec, SpecPolicySpec

__all__ = ["BUILTIN_DISTRIBUTIONS", "PluginError", "PluginInfo", "PluginManager"]

ENTRY_POINT_GROUP = "pypto_serving"
logger = logging.getLogger(__name__)

# Names our own plugin distributions provide, so a missing one gets an install hint.
BUILTIN_DISTRIBUTIONS: dict[str, dict[str, str]] = {
    "executor": {"qwen": "pypto-serving-qwen", "deepseek_mtp": "pypto-serving-deepseek-mtp"},
    "scheduler": {"sync": "pypto-serving-sync-sched", "async": "pypto-serving-async-sched"},
    "architecture": {
        "Qwen2ForCausalLM": "pypto-serving-qwen",
        "Qwen3ForCausalLM": "pypto-serving-qwen",
        "Qwen3MoeForCausalLM": "pypto-serving-qwen",
        "DeepseekV4ForCausalLM": "pypto-serving-deepseek-mtp",
    },
}


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


S = TypeVar("S", ExecutorSpec, SchedulerSpec, SpecPolicySpec)


@dataclass(slots=True)
class _Registry(Generic[S]):
    kind: str
    specs: dict[str, tuple[S, PluginInfo]] = field(default_factory=dict)

    def add(self, spec: S, plugin: PluginInfo) -> None:
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
        installed = ", ".join(sorted(self.specs)) or "none"
        msg = f"unknown {self.kind} {name!r}; installed {self.kind}s: {installed}"
        dist = BUILTIN_DISTRIBUTIONS.get(self.kind, {}).get(name)
        if dist:
            msg += f". {name!r} is provided by the distribution {dist}: pip install {dist}"
        raise PluginError(msg)


class PluginManager:
    """Owns the pluggy manager and the name -> descriptor registries."""

    def __init__(self, *, load_entry_points: bool = True, extra_plugins: Iterable[Any] = ()) -> None:
        self.pm = pluggy.PluginManager(PROJECT_NAME)
        self.pm.add_hookspecs(hookspecs)
        self.plugins: list[PluginInfo] = []
        from . import speculative  # built-in policies

        self._register(speculative, PluginInfo("core", "pypto-serving", _version("pypto-serving")))
        for i, plugin in enumerate(extra_plugins):
            self._register(plugin, PluginInfo(getattr(plugin, "__name__", f"extra{i}"), "(in-process)", ""))
        if load_entry_points:
            self._load_entry_points()
        self.executors: _Registry[ExecutorSpec] = _Registry("executor")
        self.schedulers: _Registry[SchedulerSpec] = _Registry("scheduler")
        self.spec_policies: _Registry[SpecPolicySpec] = _Registry("speculative policy")
        self._collect()

    # -- loading
    def _register(self, obj: Any, info: PluginInfo) -> None:
        self.pm.register(obj, name=info.name)
        self.plugins.append(info)

    def _load_entry_points(self) -> None:
        allowed = _allowed_names()
        for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
            if allowed is not None and ep.name not in allowed:
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
        # Walk the hook implementations one by one so every descriptor is attributed to its plugin.
        registries: tuple[tuple[Any, _Registry[Any]], ...] = (
            (self.pm.hook.pypto_serving_register_executors, self.executors),
            (self.pm.hook.pypto_serving_register_schedulers, self.schedulers),
            (self.pm.hook.pypto_serving_register_spec_policies, self.spec_policies),
        )
        for hook, registry in registries:
            for impl in reversed(hook.get_hookimpls()):  # registration order
                info = self._info_for(impl.plugin)
                specs: list[Any] = impl.function() or []
                for spec in specs:
                    registry.add(spec, info)

    def _info_for(self, obj: Any) -> PluginInfo:
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
        if name != "auto":
            return self.executors.get(name)
        if architecture is None:
            raise PluginError("executor='auto' needs a model directory whose config.json names its architectures")
        for spec, _ in self.executors.specs.values():
            if architecture in spec.architectures:
                return spec
        served = {a: n for n, (s, _) in self.executors.specs.items() for a in s.architectures}
        msg = f"no installed executor serves the architecture {architecture!r}"
        msg += f"; installed executors serve: {', '.join(sorted(served)) or 'nothing'}"
        dist = BUILTIN_DISTRIBUTIONS["architecture"].get(architecture)
        if dist:
            msg += f". {architecture} is served by the distribution {dist}: pip install {dist}"
        raise PluginError(msg)

    def select_scheduler(self, name: str) -> SchedulerSpec:
        return self.schedulers.get(name)

    def select_spec_policy(self, name: str) -> SpecPolicySpec:
        return self.spec_policies.get(name)

    def configure(self, settings: Any) -> None:
        self.pm.hook.pypto_serving_configure(settings=settings)

    def add_routes(self, app: Any) -> None:
        self.pm.hook.pypto_serving_add_routes(app=app)


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
