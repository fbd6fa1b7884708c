"""SamplingParams validation: every rule raises ValueError naming the offending field."""

from __future__ import annotations

import math
from typing import Any

import pytest

from pypto_serving import SamplingParams

INVALID = [
    ("temperature", {"temperature": -0.1}),
    ("temperature", {"temperature": math.nan}),
    ("temperature", {"temperature": math.inf}),
    ("top_p", {"top_p": 0.0}),
    ("top_p", {"top_p": 1.01}),
    ("top_k", {"top_k": -2}),
    ("min_p", {"min_p": -0.01}),
    ("min_p", {"min_p": 1.5}),
    ("presence_penalty", {"presence_penalty": 2.5}),
    ("presence_penalty", {"presence_penalty": -2.5}),
    ("frequency_penalty", {"frequency_penalty": 3.0}),
    ("frequency_penalty", {"frequency_penalty": -2.01}),
    ("repetition_penalty", {"repetition_penalty": 0.0}),
    ("repetition_penalty", {"repetition_penalty": 2.5}),
    ("max_tokens", {"max_tokens": 0}),
    ("min_tokens", {"min_tokens": -1}),
    ("min_tokens", {"min_tokens": 5, "max_tokens": 4}),
    ("n", {"n": 0}),
    ("logprobs", {"logprobs": -1}),
    ("logprobs", {"logprobs": 21}),
    ("stop", {"stop": [""]}),
    ("stop", {"stop": ["ok", 3]}),
    ("stop_token_ids", {"stop_token_ids": [-1]}),
    ("seed", {"seed": -1}),
    ("seed", {"seed": 2**63}),
    # Integers past int64 would crash the worker's wire encoder or its int64 tensors for the whole batch.
    ("top_k", {"top_k": 2**63}),
    ("top_k", {"top_k": 2**64}),
    ("max_tokens", {"max_tokens": 2**64}),
    ("min_tokens", {"min_tokens": 2**64, "max_tokens": None}),
    ("n", {"n": 2**63}),
    ("stop_token_ids", {"stop_token_ids": [2**64]}),
    ("stop", {"stop": ["\ud800"]}),
    ("stop", {"stop": ["ok", "a\udfffb"]}),
]


@pytest.mark.parametrize(("field", "kwargs"), INVALID, ids=[f"{f}-{i}" for i, (f, _) in enumerate(INVALID)])
def test_invalid_value_names_field(field: str, kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError, match=rf"^{field}=") as info:
        SamplingParams(**kwargs)  # type: ignore[arg-type]
    assert "must be" in str(info.value)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 0.0},
        {"top_p": 1.0, "top_k": 1, "min_p": 1.0},
        {"presence_penalty": -2, "frequency_penalty": 2, "repetition_penalty": 2},
        {"max_tokens": None, "min_tokens": 100},
        {"max_tokens": 3, "min_tokens": 3},
        {"logprobs": 0},
        {"logprobs": 20},
        {"seed": 0},
        {"seed": 2**63 - 1},
        {"stop_token_ids": [0]},
        {"top_k": 2**63 - 1, "stop_token_ids": [2**63 - 1], "max_tokens": 2**63 - 1, "min_tokens": 2**63 - 1},
        {"stop": ["\U0001f600 paired surrogates are fine"]},
    ],
)
def test_boundary_values_are_accepted(kwargs: dict[str, object]) -> None:
    SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_normalisation() -> None:
    sp = SamplingParams(top_k=-1, stop="END", stop_token_ids=(3, 4))  # type: ignore[arg-type]
    assert sp.top_k == 0
    assert sp.stop == ["END"]
    assert sp.stop_token_ids == [3, 4]
    assert SamplingParams(temperature=0).greedy
    assert not SamplingParams(temperature=0.5).greedy
    assert not SamplingParams().has_penalties
    assert SamplingParams(repetition_penalty=1.1).has_penalties
    assert SamplingParams(presence_penalty=0.5).has_penalties


@pytest.mark.parametrize(("start", "end"), [(0, 3), (1, 4), (3, 5), (4, 6), (0, 6), (2, 2), (5, 6)])
def test_token_slice_equals_slicing_all_tokens(start: int, end: int) -> None:
    from pypto_serving.request import Request

    req = Request("r", [1, 2, 3, 4], SamplingParams())
    req.output_token_ids = [5, 6]
    assert req.token_slice(start, end) == req.all_token_ids[start:end]


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"logit_bias": {i: 1.0 for i in range(301)}}, "logit_bias"),
        ({"logit_bias": {1: 100.5}}, "logit_bias"),
        ({"logit_bias": {1: float("nan")}}, "logit_bias"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"bad_words_token_ids": [[]]}, "bad_words"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ],
)
def test_token_fields_are_validated(kw: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field}="):
        SamplingParams(**kw)


def test_token_fields_are_checked_against_the_vocabulary() -> None:
    SamplingParams(logit_bias={9: 1.0}, allowed_token_ids=[9], bad_words_token_ids=[[8, 9]]).check_vocab(10)
    for kw, field in (
        ({"logit_bias": {10: 1.0}}, "logit_bias"),
        ({"allowed_token_ids": [3, 10]}, "allowed_token_ids"),
        ({"bad_words_token_ids": [[1, 12]]}, "bad_words"),
    ):
        with pytest.raises(ValueError, match=f"^{field}="):
            SamplingParams(**kw).check_vocab(10)
