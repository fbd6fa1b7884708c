"""The n-gram (prompt-lookup) drafter against a brute-force Python reference of its rule."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode

from pypto_serving.spec_decode import NgramDrafter
from pypto_serving.spec_decode.ngram import pad_histories, propose_ngram


def reference(h: list[int], k: int, lo: int, hi: int) -> list[int]:
    """Longest n first; for that n the latest start i < len(h) - n whose n tokens equal the last n."""
    size = len(h)
    for n in range(hi, lo - 1, -1):
        if n >= size:
            continue
        for i in range(size - n - 1, -1, -1):
            if h[i : i + n] == h[size - n :]:
                return h[i + n : i + n + k]
    return []


# Small alphabets make repeats (and overlapping repeats) common.
histories = st.lists(
    st.lists(st.integers(0, 3), max_size=40) | st.lists(st.integers(0, 50), max_size=12), min_size=1, max_size=8
)


@settings(max_examples=300, deadline=None)
@given(histories, st.integers(1, 5), st.integers(1, 4), st.integers(0, 3))
def test_matches_the_reference(hs: list[list[int]], k: int, lo: int, extra: int) -> None:
    drafter = NgramDrafter(num_speculative_tokens=k, prompt_lookup_min=lo, prompt_lookup_max=lo + extra)
    assert drafter.propose(hs) == [reference(h, k, lo, lo + extra) for h in hs]


@pytest.mark.parametrize(
    ("history", "want"),
    [
        ([1, 2, 3, 4, 1, 2, 3], [4, 1, 2]),  # the longest n (3) wins
        ([9, 2, 3, 5, 7, 2, 3, 6, 1, 3], [6, 1, 3]),  # only n = 1 matches: its most recent occurrence
        ([5, 6, 7, 8], []),  # no earlier occurrence
        ([1, 1, 1, 1], [1]),  # overlapping the suffix: the latest start leaves one token to follow
        ([1, 2, 1, 2, 1], [2, 1]),
        ([4, 8, 4], [8, 4]),  # a match at the very start, following tokens up to the end
        ([7], []),  # nothing earlier than the only token
    ],
)
def test_hand_written_cases(history: list[int], want: list[int]) -> None:
    assert NgramDrafter(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=3).propose([history]) == [want]


def test_min_longer_than_the_history_proposes_nothing() -> None:
    drafter = NgramDrafter(num_speculative_tokens=2, prompt_lookup_min=4, prompt_lookup_max=5)
    assert drafter.propose([[1, 1, 1, 1], [1, 2, 1, 2, 1, 2, 1], []]) == [[], [2, 1], []]


def test_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        NgramDrafter(num_speculative_tokens=2, prompt_lookup_min=3, prompt_lookup_max=2)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        NgramDrafter(num_speculative_tokens=0)


def test_device_output_pads_past_each_count() -> None:
    hist = pad_histories([[1, 2, 1], [3, 4]], torch.device("cpu"))
    tokens, counts = propose_ngram(hist, k=3, lookup_min=1, lookup_max=2)
    assert counts.tolist() == [2, 0]  # the following tokens may reach the history's last one
    assert tokens.tolist() == [[2, 1, -1], [-1, -1, -1]]


def test_the_search_stays_on_the_device() -> None:
    # Fake CUDA tensors carry no values: any host read or CPU tensor in the search would raise.
    with FakeTensorMode(allow_non_fake_inputs=False):
        hist = torch.empty(4, 64, dtype=torch.long, device="cuda")
        tokens, counts = propose_ngram(hist, k=3, lookup_min=1, lookup_max=4)
        assert tokens.device.type == counts.device.type == "cuda" and tokens.shape == (4, 3)
