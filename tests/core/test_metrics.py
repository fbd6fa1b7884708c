"""ServerMetrics: the engine's running totals are Prometheus counters that never go down, across
stale snapshots and worker restarts."""

from __future__ import annotations

from typing import Any

import pytest

from pypto_serving.metrics import ServerMetrics

_COUNTERS = (
    "pypto_serving_num_preemptions",
    "pypto_serving_spec_decode_num_draft_tokens",
    "pypto_serving_spec_decode_num_accepted_tokens",
    "pypto_serving_spec_decode_num_accepted_tokens_per_pos",
)


def _stats(steps: int, preempted: int, drafted: int = 0, per_pos: tuple[int, ...] = ()) -> dict[str, Any]:
    return {
        "num_steps": steps,
        "num_preemptions": preempted,
        "spec_drafted": drafted,
        "spec_accepted": sum(per_pos),
        "spec_accepted_per_pos": list(per_pos),
    }


def _value(m: ServerMetrics, name: str, **labels: str) -> float:
    value = m.registry.get_sample_value(name, {"model_name": "m", **labels})
    assert value is not None, name
    return value


def _preemptions(m: ServerMetrics) -> float:
    return _value(m, "pypto_serving_num_preemptions_total")


def test_engine_totals_are_counters() -> None:
    m = ServerMetrics("m")
    m.update_engine(_stats(4, 3, drafted=10, per_pos=(5, 2)), dead=False)
    text = m.render().decode()
    for name in _COUNTERS:
        assert f"# TYPE {name}_total counter" in text, name
    assert _preemptions(m) == 3
    assert _value(m, "pypto_serving_spec_decode_num_draft_tokens_total") == 10
    assert _value(m, "pypto_serving_spec_decode_num_accepted_tokens_total") == 7
    assert _value(m, "pypto_serving_spec_decode_num_accepted_tokens_per_pos_total", position="1") == 2
    assert _value(m, "pypto_serving_spec_decode_acceptance_rate") == pytest.approx(0.7)  # ratios stay gauges


def test_the_speculation_in_use_is_labelled() -> None:
    m = ServerMetrics("m")
    m.update_engine({**_stats(1, 0), "spec_method": None, "spec_policy": None, "spec_k": 0}, dead=False)
    assert "pypto_serving_spec_decode_config{" not in m.render().decode()
    m.update_engine({**_stats(2, 0), "spec_method": "ngram", "spec_policy": "adaptive", "spec_k": 3}, dead=False)
    labels = {"method": "ngram", "policy": "adaptive", "num_speculative_tokens": "3"}
    assert _value(m, "pypto_serving_spec_decode_config", **labels) == 1


def test_a_running_total_counts_once_and_a_stale_snapshot_changes_nothing() -> None:
    m = ServerMetrics("m")
    m.update_engine(_stats(4, 3), dead=False)
    m.update_engine(_stats(4, 3), dead=False)  # the same snapshot again (a scrape)
    m.update_engine(_stats(9, 5), dead=False)
    assert _preemptions(m) == 5
    m.update_engine(_stats(6, 4), dead=False)  # a scrape that read the snapshot before the last one
    assert _preemptions(m) == 5
    m.update_engine(_stats(10, 6), dead=False)
    assert _preemptions(m) == 6


def test_totals_of_a_new_engine_after_a_restart_are_added() -> None:
    m = ServerMetrics("m")
    m.update_engine(_stats(9, 5, drafted=8, per_pos=(4,)), dead=False)
    m.observe_restart()
    m.update_engine(_stats(9, 5, drafted=8, per_pos=(4,)), dead=False)  # the dead engine's, while loading
    assert _preemptions(m) == 5
    m.update_engine(_stats(0, 0), dead=False)  # the new engine, right after start-up
    m.update_engine(_stats(1, 2, drafted=3, per_pos=(1,)), dead=False)
    assert _preemptions(m) == 7
    assert _value(m, "pypto_serving_spec_decode_num_draft_tokens_total") == 11
    assert _value(m, "pypto_serving_spec_decode_num_accepted_tokens_per_pos_total", position="0") == 5
    m.update_engine(_stats(3, 4, drafted=3, per_pos=(1,)), dead=False)
    assert _preemptions(m) == 9
    assert _value(m, "pypto_serving_worker_restarts_total") == 1


def test_a_new_engine_seen_first_mid_run_counts_whole() -> None:
    """No start-up snapshot of the new engine was seen: its first one already counted."""
    m = ServerMetrics("m")
    m.update_engine(_stats(50, 8), dead=False)
    m.observe_restart()
    m.update_engine(_stats(2, 1), dead=False)
    assert _preemptions(m) == 9
