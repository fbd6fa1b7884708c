"""Speculative-token policies: how many draft tokens ``k`` to reserve for a request in one step.

A policy is a :data:`SpecPolicy`, called as ``policy(request, max_k) -> k`` for each decode of a
step on an executor that drafts. ``max_k`` is the scheduler's cap (remaining token budget,
``max_tokens``, context length, the drafting depth); a policy returns ``0 <= k <= max_k``. A policy
object may also have an ``observe(obs: StepObservation)`` method: the scheduler then calls it with
every step's size, time and acceptance once the step's result is applied.

Speculation never changes what a request outputs (verification is exact at every temperature), so a
policy only trades speed: it decides whether verifying ``k`` extra positions pays.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .hookspecs import SpecPolicySpec, hookimpl

if TYPE_CHECKING:
    from .config import ServingSettings
    from .request import Request

__all__ = [
    "CORE_DRAFTERS",
    "AdaptivePolicy",
    "SpecPolicy",
    "StepCostModel",
    "StepObservation",
    "adaptive_policy",
    "expected_tokens",
    "fixed_policy",
    "greedy_policy",
    "no_speculation",
]

CORE_DRAFTERS = frozenset({"ngram"})
"""Drafting methods the core runs itself (in the worker), for any executor that can verify drafts."""

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
    """

    num_tokens: int
    num_decodes: int
    num_drafted: int
    num_accepted: int
    seconds: float


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


def fixed_policy(settings: ServingSettings) -> SpecPolicy:
    """``k = num_speculative_tokens`` for every decode, greedy or sampled (verification is exact for both)."""
    k = settings.speculative_config.num_speculative_tokens if settings.speculative_config else 0

    def policy(request: Request, max_k: int) -> int:
        return max(0, min(k, max_k))

    return policy


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a step yields with ``k`` drafts when each is accepted with probability ``alpha`` given its
    predecessors were: ``1 + alpha + ... + alpha**k`` (Leviathan et al. 2023, eq. 1)."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


@dataclass(slots=True)
class StepCostModel:
    """Step time as ``a + b * tokens``, fitted by exponentially weighted least squares over recent steps.

    ``decay`` weights the past (0.98: about the last 50 steps count). The fit is usable once the
    steps seen differ enough in size to separate ``a`` from ``b`` (:attr:`ready`).
    """

    decay: float = 0.98
    w: float = 0.0
    st: float = 0.0  # weighted sums of tokens, seconds, tokens**2 and tokens*seconds
    ss: float = 0.0
    stt: float = 0.0
    sts: float = 0.0

    def add(self, tokens: int, seconds: float) -> None:
        d = self.decay
        self.w = d * self.w + 1.0
        self.st = d * self.st + tokens
        self.ss = d * self.ss + seconds
        self.stt = d * self.stt + tokens * tokens
        self.sts = d * self.sts + tokens * seconds

    @property
    def _var(self) -> float:
        return self.stt / self.w - (self.st / self.w) ** 2 if self.w else 0.0

    @property
    def ready(self) -> bool:
        """Enough steps, differing by at least one token in spread, to estimate the slope."""
        return self.w >= 4.0 and self._var >= 0.25

    def coefficients(self) -> tuple[float, float]:
        """``(a, b)``: fixed seconds per step and seconds per token, both clamped at 0."""
        mean_t, mean_s = self.st / self.w, self.ss / self.w
        b = max(0.0, (self.sts / self.w - mean_t * mean_s) / self._var)
        return max(0.0, mean_s - b * mean_t), b


class AdaptivePolicy:
    """Chooses each request's ``k`` from its acceptance rate and the measured cost of extra tokens.

    The model: a step of ``T`` tokens takes ``a + b * T`` seconds (:class:`StepCostModel`), and a
    request whose drafts are accepted with probability ``alpha`` yields :func:`expected_tokens`
    per step. With ``R`` decodes in the batch each verifying ``k`` drafts the step takes
    ``a + b * R * (1 + k)``, so ``k`` pays when ``E(alpha, k) / (1 + rho * k)`` beats 1, where
    ``rho = b * R / (a + b * R)`` is the share of the step that grows with tokens: near 0 for one
    request on a latency-bound device (speculate deeply), near 1 for a large compute-bound batch
    (do not). The best ``k`` must beat ``k = 0`` by ``margin`` or the request does not speculate.

    ``alpha`` is the request's own accepted/drafted ratio shrunk towards the engine-wide rate by
    ``prior_weight`` pseudo-drafts, so a new request starts from the engine's experience. While the
    cost fit is not ready (all steps the same size), steps alternate between ``max_k`` and ``0`` so
    both sizes get measured; the alternation stops as soon as the fit separates the two costs.
    """

    def __init__(self, k: int, *, margin: float = 1.02, prior_weight: float = 4.0) -> None:
        self.k = k
        self.margin = margin
        self.prior_weight = prior_weight
        self.cost = StepCostModel()
        self.drafted = 0
        self.accepted = 0
        self.num_decodes = 1
        self.steps = 0

    def observe(self, obs: StepObservation) -> None:
        self.steps += 1
        self.drafted += obs.num_drafted
        self.accepted += obs.num_accepted
        if obs.num_decodes:
            self.num_decodes = obs.num_decodes
        if obs.seconds > 0:
            self.cost.add(obs.num_tokens, obs.seconds)

    def alpha(self, request: Request) -> float:
        prior = (self.accepted + 1.0) / (self.drafted + 2.0)  # Laplace: 0.5 before any draft
        return (request.spec_accepted + self.prior_weight * prior) / (request.spec_drafted + self.prior_weight)

    def __call__(self, request: Request, max_k: int) -> int:
        top = min(self.k, max_k)
        if top <= 0:
            return 0
        if not self.cost.ready:
            return top if self.steps % 2 == 0 else 0
        a, b = self.cost.coefficients()
        share = b * self.num_decodes
        rho = share / (a + share) if a + share > 0 else 1.0
        alpha = self.alpha(request)
        gains = [expected_tokens(alpha, k) / (1.0 + rho * k) for k in range(top + 1)]
        best = max(range(top + 1), key=gains.__getitem__)
        return best if gains[best] >= self.margin * gains[0] and math.isfinite(gains[best]) else 0


def adaptive_policy(settings: ServingSettings) -> SpecPolicy:
    """:class:`AdaptivePolicy` with ``num_speculative_tokens`` as its deepest ``k``."""
    return AdaptivePolicy(settings.speculative_config.num_speculative_tokens if settings.speculative_config else 0)


@hookimpl
def pypto_serving_register_spec_policies() -> list[SpecPolicySpec]:
    return [
        SpecPolicySpec("none", no_speculation, "never speculate"),
        SpecPolicySpec("greedy", greedy_policy, "k draft tokens for decodes of greedy requests, 0 otherwise"),
        SpecPolicySpec("fixed", fixed_policy, "k draft tokens for every decode, greedy or sampled"),
        SpecPolicySpec(
            "adaptive",
            adaptive_policy,
            "per request, the k (up to num_speculative_tokens) that the measured step cost and the "
            "request's acceptance rate say pays; 0 when none does",
        ),
    ]
