"""``POST /start_profile`` and ``POST /stop_profile`` (the admin key, see guard.py): a ``torch.profiler``
trace of the engine process and of the worker, written as Chrome traces into ``profile_dir``
(see :mod:`pypto_serving.profiler`). ``/stop_profile`` waits for the files and names them."""

from __future__ import annotations

import asyncio
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI

from .protocol import APIError

if TYPE_CHECKING:
    from .openai_requests import _Ctx

__all__ = ["add_profile_routes"]

TRACE_WAIT = 120.0
"""Seconds ``/stop_profile`` waits for the traces (a long profile takes a while to write)."""


@dataclass(slots=True)
class _Running:
    path: Path | None = None  # the traces' common prefix while a profile runs


def _trace_files(ctx: _Ctx, path: Path) -> list[Path]:
    """The files a stop writes: each replica's engine and worker trace."""
    replicas = getattr(ctx.llm, "replicas", None)
    prefixes = [f"{path}-r{i}" for i in range(len(replicas))] if replicas is not None else [str(path)]
    return [Path(f"{p}.{part}.json") for p in prefixes for part in ("engine", "worker")]


def add_profile_routes(app: FastAPI, ctx: _Ctx) -> None:
    running = _Running()

    @app.post("/start_profile")
    async def start_profile() -> dict[str, Any]:
        if running.path is not None:
            raise APIError(409, "a profile is already running; POST /stop_profile first", code="profile_running")
        directory = ctx.settings.profile_dir or Path(tempfile.gettempdir()) / "pypto-serving-profiles"
        await asyncio.to_thread(directory.mkdir, parents=True, exist_ok=True)
        running.path = directory / f"profile-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}"
        ctx.llm.profile(True, str(running.path))
        return {"status": "started", "traces": [str(p) for p in _trace_files(ctx, running.path)]}

    @app.post("/stop_profile")
    async def stop_profile() -> dict[str, Any]:
        if running.path is None:
            raise APIError(409, "no profile is running; POST /start_profile first", code="no_profile")
        path, running.path = running.path, None
        ctx.llm.profile(False, str(path))
        files = _trace_files(ctx, path)
        deadline = time.monotonic() + TRACE_WAIT
        while not all(f.exists() for f in files) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        missing = [str(f) for f in files if not f.exists()]
        if missing:
            raise APIError(504, f"the traces were not written within {TRACE_WAIT:.0f}s: {', '.join(missing)}")
        return {"status": "stopped", "traces": [str(f) for f in files]}
