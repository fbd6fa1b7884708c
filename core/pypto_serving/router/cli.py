"""``pypto-serving router``: an OpenAI-compatible router in front of serving replicas (docs/router.md)."""

from __future__ import annotations

import argparse
import logging
import math
import sys
from typing import Any

import uvicorn

from ..config import SettingsError
from ..graceful import ReturningServer
from .config import RouterSettings, add_router_arguments, router_settings_from_args

__all__ = ["add_router_command", "run_router"]

_LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

_DESCRIPTION = """\
Route OpenAI API requests over replicas (pypto-serving serve, on this host or others), given by URL
in the config file's [[replicas]] tables or with --replica URL. A request with a session header goes
to its session's replica (rendezvous hashing); one sharing leading prompt blocks with an earlier one
goes where that one went unless that replica is overloaded; the rest go to the replica with the
fewest outstanding tokens. Unhealthy and drained replicas get no new requests; a request whose
replica fails before answering is sent to another one. A replica entry with a command is started
and stopped by the router. Admin routes (/router/replicas, .../drain, .../undrain) need
--admin-token. See docs/router.md."""


def add_router_command(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "router",
        help="route the OpenAI API over serving replicas (session affinity, prefix-aware, least tokens)",
        description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_router_arguments(p)
    p.set_defaults(func=_cmd_router)


def _cmd_router(args: argparse.Namespace) -> int:
    settings = router_settings_from_args(args)  # a SettingsError becomes "pypto-serving: error: ..."
    if not settings.replicas:
        raise SettingsError("no replicas: give [[replicas]] in --config FILE or --replica URL")
    return run_router(settings)


class _RouterServer(ReturningServer):
    """uvicorn whose SIGINT/SIGTERM end in a normal return (exit 0) after the graceful shutdown."""


def run_router(settings: RouterSettings) -> int:
    """Bind, serve until SIGINT/SIGTERM, stop launched replicas; returns the exit code."""
    from ..server.cli import _bind
    from ..server.transport import timed_h11
    from .app import build_router_app

    logging.basicConfig(level=settings.log_level.upper(), format=_LOG_FORMAT)
    try:
        sock = _bind(settings.host, settings.port)
    except OSError as e:
        print(
            f"pypto-serving: error: cannot listen on {settings.host}:{settings.port}: {e.strerror or e}",
            file=sys.stderr,
        )
        return 2
    app = build_router_app(settings)
    host, port = sock.getsockname()[:2]
    names = ", ".join(r.name or r.url for r in settings.replicas)
    print(f"pypto-serving router: routing on http://{host}:{port} to {names}", flush=True)
    config = uvicorn.Config(
        app,
        log_level=settings.log_level,
        access_log=False,
        # serve's defaults for a client's headers and body: a stalled client cannot hold a connection
        http=timed_h11(header_timeout=10.0, body_timeout=30.0),
        timeout_graceful_shutdown=math.ceil(settings.shutdown_timeout),
    )
    server = _RouterServer(config)
    try:
        server.run(sockets=[sock])
    except SystemExit:  # uvicorn exits (code 3) when the lifespan fails; the message below says so
        pass
    finally:
        sock.close()
    if not server.started:  # the lifespan failed (a replica's command could not start): uvicorn logged why
        print("pypto-serving: error: the router did not start (see the log above)", file=sys.stderr)
        return 1
    return 0
