"""``torch.profiler`` traces of the engine and its worker, started and stopped by ``/start_profile`` and
``/stop_profile`` (the admin key).

A :class:`ProfileControl` travels to the worker in order with the step commands and is answered by
nothing: on ``start`` the worker starts a profiler, on the ``stop`` that follows it writes a Chrome
trace to the file the command names (written beside it, then renamed: the file appears whole), and the
server waits for that file. The engine process profiles itself the same way (its own file), since the
schedule and the application of results run there. Each step's phases are named with
``record_function``: ``schedule`` and ``apply`` (engine), ``launch``, ``forward``, ``sample`` and
``finish`` (worker), so they show as named ranges in the trace; within ``forward``, each layer by its
kind (:class:`LayerRanges`).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import torch

__all__ = ["LayerRanges", "ProfileControl", "TraceProfiler", "phase"]

logger = logging.getLogger(__name__)


def phase(name: str) -> contextlib.AbstractContextManager[object]:
    """``with phase("forward"):`` names a range of a step in the trace. Outside a profile it is a
    null context: ``record_function`` calls into torch's dispatcher on entry and exit even then
    (6-11 µs a range, several ranges a step in each process, at every token of concurrency 1)."""
    if torch._C._autograd._profiler_enabled():
        return torch.profiler.record_function(name)
    return contextlib.nullcontext()


class ProfileControl(msgspec.Struct, frozen=True, tag=True):
    """Start a profile, or stop it and write its Chrome trace to ``path``."""

    start: bool
    path: str = ""


class LayerRanges:
    """While a profile runs, forward hooks that name each layer of ``model`` by its kind: every
    element of an ``nn.ModuleList`` (``layer <class name>``, e.g. ``layer QwenDecoderLayer``) and each
    of its direct parts (``<class name>``: ``QwenAttention``, ``QwenMLP``, ``QwenSparseMoe``). Only
    executors whose model is an ``nn.Module`` (the executor's ``model`` attribute) get them, and a
    replayed device graph runs no hooks."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._handles: list[Any] = []
        for layers in model.modules():
            if isinstance(layers, torch.nn.ModuleList):
                for layer in layers:
                    self._name(layer, f"layer {type(layer).__name__}")
                    for part in layer.children():
                        self._name(part, type(part).__name__)

    def _name(self, module: torch.nn.Module, name: str) -> None:
        open_ranges: list[contextlib.ExitStack] = []

        def enter(mod: torch.nn.Module, args: Any) -> None:
            stack = contextlib.ExitStack()
            stack.enter_context(phase(name))
            open_ranges.append(stack)

        def leave(mod: torch.nn.Module, args: Any, out: Any) -> None:
            if open_ranges:
                open_ranges.pop().close()

        self._handles += [
            module.register_forward_pre_hook(enter),
            module.register_forward_hook(leave, always_call=True),
        ]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


class TraceProfiler:
    """One process's profiler: at most one profile at a time. ``model`` gives the module whose layers
    are named while it runs (:class:`LayerRanges`), if any."""

    def __init__(self, model: Callable[[], Any] | None = None) -> None:
        self._prof: Any = None
        self._model = model
        self._layers: LayerRanges | None = None

    def control(self, msg: ProfileControl) -> None:
        """Apply ``msg``; failures are logged (nobody waits for an answer but the trace file)."""
        try:
            if msg.start:
                self.start()
            else:
                self.stop(Path(msg.path))
        except Exception:
            logger.exception("profiler %s failed", "start" if msg.start else "stop")

    def start(self) -> None:
        if self._prof is not None:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._prof = torch.profiler.profile(activities=activities, record_shapes=False, with_stack=False)
        self._prof.start()
        model = self._model() if self._model is not None else None
        if isinstance(model, torch.nn.Module):
            self._layers = LayerRanges(model)

    def stop(self, path: Path) -> None:
        """Stop the profile and write its trace to ``path`` (an empty trace if none was running)."""
        prof, self._prof = self._prof, None
        if self._layers is not None:
            self._layers.remove()
            self._layers = None
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + ".partial")
        if prof is None:
            partial.write_text('{"traceEvents": []}')
        else:
            prof.stop()
            prof.export_chrome_trace(str(partial))
        os.replace(partial, path)
