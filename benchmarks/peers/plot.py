"""Draws compare.py's PNG (run by compare.py with a python that has matplotlib):
``python plot.py REPORT.json OUT.png``. Left: output tokens/s of the throughput workload; right:
time per output token at concurrency 1 (and contended, when measured), with the
weights-over-bandwidth floor as a line."""

from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def main() -> None:
    with open(sys.argv[1]) as f:
        report = json.load(f)
    rows = [r for r in report["results"] if "error" not in r and not r.get("missing") and not r.get("unsupported")]
    names = [r["name"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    left.barh(names, [r.get("throughput", {}).get("output_tok_s", 0) for r in rows], color="tab:blue")
    left.set_xlabel("output tokens/s (higher is better)")
    left.set_title("throughput workload")
    left.invert_yaxis()
    y = range(len(rows))
    tpot = [r.get("latency", {}).get("tpot_ms", 0) for r in rows]
    right.barh([i - 0.2 for i in y], tpot, height=0.4, label="idle", color="tab:green")
    contended = [r.get("contended", {}).get("tpot_ms") or 0 for r in rows]
    if any(contended):
        right.barh([i + 0.2 for i in y], contended, height=0.4, label="with a CPU hog", color="tab:red")
    floor = report.get("regions_floor_ms", report["floor_ms"])  # the TPOT / floor column's
    right.axvline(floor, color="black", linestyle="--", label="weights / bandwidth floor")
    right.set_yticks(list(y), names)
    right.invert_yaxis()
    right.set_xlabel("ms per output token at concurrency 1 (lower is better)")
    right.set_title("concurrency 1")
    right.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(sys.argv[2], dpi=120)


if __name__ == "__main__":
    main()
