"""ServerMetrics: the engine's running totals are Prometheus counters that never go down, across
stale snapshots and worker restarts; under data parallelism each replica has its own series beside
the sums, and one replica's restart adds to the summed counters."""

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


# -- data parallelism: per-replica series beside the sums, each replica's totals tracked apart


class _Replica:
    """What the router reads of a replica, and the metric calls its AsyncLLM makes."""

    def __init__(self) -> None:
        from pypto_serving import ServingSettings

        self.settings = ServingSettings(model="unused", data_parallel_size=2)
        self.stats: dict[str, Any] = _stats(0, 0)
        self.dead_reason: str | None = None
        self.metrics: Any = None
        self.on_finished: Any = None

    def step(self, stats: dict[str, Any]) -> None:
        """The engine thread after a step: a new snapshot, passed to the metrics."""
        self.stats = stats
        self.metrics.update_engine(stats, False)

    def restart(self) -> None:
        """``AsyncLLM._take_restart`` then the scrapes meanwhile: the dead engine's snapshot stays."""
        self.metrics.observe_restart()
        self.metrics.update_engine(self.stats, False)


def _router(metrics: ServerMetrics) -> tuple[Any, list[_Replica]]:
    from pypto_serving.server.data_parallel import DataParallelLLM

    replicas = [_Replica(), _Replica()]
    router = DataParallelLLM(replicas[0].settings, replicas=replicas)  # type: ignore[arg-type]
    router.metrics = metrics
    return router, replicas


def _scrape(m: ServerMetrics, router: Any) -> None:
    """What the /metrics route does before rendering."""
    m.update_engine(router.stats, router.dead_reason is not None)


def test_a_replica_restart_adds_to_the_summed_counters() -> None:
    m = ServerMetrics("m")
    router, (r0, r1) = _router(m)
    r0.step(_stats(10, 4, drafted=6, per_pos=(3,)))
    r1.step(_stats(10, 5, drafted=4, per_pos=(2,)))
    assert _preemptions(m) == 9
    r1.restart()
    _scrape(m, router)
    r1.step(_stats(0, 0))  # the new engine, right after start-up
    r1.step(_stats(3, 2, drafted=2, per_pos=(1,)))  # still below replica 1's old totals
    r0.step(_stats(11, 4, drafted=6, per_pos=(3,)))
    _scrape(m, router)
    assert _preemptions(m) == 4 + 5 + 2
    assert _value(m, "pypto_serving_spec_decode_num_draft_tokens_total") == 6 + 4 + 2
    assert _value(m, "pypto_serving_spec_decode_num_accepted_tokens_per_pos_total", position="0") == 3 + 2 + 1
    assert _value(m, "pypto_serving_worker_restarts_total") == 1
    assert _value(m, "pypto_serving_replica_num_preemptions_total", replica="1") == 5 + 2
    assert _value(m, "pypto_serving_replica_worker_restarts_total", replica="1") == 1
    assert _value(m, "pypto_serving_replica_worker_restarts_total", replica="0") == 0


def test_each_replica_has_its_own_series_beside_the_sums() -> None:
    m = ServerMetrics("m")
    router, (r0, r1) = _router(m)
    r0.step({**_stats(3, 1), "num_running": 2, "num_waiting": 1, "kv_usage": 0.5})
    r1.step({**_stats(7, 2), "num_running": 1, "num_waiting": 0, "kv_usage": 0.25})
    router._load[:] = [40, 9]  # tokens booked by in-flight requests
    r1.dead_reason = "no restart left"
    _scrape(m, router)
    want = {"num_requests_running": (2, 1), "num_requests_waiting": (1, 0), "kv_cache_usage_perc": (0.5, 0.25)}
    for name, values in want.items():
        per_replica = [_value(m, f"pypto_serving_replica_{name}", replica=str(i)) for i in (0, 1)]
        assert per_replica == list(values), name
    assert _value(m, "pypto_serving_num_requests_running") == 3
    assert _value(m, "pypto_serving_kv_cache_usage_perc") == pytest.approx(0.375)  # the replicas' mean
    assert _value(m, "pypto_serving_replica_num_preemptions_total", replica="0") == 1
    assert _value(m, "pypto_serving_replica_num_preemptions_total", replica="1") == 2
    assert [_value(m, "pypto_serving_replica_outstanding_tokens", replica=str(i)) for i in (0, 1)] == [40, 9]
    assert [_value(m, "pypto_serving_replica_engine_dead", replica=str(i)) for i in (0, 1)] == [0, 1]
    assert _value(m, "pypto_serving_engine_dead") == 1


def test_a_finished_request_counts_for_its_replica() -> None:
    from pypto_serving.request import CompletionOutput, RequestOutput

    m = ServerMetrics("m")
    _, (r0, r1) = _router(m)
    done = CompletionOutput(index=0, text="", token_ids=[5, 6], finish_reason="length")
    out = RequestOutput(request_id="a", prompt=None, prompt_token_ids=[1, 2], outputs=[done], finished=True)
    r1.metrics.observe_finished(out)
    r1.metrics.observe_finished(out)
    r0.metrics.observe_finished(out)
    assert _value(m, "pypto_serving_request_success_total", finish_reason="length") == 3
    assert _value(m, "pypto_serving_generation_tokens_total") == 6
    success = "pypto_serving_replica_request_success_total"
    assert [_value(m, success, replica=str(i), finish_reason="length") for i in (0, 1)] == [1, 2]


def test_a_single_engine_has_no_replica_series() -> None:
    m = ServerMetrics("m")
    m.update_engine(_stats(4, 3), dead=False)
    assert "pypto_serving_replica_" not in m.render().decode()
