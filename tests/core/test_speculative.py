"""Speculative-token policies: the fixed and adaptive policies, the step cost model, the n-gram
settings and how the engine wires a core drafter to an executor."""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest

from pypto_serving import LLM, ServingSettings
from pypto_serving.config import SettingsError
from pypto_serving.messages import StepResult
from pypto_serving.plugins import PluginError
from pypto_serving.request import Request, SamplingParams
from pypto_serving.speculative import (
    AdaptivePolicy,
    StepCostModel,
    StepObservation,
    drafts_for,
    expected_tokens,
    fixed_policy,
    greedy_policy,
    no_speculation,
)
from tests.conftest import plugin_installed
from tests.core.test_scheduler import make_sched, req  # noqa: F401 - the fixture is used by name


def _request(temperature: float = 0.7, drafted: int = 0, accepted: int = 0) -> Request:
    r = Request("r", [1, 2, 3], SamplingParams(temperature=temperature, max_tokens=100))
    r.spec_drafted, r.spec_accepted = drafted, accepted
    return r


def _settings(**spec: Any) -> ServingSettings:
    return ServingSettings(speculative_config={"method": "mtp", "num_speculative_tokens": 3, **spec})


# ----------------------------------------------------------------------------- fixed and greedy


def test_fixed_policy_speculates_for_sampled_requests_too() -> None:
    fixed, greedy = fixed_policy(_settings()), greedy_policy(_settings())
    assert fixed(_request(0.7), 8) == 3 and fixed(_request(0.0), 8) == 3
    assert fixed(_request(0.7), 2) == 2 and fixed(_request(0.7), 0) == 0
    assert greedy(_request(0.7), 8) == 0 and greedy(_request(0.0), 8) == 3


def test_the_default_policy_speculates_for_sampled_requests() -> None:
    """Only method and k given, as a vLLM user writes it: the policy is ``adaptive``, which drafts for
    greedy and sampled requests alike (its first steps give both the configured k)."""
    settings = ServingSettings(speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    assert settings.speculative_config is not None and settings.speculative_config.policy == "adaptive"
    policy = AdaptivePolicy(2)
    assert policy(_request(0.7), 8) == 2 and policy(_request(0.0), 8) == 2


def test_the_worker_drafts_only_for_requests_the_policy_can_give_drafts() -> None:
    """``drafts_for``: nobody under ``none`` (nor without speculation), greedy requests without
    penalties under ``greedy``, everyone under the others; ``none`` also sets a drafting depth of 0."""
    sampled, greedy = SamplingParams(temperature=0.7), SamplingParams(temperature=0.0)
    penalised = SamplingParams(temperature=0.0, presence_penalty=0.5)
    cases = {"none": (False, False, False), "greedy": (False, True, False), "fixed": (True, True, True)}
    for name, want in cases.items():
        wants = drafts_for(_settings(policy=name))
        assert (wants(sampled), wants(greedy), wants(penalised)) == want, name
    assert drafts_for(_settings())(sampled)  # the default, adaptive
    assert not drafts_for(ServingSettings())(greedy)  # no speculative_config
    assert no_speculation(_settings()).draft_depth() == 0  # type: ignore[attr-defined]


# ----------------------------------------------------------------------------- the model


@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.8, 1.0])
@pytest.mark.parametrize("k", [0, 1, 3])
def test_expected_tokens_matches_enumeration(alpha: float, k: int) -> None:
    """Enumerate every accept/reject pattern of k drafts: a step yields the accepted prefix plus one."""
    total = 0.0
    for pattern in itertools.product([True, False], repeat=k):
        prob = 1.0
        for accepted in pattern:
            prob *= alpha if accepted else 1 - alpha
        prefix = next((i for i, a in enumerate(pattern) if not a), k)
        total += prob * (prefix + 1)
    assert expected_tokens(alpha, k) == pytest.approx(total)


def test_cost_model_recovers_a_linear_cost() -> None:
    model = StepCostModel()
    assert not model.ready
    rng = random.Random(0)
    for _ in range(40):
        tokens = rng.randint(1, 64)
        model.add(tokens, 0.010 + 0.0005 * tokens)
    assert model.ready
    a, b = model.coefficients()
    assert a == pytest.approx(0.010) and b == pytest.approx(0.0005)


