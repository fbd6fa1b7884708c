"""benchmarks/compare.py's bandwidth floors: the copy rate and the plain-read rate measured on one
tensor, and the report's line putting each engine's concurrency-1 time over the read floor."""

from __future__ import annotations

from typing import Any

from tests.scripts import load_script


def _compare() -> Any:
    return load_script("benchmarks/compare.py")


def test_memory_bandwidth_measures_a_copy_and_a_read() -> None:
    copy, read = _compare().memory_bandwidth(4, threads=1)
    assert copy > 0 and read > 0


def _report(tpots: dict[str, float | None]) -> dict[str, Any]:
    results: list[dict[str, Any]] = [
        {"name": name, "version": "1", "latency": {} if t is None else {"tpot_ms": t}} for name, t in tpots.items()
    ]
    results.append({"name": "also-row", "weight_bytes": 10, "latency": {"tpot_ms": 1.0}})  # its own floor: left out
    return {
        "command": "compare.py",
        "machine": "test",
        "precision": "float32",
        "weight_bytes": 2_000_000,
        "bandwidth_gbs": 2.0,
        "floor_ms": 1.0,
        "read_bandwidth_gbs": 1.0,
        "read_floor_ms": 2.0,
        "peak_gflops": {"float32": 1.0, "bfloat16": 2.0},
        "workload_gflop": 1.0,
        "results": results,
    }


def test_the_report_puts_concurrency_1_over_the_read_floor() -> None:
    compare = _compare()
    args = compare.parse_args(["--model", "m", "--peers", "none"])
    text = compare.markdown(args, _report({"ours": 3.0, "peer": 5.0, "failed": None}))
    line = next(x for x in text.splitlines() if x.startswith("Memory read bandwidth"))
    assert "1.0 GB/s" in line and "2.00 ms per token" in line
    assert "ours 1.50x, peer 2.50x)." in line and "failed" not in line and "also-row" not in line


def test_a_report_without_the_read_rate_has_no_read_line() -> None:
    compare = _compare()
    report = _report({"ours": 3.0})
    del report["read_floor_ms"], report["read_bandwidth_gbs"]  # written before the read rate was measured
    text = compare.markdown(compare.parse_args(["--model", "m"]), report)
    assert "Memory read bandwidth" not in text and "weights-over-bandwidth floor" in text
