"""The ``sync`` scheduling strategy: schedule -> execute -> update, one step at a time."""

from __future__ import annotations

from typing import Any

from pypto_serving import SchedulerSpec, hookimpl

__all__ = ["SyncStrategy"]


class SyncStrategy:
    """One step in flight: the simplest strategy, and the reference the async one must equal."""

    def __init__(self, core: Any) -> None:
        self.core = core

    def step(self) -> None:
        out = self.core.schedule()
        if out is None:
            return
        self.core.submit(out)
        self.core.apply(out, self.core.wait_result())


@hookimpl
def pypto_serving_register_schedulers() -> list[SchedulerSpec]:
    return [SchedulerSpec("sync", SyncStrategy, pipelined=False, description="schedule -> execute -> update")]
