"""The ``sync`` scheduling strategy: schedule -> execute -> update, one step at a time."""

from __future__ import annotations

from pypto_serving import SchedulerSpec, StrategyHost, hookimpl

__all__ = ["SyncStrategy"]


class SyncStrategy:
    """One step in flight: the simplest strategy, and the reference the async one must equal."""

    def __init__(self, host: StrategyHost) -> None:
        self.host = host

    def step(self) -> None:
        out = self.host.schedule()
        if out is None:
            return
        self.host.submit(out)
        self.host.apply(out, self.host.wait_result())

    def drain(self) -> None:
        """Nothing to do: every step is applied within the ``step()`` that submitted it."""


@hookimpl
def pypto_serving_register_schedulers() -> list[SchedulerSpec]:
    return [
        SchedulerSpec(name="sync", factory=SyncStrategy, pipelined=False, description="schedule -> execute -> update")
    ]
