"""Time per output token of decoding streams while long prompts arrive: co-located against
disaggregated prefill and decode (the ``torch_p2p`` connector over loopback), on the same total cores.

``--streams`` requests (short prompts, ``--stream-tokens`` outputs each) decode throughout; meanwhile
``--long`` requests with ``--long-tokens``-token prompts arrive one every ``--every`` seconds (each
with 8 outputs). The time per output token (TPOT) of each stream is the gap between its consecutive
tokens, as the engine loop sees them; its p50 and p99 over every gap of every stream are reported.

* co-located: one engine, its worker on ``--threads`` threads, takes everything;
* disaggregated: a prefill engine and a decode engine, each worker on ``--threads / 2`` threads; the
  long prompts go to the prefill engine (max_tokens 1, do_remote_decode), then to the decode engine
  with the returned ``kv_transfer_params``; the streams go to the decode engine.

Each engine runs its worker in its own process; the engine loops run on threads of this process.

    python benchmarks/disaggregated.py                   # tiny-qwen3, 16 streams, 2 threads in all
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

from pypto_serving import EngineCore, SamplingParams, ServingSettings

COMMON: dict[str, Any] = {"device": "cpu", "num_kv_blocks": 1024, "max_model_len": 2048, "scheduler": "sync"}


def _engine(args: argparse.Namespace, threads: int, role: str | None) -> EngineCore:
    return EngineCore(ServingSettings(model=args.model, worker_threads=threads, kv_role=role, **COMMON))


def _long_prompt(i: int, n: int) -> list[int]:
    return [(7 * i + 13 * j) % 500 + 3 for j in range(n)]


def _stream_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=args.stream_tokens, ignore_eos=True)


class _Loop:
    """An engine stepped on a thread; records when each request's output grew."""

    def __init__(self, engine: EngineCore) -> None:
        self.engine = engine
        self.lock = threading.Lock()
        self.times: dict[str, list[float]] = {}
        self.finished: dict[str, Any] = {}
        self.stop = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def add(self, rid: str, prompt: list[int], params: SamplingParams) -> None:
        with self.lock:
            self.engine.add_request(rid, prompt, params)

    def _run(self) -> None:
        seen: dict[str, int] = {}
        while not self.stop:
            with self.lock:
                outs = self.engine.step() if self.engine.has_unfinished() else self.engine.check_worker()
            now = time.perf_counter()
            for out in outs:
                n = len(out.outputs[0].token_ids)
                self.times.setdefault(out.request_id, []).extend([now] * (n - seen.get(out.request_id, 0)))
                seen[out.request_id] = n
                if out.finished:
                    self.finished[out.request_id] = out
            if not outs:
                time.sleep(0.0005)

    def wait(self, rids: list[str], timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while not all(r in self.finished for r in rids):
            if time.monotonic() > deadline:
                raise SystemExit(f"timed out waiting for {len(rids)} requests")
            time.sleep(0.005)

    def close(self) -> None:
        self.stop = True
        self.thread.join()
        self.engine.shutdown()


def _tpot(times: dict[str, list[float]], rids: list[str]) -> tuple[float, float]:
    gaps = [b - a for r in rids for a, b in zip(times[r], times[r][1:])]
    q = statistics.quantiles(gaps, n=100)
    return q[49] * 1e3, q[98] * 1e3


def _drive(args: argparse.Namespace, decode: _Loop, send_long: Callable[[int], None]) -> tuple[float, float]:
    streams = [f"s{i}" for i in range(args.streams)]
    for i, rid in enumerate(streams):
        decode.add(rid, [11 + i, 12, 13, 14], _stream_params(args))
    time.sleep(args.every)
    for i in range(args.long):
        send_long(i)
        time.sleep(args.every)
    decode.wait(streams)
    decode.wait([f"L{i}" for i in range(args.long)])  # every transfer done before the engines close
    failed = [r for r, out in decode.finished.items() if out.outputs[0].error is not None]
    if failed:
        raise SystemExit(f"requests failed: {failed}")
    return _tpot(decode.times, streams)


def colocated(args: argparse.Namespace) -> tuple[float, float]:
    loop = _Loop(_engine(args, args.threads, None))
    try:
        long = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        return _drive(args, loop, lambda i: loop.add(f"L{i}", _long_prompt(i, args.long_tokens), long))
    finally:
        loop.close()


def disaggregated(args: argparse.Namespace) -> tuple[float, float]:
    half = max(1, args.threads // 2)
    prefill, decode = _Loop(_engine(args, half, "prefill")), _Loop(_engine(args, half, "decode"))
    first = SamplingParams(temperature=0, max_tokens=1, kv_transfer_params={"do_remote_decode": True})

    def send_long(i: int) -> None:
        def run() -> None:  # the prefill's answer, then the decode request: as a router would
            prompt = _long_prompt(i, args.long_tokens)
            prefill.add(f"L{i}", prompt, first)
            prefill.wait([f"L{i}"])
            params = prefill.finished[f"L{i}"].kv_transfer_params
            decode.add(f"L{i}", prompt, SamplingParams(temperature=0, max_tokens=8, kv_transfer_params=params))

        threading.Thread(target=run, daemon=True).start()

    try:
        return _drive(args, decode, send_long)
    finally:
        prefill.close()
        decode.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="tiny-qwen3")
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--stream-tokens", type=int, default=128)
    p.add_argument("--long", type=int, default=6)
    p.add_argument("--long-tokens", type=int, default=1536)
    p.add_argument("--every", type=float, default=0.25, help="seconds between long prompts")
    p.add_argument("--threads", type=int, default=2, help="worker threads in all (split in two when disaggregated)")
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    print("| setup | run | TPOT p50 (ms) | TPOT p99 (ms) |\n|---|---|---|---|")
    for run in range(args.repeats):
        for name, fn in (("co-located", colocated), ("disaggregated", disaggregated)):
            p50, p99 = fn(args)
            print(f"| {name} | {run + 1} | {p50:.2f} | {p99:.2f} |", flush=True)


if __name__ == "__main__":
    main()
