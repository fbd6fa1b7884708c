"""The ``async`` scheduling strategy: step N+1 is scheduled and dispatched while step N runs.

The scheduler does the bookkeeping that makes this exact: scheduling advances each request
optimistically and reserves ``1 + k`` output placeholders per sampling entry; a decode whose input
is still being sampled carries ``use_last_sampled`` (the worker resolves it from its own cache);
applying a result releases the placeholders and gives back rejected draft positions. Results of
requests aborted (finished) or preempted (``SchedState.valid_from``) in the meantime are discarded.
"""

from __future__ import annotations

from collections import deque

from pypto_serving import SchedulerOutput, SchedulerSpec, StrategyHost, hookimpl

__all__ = ["AsyncStrategy"]

DEPTH = 2


class AsyncStrategy:
    """At most ``DEPTH`` steps in flight; each call dispatches one and applies the oldest."""

    def __init__(self, host: StrategyHost) -> None:
        self.host = host
        self.in_flight: deque[SchedulerOutput] = deque()

    def step(self) -> None:
        dispatched = False
        if len(self.in_flight) < DEPTH:
            out = self.host.schedule()
            if out is not None:
                self.host.submit(out)
                self.in_flight.append(out)
                dispatched = True
        if self.in_flight and (len(self.in_flight) == DEPTH or not dispatched):
            self._apply_oldest()

    def _apply_oldest(self) -> None:
        out = self.in_flight.popleft()
        try:
            result = self.host.wait_result()
        except BaseException:
            self.in_flight.clear()  # the worker is gone; the engine fails every live request
            raise
        # A failed step fails the requests it carried (``apply``); their entries in the later step,
        # built on this step's optimistic state, are discarded when that result is applied, since
        # those requests are finished by then. Requests only in the later step did not depend on
        # this one and keep their result.
        self.host.apply(out, result)

    def drain(self) -> None:
        """Apply every in-flight result (the engine calls it before shutting down)."""
        while self.in_flight:
            self._apply_oldest()


@hookimpl
def pypto_serving_register_schedulers() -> list[SchedulerSpec]:
    return [
        SchedulerSpec(
            name="async",
            factory=AsyncStrategy,
            pipelined=True,
            description="depth-2 pipelined scheduling with placeholders",
        )
    ]
