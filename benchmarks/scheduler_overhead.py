"""Time of one Scheduler.schedule() + Scheduler.update() with a no-op executor, and with the step
message: the engine's side of the pipe (msgpack-encoding the StepCommand, decoding the StepResult).

Builds N running decode requests (prompts already computed), then times steps where the "worker"
answers instantly with one token per request. Reports µs per step and µs per running request.

    python benchmarks/scheduler_overhead.py [--steps 200]
"""

from __future__ import annotations

import argparse
import time

import msgspec

from pypto_serving.executor import CacheGroupSpec, ExecutorInfo
from pypto_serving.kv_cache import KVCacheManager
from pypto_serving.messages import StepResult
from pypto_serving.request import Request, SamplingParams
from pypto_serving.scheduler import Scheduler, SchedulerConfig
from pypto_serving.speculative import no_speculation


def measure(n: int, steps: int, *, wire: bool = False) -> tuple[float, float]:
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
        t0 = time.perf_counter()
        out = sched.schedule()
        sampled = {it.request.request_id: [7] for it in out.items if it.sample}
        if wire:  # the worker's reply arrives as bytes; encoding it is the worker's cost, not timed
            encoder.encode(out.command)
            t1 = time.perf_counter()
            raw = encoder.encode(StepResult(out.command.step_id, sampled=sampled))
            t0 += time.perf_counter() - t1
            result = decoder.decode(raw)
        else:
            result = StepResult(out.command.step_id, sampled=sampled)
        sched.update(out, result)
        return time.perf_counter() - t0

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
    args = ap.parse_args()
    print(
        "| running decode requests | µs per schedule+update (median) | µs per request "
        "| µs per request with the step message |"
    )
    print("|---:|---:|---:|---:|")
    for n in (64, 256, 1024):
        step_us, per_req = measure(n, args.steps)
        _, per_req_wire = measure(n, args.steps, wire=True)
        print(f"| {n} | {step_us:.0f} | {per_req:.2f} | {per_req_wire:.2f} |")


if __name__ == "__main__":
    main()
