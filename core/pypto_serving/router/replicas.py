"""The replicas behind the router: their connection pools, health polling and launched processes.

A replica is any server speaking the OpenAI API with a ``/health`` route (``pypto-serving serve``
anywhere, or another engine). The router polls each one's ``/health`` every ``health_interval``: a
``200`` marks it healthy, ``unhealthy_after`` failed polls in a row mark it unhealthy, and a request
that cannot reach it marks it unhealthy at once (the next good poll brings it back). A replica entry
with a ``command`` is started by the router as a subprocess (its own session, output to its log
file) and stopped at shutdown: SIGTERM, then after ``stop_timeout`` SIGKILL to its process group.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import IO, Any

import httpx

from .config import ReplicaConfig, RouterSettings
from .routing import ReplicaLoad

__all__ = ["Recover", "Replica", "launch", "poll_health", "stop"]

logger = logging.getLogger("pypto_serving.router")

# A launched replica exiting within this long of its start waits twice as long before the next one.
_YOUNG_S, _MAX_DELAY_S = 60.0, 60.0


@dataclass(slots=True)
class Replica:
    """One replica's runtime state beside its configuration."""

    config: ReplicaConfig
    load: ReplicaLoad
    client: httpx.AsyncClient
    # Polls have a connection of their own: a pool full of requests is load, not a failed check.
    health_client: httpx.AsyncClient
    failed_polls: int = 0
    last_error: str | None = None
    process: subprocess.Popen[bytes] | None = None
    log: IO[bytes] | None = field(default=None, repr=False)
    started_at: float = 0.0  # monotonic time of the last launch
    restarts: int = 0
    last_exit_code: int | None = None  # of the last launched process that exited
    restart_at: float | None = None  # when an exited process is started again
    restart_delay: float = 0.0  # the wait before that start

    @property
    def name(self) -> str:
        return self.load.name

    @property
    def url(self) -> str:
        return self.config.url

    def mark_down(self, reason: str) -> None:
        if self.load.healthy:
            logger.warning("replica %s is unhealthy: %s", self.name, reason)
        self.load.healthy = False
        self.last_error = reason

    def mark_up(self) -> None:
        if not self.load.healthy:
            logger.info("replica %s is healthy", self.name)
        self.load.healthy = True
        self.failed_polls = 0
        self.last_error = None

    def describe(self) -> dict[str, Any]:
        """The replica as the admin route shows it."""
        process = self.process
        return {
            "name": self.name,
            "url": self.url,
            "healthy": self.load.healthy,
            "drained": self.load.drained,
            "outstanding_tokens": self.load.outstanding_tokens,
            "in_flight": self.load.in_flight,
            "last_error": self.last_error,
            "pid": None if process is None else process.pid,
            "exit_code": None if process is None else process.poll(),
            "restarts": self.restarts,
            "last_exit_code": self.last_exit_code,
        }


def make_replica(config: ReplicaConfig, settings: RouterSettings) -> Replica:
    """A replica with its own bounded connection pool (so one slow replica cannot take every connection)."""
    limit = settings.max_connections_per_replica
    timeout = httpx.Timeout(settings.read_timeout, connect=settings.connect_timeout, pool=settings.connect_timeout)
    client = httpx.AsyncClient(
        base_url=config.url,
        limits=httpx.Limits(max_connections=limit, max_keepalive_connections=limit),
        timeout=timeout,
        trust_env=False,  # a proxy from the environment must not sit between the router and its replicas
    )
    health_client = httpx.AsyncClient(
        base_url=config.url,
        limits=httpx.Limits(max_connections=1, max_keepalive_connections=1),
        timeout=settings.health_timeout,
        trust_env=False,
    )
    assert config.name is not None
    return Replica(config=config, load=ReplicaLoad(config.name), client=client, health_client=health_client)


# Run when a replica that was not healthy answers /health: why it must stay out of routing, or None.
Recover = Callable[[Replica], Awaitable[str | None]]


