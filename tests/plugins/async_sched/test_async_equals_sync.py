"""Property: on random workloads async produces exactly sync's tokens and finish reasons.

Workloads mix prompt lengths, max_tokens (or none, running into max_model_len), min_tokens, stop
token ids, EOS, stop strings (a one-character-per-token tokenizer), greedy and seeded random
sampling, late arrivals, aborts at random steps, KV pressure that forces preemption, chunked
prefill, prefix caching, the prefill barrier, uniform batches, and the fake drafter with random
accept patterns for k = 0..3. The KV invariant is checked after every step of both runs (``run``)."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("pypto_serving_async_sched")
pytest.importorskip("pypto_serving_sync_sched")
pytest.importorskip("hypothesis")

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from pypto_serving import SamplingParams

from .helpers import VOCAB, blocks_for, make_char_tokenizer, make_llm, run, tokens

CHARS = "abcdefghij"  # stop strings are drawn from the first ids' characters


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_char_tokenizer(tmp_path_factory.mktemp("chartok")))


@st.composite
def workloads(draw: Any, k: int) -> dict[str, Any]:
    n = draw(st.integers(1, 7))
    max_model_len = draw(st.sampled_from([None, None, 40]))
    reqs = []
    need = 1
    for i in range(n):
        prompt = draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=14))
        greedy = draw(st.booleans())
        max_tokens = draw(st.integers(1, 24))
        if max_model_len is not None and draw(st.booleans()):
            max_tokens = None  # runs into max_model_len
        sp = SamplingParams(
            temperature=0.0 if greedy else draw(st.sampled_from([0.8, 1.5, 3.0])),
            top_k=draw(st.sampled_from([0, 0, 5])),
            seed=draw(st.integers(0, 2**31)),
            max_tokens=max_tokens,
            min_tokens=min(max_tokens or 99, draw(st.sampled_from([0, 0, 2]))),
            stop_token_ids=draw(st.lists(st.integers(0, VOCAB - 1), max_size=3)),
            stop=draw(st.lists(st.text(CHARS, min_size=1, max_size=2), max_size=2)),
            ignore_eos=draw(st.booleans()),
        )
        total = len(prompt) + max_tokens if max_tokens is not None else max_model_len
        need = max(need, blocks_for(total + k + 1))
        arrival = draw(st.sampled_from([0, 0, 0, 1, 3, 6]))
        reqs.append((arrival, (f"r{i}", prompt, sp)))
    rids = [r[1][0] for r in reqs]
    aborts: dict[int, list[str]] = {}
    for step, rid in draw(st.lists(st.tuples(st.integers(0, 25), st.sampled_from(rids)), max_size=2)):
        aborts.setdefault(step, []).append(rid)
    return dict(
        reqs=reqs,
        aborts=aborts,
        num_kv_blocks=draw(st.integers(need, need + 10)),  # small values force preemption
        max_num_batched_tokens=draw(st.sampled_from([4, 7, 16, 64])),
        max_num_seqs=draw(st.sampled_from([2, 64])),
        max_model_len=max_model_len,
        err=draw(st.sampled_from([0.0, 0.3, 0.7, 1.0])),
        eos=draw(st.sampled_from([None, 5])),
        barrier=draw(st.booleans()),
        uniform=draw(st.booleans()),
        prefix_caching=draw(st.booleans()),
    )


def _run(sched: str, k: int, w: dict[str, Any], tok: str) -> tuple[dict[str, Any], dict[str, Any]]:
    opts: dict[str, Any] = {"barrier": w["barrier"], "uniform": w["uniform"]}
    if w["eos"] is not None:
        opts["eos"] = w["eos"]
    llm = make_llm(
        sched,
        k=k,
        err=w["err"],
        num_kv_blocks=w["num_kv_blocks"],
        max_num_batched_tokens=w["max_num_batched_tokens"],
        max_num_seqs=w["max_num_seqs"],
        options=opts,
        tokenizer=tok,
        enable_prefix_caching=w["prefix_caching"],
        max_model_len=w["max_model_len"],
    )
    try:
        eng = llm.engine
        arrivals: dict[int, list[Any]] = {}
        for at, req in w["reqs"]:
            arrivals.setdefault(at, []).append(req)

        def add(i: int) -> None:
            for rid, prompt, sp in arrivals.get(i, []) if i else []:
                eng.add_request(rid, prompt, sp)

        res = run(eng, arrivals.get(0, []), aborts=w["aborts"], before_step=add)
        for i in sorted(arrivals):  # late arrivals after everything else finished
            if i and arrivals[i][0][0] not in res:
                res.update(run(eng, arrivals[i]))
        return tokens(res), eng.stats()
    finally:
        llm.shutdown()


def _check(k: int, w: dict[str, Any], tok: str) -> None:
    sync, _ = _run("sync", k, w, tok)
    asyn, stats = _run("async", k, w, tok)
    event(f"preempted: {stats['num_preemptions'] > 0}")
    event(f"drafts rejected: {stats['spec_accepted'] < stats['spec_drafted']}")
    event(f"finish reasons: {sorted({r for _, r in asyn.values()})}")
    assert sync.keys() == asyn.keys() == {r[1][0] for r in w["reqs"]}
    aborted = {rid for rids in w["aborts"].values() for rid in rids}
    for rid in sync:
        (ts, rs), (ta, ra) = sync[rid], asyn[rid]
        if rid not in aborted or (rs != "abort" and ra != "abort"):
            assert (ta, ra) == (ts, rs), rid
        else:  # the abort landed at a different point of the generation: one is a prefix of the other
            short, long = sorted((ts, ta), key=len)
            assert long[: len(short)] == short, rid


SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("k", [0, 1, 2, 3])
def test_async_equals_sync(k: int, tokenizer_dir: str) -> None:
    @SETTINGS
    @given(workloads(k))
    def prop(w: dict[str, Any]) -> None:
        _check(k, w, tokenizer_dir)

    prop()
