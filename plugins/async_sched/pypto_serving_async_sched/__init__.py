"""The ``async`` scheduling strategy: step N+1 is scheduled and dispatched while step N runs.

The scheduler does the bookkeeping that makes this exact: scheduling advances each request
optimistically and reserves ``1 + k`` output placeholders per sampling entry; a decode whose input
is still being sampled carries ``use_last_sampled`` (the worker resolves it from its own cache);
applying a result releases the placeholders and gives back rejected draft positions. Results of
requests aborted or preempted in the meantime are discarded by their epoch.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from pypto_serving import SchedulerSpec, hookimpl

__all__ = ["AsyncStrategy"]

DEPTH = 2


class AsyncStrategy:
    """At most ``DEPTH`` steps in flight; each call dispatches one and applies the oldest."""

    def __init__(self, core: Any) -> None:
        self.core = core
        self.in_flight: deque[Any] = deque()

    def step(self) -> None:
        dispatched = False
        if len(self.in_flight) < DEPTH:
            out = self.core.schedule()
            if out is not None:
                self.core.submit(out)
                self.in_flight.append(out)
                dispatched = True
        if self.in_flight and (len(self.in_flight) == DEPTH or not dispatched):
            self._apply_oldest()

    def _apply_oldest(self) -> None:
        out = self.in_flight.popleft()
        try:
            result = self.core.wait_result()
        except BaseException:
            self.in_flight.clear()  # the worker is gone; the engine fails every live request
            raise
        # A failed step fails the requests it carried (``apply``); their entries in the later step,
        # built on this step's optimistic state, are discarded when that result is applied, since
        # those requests are finished by then. Requests only in the later step did not depend on
        # this one and keep their result.
        self.core.apply(out, result)

    def drain(self) -> None:
        """Apply every in-flight result (used at shutdown)."""
        while self.in_flight:
            self._apply_oldest()


@hookimpl
def pypto_serving_register_schedulers() -> list[SchedulerSpec]:
    return [
        SchedulerSpec(
            "async",
            AsyncStrategy,
            pipelined=True,
            description="depth-2 pipelined scheduling with placeholders",
        )
    ]
