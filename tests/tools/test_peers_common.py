"""benchmarks/peers/_common.py's throughput phase: the median of ``throughput_repeats`` passes, the
first pass's outputs, and a flag where a later pass's outputs differ; compare.py's notes show both.
Its contention phase: quiet and busy rounds alternated in one process, a real busy process running
during the busy halves only."""

from __future__ import annotations

import json
import math
import statistics
import time
from typing import Any

from tests.scripts import load_script


def _common() -> Any:
    return load_script("benchmarks/peers/_common.py")


def _fake(delays: list[float], outputs: list[list[list[int]]]) -> Any:
    """A generate whose workload passes take ``delays`` seconds and return ``outputs`` in turn (the
    warm-up call, of one short prompt, returns at once)."""
    calls = iter(zip(delays, outputs, strict=True))

    def generate(prompts: list[list[int]], m: int) -> list[list[int]]:
        if len(prompts) == 1 and m == 2:
            return [[0, 0]]
        delay, out = next(calls)
        time.sleep(delay)
        return out

    return generate


def test_the_throughput_is_the_median_pass() -> None:
    job = {"prompts": [[1, 2, 3, 4, 5, 6, 7, 8, 9], [4]], "max_tokens": 3, "throughput_repeats": 3}
    same = [[5, 6], [7, 8]]
    t = _common().throughput(_fake([0.05, 0.25, 0.12], [same, same, same]), job)
    assert len(t["walls_s"]) == 3 and t["wall_s"] == sorted(t["walls_s"])[1]
    assert 0.12 <= t["wall_s"] < 0.25 and t["output_tok_s"] == 4 / t["wall_s"]
    assert t["outputs"] == same and not t["outputs_vary"]


def test_outputs_that_change_between_passes_are_flagged_and_noted() -> None:
    job = {"prompts": [[1, 2, 3, 4, 5, 6, 7, 8, 9]], "max_tokens": 3, "throughput_repeats": 2}
    t = _common().throughput(_fake([0.0, 0.0], [[[5, 6]], [[5, 7]]]), job)
    assert t["outputs"] == [[5, 6]] and t["outputs_vary"]
    notes = load_script("benchmarks/compare.py")._pass_notes({"name": "x", "throughput": t})
    assert any("differed" in n for n in notes) and any("throughput passes" in n for n in notes)


def test_one_pass_without_the_setting() -> None:
    job = {"prompts": [[1, 2, 3, 4, 5, 6, 7, 8, 9]], "max_tokens": 3}
    t = _common().throughput(_fake([0.0], [[[5, 6]]]), job)
    assert len(t["walls_s"]) == 1 and not t["outputs_vary"]


def test_a_runner_without_the_jobs_path_writes_why_and_runs_nothing(tmp_path: Any) -> None:
    common = _common()

    def load() -> Any:
        raise common.Unsupported("no bfloat16 compute type on this CPU")

    out = tmp_path / "out.json"
    common.run("peer", "1.0", load, {"phases": ["throughput", "latency"]}, str(out))
    result = json.loads(out.read_text())
    assert result == {"engine": "peer", "version": "1.0", "unsupported": "no bfloat16 compute type on this CPU"}
    compare = load_script("benchmarks/compare.py")
    args = compare.parse_args(["--model", "m", "--precision", "bfloat16"])
    row = compare._row(args, {"name": "CTranslate2", **result}, floor=1.0)
    assert row.startswith("| CTranslate2 | no bfloat16 path: no bfloat16 compute type on this CPU: not run |")


def _watched_popen(common: Any, monkeypatch: Any) -> list[Any]:
    """The busy processes the contention phase starts (real ones, recorded)."""
    started: list[Any] = []
    real = common.subprocess.Popen

    def popen(*args: Any, **kwargs: Any) -> Any:
        started.append(real(*args, **kwargs))
        return started[-1]

    monkeypatch.setattr(common.subprocess, "Popen", popen)
    return started


def test_contention_alternates_quiet_and_busy_rounds_in_one_process(monkeypatch: Any) -> None:
    common = _common()
    started = _watched_popen(common, monkeypatch)
    seen: list[bool] = []

    def generate(prompts: list[list[int]], m: int) -> list[list[int]]:
        busy = bool(started) and started[-1].poll() is None
        seen.append(busy)
        time.sleep(0.004 * m * (3 if busy else 1))  # a token takes 3x as long beside the busy process
        return [[7] * m]

    job = {"latency_prompt": [1, 2, 3], "max_tokens": 5, "repeats": 1, "contention_rounds": 2}
    c = common.contention(generate, job)
    # each half of a round: the settle run, latency()'s warm-up, one first-token run, one full run
    assert seen == ([False] * 4 + [True] * 4) * 2
    assert len(started) == 2 and all(p.poll() is not None for p in started)  # stopped after each round
    assert c["rounds"] == 2 and len(c["ratios"]) == 2 and c["outputs_agree"]
    assert 2.0 < c["ratio"] < 4.0 and c["tpot_ms"] == statistics.median(c["busy_tpot_ms"])
    compare = load_script("benchmarks/compare.py")
    assert compare._contended_cell(c) == f"{c['tpot_ms']:,.2f} ({c['ratio']:.2f}x)"
    notes = compare._contention_notes({"name": "x", "contended": c})
    assert len(notes) == 1 and f"median ratio {c['ratio']:.2f}x" in notes[0]


def test_an_output_that_changes_beside_the_busy_process_is_noted(monkeypatch: Any) -> None:
    common = _common()
    started = _watched_popen(common, monkeypatch)

    def generate(prompts: list[list[int]], m: int) -> list[list[int]]:
        busy = bool(started) and started[-1].poll() is None
        return [[8 if busy else 7] * m]

    c = common.contention(generate, {"latency_prompt": [1], "max_tokens": 3, "repeats": 1, "contention_rounds": 1})
    assert not c["outputs_agree"]
    notes = load_script("benchmarks/compare.py")._contention_notes({"name": "x", "contended": c})
    assert any("changed between quiet and busy runs" in n for n in notes)


def test_a_quiet_time_per_token_of_zero_has_no_ratio(monkeypatch: Any) -> None:
    """A generate faster than the clock reads gives a quiet time per token of 0: its round's ratio is
    NaN, not a ZeroDivisionError (the test above, whose generate returns at once, met one in CI)."""
    common = _common()
    _watched_popen(common, monkeypatch)
    times = iter([0.0, 2.0])
    monkeypatch.setattr(common, "latency", lambda generate, job: {"tpot_ms": next(times), "output": [7]})
    job = {"latency_prompt": [1], "max_tokens": 3, "contention_rounds": 1}
    c = common.contention(lambda prompts, m: [[7] * m], job)
    assert len(c["ratios"]) == 1 and math.isnan(c["ratios"][0]) and c["busy_tpot_ms"] == [2.0]
