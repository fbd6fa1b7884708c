"""``/dashboard``: one static page (``static/dashboard.html`` and ``dashboard.js``) charting the server's
metrics with uPlot (vendored in ``static/``, MIT, version in docs/architecture.md: no CDN, no build
step), live from ``/metrics/json`` and from the history of :mod:`.history` (``/dashboard/history``).

With an API key set, the dashboard's routes take the key from the ``Authorization`` header or from the
``pypto_serving_key`` cookie (the guard), since a browser cannot add a header to a page it navigates to;
without either, ``/dashboard`` answers 401 with a form that stores the key in that cookie.
"""

from __future__ import annotations

import asyncio
from functools import cache
from importlib.resources import files
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Query
from fastapi.responses import HTMLResponse, Response

from .history import MetricsHistory, Sampler, snapshot
from .protocol import APIError

if TYPE_CHECKING:
    from .openai_requests import _Ctx

__all__ = ["add_dashboard_routes", "start_sampler"]

# The files the page loads, by the name it asks for, and their content types; nothing else is served.
_STATIC = {
    "dashboard.js": "text/javascript; charset=utf-8",
    "uPlot.iife.min.js": "text/javascript; charset=utf-8",
    "uPlot.min.css": "text/css; charset=utf-8",
    "uPlot.LICENSE": "text/plain; charset=utf-8",
}
MAX_POINTS = 5000


@cache
def static_file(name: str) -> bytes:
    return files(__package__).joinpath("static", name).read_bytes()


def start_sampler(ctx: _Ctx) -> Sampler:
    """The history of this server's settings, sampled by a thread from now on."""
    s = ctx.settings
    history = MetricsHistory(s.dashboard_history_path, s.dashboard_history_retention, s.dashboard_history_max_bytes)

    def take() -> dict[str, float]:
        ctx.metrics.update_engine(ctx.llm.stats, ctx.llm.dead_reason is not None)
        return snapshot(ctx.metrics.render_json())

    sampler = Sampler(history, take, s.dashboard_sample_interval)
    sampler.start()
    return sampler


def add_dashboard_routes(app: FastAPI, ctx: _Ctx) -> None:
    @app.get("/dashboard")
    async def dashboard() -> HTMLResponse:
        return HTMLResponse(static_file("dashboard.html"), headers={"cache-control": "no-store"})

    @app.get("/dashboard/static/{name}")
    async def dashboard_static(name: str) -> Response:
        if name not in _STATIC:
            raise APIError(404, f"no dashboard file {name!r}", code="not_found")
        return Response(static_file(name), media_type=_STATIC[name], headers={"cache-control": "max-age=3600"})

    @app.get("/dashboard/history")
    async def dashboard_history(
        since: float = Query(0.0, ge=0, description="Unix time: only samples after it."),
        points: int = Query(720, ge=1, le=MAX_POINTS, description="Most samples, thinned evenly."),
    ) -> dict[str, Any]:
        sampler: Sampler | None = getattr(app.state, "sampler", None)
        if sampler is None:
            raise APIError(503, "the dashboard's history is not running (the server is starting or stopping)")
        rows = await asyncio.to_thread(sampler.history.read, since, points)
        s = ctx.settings
        return {
            "interval": s.dashboard_sample_interval,
            "retention": s.dashboard_history_retention,
            "snapshots": [{"t": t, "values": values} for t, values in rows],
        }
