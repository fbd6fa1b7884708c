"""Time of a one-row decode step (concurrency 1) in process, optionally alternating native kernel builds.

One request (a 128-token prompt of random ids, greedy) decodes ``--tokens`` tokens through
``LLM(worker_mode="inproc", scheduler="sync")``; every ``ModelRunner.launch`` after the prefill is
timed (the forward and the sampling launch of one step). With ``--libs A.so,B.so`` the native kernel
libraries are swapped every ``--block`` steps and the first step of each block is dropped, so each
timed step starts from its own library's cache state (a step's leftovers in L2 and L3 are what a
prefetch policy changes) while the machine's drift is shared. Each library must be built from
``kernels/pypto_kernels/csrc`` of some checkout with the native build's flags::

    cc -O3 -march=native -fopenmp -fno-math-errno -shared -fPIC -o /tmp/a.so kernels/pypto_kernels/csrc/*.c

    python benchmarks/one_row_step.py --model models/qwen3-0.6b --dtype bfloat16 --tokens 480 \\
        --libs /tmp/a.so,/tmp/b.so

``--decoder both`` alternates the native decoder (a decode step's layers in one C call) with the
kernel-by-kernel forward in the same way (``executor_options.native_decoder``); ``on`` / ``off``
keep one. With several libraries and ``both``, every (library, decoder) pair is a variant.

Prints each variant's median step time and in how many blocks (their medians, the first variant's
block against each other's next one) each later variant was faster than the first.
"""

from __future__ import annotations

import argparse
import ctypes
import random
import statistics
import time
from typing import Any


def _load(path: str, real: ctypes.CDLL) -> ctypes.CDLL:
    """The library at ``path`` with the built library's argument and result types."""
    lib = ctypes.CDLL(path)
    for name in dir(real):
        if name.startswith("pypto_"):
            getattr(lib, name).restype = getattr(real, name).restype
            getattr(lib, name).argtypes = getattr(real, name).argtypes
    return lib


def _block_medians(times: list[float], size: int) -> list[float]:
    return [statistics.median(times[i : i + size]) for i in range(0, len(times) - size + 1, size)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--libs", default="", help="comma list of native kernel libraries to alternate")
    p.add_argument("--block", type=int, default=8, help="steps per library before the next one")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--decoder", choices=["on", "off", "both"], default="on", help="the native decoder")
    args = p.parse_args()

    import pypto_serving.runner as runner
    from pypto_kernels import native
    from pypto_serving import LLM, SamplingParams

    llm = LLM(
        model=args.model,
        scheduler="sync",
        dtype=args.dtype,
        worker_threads=args.threads,
        enable_prefix_caching=False,
        log_level="warning",
        worker_mode="inproc",
    )
    built = native.library()
    names = args.libs.split(",") if args.libs else ["built"]
    if args.libs and built is None:
        raise SystemExit("the native kernels are not built here: nothing to swap")
    libs = [_load(n, built) for n in names] if args.libs else [built]
    decoders = {"on": [True], "off": [False], "both": [True, False]}[args.decoder]
    variants = [(lib, on) for lib in libs for on in decoders]
    names = [f"{n} decoder {'on' if on else 'off'}" for n in names for on in decoders]
    model = llm.engine.worker._runner.executor.model  # type: ignore[union-attr]
    times: list[list[float]] = [[] for _ in names]
    native_steps = [0 for _ in names]  # timed steps that really ran the native decoder, per variant
    state = {"step": 0, "on": False}
    launch = runner.ModelRunner.launch

    def timed(self: Any, *a: Any, **k: Any) -> Any:
        step = state["step"]
        which, first = (step // args.block) % len(variants), step % args.block == 0
        state["step"] += 1
        native.library = lambda lib=variants[which][0]: lib  # type: ignore[assignment]
        model.native_decoder_enabled = variants[which][1]
        before, start = model.native_decoder_steps, time.perf_counter()
        out = launch(self, *a, **k)
        if state["on"] and not first:
            times[which].append(time.perf_counter() - start)
            native_steps[which] += model.native_decoder_steps - before
        return out

    runner.ModelRunner.launch = timed  # type: ignore[method-assign]
    prompt = [random.Random(0).randrange(100, 150_000) for _ in range(128)]
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    state["on"], state["step"] = True, 0  # step 0, the prefill, opens a block: never timed
    llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True), use_tqdm=False)
    size = args.block - 1
    first = _block_medians(times[0], size)
    for name, t in zip(names, times, strict=True):
        median, mean = statistics.median(t) * 1e3, statistics.mean(t) * 1e3
        print(f"{name}: median {median:.2f} ms a step, mean {mean:.2f}, n={len(t)}")
    for name, (_, on), t, ran in zip(names, variants, times, native_steps, strict=True):
        if ran != (len(t) if on else 0):  # the variant measured is the one named
            raise SystemExit(f"{name}: {ran} of its {len(t)} timed steps ran the native decoder")
    for name, t in zip(names[1:], times[1:], strict=True):
        other = _block_medians(t, size)
        wins = sum(b < a for a, b in zip(first, other, strict=False))
        print(f"{name} faster than {names[0]} in {wins} of {min(len(first), len(other))} blocks")


if __name__ == "__main__":
    main()
