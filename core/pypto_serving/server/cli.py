"""``pypto-serving serve``: load the engine, then serve the OpenAI API on uvicorn.

Start-up order matters for clear failures: settings are validated first, the port is bound next
(a port in use fails in milliseconds, not after loading weights), then the engine loads, and only
then does uvicorn start accepting on the already-bound socket.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import signal
import socket
import sys
import threading
from collections.abc import Iterator
from typing import Any

from ..config import SettingsError, add_settings_arguments, settings_from_args
from ..engine import read_architecture
from ..plugins import PluginError

__all__ = ["add_serve_command", "run_server"]

logger = logging.getLogger("pypto_serving.server")


def add_serve_command(subparsers: Any) -> None:
    p = subparsers.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    p.add_argument("--config", help="TOML or YAML settings file (see examples/serve.toml)")
    p.add_argument("--model", help="model directory")
    add_settings_arguments(p)
    p.set_defaults(func=_cmd_serve)


def _fail(message: str) -> int:
    print(f"pypto-serving: error: {message}", file=sys.stderr)
    return 2


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _server_class() -> Any:
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn re-raises SIGTERM/SIGINT after its graceful shutdown, which makes the process die
        by the signal (exit -15). A drained shutdown is a success, so we handle the signals ourselves:
        stop accepting, let uvicorn wait for in-flight responses, and return normally (exit 0)."""

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    return Server


def _cmd_serve(args: argparse.Namespace) -> int:
    try:
        settings = settings_from_args(args)
        if settings.model is None and settings.executor == "auto":
            raise SettingsError("serve needs a model: pass --model DIR or set model in the config file")
        read_architecture(settings.model)  # a missing directory or config.json fails here, before binding
    except (SettingsError, ValueError) as e:
        return _fail(str(e))
    return run_server(settings)


def run_server(settings: Any, plugins: Any = None) -> int:
    """Bind, load, serve until SIGINT/SIGTERM; returns the process exit code."""
    import uvicorn

    from ..engine import EngineDeadError
    from ..executor import WorkerError
    from .app import build_app
    from .async_llm import AsyncLLM

    _Server = _server_class()

    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        sock = _bind(settings.host, settings.port)
    except OSError as e:
        return _fail(f"cannot listen on {settings.host}:{settings.port}: {e.strerror or e}")
    llm = AsyncLLM(settings, plugins)
    try:
        llm.wait_ready()
    except (SettingsError, PluginError, WorkerError, EngineDeadError, ValueError, OSError) as e:
        sock.close()
        return _fail(str(e).splitlines()[0] if str(e) else type(e).__name__)
    app = build_app(llm, settings)
    host, port = sock.getsockname()[:2]
    # Printed (not only logged) so wrappers and tests can find the port when port = 0.
    print(f"pypto-serving: serving {settings.model} on http://{host}:{port}", flush=True)
    config = uvicorn.Config(
        app,
        log_level=settings.log_level,
        # uvicorn treats 0 as "wait forever", so the shortest real wait is one second.
        timeout_graceful_shutdown=max(1, math.ceil(settings.shutdown_timeout)),
        access_log=settings.log_level == "debug",
    )
    server = _Server(config)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
        llm.shutdown(max(5.0, settings.shutdown_timeout))
    return 0
