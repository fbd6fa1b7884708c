"""The n-gram (prompt-lookup) drafter against a brute-force Python reference of its rule, and the
runner's verification of its drafts (rejection sampling with a point-mass draft) against the exact law."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode

from pypto_serving import BatchInput, CacheGroupSpec, Executor, ExecutorInfo, SamplingParams
from pypto_serving.messages import NewRequestData, ScheduledEntry, StepCommand, StepResult, wire_sampling
from pypto_serving.runner import ModelRunner
from pypto_serving.spec_decode import NgramDrafter, SpecRow, read, rejection_sample
from pypto_serving.spec_decode.ngram import pad_histories, propose_ngram
from tests.core.test_rejection import chi_square


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


# ---------------------------------------------------------------------------- verification in the runner
V = 6
P = [0.02, 0.03, 0.03, 0.5, 0.4, 0.02]  # the target: a fixed distribution, whatever the context
PROMPT = [1, 2, 3, 4, 1]  # with the first output 2, the history ends "1 2": the drafts are [3, 4]
N_RUNS = 20000


class _FixedTarget(Executor):
    """The first step's logits make 2 certain; every later row's probabilities are ``P``."""

    def __init__(self) -> None:
        self.steps = 0

    def load(self) -> ExecutorInfo:
        self.device = torch.device("cpu")
        return ExecutorInfo(cache_groups=[CacheGroupSpec("kv", 4, 64)], vocab_size=V, max_model_len=64)

    def init_kv_cache(self, num_blocks: dict[str, int]) -> None:
        pass

    def execute(self, batch: BatchInput) -> torch.Tensor:
        self.steps += 1
        first = torch.full((V,), -30.0).index_fill(0, torch.tensor([2]), 0.0)
        row = first if self.steps == 1 else torch.tensor(P).log()
        return row.expand(len(batch.logits_indices), V).contiguous()


class _RecordingDrafter(NgramDrafter):
    def propose(self, histories: Sequence[Sequence[int]]) -> list[list[int]]:
        _proposed.append([list(h) for h in histories])
        return NgramDrafter.propose(self, histories)


_proposed: list[list[list[int]]] = []


def _ngram_runner() -> ModelRunner:
    spec = SimpleNamespace(
        method="ngram", num_speculative_tokens=2, prompt_lookup_min=2, prompt_lookup_max=3, policy="adaptive"
    )
    runner = ModelRunner(_FixedTarget(), SimpleNamespace(speculative_config=spec, max_num_seqs=16))
    runner.load()
    runner._ngram = _RecordingDrafter(num_speculative_tokens=2, prompt_lookup_min=2, prompt_lookup_max=3)
    return runner


def _sampled_entry(rid: str, *, decode: bool, num_draft: int, num_propose: int = -1) -> ScheduledEntry:
    return ScheduledEntry(
        request_id=rid,
        token_ids=[] if decode else PROMPT,
        use_last_sampled=decode,
        num_draft=num_draft,
        start_pos=len(PROMPT) if decode else 0,
        rejected_seen=0,
        new_block_ids={} if decode else {"kv": [0, 1]},
        sample=True,
        num_propose=num_propose,
    )


def _run_two_steps(n: int, num_draft: int = 2, num_propose: int = -1) -> tuple[ModelRunner, StepResult]:
    """Prefill ``n`` requests (seeds 0 .. n-1, temperature 1), then one decode verifying ``num_draft``
    and proposing ``num_propose`` drafts after it."""
    runner = _ngram_runner()
    sp = wire_sampling(SamplingParams(temperature=1.0), ())
    rids = [f"r{i}" for i in range(n)]
    new = [
        NewRequestData(request_id=r, prompt_token_ids=PROMPT, output_token_ids=[], sampling=sp, seed=i)
        for i, r in enumerate(rids)
    ]
    first = runner.step(StepCommand(0, new, [_sampled_entry(r, decode=False, num_draft=0) for r in rids], []))
    assert first.error is None and all(first.sampled[r] == [2] for r in rids)
    decodes = [_sampled_entry(r, decode=True, num_draft=num_draft, num_propose=num_propose) for r in rids]
    second = runner.step(StepCommand(1, [], decodes, []))
    assert second.error is None, second.error
    return runner, second


def _exact_step() -> dict[tuple[int, ...], float]:
    """The emitted sequence of a step verifying drafts [3, 4] against ``P`` at every position, by the
    rejection rule with a point-mass draft: accept d with probability P[d], else draw from P without d."""
    out: dict[tuple[int, ...], float] = {}
    for t in range(V):
        if t != 3:
            out[(t,)] = P[t]
        if t != 4:
            out[(3, t)] = P[3] * P[t]
        out[(3, 4, t)] = P[3] * P[4] * P[t]
    return out


def test_ngram_drafts_are_rejection_sampled_with_a_point_mass() -> None:
    """n-gram drafts of sampled requests are verified by rejection sampling with ``q`` one-hot at the
    draft (not sample-and-compare, whose tokens differ for the same seeds): each request emits exactly
    what :func:`rejection_sample` gives for its seed and output index, and over ``N_RUNS`` seeds the
    emitted sequences follow the exact law (draft ``j`` accepted with probability ``P[d_j]``; a
    rejection draws from ``P`` without ``d_j``, so the first token is distributed as ``P``).

    Statistics: Pearson's statistic over the 16 cells of positive probability (expected counts from
    4.8 up; the two below 5 pooled) stays below ``df + 6 sqrt(2 df)`` (a tail probability of about
    1e-5 under the law), and cells of probability 0 (a rejected draft emitted again) stay empty. The
    first acceptance rate must lie within 5 sigma (0.018) of ``P[3] = 0.5``. Power, computed below
    from the same law: a rule that accepts the first draft with probability 0.05 too low or too high
    moves the expected statistic past three times the threshold; one off by 0.03 moves the acceptance
    rate 8.5 sigma off (failing the 5-sigma check with probability above 0.99). The seeds are fixed, so the
    outcome is deterministic."""
    _, res = _run_two_steps(N_RUNS)
    got = [tuple(res.sampled[f"r{i}"]) for i in range(N_RUNS)]
    # The reference: rejection_sample itself on the same probabilities, seeds and output index.
    target = torch.tensor(P).expand(3 * N_RUNS, V).contiguous()
    rows = [SpecRow(seed=i, first_index=1, num_drafts=2, greedy=False) for i in range(N_RUNS)]
    want = read(rejection_sample(target, torch.tensor([3, 4] * N_RUNS), rows)).tokens
    assert [list(s) for s in got] == want
    assert res.num_drafted == 2 * N_RUNS and res.num_verify_steps == N_RUNS
    assert abs(res.num_accepted_per_pos[0] / N_RUNS - P[3]) < 5 * math.sqrt(P[3] * (1 - P[3]) / N_RUNS)
    exact = _exact_step()
    assert math.isclose(sum(exact.values()), 1.0)
    counts = Counter(got)
    assert set(counts) <= set(exact), set(counts) - set(exact)
    stat, df = chi_square(counts, exact, N_RUNS)
    assert stat < df + 6 * math.sqrt(2 * df), (stat, df)
    for shift in (-0.05, 0.05):  # the power claimed above
        wrong = _shifted(exact, shift)
        bug_stat, _ = chi_square(Counter({s: round(N_RUNS * w) for s, w in wrong.items()}), exact, N_RUNS)
        assert bug_stat > 3 * (df + 6 * math.sqrt(2 * df)), (shift, bug_stat)


def _shifted(exact: dict[tuple[int, ...], float], shift: float) -> dict[tuple[int, ...], float]:
    """The law when the first draft is accepted with probability ``P[3] + shift`` instead."""
    a = P[3] + shift
    return {s: (w / P[3] * a if s[0] == 3 and len(s) > 1 else w / (1 - P[3]) * (1 - a)) for s, w in exact.items()}


def test_an_entry_proposing_no_drafts_costs_no_ngram_proposal() -> None:
    """An entry whose next decode the speculative policy gives k = 0 (``num_propose == 0``) drafts
    nothing after its step: the n-gram drafter is not even asked (its drafts would be thrown away);
    one proposing 1 keeps one draft."""
    _proposed.clear()
    runner, res = _run_two_steps(2, num_draft=2, num_propose=0)
    # The prefill step asked for both histories; the decode proposing none asked for none.
    assert len(_proposed) == 1 and len(_proposed[0]) == 2
    assert res.sampled["r0"] and all(st.drafts == [] for st in runner.states.values())
    _proposed.clear()
    runner, res = _run_two_steps(2, num_draft=2, num_propose=1)
    assert len(_proposed) == 2 and len(_proposed[1]) == 2  # a decode proposing drafts drafts again


def test_an_entry_keeps_at_most_the_drafts_it_proposes() -> None:
    """The drafter's drafts are cut to the entry's ``num_propose`` (-1: the drafter's depth)."""
    sp = wire_sampling(SamplingParams(temperature=1.0), ())
    drafts = []
    for num_propose in (-1, 1):
        runner = _ngram_runner()
        new = [NewRequestData(request_id="r", prompt_token_ids=PROMPT, output_token_ids=[], sampling=sp, seed=0)]
        entry = _sampled_entry("r", decode=False, num_draft=0, num_propose=num_propose)
        assert runner.step(StepCommand(0, new, [entry], [])).error is None
        drafts.append(runner.states["r"].drafts)
    assert drafts == [[3, 4], [3]]
