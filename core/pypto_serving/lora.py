"""The engine's LoRA adapters: which names are served, the key and slot of each, and the slots that
adapters unloaded at run time still hold until their last request ends.

An adapter's *key* is what requests carry to the worker and what seeds their prefix-cache chains
(``kv_cache._root``): an adapter of ``lora_modules`` is keyed by its name; one loaded at run time by
its name and a load count that never repeats in an engine, so an adapter loaded again under a name
(or into a slot) another had never meets that one's cached KV. Slots are numbered 1 .. ``max_loras``
(0 is the base model); an unloaded adapter keeps its slot, and the worker its weights, while
requests that selected it before the unload still run, and new requests naming it are refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from .config import ServingSettings, lora_paths
from .request import SamplingParams

__all__ = ["LoadedAdapter", "LoraError", "LoraRegistry"]

#: Characters an adapter name may not hold: lora_modules' separators, whitespace, the key separator.
_BAD_NAME_CHARS = frozenset(",= \t\n\r\0")


class LoraError(ValueError):
    """A load or unload refused; ``status`` is the HTTP status that says why (400, 404, 409)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(slots=True)
class LoadedAdapter:
    key: str
    path: str
    slot: int


@dataclass(slots=True)
class LoraRegistry:
    """The adapters an engine serves (see the module docstring)."""

    enabled: bool
    max_loras: int
    adapters: dict[str, LoadedAdapter] = field(default_factory=dict)  # served, by name, in load order
    unloading: list[LoadedAdapter] = field(default_factory=list)  # unloaded, their requests still running
    loads: int = 0  # adapters loaded at run time so far (each key's count)
    reading: set[str] = field(default_factory=set)  # keys the worker reads in the background

    @classmethod
    def of(cls, settings: ServingSettings) -> LoraRegistry:
        paths = lora_paths(settings)
        adapters = {name: LoadedAdapter(name, path, slot) for slot, (name, path) in enumerate(paths.items(), start=1)}
        return cls(bool(paths) or settings.enable_lora, settings.max_loras, adapters)

    @property
    def names(self) -> list[str]:
        return list(self.adapters)

    def entries(self) -> list[str]:
        """The served adapters as ``lora_modules`` entries (what a fresh engine loads at start)."""
        return [f"{name}={a.path}" for name, a in self.adapters.items()]

    def select(self, params: SamplingParams) -> SamplingParams:
        """``params`` with its adapter's name replaced by the adapter's key; an adapter that is not
        served (never loaded, or unloaded) is a LoraError (404)."""
        if params.lora is None:
            return params
        adapter = self.adapters.get(params.lora)
        if adapter is None:
            known = sorted(self.adapters) or "none (lora_modules is empty)"
            raise LoraError(404, f"unknown LoRA adapter {params.lora!r}; loaded: {known}")
        return params if adapter.key == params.lora else replace(params, lora=adapter.key)

    def plan_load(self, name: str, path: str) -> LoadedAdapter:
        """The key and free slot of an adapter about to load (registered by :meth:`commit` once the
        worker has it); refused when LoRA is off, the name is bad or taken, or no slot is free."""
        if not self.enabled:
            raise LoraError(400, "LoRA is not enabled: start the server with enable_lora (or lora_modules)")
        if not name or _BAD_NAME_CHARS & set(name):
            raise LoraError(400, f"LoRA adapter name {name!r} must be non-empty, without whitespace, ',' or '='")
        if not path:
            raise LoraError(400, "lora_path is empty: give the PEFT adapter directory")
        if name in self.adapters:
            raise LoraError(409, f"LoRA adapter {name!r} is already loaded; unload it first")
        taken = {a.slot for a in (*self.adapters.values(), *self.unloading)}
        free = [s for s in range(1, self.max_loras + 1) if s not in taken]
        if not free:
            draining = f" ({len(self.unloading)} unloaded, finishing their requests)" if self.unloading else ""
            raise LoraError(
                409, f"no free LoRA slot: all max_loras={self.max_loras} are in use{draining}; unload an adapter"
            )
        return LoadedAdapter(f"{name}\0{self.loads + 1}", path, free[0])

    def commit(self, name: str, adapter: LoadedAdapter) -> None:
        self.loads += 1
        self.adapters[name] = adapter

    def unload(self, name: str) -> None:
        """Stop serving ``name``; its slot stays held until :meth:`release` sees no request of it."""
        adapter = self.adapters.pop(name, None)
        if adapter is None:
            raise LoraError(404, f"LoRA adapter {name!r} is not loaded; loaded: {sorted(self.adapters)}")
        self.unloading.append(adapter)

    def release(self, in_use: set[str | None]) -> None:
        """Free the slots of unloaded adapters whose key no live request carries any more."""
        self.unloading = [a for a in self.unloading if a.key in in_use]
