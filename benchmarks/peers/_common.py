"""Shared by the peer runners (standard library only: each runner runs with its own peer's python).

A runner is called as ``PYTHON run_<peer>.py JOB.json OUT.json``. The job (written by
benchmarks/compare.py) holds the model directory, the workload's token-id prompts, ``max_tokens``,
the concurrency-1 prompt and the phases to run; the runner writes the same fields for every engine:

    {"engine", "version", "load_s",
     "throughput": {"num_requests", "prompt_tokens", "output_tokens", "walls_s", "outputs_vary", "wall_s",
                    "requests_per_s", "output_tok_s", "total_tok_s", "outputs": [[ids]...]},
     "latency": {"prompt_tokens", "max_tokens", "first_s", "full_s", "tpot_ms", "output": [ids]},
     "contended": {"rounds", "quiet_tpot_ms", "busy_tpot_ms", "ratios", "ratio", "tpot_ms", "outputs_agree"}}

Throughput is the median of ``throughput_repeats`` passes of the workload (default 1), each engine's
passes back to back. Latency at concurrency 1 is taken the same way everywhere: the median wall time of one request
with ``max_tokens=1`` (``first_s``, prefill + one token) and with ``max_tokens=M`` (``full_s``),
over ``repeats`` runs each after one warm-up; ``tpot_ms = (full_s - first_s) / (M - 1)``.

The contention phase measures concurrency 1 beside a busy process (a Python busy loop) in the same
process, alternated with quiet runs, ``contention_rounds`` rounds (default 3) of one quiet and one
busy latency measurement. Each measurement follows one untimed run of the request after the busy
process started or stopped, so an engine that adapts to its neighbour has seen the change. ``ratio``
is the median of the rounds' busy over quiet times: both halves of a round read the same weights'
pages (where memory reads at different rates by where a page lands, a quiet run in one process against
a busy one in another would compare two placements too).
"""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

# generate(prompts, max_tokens) -> generated token ids per prompt, in order, exactly max_tokens each
Generate = Callable[[list[list[int]], int], list[list[int]]]


def read_job() -> tuple[dict[str, Any], str]:
    if len(sys.argv) != 3:
        sys.exit(f"usage: {sys.argv[0]} JOB.json OUT.json")
    with open(sys.argv[1]) as f:
        return json.load(f), sys.argv[2]


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - start


def throughput(generate: Generate, job: dict[str, Any]) -> dict[str, Any]:
    """The workload ``throughput_repeats`` times (default 1) after a warm-up; the rates are those of the
    median wall time, the outputs the first pass's (``outputs_vary``: whether a later pass's differed)."""
    prompts, m, repeats = job["prompts"], job["max_tokens"], job.get("throughput_repeats", 1)
    generate([prompts[0][:8]], 2)  # warm-up
    passes = [timed(lambda: generate(prompts, m)) for _ in range(max(1, repeats))]
    outputs, walls = passes[0][0], [wall for _, wall in passes]
    wall = statistics.median(walls)
    prompt_tokens = sum(len(p) for p in prompts)
    output_tokens = sum(len(o) for o in outputs)
    return {
        "num_requests": len(prompts),
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "walls_s": walls,
        "outputs_vary": any(outs != outputs for outs, _ in passes[1:]),
        "wall_s": wall,
        "requests_per_s": len(prompts) / wall,
        "output_tok_s": output_tokens / wall,
        "total_tok_s": (prompt_tokens + output_tokens) / wall,
        "outputs": outputs,
    }


def latency(generate: Generate, job: dict[str, Any]) -> dict[str, Any]:
    prompt, m, repeats = job["latency_prompt"], job["max_tokens"], job.get("repeats", 3)
    generate([prompt], 2)  # warm-up
    firsts = [timed(lambda: generate([prompt], 1))[1] for _ in range(repeats)]
    fulls = []
    output: list[int] = []
    for _ in range(repeats):
        outs, t = timed(lambda: generate([prompt], m))
        fulls.append(t)
        output = outs[0]
    first, full = statistics.median(firsts), statistics.median(fulls)
    return {
        "prompt_tokens": len(prompt),
        "max_tokens": m,
        "first_s": first,
        "full_s": full,
        "tpot_ms": (full - first) / (m - 1) * 1000 if m > 1 else float("nan"),
        "output": output,
    }


class BusyProcess:
    """A competing CPU-bound process (a Python busy loop) while the ``with`` block runs."""

    def __enter__(self) -> BusyProcess:
        self.proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.terminate()
        self.proc.wait(10)


def contention(generate: Generate, job: dict[str, Any]) -> dict[str, Any]:
    """Concurrency 1 quiet and beside a busy process, alternated in ``contention_rounds`` rounds (see the
    module's docstring); ``outputs_agree``: every run's output equals the first quiet one's."""
    prompt, m = job["latency_prompt"], job["max_tokens"]
    quiet: list[dict[str, Any]] = []
    busy: list[dict[str, Any]] = []
    for _ in range(max(1, job.get("contention_rounds", 3))):
        generate([prompt], m)  # the settle run: the busy process of the round before has stopped
        quiet.append(latency(generate, job))
        with BusyProcess():
            generate([prompt], m)
            busy.append(latency(generate, job))
    # A quiet time per token of zero or less (a generate faster than the clock reads) has no ratio.
    ratios = [b["tpot_ms"] / q["tpot_ms"] if q["tpot_ms"] > 0 else math.nan for q, b in zip(quiet, busy)]
    return {
        "rounds": len(ratios),
        "quiet_tpot_ms": [q["tpot_ms"] for q in quiet],
        "busy_tpot_ms": [b["tpot_ms"] for b in busy],
        "ratios": ratios,
        "ratio": statistics.median(ratios),
        "tpot_ms": statistics.median(b["tpot_ms"] for b in busy),
        "outputs_agree": all(r["output"] == quiet[0]["output"] for r in quiet + busy),
    }


class Unsupported(Exception):
    """Raised by a runner's ``load`` when its engine has no path for the job (such as a precision this CPU
    lacks): the runner then writes ``{"engine", "version", "unsupported": reason}`` and runs nothing."""


def run(engine: str, version: str, load: Callable[[], Generate], job: dict[str, Any], out: str) -> None:
    """Load, run the job's phases, write ``out``."""
    try:
        generate, load_s = timed(load)
    except Unsupported as e:
        with open(out, "w") as f:
            json.dump({"engine": engine, "version": version, "unsupported": str(e)}, f)
        return
    result: dict[str, Any] = {"engine": engine, "version": version, "load_s": load_s}
    phases = job.get("phases", ["throughput", "latency"])
    if "throughput" in phases:
        result["throughput"] = throughput(generate, job)
    if "latency" in phases:
        result["latency"] = latency(generate, job)
    if "contention" in phases:
        result["contended"] = contention(generate, job)
    with open(out, "w") as f:
        json.dump(result, f)
