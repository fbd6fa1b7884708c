"""The seam between the engine and a scheduling strategy plugin, as two Protocols.

A strategy decides how many steps are in flight; the engine owns everything else. A
:class:`~pypto_serving.SchedulerSpec` factory receives the engine as a :class:`StrategyHost` and
returns a :class:`StepStrategy`. Both are structural types: a plugin implements ``StepStrategy``
without inheriting from it, and type-checks against them with the names the package root exports.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from .messages import StepResult
    from .scheduler import SchedulerOutput

__all__ = ["StepStrategy", "StrategyHost"]


class StrategyHost(Protocol):
    """What a strategy may call on the engine; the engine calls nothing else on the strategy's behalf."""

    def schedule(self) -> SchedulerOutput | None:
        """Pick the next step's work and advance its requests optimistically.

        :return: the step to dispatch, or ``None`` when nothing is runnable now.
        """
        ...

    def submit(self, out: SchedulerOutput) -> None:
        """Send a scheduled step to the worker without waiting for it.

        :param out: a step ``schedule()`` returned and that was not submitted before.
        """
        ...

    def wait_result(self) -> StepResult:
        """Block until the worker answers the oldest submitted step (steps answer in submit order).

        :return: that step's result.
        """
        ...

    def apply(self, out: SchedulerOutput, result: StepResult) -> None:
        """Commit a step's result to the requests it carried (a failed step fails them).

        :param out: the submitted step, applied in submit order.
        :param result: the result ``wait_result()`` returned for it.
        """
        ...


class StepStrategy(Protocol):
    """A scheduling strategy: drives :class:`StrategyHost` one engine step at a time."""

    def step(self) -> None:
        """Make progress: schedule, submit, wait for and apply steps as the strategy sees fit.

        Called by the engine's own step; the engine collects the requests' outputs afterwards.
        """
        ...

    def drain(self) -> None:
        """Wait for and apply every step still in flight (the engine calls it before shutting down)."""
        ...
