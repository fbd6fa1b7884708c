"""benchmarks/compare.py's bandwidth floors: the copy rate and the plain-read rate measured on one
tensor, the read rates of several tensors whose overall rate gives the TPOT / floor column's floor,
and the report's lines putting each engine's concurrency-1 time over them."""

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


def test_the_report_names_each_engines_first_token_and_peers_fit_the_longest_prompt() -> None:
    compare = _compare()
    args = compare.parse_args(["--model", "m", "--latency-prompt-len", "4096", "--max-tokens", "8"])
    report = _report({"ours": 3.0, "failed": None})
    report["results"][0]["latency"]["first_s"] = 0.3834
    line = next(x for x in compare.markdown(args, report).splitlines() if x.startswith("Concurrency 1's first token"))
    assert "4096-token prompt" in line and line.endswith("ms: ours 383.4.") and "failed" not in line
    assert compare.context_len(args) == 4104
    assert compare.context_len(compare.parse_args(["--model", "m"])) == 2048


def test_a_report_without_the_read_rate_has_no_read_line() -> None:
    compare = _compare()
    report = _report({"ours": 3.0})
    del report["read_floor_ms"], report["read_bandwidth_gbs"]  # written before the read rate was measured
    text = compare.markdown(compare.parse_args(["--model", "m"]), report)
    assert "Memory read bandwidth" not in text and "weights-over-bandwidth floor" in text


def test_region_rates_read_each_tensor_and_combine_as_one_read_after_another() -> None:
    compare = _compare()
    rates = compare.region_read_rates(8, regions=4, threads=1)
    assert len(rates) == 4 and all(r > 0 for r in rates)
    # 1 byte at 1 B/s and 1 byte at 3 B/s take 4/3 s: 2 bytes over 4/3 s is 1.5 B/s, not the mean 2.
    assert compare.overall_rate([1.0, 3.0]) == 1.5


def test_the_column_uses_the_regions_overall_rate() -> None:
    compare = _compare()
    report = _report({"ours": 3.0})
    report["region_read_gbs"] = [1.0, 4.0]  # overall 1.6 GB/s: 2 MB in 1.25 ms
    report["regions_floor_ms"] = 1.25
    report["results"][-1]["weight_bytes"] = 1_000_000  # the also-row's own bytes: 0.625 ms at that rate
    args = compare.parse_args(["--model", "m", "--peers", "none", "--bandwidth-mib", "256"])
    text = compare.markdown(args, report)
    row = next(x for x in text.splitlines() if x.startswith("| ours |"))
    assert "| 3.00 | 2.40x |" in row  # 3.0 / 1.25, not 3.0 over the copy floor of 1.0
    line = next(x for x in text.splitlines() if x.startswith("Memory read by region"))
    assert "2 tensors of 128 MiB" in line and "1.0-4.0 GB/s, 1.6 GB/s over all" in line
    assert "1.25 ms per token" in line and "fastest region's rate 0.50 ms" in line
    also = next(x for x in text.splitlines() if x.startswith("| also-row |"))
    assert "| 1.00 | 1.60x |" in also


def test_each_engine_is_put_over_the_floor_read_around_its_own_run(monkeypatch: Any, tmp_path: Any) -> None:
    """The regions' overall rate is read right before and right after each engine's run; its row's
    TPOT / floor is over the floor at their mean (others keep the report's), and a note gives both,
    saying where the state changed between them."""
    compare = _compare()
    report = _report({"ours": 3.0, "peer": 3.0})
    report["region_read_gbs"] = [1.0, 4.0]  # the column's rate: 1.6 GB/s, a 1.25 ms floor
    report["regions_floor_ms"] = 1.25
    report["results"][0]["read_gbs_around"] = [1.0, 3.0]  # mean 2 GB/s: a 1.0 ms floor, changed state
    report["results"][-1]["read_gbs_around"] = [4.0, 4.0]  # the also-row's 10 bytes: 2.5e-6 ms
    text = compare.markdown(compare.parse_args(["--model", "m", "--peers", "none"]), report)
    rows = {x.split(" |")[0][2:]: x for x in text.splitlines() if x.startswith("| ")}
    assert "| 3.00 | 3.00x |" in rows["ours"] and "| 3.00 | 2.40x |" in rows["peer"]
    assert "| 1.00 | 400000.00x |" in rows["also-row"]
    notes = [x for x in text.splitlines() if "right before its run" in x]
    assert notes == [
        "- ours: memory read 1.0 GB/s over all right before its run and 3.0 right after (the state changed "
        "during the run); its TPOT / floor is over the floor at their mean.",
        "- also-row: memory read 4.0 GB/s over all right before its run and 4.0 right after; its TPOT / floor "
        "is over the floor at their mean.",
    ]
    reads = iter([1e9, 2e9])
    monkeypatch.setattr(compare, "_overall_read_rate", lambda args: next(reads))
    monkeypatch.setattr(compare, "run_engine", lambda *a: {"latency": {"tpot_ms": 1.0}})
    monkeypatch.setattr(compare, "engines", lambda args, ours: [{"name": "x", "job": {}}])
    monkeypatch.setattr(compare, "memory_bandwidth", lambda *a: (1e9, 1e9))
    monkeypatch.setattr(compare, "region_read_rates", lambda *a: [1e9])
    monkeypatch.setattr(compare, "matmul_peak", lambda *a: 1e9)
    monkeypatch.setattr(compare, "weight_bytes", lambda *a: 1)
    monkeypatch.setattr(compare, "workload_flops", lambda *a: 1.0)
    monkeypatch.setattr(compare, "prompt_vocab_size", lambda model: 100)
    (tmp_path / "config.json").write_text("{}")
    args = compare.parse_args(["--model", str(tmp_path), "--peers", "none"])
    [result] = compare.run_all(args, tmp_path)["results"]
    assert result["read_gbs_around"] == [1.0, 2.0]


def test_the_floor_tensors_are_advised_onto_huge_pages_before_their_first_touch(monkeypatch: Any) -> None:
    import torch

    compare = _compare()
    calls: list[tuple[int, int, int]] = []

    class Libc:
        def madvise(self, start: Any, length: Any, advice: int) -> int:
            calls.append((start.value, length.value, advice))
            return 0

    monkeypatch.setattr(compare.ctypes, "CDLL", lambda name: Libc())
    t = torch.empty(3 * 2**20 // 4 + 5)  # 3 MiB and 20 bytes, 64-byte aligned
    assert compare.on_huge_pages(t) is t
    [(start, length, advice)] = calls
    begin, end = t.data_ptr(), t.data_ptr() + t.numel() * 4
    assert advice == 14 and start % 4096 == 0 and (start + length) % 4096 == 0  # MADV_HUGEPAGE, whole pages
    assert begin <= start < begin + 4096 and end - 4096 < start + length <= end  # its whole page-aligned span
    calls.clear()
    compare.region_read_rates(8, regions=2, threads=1)
    assert len(calls) == 2  # each region tensor advised
