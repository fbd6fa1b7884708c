"""The speculative-token policy contract: :data:`SpecPolicy` and the :class:`StepObservation` a
policy's ``observe`` receives.

A leaf module (nothing of the core at run time), so that the plugin contract (``hookspecs``) and the
scheduler name these types without importing the built-in policies of :mod:`.speculative`, which
register themselves through ``hookspecs``: that was an import loop.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .request import Request

__all__ = ["SpecPolicy", "StepObservation"]

SpecPolicy = Callable[["Request", int], int]
"""``policy(request, max_k) -> k``: draft tokens to reserve for ``request``'s decode this step."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StepObservation:
    """One finished step, as a policy's ``observe`` sees it.

    :param num_tokens: tokens the step computed (scheduled tokens plus draft positions).
    :param num_decodes: requests that sampled in the step.
    :param num_drafted: draft tokens verified in the step.
    :param num_accepted: of those, accepted.
    :param seconds: the worker's time for the step (forward, sampling, drafting); 0 when unknown.
    :param draft_seconds: the part of ``seconds`` spent proposing the next step's drafts.
    :param draft_depth: the drafting depth the step's command asked for (None: the configured one).
    :param num_rejections: requests whose verification rejected a draft in the step (one each at
        most: a request's verification stops at its first rejection; reserved draft slots the
        worker held no draft for count as rejected).
    """

    num_tokens: int
    num_decodes: int
    num_drafted: int
    num_accepted: int
    seconds: float
    draft_seconds: float = 0.0
    draft_depth: int | None = None
    num_rejections: int = 0