def test_cost_model_is_not_ready_while_every_step_has_the_same_size() -> None:
    model = StepCostModel()
    for _ in range(20):
        model.add(16, 0.02)
    assert not model.ready


def _fed(policy: AdaptivePolicy, *, a: float, b: float, decodes: int, alpha: float, steps: int = 30) -> AdaptivePolicy:
    """Feed ``steps`` observations of a cost ``a + b * tokens`` alternating plain and k-draft steps."""
    for i in range(steps):
        k = policy.k if i % 2 else 0
        tokens = decodes * (1 + k)
        drafted = decodes * k
        policy.observe(
            StepObservation(
                num_tokens=tokens,
                num_decodes=decodes,
                num_drafted=drafted,
                num_accepted=round(alpha * drafted),
                seconds=a + b * tokens,
            )
        )
    return policy


def test_adaptive_alternates_until_the_cost_is_measured() -> None:
    policy = AdaptivePolicy(3)
    picks = []
    for _ in range(4):
        picks.append(policy(_request(), 8))
        policy.observe(StepObservation(num_tokens=1, num_decodes=1, num_drafted=0, num_accepted=0, seconds=0.01))
    assert picks == [3, 2, 3, 2]  # one draft fewer every other step: two step sizes to fit the cost


def test_adaptive_speculates_deeply_when_steps_are_latency_bound() -> None:
    # One request, 10 ms per step and 0.1 ms per token: rho = 0.0099, E(0.8, 3) = 2.952.
    policy = _fed(AdaptivePolicy(3), a=0.010, b=0.0001, decodes=1, alpha=0.8)
    assert policy(_request(drafted=100, accepted=80), 8) == 3


def test_adaptive_does_not_speculate_when_compute_bound() -> None:
    # 64 requests, no fixed cost: every draft position costs as much as a token, so gains are < 1.
    policy = _fed(AdaptivePolicy(3), a=0.0, b=0.001, decodes=64, alpha=0.8)
    assert policy(_request(drafted=100, accepted=80), 8) == 0


def test_adaptive_picks_the_k_the_model_says_is_best() -> None:
    """Half the step grows with tokens (rho = 0.5): with alpha = 0.9, E(k)/(1 + k/2) is
    1, 1.267, 1.355, 1.374 for k = 0..3 (computed by hand), so k = 3; with alpha = 0.6 it is
    1, 1.067, 0.98, ... so k = 1."""
    policy = _fed(AdaptivePolicy(3), a=0.016, b=0.001, decodes=16, alpha=0.9)
    assert policy(_request(drafted=1000, accepted=900), 8) == 3
    assert policy(_request(drafted=1000, accepted=600), 8) == 1
    assert policy(_request(drafted=1000, accepted=900), 2) == 2  # capped by the scheduler


def _fed_drafting(policy: AdaptivePolicy, *, a: float, c: float, alpha: float, decodes: int = 16) -> AdaptivePolicy:
    """Feed 40 steps at the policy's own drafting depth: the forward costs ``a``, drafting ``c`` per
    depth, and each request accepts each draft with probability ``alpha`` given its predecessors."""
    for _ in range(40):
        depth = policy.draft_depth()
        accepted = decodes * sum(alpha**j for j in range(1, depth + 1))
        policy.observe(
            StepObservation(
                num_tokens=decodes * (1 + depth),
                num_decodes=decodes,
                num_drafted=decodes * depth,
                num_accepted=round(accepted),
                seconds=a + depth * c,
                draft_seconds=depth * c,
                draft_depth=depth,
                num_rejections=round(decodes * (1 - alpha**depth)) if depth else 0,
            )
        )
    return policy


def test_adaptive_drafts_at_the_configured_depth_until_drafting_is_measured() -> None:
    policy = AdaptivePolicy(3)
    assert policy.draft_depth() == 3
    policy.observe(StepObservation(num_tokens=16, num_decodes=16, num_drafted=0, num_accepted=0, seconds=0.01))
    assert policy.draft_depth() == 3


