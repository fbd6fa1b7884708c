"""Time of one Scheduler.schedule() + Scheduler.update() with a no-op executor, and with the step
message: the engine's side of the pipe (msgpack-encoding the StepCommand, decoding the StepResult).

Builds N running decode requests (prompts already computed), then times steps where the "worker"
answers instantly with one token per request; building and encoding that answer is the worker's
work and is not timed. Reports µs per step and µs per running request (medians over the steps).

    python benchmarks/scheduler_overhead.py [--steps 200] [--sizes 64 256 1024] [--clock wall|cpu]
    python benchmarks/scheduler_overhead.py --against /tmp/base/core [--repeats 5]

``--against DIR`` loads a second copy of the scheduler's modules from another checkout's ``core``
directory (a git worktree of an older commit, say) and alternates steps between the two in one
process, so both see the same noise from the rest of the machine; it reports both sides and the
ratio of their medians, per repeat and as the median over repeats.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

MODULES = ("executor", "kv_cache", "messages", "request", "scheduler", "speculative")


def load(core_dir: Path, alias: str) -> dict[str, Any]:
    """The scheduler's modules from ``core_dir/pypto_serving`` as package ``alias``, without the
    package's ``__init__`` (which imports the engine and torch): they import each other relatively."""
    pkg = types.ModuleType(alias)
    pkg.__path__ = [str(core_dir / "pypto_serving")]
    sys.modules[alias] = pkg
    return {m: importlib.import_module(f"{alias}.{m}") for m in MODULES}


class Bench:
    """One scheduler with ``n`` running decode requests and a worker that answers at once."""

    def __init__(self, mods: dict[str, Any], n: int, *, wire: bool, clock: Callable[[], float]) -> None:
        ex, req = mods["executor"], mods["request"]
        info = ex.ExecutorInfo([ex.CacheGroupSpec("kv", 16, 1)], vocab_size=32000, max_model_len=8192)
        kv = mods["kv_cache"].KVCacheManager(info.cache_groups, {"kv": n * 40}, enable_prefix_caching=True)
        sched = mods["scheduler"]
        config = sched.SchedulerConfig(max_num_seqs=n, max_num_batched_tokens=n * 64, max_model_len=8192)
        self.sched = sched.Scheduler(config, kv, info, mods["speculative"].no_speculation(None))
        params = req.SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True)
        for i in range(n):
            self.sched.add_request(req.Request(f"r{i}", [i % 100 + 1] * 32, params))
        self.n, self.wire, self.clock = n, wire, clock
        self.result_type = mods["messages"].StepResult
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(self.result_type)
        for _ in range(6):  # the prefill step, then decodes
            self.step()

    def step(self) -> float:
        clock, sched = self.clock, self.sched
        t0 = clock()
        out = sched.schedule()
        if self.wire:
            self.encoder.encode(out.command)
        t1 = clock()  # the worker's part is not timed: building its reply and encoding it
        sampled = {e.request_id: [7] for e in out.command.entries if e.sample}
        result = self.result_type(out.command.step_id, sampled=sampled)
        raw = self.encoder.encode(result) if self.wire else b""
        t0 += clock() - t1
        if self.wire:
            result = self.decoder.decode(raw)
        sched.update(out, result)
        return clock() - t0

    def per_request_us(self, times: list[float]) -> float:
        assert len(self.sched.running) == self.n
        return statistics.median(times) * 1e6 / self.n


def measure(
    mods: dict[str, Any], n: int, steps: int, *, wire: bool = False, clock: Callable[[], float] = time.perf_counter
) -> tuple[float, float]:
    """Median µs per step and per running request."""
    bench = Bench(mods, n, wire=wire, clock=clock)
    per_request = bench.per_request_us([bench.step() for _ in range(steps)])
    return per_request * n, per_request


def compare(mine: dict[str, Any], other: dict[str, Any], args: argparse.Namespace, clock: Callable[[], float]) -> None:
    print("| running decode requests | step message | µs per request, --against | µs per request, this tree | ratio |")
    print("|---:|---|---:|---:|---:|")
    for n in args.sizes:
        for wire in (False, True):
            rows = []
            for _ in range(args.repeats):
                a, b = Bench(other, n, wire=wire, clock=clock), Bench(mine, n, wire=wire, clock=clock)
                ta, tb = [], []
                for _ in range(args.steps):  # alternate steps: both sides see the same noise
                    ta.append(a.step())
                    tb.append(b.step())
                rows.append((a.per_request_us(ta), b.per_request_us(tb)))
            before, after = (statistics.median(r[i] for r in rows) for i in (0, 1))
            each = ", ".join(f"{x:.2f}/{y:.2f}" for x, y in rows)
            ratio = statistics.median(y / x for x, y in rows)
            print(f"| {n} | {'yes' if wire else 'no'} | {before:.2f} | {after:.2f} | {ratio:.2f} (repeats: {each}) |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--sizes", type=int, nargs="+", default=[64, 256, 1024], help="running decode requests")
    ap.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="cpu: this thread's CPU time, which other jobs on a shared machine disturb less",
    )
    ap.add_argument("--against", type=Path, help="another checkout's core/ directory to alternate steps with")
    ap.add_argument("--repeats", type=int, default=5, help="with --against: fresh schedulers per size")
    args = ap.parse_args()
    clock = time.perf_counter if args.clock == "wall" else time.thread_time
    mine = load(Path(__file__).resolve().parents[1] / "core", "pypto_serving_this")
    if args.against is not None:
        compare(mine, load(args.against.resolve(), "pypto_serving_against"), args, clock)
        return
    print(
        "| running decode requests | µs per schedule+update (median) | µs per request "
        "| µs per request with the step message |"
    )
    print("|---:|---:|---:|---:|")
    for n in args.sizes:
        step_us, per_req = measure(mine, n, args.steps, clock=clock)
        _, per_req_wire = measure(mine, n, args.steps, wire=True, clock=clock)
        print(f"| {n} | {step_us:.0f} | {per_req:.2f} | {per_req_wire:.2f} |")


if __name__ == "__main__":
    main()
