"""``pypto-serving serve``: load the engine, then serve the OpenAI API on uvicorn.

Start-up order matters for clear failures: settings are validated first, the port is bound next
(a port in use fails in milliseconds, not after loading weights), then the engine loads, and only
then does uvicorn start accepting on the already-bound socket.
"""

from __future__ import annotations

import argparse
import logging
import socket
import sys
from typing import Any

from ..config import SettingsError, add_settings_arguments, settings_from_args
from ..engine import read_architecture
from ..model_files import check_max_model_len
from ..plugins import PluginError, PluginManager, require_model

__all__ = ["add_serve_command", "run_server"]

logger = logging.getLogger("pypto_serving.server")

_LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def add_serve_command(subparsers: Any) -> None:
    p = subparsers.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    p.add_argument("--config", metavar="FILE", help="TOML or YAML settings file (see examples/serve.toml)")
    p.add_argument("--model", metavar="DIR|NAME", help="model directory or named model (default: the default one)")
    add_settings_arguments(p)
    p.set_defaults(func=_cmd_serve)


def _fail(message: str) -> int:
    print(f"pypto-serving: error: {message}", file=sys.stderr)
    return 2


def _bind(host: str, port: int) -> socket.socket:
    """The listening socket, made with ``IPPROTO_TCP``: asyncio sets ``TCP_NODELAY`` on accepted
    connections only when their protocol says TCP, and without it Nagle's algorithm plus the client's
    delayed ACK add about 40 ms to every response on a reused keep-alive connection."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _cmd_serve(args: argparse.Namespace) -> int:
    try:
        settings = settings_from_args(args)
        logging.basicConfig(level=settings.log_level.upper(), format=_LOG_FORMAT)
        plugins = PluginManager()
        settings = require_model(plugins, settings, "serve")
        read_architecture(settings.model)  # a missing directory or config.json fails here, before binding
        check_max_model_len(settings)
    except (SettingsError, PluginError, ValueError) as e:
        return _fail(str(e))
    return run_server(settings, plugins)


def run_server(settings: Any, plugins: Any = None) -> int:
    """Bind, load, serve until SIGINT/SIGTERM; returns the process exit code: 0 after a drained
    shutdown, 1 when the worker kept dying past the restart budget (so a supervisor restarts us)."""
    from ..engine import EngineDeadError
    from ..worker import WorkerError, keep_off_workers
    from .app import build_app, served_model_name
    from .data_parallel import make_llm
    from .openai_requests import warm_grammars
    from .transport import ServingServer, uvicorn_config

    logging.basicConfig(level=settings.log_level.upper(), format=_LOG_FORMAT)
    try:
        sock = _bind(settings.host, settings.port)
    except OSError as e:
        return _fail(f"cannot listen on {settings.host}:{settings.port}: {e.strerror or e}")
    fatal: list[str] = []
    server: ServingServer | None = None

    def give_up(reason: str) -> None:  # the engine thread is out of restarts: stop serving, exit 1
        fatal.append(reason)
        if server is not None:
            server.should_exit = True

    llm = make_llm(settings, plugins, on_fatal=give_up)
    try:
        keep_off_workers(llm.settings)  # this process and the engine cores it starts (engine_cpu_bind)
        llm.wait_ready()
    except (SettingsError, PluginError, WorkerError, EngineDeadError, ValueError, OSError) as e:
        sock.close()
        return _fail(str(e).splitlines()[0] if str(e) else type(e).__name__)
    settings = llm.settings  # with a named model resolved to its directory
    app = build_app(llm, settings)
    warm_grammars(app.state.ctx)
    host, port = sock.getsockname()[:2]
    # Printed (not only logged) so wrappers and tests can find the port when port = 0.
    print(f"pypto-serving: serving {served_model_name(settings)} on http://{host}:{port}", flush=True)
    server = ServingServer(uvicorn_config(app, settings), llm, settings.shutdown_timeout)
    server.should_exit = bool(fatal)  # restarts ran out while the server was being built

    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
        llm.shutdown(max(5.0, settings.shutdown_timeout))
    if fatal:
        print(f"pypto-serving: error: {fatal[0]}", file=sys.stderr, flush=True)
        return 1
    return 0