@pytest.mark.parametrize(
    ("c", "alpha", "depth"),
    [
        # Tokens per 10 ms of forward, D = 0..3, computed by hand as E(alpha, D) / (1 + D * c / a):
        (0.001, 0.8, 3),  # 1, 1.636, 2.033, 2.271: cheap drafts, mostly accepted
        (0.004, 0.6, 1),  # 1, 1.143, 1.089, 0.989
        (0.010, 0.3, 0),  # 1, 0.65, 0.46, 0.36: every depth costs a forward and rarely pays
    ],
)
def test_adaptive_drafts_as_deep_as_pays(c: float, alpha: float, depth: int) -> None:
    policy = _fed_drafting(AdaptivePolicy(3), a=0.010, c=c, alpha=alpha)
    assert policy.draft_depth() == depth
    assert policy.engine_alpha() == pytest.approx(alpha, abs=0.03)
    assert policy(_request(drafted=1000, accepted=int(1000 * alpha)), 8) <= depth


def test_adaptive_starts_new_requests_from_the_engine_wide_rate() -> None:
    high = _fed(AdaptivePolicy(3), a=0.016, b=0.001, decodes=16, alpha=0.95)
    low = _fed(AdaptivePolicy(3), a=0.016, b=0.001, decodes=16, alpha=0.1)
    assert high(_request(), 8) == 3
    assert low(_request(), 8) == 0


# ----------------------------------------------------------------------------- the scheduler feeds it


def test_scheduler_reports_steps_and_per_request_acceptance(make_sched: Callable[..., Any]) -> None:  # noqa: F811
    seen: list[StepObservation] = []

    class Recording:
        def __call__(self, request: Request, max_k: int) -> int:
            return min(2, max_k)

        def observe(self, obs: StepObservation) -> None:
            seen.append(obs)

        def draft_depth(self) -> int:
            return 3 - len(seen)  # the depth each step's command carries

    s = make_sched(executor_options={"max_draft": 2}, policy=Recording())
    r = req("a", 4, max_tokens=20)
    s.add_request(r)
    out = s.schedule()  # the prefill
    assert out.command.draft_depth == 3
    s.update(out, StepResult(out.command.step_id, sampled={"a": [5]}, execute_seconds=0.5, draft_seconds=0.1))
    out = s.schedule()  # a decode with 2 drafts, one of them accepted
    assert out.command.entries[0].num_draft == 2 and out.command.draft_depth == 2
    s.update(out, StepResult(out.command.step_id, sampled={"a": [6, 7]}, num_drafted=2, num_accepted_per_pos=[1, 0]))
    out = s.schedule()  # 2 drafts again, both accepted: no rejection
    s.update(
        out, StepResult(out.command.step_id, sampled={"a": [8, 9, 10]}, num_drafted=2, num_accepted_per_pos=[1, 1])
    )
    common = dict(num_decodes=1, draft_seconds=0.0)
    assert seen == [
        StepObservation(
            num_tokens=4, num_decodes=1, num_drafted=0, num_accepted=0, seconds=0.5, draft_seconds=0.1, draft_depth=3
        ),
        StepObservation(
            num_tokens=3, num_drafted=2, num_accepted=1, seconds=0.0, draft_depth=2, num_rejections=1, **common
        ),
        StepObservation(num_tokens=3, num_drafted=2, num_accepted=2, seconds=0.0, draft_depth=1, **common),
    ]
    assert (r.spec_drafted, r.spec_accepted) == (4, 3)


# ----------------------------------------------------------------------------- settings and wiring


