"""Prompt logprobs are the same for every choice of a request: with ``n`` choices the prompt is scored
once, not n times (a request of ``n: 128`` with ``prompt_logprobs: 20`` made the worker score its
prompt 128 times over, issue 25 item 9), and the answer equals the one-choice request's."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tests.fakes import FakeExecutor

PROMPT = list(range(3, 23))  # 20 tokens: 19 of them are scored
MAX_TOKENS = 3


def _scored_rows(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Logits rows the fake returns beyond the sampled ones (each step's prompt rows), per step."""
    rows: list[int] = []
    execute = FakeExecutor.execute

    def counting(self: FakeExecutor, batch: Any) -> Any:
        out = execute(self, batch)
        rows.append(out.shape[0] - sum(batch.num_logits))
        return out

    monkeypatch.setattr(FakeExecutor, "execute", counting)
    return rows


def test_n_choices_score_the_prompt_once(make_llm: Callable[..., Any], monkeypatch: pytest.MonkeyPatch) -> None:
    from pypto_serving import SamplingParams

    rows = _scored_rows(monkeypatch)
    llm = make_llm(executor_options={"vocab": 97, "prompt_logits": True}, enable_prefix_caching=False)
    params = SamplingParams(n=4, max_tokens=MAX_TOKENS, temperature=1.0, seed=3, prompt_logprobs=2)
    [many] = llm.generate([PROMPT], params)
    assert sum(rows) == len(PROMPT) - 1, rows  # one choice's worth, not four
    [one] = llm.generate([PROMPT], SamplingParams(max_tokens=MAX_TOKENS, prompt_logprobs=2))
    assert len(many.outputs) == 4 and all(len(o.token_ids) == MAX_TOKENS for o in many.outputs)
    assert many.prompt_logprobs is not None and len(many.prompt_logprobs) == len(PROMPT)
    assert many.prompt_logprobs == one.prompt_logprobs
