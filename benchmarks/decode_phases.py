"""Where a batch's decode steps spend the native decoder's call, phase by phase (CPU).

Builds the native kernels with ``-DPYPTO_DECODE_TIMERS`` (``csrc/decode_layers.c`` then sums each
phase's seconds over the calls of more than 16 rows), swaps that build in for the built one, runs
``--prompts`` prompts of 32..256 random tokens x ``--tokens`` new tokens through
``LLM(worker_mode="inproc", scheduler="sync")`` (greedy, the batch at ``max_num_seqs`` 64) and
prints each phase's milliseconds a step, its share of the call, the products' GFLOP/s and the
attention's K/V read rate (its bytes from the steps' lengths, every layer's keys and values read
once)::

    python benchmarks/decode_phases.py --model models/qwen3-0.6b --dtype bfloat16 --tokens 48

Needs a C compiler (the build) and a dense Qwen checkpoint whose decode steps take the native
decoder (every projection in the native panels: a non-Intel CPU with AVX-512; ``cpu_linear =
"panels"`` is set).
"""

from __future__ import annotations

import argparse
import ctypes
import random
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from one_row_step import _load

PHASES = (
    "RMSNorm", "QKV", "q/k norm + RoPE + write", "attention", "O", "RMSNorm + residual", "gate-up", "SwiGLU", "down",
)  # fmt: skip


def _build(out: Path) -> Path:
    from pypto_kernels import native

    lib = out / "pypto_native_phases.so"
    compiler = native._compiler()  # type: ignore[attr-defined]
    if compiler is None:
        raise SystemExit("no C compiler: the timed build cannot be made")
    sources = [str(s) for s in native._SOURCES]  # type: ignore[attr-defined]
    subprocess.run([compiler, *native._FLAGS, "-DPYPTO_DECODE_TIMERS", "-o", str(lib), *sources], check=True)  # type: ignore[attr-defined]
    return lib


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()

    from pypto_kernels import native
    from pypto_kernels.native_decoder import NativeDecoder
    from pypto_serving import LLM, SamplingParams

    llm = LLM(
        model=args.model, scheduler="sync", dtype=args.dtype, max_num_seqs=64, worker_threads=args.threads,
        enable_prefix_caching=False, log_level="warning", worker_mode="inproc",
        executor_options={"cpu_linear": "panels"},
    )  # fmt: skip
    built = native.library()
    if built is None:
        raise SystemExit("the native kernels are not built here")
    with tempfile.TemporaryDirectory() as tmp:
        path = _build(Path(tmp))
        timed = _load(str(path), built)
        seconds = (ctypes.c_double * 10).in_dll(ctypes.CDLL(str(path)), "pypto_decode_phase_seconds")
        native.library = lambda: timed  # type: ignore[assignment]
        keys = [0]  # keys the batch calls' rows saw, summed (each layer reads each once, K and V)
        run = NativeDecoder.run

        def counted(self: Any, hidden: Any, rotary: Any, slots: Any, tables: Any, q: Any, s: Any) -> Any:
            if hidden.shape[0] > 16:
                keys[0] += sum(s)
            return run(self, hidden, rotary, slots, tables, q, s)

        NativeDecoder.run = counted  # type: ignore[method-assign]
        rng = random.Random(0)
        prompts = [[rng.randrange(100, 150_000) for _ in range(rng.randint(32, 256))] for _ in range(args.prompts)]
        warm = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
        llm.generate(prompts[:2], warm, use_tqdm=False)
        for i in range(10):
            seconds[i] = 0.0
        keys[0] = 0
        start = time.perf_counter()
        params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
        llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - start
        _report(llm, [seconds[i] for i in range(10)], keys[0], wall)


def _report(llm: Any, seconds: list[float], keys: int, wall: float) -> None:
    model = llm.engine.worker._runner.executor.model
    cfg, layers, calls = model.cfg, len(model.layers), seconds[9]
    if not calls:
        raise SystemExit("no decode step of more than 16 rows took the native decoder")
    h, d, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q_width, kv_width = cfg.num_heads * d, cfg.num_kv_heads * d
    macs = {1: h * (q_width + 2 * kv_width), 4: q_width * h, 6: h * 2 * inter, 8: inter * h}
    rows = 64  # the batch's decode steps (prompts >= max_num_seqs)
    element = 2 if model.dtype.itemsize == 2 else 4
    total = sum(seconds[:9])
    print(f"{calls:.0f} decode calls of >16 rows, {1e3 * total / calls:.1f} ms each (run {wall:.1f} s)")
    print("| phase | ms a step | share | rate |")
    print("|---|---:|---:|---|")
    for i, name in enumerate(PHASES):
        rate = ""
        if i in macs:
            rate = f"{2 * macs[i] * rows * layers * calls / seconds[i] / 1e9:.0f} GFLOP/s (at {rows} rows)"
        elif i == 3:
            rate = f"{2 * keys * kv_width * element * layers / seconds[i] / 1e9:.1f} GB/s of K/V"
        print(f"| {name} | {1e3 * seconds[i] / calls:.2f} | {100 * seconds[i] / total:.1f} % | {rate} |")


if __name__ == "__main__":
    main()