def test_ngram_settings_defaults_and_errors() -> None:
    spec = ServingSettings(speculative_config={"method": "ngram", "num_speculative_tokens": 3}).speculative_config
    assert spec is not None and (spec.prompt_lookup_min, spec.prompt_lookup_max) == (2, 5)
    with pytest.raises(SettingsError, match="prompt_lookup_min only apply to method 'ngram', not 'mtp'"):
        ServingSettings.load(speculative_config={"method": "mtp", "prompt_lookup_min": 2})
    with pytest.raises(SettingsError, match="prompt_lookup_min=4 is larger than prompt_lookup_max=3"):
        ServingSettings.load(speculative_config={"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 3})


@pytest.mark.requires_plugin("sync_sched")
def test_ngram_needs_an_executor_that_verifies_drafts(fake_pm: Any) -> None:
    spec = {"method": "ngram", "num_speculative_tokens": 2}
    base = {"executor": "fake", "worker_mode": "inproc", "scheduler": "sync", "speculative_config": spec}
    with pytest.raises(PluginError, match=r"cannot verify drafts .*method='ngram'"):
        LLM(plugins=fake_pm, **base)
    llm = LLM(plugins=fake_pm, executor_options={"verify_drafts": True}, **base)
    try:
        assert llm.engine is not None and llm.engine.max_draft_tokens == 2
    finally:
        llm.shutdown()


# ----------------------------------------------------------------------------- sampled requests speculate


@pytest.mark.requires_plugin("sync_sched")
@pytest.mark.parametrize("policy", ["fixed", "adaptive"])
def test_sampled_requests_speculate_with_unchanged_output(fake_pm: Any, policy: str) -> None:
    """At temperature 3 the fake model's argmax (its drafts) is drawn about a third of the time, so
    drafts are both accepted and rejected; seeded outputs (with penalties and min_tokens, which the
    verifier applies per draft position) equal those of the same requests without speculation."""
    base = {"executor": "fake", "worker_mode": "inproc", "scheduler": "sync", "block_size": 4}
    params = [
        SamplingParams(temperature=3.0, seed=i, max_tokens=24, min_tokens=4 * (i % 2), presence_penalty=0.5 * (i % 3))
        for i in range(6)
    ]
    prompts = [[(7 * i + j) % 90 + 1 for j in range(5 + i)] for i in range(6)]
    plain = LLM(plugins=fake_pm, **base)
    spec = LLM(
        plugins=fake_pm,
        speculative_config={"method": "fake", "num_speculative_tokens": 2, "policy": policy},
        # A forward that costs more than drafting, as a model's does, so the adaptive policy drafts.
        executor_options={"max_draft": 2, "step_sleep": 0.005},
        **base,
    )
    try:
        want = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
        got = [o.outputs[0].token_ids for o in spec.generate(prompts, params)]
        assert spec.engine is not None
        stats = spec.engine.stats()
    finally:
        plain.shutdown()
        spec.shutdown()
    assert got == want
    assert 0 < stats["spec_accepted"] < stats["spec_drafted"]


# ----------------------------------------------------------------------------- n-gram drafting, exactness


@pytest.mark.requires_plugin("sync_sched")
@pytest.mark.parametrize("scheduler", ["sync", "async"])
@pytest.mark.parametrize("policy", ["fixed", "adaptive"])
def test_ngram_speculation_equals_plain_decoding(fake_pm: Any, scheduler: str, policy: str) -> None:
    """Random workloads with repeated patterns (so the drafter proposes), aborts, a tight cache
    (preemption) and an EOS token: the outputs equal the fake model's greedy reference."""
    from hypothesis import given
    from hypothesis import strategies as st

    from tests.core.test_engine_properties import PROPS, blocks_alone, check_against_reference, run, workloads

    if scheduler == "async" and not plugin_installed("async_sched"):
        pytest.skip("plugin async_sched not installed")

    @PROPS
    @given(jobs=workloads(), k=st.integers(1, 3), spare=st.integers(0, 6), budget=st.integers(4, 32))
    def check(jobs: list[Any], k: int, spare: int, budget: int) -> None:
        # Each prompt repeated once, so the 1..3-gram lookup finds matches to propose.
        jobs = [replace(j, prompt=(j.prompt + j.prompt)[:60]) for j in jobs]
        spec = {"method": "ngram", "num_speculative_tokens": k, "policy": policy, "prompt_lookup_min": 1}
        llm = LLM(
            plugins=fake_pm,
            executor="fake",
            worker_mode="inproc",
            scheduler=scheduler,
            block_size=4,
            num_kv_blocks=blocks_alone(jobs, 4) + spare + 1,
            max_num_batched_tokens=budget,
            speculative_config=spec,
            executor_options={"verify_drafts": True, "eos": 3},
        )
        try:
            check_against_reference(jobs, run(llm, jobs), eos=3)
        finally:
            llm.shutdown()

    check()
