"""A request the speculative policy gives ``k = 0`` for good costs no drafting work: the MTP depths
run only over requests that may draft, and a step where none may runs no MTP forward at all."""

from __future__ import annotations

from typing import Any

import pytest

import pypto_serving_deepseek_mtp.executor as executor_mod
from pypto_serving import LLM, SamplingParams
from pypto_serving_deepseek_mtp.plugin import TINY_DEEPSEEK_V4

pytestmark = pytest.mark.requires_plugin("sync_sched")


def _mtp_rows(monkeypatch: pytest.MonkeyPatch, policy: str | None, params: list[SamplingParams]) -> list[int]:
    """The requests (batch rows) each MTP forward ran over, generating ``params`` under ``policy``."""
    rows: list[int] = []
    run_mtp = executor_mod.DeepseekMTPExecutor._run_mtp

    def counting(self: Any, d: int, spans: list[tuple[int, int, int]], *args: Any) -> Any:
        rows.append(len(spans))
        return run_mtp(self, d, spans, *args)

    monkeypatch.setattr(executor_mod.DeepseekMTPExecutor, "_run_mtp", counting)
    spec: dict[str, Any] = {"method": "mtp", "num_speculative_tokens": 2}
    if policy is not None:
        spec["policy"] = policy
    with LLM(
        model=str(TINY_DEEPSEEK_V4), device="cpu", worker_mode="inproc", scheduler="sync", speculative_config=spec
    ) as llm:
        llm.generate(["def main():\n"] * len(params), params, use_tqdm=False)
    return rows


SAMPLED = SamplingParams(temperature=0.7, seed=1, max_tokens=8, ignore_eos=True)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def test_policy_none_runs_no_mtp(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _mtp_rows(monkeypatch, "none", [GREEDY, SAMPLED]) == []


def test_greedy_policy_drafts_only_for_greedy_requests(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _mtp_rows(monkeypatch, "greedy", [SAMPLED, SAMPLED]) == []  # no MTP forward at all
    rows = _mtp_rows(monkeypatch, "greedy", [SAMPLED, GREEDY, SAMPLED])
    assert rows and max(rows) == 1  # the greedy request's rows only


def test_the_default_policy_drafts_for_sampled_requests(monkeypatch: pytest.MonkeyPatch) -> None:
    assert max(_mtp_rows(monkeypatch, None, [SAMPLED, SAMPLED])) == 2


class _EvenDrafts:
    """``k = 2`` for requests with an even ``max_tokens``, 0 for the others (the request's own decision,
    as the adaptive policy makes it from the request's acceptance)."""

    def __call__(self, request: Any, max_k: int) -> int:
        return min(2, max_k) if request.sampling_params.max_tokens % 2 == 0 else 0


def test_a_request_given_k_0_runs_no_mtp_depth_and_outputs_stay_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    """A policy that gives one request k = 0 while another speculates: the scheduler tells the worker,
    per entry, how many drafts each request proposes, so the k = 0 request joins no MTP forward at
    all (before, every request the policy could ever give drafts ran every depth), the other runs
    both depths, and both outputs equal no speculation's."""
    import pypto_serving.speculative as speculative

    monkeypatch.setattr(speculative, "fixed_policy", lambda settings: _EvenDrafts())
    rows: list[tuple[int, str]] = []
    run_mtp = executor_mod.DeepseekMTPExecutor._run_mtp

    def counting(self: Any, d: int, spans: list[tuple[int, int, int]], *args: Any) -> Any:
        assert self._last is not None
        rows.extend((d, self._last[0].request_ids[r]) for r, _, _ in spans)
        return run_mtp(self, d, spans, *args)

    monkeypatch.setattr(executor_mod.DeepseekMTPExecutor, "_run_mtp", counting)
    prompts = ["def main():\n", "def main():\n"]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (10, 9)]
    outputs = []
    for spec in ({"method": "mtp", "num_speculative_tokens": 2, "policy": "fixed"}, None):
        with LLM(
            model=str(TINY_DEEPSEEK_V4), device="cpu", worker_mode="inproc", scheduler="sync", speculative_config=spec
        ) as llm:
            outs = llm.generate(prompts, params, use_tqdm=False)
            outputs.append([list(o.outputs[0].token_ids) for o in outs])
            ids = [o.request_id for o in outs]
            if spec is not None:
                assert llm.engine is not None and llm.engine.stats()["spec_drafted"] > 0
    assert outputs[0] == outputs[1]
    assert {(0, ids[0]), (1, ids[0])} <= set(rows)
    assert not [r for r in rows if r[1] == ids[1]], rows
