"""Start ``pypto-serving serve`` as a child process for ``bench serve`` and stop it afterwards."""

from __future__ import annotations

import argparse
import contextlib
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import IO

from ..config import ServingSettings

__all__ = ["serve_command", "started_server"]

_SERVING = re.compile(r"pypto-serving: serving .* on (http://\S+)")


def serve_command(args: argparse.Namespace) -> list[str]:
    """``python -m pypto_serving.cli serve`` with the settings flags given to ``bench serve``; port 0
    (a free one) unless ``--port`` was given."""
    cmd = [sys.executable, "-m", "pypto_serving.cli", "serve"]
    if args.model:
        cmd += ["--model", args.model]
    if args.config:
        cmd += ["--config", args.config]
    for name in ServingSettings.model_fields:
        value = getattr(args, f"setting_{name}", None)
        if value is not None:
            cmd += ["--" + name.replace("_", "-"), str(value)]
    if getattr(args, "setting_port", None) is None:
        cmd += ["--port", "0"]
    if getattr(args, "setting_log_level", None) is None:
        cmd += ["--log-level", "warning"]  # no access-log line per benchmark request
    return cmd


def _pump(stream: IO[str], lines: queue.Queue[str | None]) -> None:
    """Forward the server's output to stderr, and each line to the queue until the URL is seen."""
    for line in stream:
        sys.stderr.write(line)
        lines.put(line)
    lines.put(None)


def _wait_url(proc: subprocess.Popen[str], lines: queue.Queue[str | None], timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while True:
        try:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise ValueError(f"the server did not listen within {timeout:.0f} s") from None
        if line is None:
            raise ValueError(f"the server exited before listening (exit code {proc.wait()})")
        if m := _SERVING.search(line):
            return m.group(1)


@contextlib.contextmanager
def started_server(args: argparse.Namespace) -> Iterator[str]:
    """Yield the base URL of a freshly started server; SIGTERM (then SIGKILL) it on exit."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(serve_command(args), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: queue.Queue[str | None] = queue.Queue()
    assert proc.stdout is not None
    threading.Thread(target=_pump, args=(proc.stdout, lines), daemon=True).start()
    try:
        yield _wait_url(proc, lines, args.server_timeout)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
