"""Helpers of the router tests: the router on a loopback port in a thread, and a fake-executor replica
as its own process (``python -m tests.core.server.router_helpers MODEL_DIR PORT STEP_SLEEP``), which a
router can launch from its config and a test can kill."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Any

# Every replica of the router tests: room for multi-turn chats, and a KV cache that never preempts.
# One forward a command: the router's tests pace requests by the replicas' step time and count a
# stream's chunks one token each.
REPLICA_SETTINGS: dict[str, Any] = {"max_model_len": 1024, "num_kv_blocks": 2048, "num_scheduler_steps": 1}


def replica_options(step_sleep: float) -> dict[str, Any]:
    return {**REPLICA_SETTINGS, "executor_options": {"max_model_len": 1024, "step_sleep": step_sleep}}


class RouterThread:
    """``pypto-serving router``'s app under uvicorn on 127.0.0.1 in a background thread."""

    def __init__(self, settings: Any) -> None:
        import uvicorn

        from pypto_serving.router import build_router_app
        from tests.core.server.server_helpers import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.app = build_router_app(settings)
        self.state = self.app.state.router
        config = uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "the router did not start"
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(60)


def main(argv: list[str]) -> None:
    """A replica process: the fake executor behind the real app and transport."""
    from pypto_serving.server import build_app
    from pypto_serving.server.transport import ServingServer, uvicorn_config
    from tests.core.server.conftest import start_llm

    model_dir, port, step_sleep = Path(argv[0]), int(argv[1]), float(argv[2])
    llm = start_llm(model_dir, **replica_options(step_sleep))
    config = uvicorn_config(build_app(llm, manage_engine=False), llm.settings)
    config.host, config.port = "127.0.0.1", port
    try:
        ServingServer(config, llm, llm.settings.shutdown_timeout).run()
    finally:
        llm.shutdown(10)


if __name__ == "__main__":
    main(sys.argv[1:])
