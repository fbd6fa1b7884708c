"""Time of one Scheduler.schedule() + Scheduler.update() with a no-op executor, and with the step
message: the engine's side of the pipe (msgpack-encoding the StepCommand, decoding the StepResult).

Builds N running decode requests (prompts already computed), then times steps where the "worker"
answers instantly with one token per request; building and encoding that answer is the worker's
work and is not timed. Reports µs per step and µs per running request.

    python benchmarks/scheduler_overhead.py [--steps 200] [--sizes 64 256 1024] [--clock wall|cpu]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import msgspec

from pypto_serving.executor import CacheGroupSpec, ExecutorInfo
from pypto_serving.kv_cache import KVCacheManager
from pypto_serving.messages import StepResult
from pypto_serving.request import Request, SamplingParams
from pypto_serving.scheduler import Scheduler, SchedulerConfig
from pypto_serving.speculative import no_speculation


def measure(
    n: int, steps: int, *, wire: bool = False, clock: Callable[[], float] = time.perf_counter
) -> tuple[float, float]:
    info = ExecutorInfo([CacheGroupSpec("kv", 16, 1)], vocab_size=32000, max_model_len=8192)
    kv = KVCacheManager(info.cache_groups, {"kv": n * 40}, enable_prefix_caching=True)
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=n, max_num_batched_tokens=n * 64, max_model_len=8192),
        kv,
        info,
        no_speculation(None),
    )  # type: ignore[arg-type]
    params = SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True)
    for i in range(n):
        sched.add_request(Request(f"r{i}", [i % 100 + 1] * 32, params))

    encoder = msgspec.msgpack.Encoder()
    decoder = msgspec.msgpack.Decoder(StepResult)

    def one_step() -> float:
        t0 = clock()
        out = sched.schedule()
        if wire:
            encoder.encode(out.command)
        # The worker's part is not timed: building its reply and encoding it.
        t1 = clock()
        sampled = {it.request.request_id: [7] for it in out.items if it.sample}
        raw = encoder.encode(StepResult(out.command.step_id, sampled=sampled)) if wire else b""
        t0 += clock() - t1
        result = decoder.decode(raw) if wire else StepResult(out.command.step_id, sampled=sampled)
        sched.update(out, result)
        return clock() - t0

    one_step()  # the prefill step
    for _ in range(5):
        one_step()
    times = sorted(one_step() for _ in range(steps))
    median = times[len(times) // 2]
    assert len(sched.running) == n
    return median * 1e6, median * 1e6 / n


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
    args = ap.parse_args()
    clock = time.perf_counter if args.clock == "wall" else time.thread_time
    print(
        "| running decode requests | µs per schedule+update (median) | µs per request "
        "| µs per request with the step message |"
    )
    print("|---:|---:|---:|---:|")
    for n in args.sizes:
        step_us, per_req = measure(n, args.steps, clock=clock)
        _, per_req_wire = measure(n, args.steps, wire=True, clock=clock)
        print(f"| {n} | {step_us:.0f} | {per_req:.2f} | {per_req_wire:.2f} |")


if __name__ == "__main__":
    main()
