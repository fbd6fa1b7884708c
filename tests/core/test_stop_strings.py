"""Stop strings are the engine's (text), checked only once ``min_tokens`` tokens exist.

The fake model's greedy tokens are given a hand-made text table (``ab|cST|OP|xy|z``) so the expected
text is known in advance; a brute-force reference (decode every prefix, find the first stop string
that ends in text added at or after ``min_tokens``) is checked against hand-written expectations,
then the engine is checked against it under sync and async scheduling, with and without drafts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from pypto_serving import SamplingParams
from tests.fakes import reference_tokens

VOCAB = 97
PROMPT = [5, 6, 7]
PIECES = ["ab", "cST", "OP", "xy", "z", "STO", "P!", "q"]


class TableTokenizer:
    """Decodes each token id to a fixed piece of text (prompt and unknown ids to nothing)."""

    def __init__(self, table: dict[int, str]) -> None:
        self.table = table

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(self.table.get(t, "") for t in ids)


def table() -> dict[int, str]:
    ref = reference_tokens(PROMPT, len(PIECES), VOCAB)[0]
    assert len(set(ref)) == len(ref) and not set(ref) & set(PROMPT), "pick another prompt"
    return dict(zip(ref, PIECES))


def brute_force(pieces: list[str], stop: list[str], min_tokens: int, max_tokens: int) -> tuple[str, int, str]:
    """(text, number of tokens, finish reason) by decoding every prefix from scratch."""
    seen: set[tuple[int, str]] = set()
    for n in range(1, max_tokens + 1):
        text = "".join(pieces[:n])
        found = {(i, s) for s in stop for i in range(len(text)) if text.startswith(s, i)}
        new = sorted(found - seen)
        seen |= found
        if new and n >= min_tokens:
            return text[: new[0][0]], n, "stop"
    return "".join(pieces[:max_tokens]), max_tokens, "length"


def test_reference_matches_hand_written_expectations() -> None:
    assert brute_force(PIECES, ["STOP"], 0, 8) == ("abc", 3, "stop")
    assert brute_force(PIECES, ["STOP"], 3, 8) == ("abc", 3, "stop")
    # STOP ended at token 3, before min_tokens=4: it never matches, the next STOP (tokens 6-7) does.
    assert brute_force(PIECES, ["STOP"], 4, 8) == ("abcSTOPxyz", 7, "stop")
    assert brute_force(PIECES, ["STOP"], 4, 5) == ("abcSTOPxyz", 5, "length")
    assert brute_force(PIECES, ["xy", "OPx"], 0, 8) == ("abcST", 4, "stop")


CASES = [
    (["STOP"], 0, 8),
    (["STOP"], 3, 8),
    (["STOP"], 4, 8),
    (["STOP"], 4, 5),
    (["STOP"], 7, 8),
    (["xy", "OPx"], 0, 8),
    (["P!"], 2, 8),
]


@pytest.mark.parametrize(
    "engine_kw",
    [
        {"scheduler": "sync", "num_scheduler_steps": 1},
        {"scheduler": "sync", "num_scheduler_steps": 8},
        pytest.param({"scheduler": "async"}, marks=pytest.mark.requires_plugin("async_sched")),
        {
            "scheduler": "sync",
            "speculative_config": {"method": "fake", "num_speculative_tokens": 2},
            "executor_options": {"vocab": VOCAB, "max_draft": 2},
        },
    ],
    ids=["one-forward", "eight-forwards", "async", "drafts"],
)
def test_stop_strings_respect_min_tokens(make_llm: Callable[..., Any], engine_kw: dict[str, Any]) -> None:
    kw: dict[str, Any] = {"block_size": 4, "num_kv_blocks": 32, "executor_options": {"vocab": VOCAB}, **engine_kw}
    llm = make_llm(**kw)
    tab = table()
    llm.engine.tokenizer = TableTokenizer(tab)
    for stop, min_tokens, max_tokens in CASES:
        want_text, want_n, want_reason = brute_force(PIECES, stop, min_tokens, max_tokens)
        params = SamplingParams(temperature=0, max_tokens=max_tokens, min_tokens=min_tokens, stop=stop, ignore_eos=True)
        [out] = llm.generate([PROMPT], params, use_tqdm=False)
        c = out.outputs[0]
        case = (stop, min_tokens, max_tokens)
        assert (c.text, len(c.token_ids), c.finish_reason) == (want_text, want_n, want_reason), case
        assert [tab[t] for t in c.token_ids] == PIECES[:want_n], case
        if want_reason == "stop":
            assert c.stop_reason in stop, case
        else:
            assert c.stop_reason is None, case
    assert not llm.engine.has_unfinished()
    assert all(p.num_free == p.num_blocks for p in llm.engine.kv.pools.values())