async def poll_once(replica: Replica, settings: RouterSettings, recover: Recover | None = None) -> None:
    if settings.restart_replicas:
        supervise(replica, settings)
    try:
        response = await replica.health_client.get("/health")
    except httpx.HTTPError as e:
        reason = f"/health: {type(e).__name__}: {e}"
    else:
        if response.status_code == 200:
            held_back = None if replica.load.healthy or recover is None else await recover(replica)
            if held_back is None:
                replica.mark_up()
                return
            replica.last_error = held_back
            logger.warning("replica %s stays out of routing: %s", replica.name, held_back)
            return
        reason = f"/health answered {response.status_code}: {response.text[:200]}"
    if replica.process is not None and (code := replica.process.poll()) is not None:
        reason = f"its process exited with code {code}; {reason}"
    replica.failed_polls += 1
    if replica.failed_polls >= settings.unhealthy_after or not replica.load.healthy:
        replica.mark_down(reason)


async def poll_health(replicas: list[Replica], settings: RouterSettings, recover: Recover | None = None) -> None:
    """Poll every replica's /health forever (cancelled at shutdown)."""
    while True:
        started = time.monotonic()
        await asyncio.gather(*(poll_once(r, settings, recover) for r in replicas))
        await asyncio.sleep(max(0.0, settings.health_interval - (time.monotonic() - started)))


def launch(replica: Replica, settings: RouterSettings) -> None:
    """Start the replica's command, its output appended to its log file."""
    command = replica.config.command
    assert command
    path = replica.config.log_file or settings.log_dir / f"{replica.name.replace(':', '_').replace('/', '_')}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    replica.log = path.open("ab")
    try:
        replica.process = subprocess.Popen(
            command,
            stdout=replica.log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **replica.config.env},
            start_new_session=True,  # its own process group, so stopping it reaches its children too
        )
    except OSError as e:
        replica.log.close()
        raise OSError(f"cannot start replica {replica.name} ({command[0]}): {e.strerror or e}") from e
    replica.started_at = time.monotonic()
    logger.info("started replica %s (pid %d), log %s", replica.name, replica.process.pid, path)


def supervise(replica: Replica, settings: RouterSettings) -> None:
    """Start a launched replica again once its process has exited: after ``restart_delay``, doubled
    (up to a minute) while it keeps exiting within a minute of its start, so a replica that cannot
    come up does not spin. Until it answers /health again it takes no requests."""
    process, now = replica.process, time.monotonic()
    if process is None or process.poll() is None:
        return
    if replica.restart_at is None:
        young = now - replica.started_at < _YOUNG_S
        replica.restart_delay = min(2 * replica.restart_delay, _MAX_DELAY_S) if young else settings.restart_delay
        replica.restart_delay = max(replica.restart_delay, settings.restart_delay)
        replica.restart_at = now + replica.restart_delay
        replica.last_exit_code = process.returncode
        replica.mark_down(f"its process exited with code {process.returncode}")
        logger.warning(
            "replica %s exited (code %s): starting it again in %.1fs",
            replica.name,
            process.returncode,
            replica.restart_delay,
        )
        return
    if now < replica.restart_at:
        return
    replica.restart_at = None
    if replica.log is not None:
        replica.log.close()
    try:
        launch(replica, settings)
    except OSError as e:
        logger.error("%s", e)
        replica.started_at = now  # counts as dying young: the next try waits longer
        return
    replica.restarts += 1


def stop(replica: Replica, timeout: float) -> None:
    """SIGTERM the launched process (``serve`` drains), then SIGKILL its group if it outlives ``timeout``."""
    process = replica.process
    if process is None:
        return
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            logger.warning("replica %s did not stop within %gs: killing it", replica.name, timeout)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)  # what the replica left behind (engine, workers)
    process.wait()
    if replica.log is not None:
        replica.log.close()
    logger.info("stopped replica %s (exit code %s)", replica.name, process.returncode)
