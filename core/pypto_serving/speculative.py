"""Speculative-token policies: how many draft tokens ``k`` to reserve for a request in one step.

A policy is a :data:`SpecPolicy`, called as ``policy(request, max_k) -> k`` for each decode of a
step on an executor that drafts. ``max_k`` is the scheduler's cap (remaining token budget,
``max_tokens``, context length, the executor's drafting depth); a policy returns ``0 <= k <= max_k``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from .hookspecs import SpecPolicySpec, hookimpl

if TYPE_CHECKING:
    from .config import ServingSettings
    from .request import Request

__all__ = ["SpecPolicy", "greedy_policy", "no_speculation"]

SpecPolicy = Callable[["Request", int], int]
"""``policy(request, max_k) -> k``: draft tokens to reserve for ``request``'s decode this step."""


def no_speculation(settings: ServingSettings) -> SpecPolicy:
    def policy(request: Request, max_k: int) -> int:
        return 0

    return policy


def greedy_policy(settings: ServingSettings) -> SpecPolicy:
    """``k = num_speculative_tokens`` for greedy requests, else 0.

    Requests with penalties or ``min_tokens`` still to reach also get 0: their logits depend on the
    tokens drafted just before, so verifying several positions in one pass would change the result.
    """
    k = settings.speculative_config.num_speculative_tokens if settings.speculative_config else 0

    def policy(request: Request, max_k: int) -> int:
        sp = request.sampling_params
        if not sp.greedy or sp.has_penalties:
            return 0
        if request.num_produced < sp.min_tokens:
            return 0
        return max(0, min(k, max_k))

    return policy


@hookimpl
def pypto_serving_register_spec_policies() -> list[SpecPolicySpec]:
    return [
        SpecPolicySpec("none", no_speculation, "never speculate"),
        SpecPolicySpec("greedy", greedy_policy, "k draft tokens for decodes of greedy requests, 0 otherwise"),
    ]
