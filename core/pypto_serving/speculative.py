"""Speculative-token policies: how many draft tokens ``k`` to reserve for a request in one step.

A policy is a callable ``(request, is_decode, max_k) -> int``. ``max_k`` is the scheduler's cap
(remaining token budget, ``max_tokens``, context length, the executor's drafting depth); a policy
never returns more than it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from .hookspecs import SpecPolicySpec, hookimpl

if TYPE_CHECKING:
    from .config import ServingSettings
    from .request import Request

__all__ = ["SpecPolicy", "greedy_policy", "no_speculation"]

SpecPolicy = Callable[["Request", bool, int], int]


def no_speculation(settings: ServingSettings) -> SpecPolicy:
    def policy(request: Request, is_decode: bool, max_k: int) -> int:
        return 0

    return policy


def greedy_policy(settings: ServingSettings) -> SpecPolicy:
    """The seed rule: ``k = num_speculative_tokens`` for decode steps of greedy requests, else 0.

    Requests with penalties or ``min_tokens`` also get 0: their logits depend on the tokens drafted
    just before, so verifying several positions in one pass would change the result.
    """
    k = settings.speculative_config.num_speculative_tokens if settings.speculative_config else 0

    def policy(request: Request, is_decode: bool, max_k: int) -> int:
        sp = request.sampling_params
        if not is_decode or not sp.greedy or sp.has_penalties:
            return 0
        if len(request.output_token_ids) + request.num_output_placeholders < sp.min_tokens:
            return 0
        return max(0, min(k, max_k))

    return policy


@hookimpl
def pypto_serving_register_spec_policies() -> list[SpecPolicySpec]:
    return [
        SpecPolicySpec("none", no_speculation, "never speculate"),
        SpecPolicySpec("greedy", greedy_policy, "k draft tokens for greedy decode steps, 0 otherwise"),
    ]
