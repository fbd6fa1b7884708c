"""Fixtures of the server tests: a fake-executor model directory with a real tokenizer, and app
factories (in-process via TestClient, or a real uvicorn on a loopback port in a thread).

The per-test factories run the engine in a thread (``engine_mode = "thread"``): a core process costs
each server a Python start and a torch import, and many of these tests inspect the engine itself.
The module-wide ``shared_client`` runs the default engine-core process, so the read-only API tests
cross the process boundary; ``test_engine_process.py`` covers that mode's own behaviour."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.core.server.server_helpers import free_port, write_fake_model

VOCAB = 320


@pytest.fixture(scope="session")
def fake_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_fake_model(tmp_path_factory.mktemp("fake_model") / "tiny-fake", VOCAB)


def fake_settings(model_dir: Path, **overrides: Any) -> Any:
    from pypto_serving import ServingSettings

    options = {"vocab": VOCAB, "max_model_len": 128, **overrides.pop("executor_options", {})}
    values: dict[str, Any] = dict(
        model=str(model_dir),
        executor="fake",
        worker_mode="inproc",
        scheduler="sync",
        block_size=4,
        num_kv_blocks=128,
        executor_options=options,
        enable_prefix_caching=False,
        engine_mode="thread",
    )
    values.update(overrides)
    return ServingSettings(**values)


def start_llm(model_dir: Path, **overrides: Any) -> Any:
    from pypto_serving import PluginManager
    from pypto_serving.server import AsyncLLM
    from tests.fakes import FakePlugin

    llm = AsyncLLM(fake_settings(model_dir, **overrides), PluginManager(extra_plugins=[FakePlugin]))
    llm.wait_ready(60)
    return llm


@pytest.fixture
def make_client(fake_model_dir: Path) -> Iterator[Callable[..., tuple[Any, Any]]]:
    """``make_client(**settings) -> (TestClient, AsyncLLM)``; everything is closed at teardown."""
    pytest.importorskip("pypto_serving_sync_sched")
    from fastapi.testclient import TestClient

    from pypto_serving.server import build_app

    made: list[tuple[Any, Any]] = []

    def factory(**overrides: Any) -> tuple[Any, Any]:
        llm = start_llm(fake_model_dir, **overrides)
        client = TestClient(build_app(llm, manage_engine=False), raise_server_exceptions=False)
        client.__enter__()
        made.append((client, llm))
        return client, llm

    yield factory
    for client, llm in made:
        client.__exit__(None, None, None)
        llm.shutdown(10)


@pytest.fixture(scope="module")
def shared_client(fake_model_dir: Path) -> Iterator[tuple[Any, Any]]:
    """One default app for the many read-only API tests of a module (saves engine start-ups)."""
    pytest.importorskip("pypto_serving_sync_sched")
    from fastapi.testclient import TestClient

    from pypto_serving.server import build_app

    llm = start_llm(fake_model_dir, engine_mode="process")
    with TestClient(build_app(llm, manage_engine=False), raise_server_exceptions=False) as client:
        yield client, llm
    llm.shutdown(10)


class LiveServer:
    """uvicorn serving the app on 127.0.0.1 in a background thread (real sockets, real disconnects)."""

    def __init__(self, app: Any, llm: Any = None) -> None:
        """With ``llm``, the transport ``serve`` uses (timeouts, shutdown cut) from its settings."""
        import uvicorn

        from pypto_serving.server.transport import ServingServer, uvicorn_config

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        if llm is None:
            self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        else:
            config = uvicorn_config(app, llm.settings)
            config.host, config.port = "127.0.0.1", self.port
            self.server = ServingServer(config, llm, llm.settings.shutdown_timeout)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)


@pytest.fixture
def live_server(fake_model_dir: Path) -> Iterator[Callable[..., tuple[LiveServer, Any]]]:
    pytest.importorskip("pypto_serving_sync_sched")
    from pypto_serving.server import build_app

    made: list[tuple[LiveServer, Any]] = []

    def factory(**overrides: Any) -> tuple[LiveServer, Any]:
        llm = start_llm(fake_model_dir, **overrides)
        server = LiveServer(build_app(llm, manage_engine=False), llm=llm)
        made.append((server, llm))
        return server, llm

    yield factory
    for server, llm in made:
        server.stop()
        llm.shutdown(10)
