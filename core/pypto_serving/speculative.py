"""Speculative-token policies: how many draft tokens ``k`` to reserve for a request in one step.

A policy is a :data:`SpecPolicy`, called as ``policy(request, max_k) -> k`` for each decode of a
step on an executor that drafts. ``max_k`` is the scheduler's cap (remaining token budget,
``max_tokens``, context length, the drafting depth); a policy returns ``0 <= k <= max_k``. A policy
object may also have an ``observe(obs: StepObservation)`` method: the scheduler then calls it with
every step's size, time and acceptance once the step's result is applied; a
``draft_depth() -> int | None`` method: the scheduler sends its value with each step, and the worker
proposes at most that many drafts per request after the step (``None``: the configured depth); and a
``drafts(request, max_k) -> int`` method: after each sampling entry the scheduler asks it how many
drafts the worker proposes for that request (``ScheduledEntry.num_propose``), and the request's next
decode verifies at most that many (without it, the policy itself is asked).

Speculation never changes what a request outputs (verification is exact at every temperature: greedy
requests by comparison, sampled ones by rejection sampling, penalties, bans and ``min_tokens``
applied per draft position), so a policy only trades speed: it decides whether verifying ``k`` extra
positions pays. The default, ``adaptive``, speculates for greedy and sampled requests alike.

Drafting itself costs work (an MTP depth is a decoder layer), so the worker drafts only for requests
the configured policy can give drafts (:func:`drafts_for`): none under ``none``, the greedy ones
without penalties under ``greedy``; and, per step, only as many drafts per request as the scheduler
asked for with the request's entry (the policy's decision for its next decode): a request given
``k = 0`` runs no MTP depth, one given ``k = 1`` only the first.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from .hookspecs import SpecPolicySpec, hookimpl
from .spec_policy import SpecPolicy, StepObservation

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
    "drafts_for",
    "expected_tokens",
    "fixed_policy",
    "greedy_policy",
    "no_speculation",
]

CORE_DRAFTERS = frozenset({"ngram"})
"""Drafting methods the core runs itself (in the worker), for any executor that can verify drafts."""


class NoSpeculation:
    """``k = 0`` for every request, and a drafting depth of 0, so a drafter that is configured anyway
    (e.g. MTP) runs nothing."""

    def __call__(self, request: Request, max_k: int) -> int:
        return 0

    def draft_depth(self) -> int:
        return 0


def no_speculation(settings: ServingSettings) -> SpecPolicy:
    return NoSpeculation()


def greedy_policy(settings: ServingSettings) -> SpecPolicy:
    """``k = num_speculative_tokens`` for greedy requests without penalties once ``min_tokens`` is
    reached, else 0 (the plain argmax-comparison speculation; the verifier is exact for the others
    too, see ``fixed``)."""
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


class SamplingLike(Protocol):
    """The parameters :func:`drafts_for` reads (the worker's sampling struct has them)."""

    @property
    def temperature(self) -> float: ...

    @property
    def has_penalties(self) -> bool: ...


def _never(sp: SamplingLike) -> bool:
    return False


def _always(sp: SamplingLike) -> bool:
    return True


def _greedy_without_penalties(sp: SamplingLike) -> bool:
    return sp.temperature == 0.0 and not sp.has_penalties


def drafts_for(settings: ServingSettings) -> Callable[[SamplingLike], bool]:
    """Whether the configured policy can ever give a request with these sampling parameters drafts.

    The worker proposes drafts only for those, so a request the policy gives ``k = 0`` for good (all
    under ``none``, sampled or penalised ones under ``greedy``) costs no drafting work (MTP depths
    run for the drafting requests only). Other policies, plugins' included, may give any request
    drafts: every request drafts. ``min_tokens`` is not looked at: it is reached during the request.
    """
    spec = getattr(settings, "speculative_config", None)
    name = spec.policy if spec is not None else "none"
    if name == "none":
        return _never
    if name == "greedy":
        return _greedy_without_penalties
    return _always


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

    def predict(self, tokens: float) -> float:
        """Seconds for a step of ``tokens``: the fit once :attr:`ready`, else the mean seen (0 before any)."""
        if self.ready:
            a, b = self.coefficients()
            return a + b * tokens
        return self.ss / self.w if self.w else 0.0


class AdaptivePolicy:
    """Chooses the drafting depth of each step and each request's ``k`` from measured costs and
    acceptance.

    Two measured costs: a step's forward and sampling take ``a + b * T`` seconds for ``T`` tokens
    (:class:`StepCostModel`, the worker's step time less its drafting time), and drafting takes
    ``c(R)`` seconds per depth for ``R`` decodes (a second fit, of drafting seconds per depth against
    ``R``). Drafts are accepted with probability ``alpha`` each, given their predecessors were,
    estimated engine-wide from truncated runs as accepted / (accepted + rejections), so a step with
    drafting depth ``D`` yields ``R * E(alpha, D)`` tokens (:func:`expected_tokens`) in
    ``a + b * R * (1 + D) + D * c(R)`` seconds. After every step the policy sets the depth ``D`` that
    maximises that rate (0 unless the best beats it by ``margin``): the executor then drafts at most
    ``D`` tokens per request, so a drafter whose every depth costs a forward (MTP) stops paying for
    depths that do not pay, e.g. at large batch sizes. Until both costs are measured (drafting over
    ``min_draft_steps`` decode-only steps), ``D`` is the configured depth.

    Per request, ``k <= D`` trades only verification, since drafting is paid for: ``k`` pays when
    ``E(alpha_r, k) / (1 + rho * k)`` beats 1, where ``rho = b * R / (a + b * R)`` is the share of the
    step that grows with tokens, and ``alpha_r`` is the request's accepted/drafted ratio shrunk
    towards the engine-wide rate by ``prior_weight`` pseudo-drafts. While the forward fit is not ready
    (all steps the same size), steps alternate between the deepest ``k`` and one fewer, so two sizes
    get measured.
    """

    def __init__(
        self, k: int, *, margin: float = 1.02, prior_weight: float = 4.0, min_draft_steps: float = 4.0
    ) -> None:
        self.k = k
        self.min_draft_steps = min_draft_steps
        self.margin = margin
        self.prior_weight = prior_weight
        self.cost = StepCostModel()  # forward + sampling seconds against tokens
        self.draft_cost = StepCostModel()  # drafting seconds per depth against decodes
        self.drafted = 0
        self.accepted = 0
        self.rejections = 0
        self.num_decodes = 1
        self.steps = 0
        self.depth = k

    def observe(self, obs: StepObservation) -> None:
        self.steps += 1
        self.drafted += obs.num_drafted
        self.accepted += obs.num_accepted
        self.rejections += obs.num_rejections
        if obs.num_decodes:
            self.num_decodes = obs.num_decodes
        if obs.seconds > 0:
            self.cost.add(obs.num_tokens, max(0.0, obs.seconds - obs.draft_seconds))
        depth = self.k if obs.draft_depth is None else obs.draft_depth
        # Drafting after a prefill chunk also catches the drafter up over the prompt, which says
        # nothing about a decode's drafting cost: only decode-only steps measure it.
        decode_only = obs.num_tokens <= obs.num_decodes * (1 + self.k)
        if depth > 0 and obs.draft_seconds > 0 and obs.num_decodes and decode_only:
            self.draft_cost.add(obs.num_decodes, obs.draft_seconds / depth)
        self.depth = self._best_depth()

    def engine_alpha(self) -> float:
        """Per-draft acceptance over the engine's verifications (Laplace: 0.5 before any)."""
        return (self.accepted + 1.0) / (self.accepted + self.rejections + 2.0)

    def step_rate(self, depth: int, decodes: int) -> float:
        """Expected tokens per second of a step of ``decodes`` requests drafting ``depth`` deep."""
        seconds = self.cost.predict(decodes * (1 + depth)) + depth * self.draft_cost.predict(decodes)
        return decodes * expected_tokens(self.engine_alpha(), depth) / max(seconds, 1e-12)

    def _best_depth(self) -> int:
        # A lowered depth is for good for the requests running (see DeepseekMTPExecutor), so it waits
        # for a few measured decode steps rather than follow the first one.
        if self.k <= 0 or not self.cost.w or self.draft_cost.w < self.min_draft_steps:
            return self.k
        rates = [self.step_rate(d, max(1, self.num_decodes)) for d in range(self.k + 1)]
        best = max(range(self.k + 1), key=rates.__getitem__)
        return best if rates[best] >= self.margin * rates[0] else 0

    def draft_depth(self) -> int:
        """The most drafts per request the worker proposes after the next step."""
        return self.depth

    def alpha(self, request: Request) -> float:
        prior = (self.accepted + 1.0) / (self.drafted + 2.0)  # Laplace: 0.5 before any draft
        return (request.spec_accepted + self.prior_weight * prior) / (request.spec_drafted + self.prior_weight)

    def __call__(self, request: Request, max_k: int) -> int:
        top = min(self.k, max_k, self.depth)
        if top > 0 and not self.cost.ready:
            # One draft fewer every other step varies the step's size by one token per request,
            # enough to fit the slope, at the cost of one token rather than all of them.
            return top if self.steps % 2 == 0 else top - 1
        return self.drafts(request, max_k)

    def drafts(self, request: Request, max_k: int) -> int:
        """The drafts to propose for ``request`` after a step: the ``k`` its next decode may verify,
        without the alternation that fits the step cost (it needs the deepest ``k`` drafted)."""
        top = min(self.k, max_k, self.depth)
        if top <= 0:
            return 0
        if not self.cost.ready:
            return top
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
        SpecPolicySpec(
            "greedy", greedy_policy, "k draft tokens for decodes of greedy requests without penalties, 0 otherwise"
        ),
        SpecPolicySpec("fixed", fixed_policy, "k draft tokens for every decode, greedy or sampled"),
        SpecPolicySpec(
            "adaptive",
            adaptive_policy,
            "per request, the k (up to num_speculative_tokens) that the measured step cost and the "
            "request's acceptance rate say pays; 0 when none does",
        ),
    ]
