"""``torch.profiler`` traces of the engine and its worker, started and stopped by ``/start_profile`` and
``/stop_profile`` (the admin key).

A :class:`ProfileControl` travels to the worker in order with the step commands and is answered by
nothing: on ``start`` the worker starts a profiler, on the ``stop`` that follows it writes a Chrome
trace to the file the command names (written beside it, then renamed: the file appears whole), and the
server waits for that file. The engine process profiles itself the same way (its own file), since the
schedule and the application of results run there. Each step's phases are named with
``record_function``: ``schedule`` and ``apply`` (engine), ``launch``, ``forward``, ``sample`` and
``finish`` (worker), so they show as named ranges in the trace.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import msgspec
import torch

__all__ = ["ProfileControl", "TraceProfiler", "phase"]

logger = logging.getLogger(__name__)

phase = torch.profiler.record_function
"""``with phase("forward"):`` names a range of a step in the trace (a few µs when no profile runs)."""


class ProfileControl(msgspec.Struct, frozen=True, tag=True):
    """Start a profile, or stop it and write its Chrome trace to ``path``."""

    start: bool
    path: str = ""


class TraceProfiler:
    """One process's profiler: at most one profile at a time."""

    def __init__(self) -> None:
        self._prof: Any = None

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

    def stop(self, path: Path) -> None:
        """Stop the profile and write its trace to ``path`` (an empty trace if none was running)."""
        prof, self._prof = self._prof, None
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + ".partial")
        if prof is None:
            partial.write_text('{"traceEvents": []}')
        else:
            prof.stop()
            prof.export_chrome_trace(str(partial))
        os.replace(partial, path)
