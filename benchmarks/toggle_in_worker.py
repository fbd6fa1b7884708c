"""One boolean of the worker's runner switched on and off every few steps inside one worker process:
the step period (one launch to the next) grouped by the setting.

Two processes of the same tree can differ by more than a small change does (on the 2-core EPYC of
docs/benchmarks.md a concurrency-1 token of one tree read 2.6-3.2 ms from process to process, with
the model's pages placed differently), so a change of a few percent is measured inside one worker:
the attribute (a dotted path from the worker's ``ModelRunner``, e.g. ``input_batch.host_tables``) is
True for ``--every`` steps, False for the next ``--every``, and so on, over the same requests and the
same memory. The runner is patched at import: a spawned worker imports this script again as its
main module, so the patch runs there too.

Usage: python benchmarks/toggle_in_worker.py --model models/qwen3-small --attr input_batch.host_tables
       [--dtype auto] [--requests 1] [--max-tokens 256] [--rounds 3] [--every 16] [--scheduler async]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from pypto_serving import runner as _runner

_STAMPS = "PYPTO_TOGGLE_STAMPS"  # where the worker writes its (step id, launch time, setting) triples
_ATTR = "PYPTO_TOGGLE_ATTR"
_EVERY = "PYPTO_TOGGLE_EVERY"


def _set(root: Any, path: str, value: bool) -> None:
    *parents, name = path.split(".")
    for p in parents:
        root = getattr(root, p)
    if not isinstance(getattr(root, name), bool):
        raise TypeError(f"{path} is not a boolean of the runner")
    setattr(root, name, value)


def _patch() -> None:
    """Flip the attribute at each launch and record the launch; write the record at shutdown."""
    if not os.environ.get(_STAMPS):
        return
    stamps: list[tuple[int, float, bool]] = []
    launch, shutdown = _runner.ModelRunner.launch, _runner.ModelRunner.shutdown
    attr, every = os.environ[_ATTR], int(os.environ[_EVERY])

    def timed_launch(self: _runner.ModelRunner, cmd: Any) -> Any:
        on = (cmd.step_id // every) % 2 == 0
        _set(self, attr, on)
        stamps.append((cmd.step_id, time.monotonic(), on))
        return launch(self, cmd)

    def dumping_shutdown(self: _runner.ModelRunner) -> None:
        Path(os.environ[_STAMPS]).write_text(json.dumps(stamps))
        shutdown(self)

    _runner.ModelRunner.launch = timed_launch  # type: ignore[method-assign]
    _runner.ModelRunner.shutdown = dumping_shutdown  # type: ignore[method-assign]


_patch()


def periods(stamps: list[list[Any]]) -> dict[bool, list[float]]:
    """Seconds from each step's launch to the next step's, by the setting the step ran with
    (consecutive step ids only: a gap between generate calls is not a step)."""
    out: dict[bool, list[float]] = {True: [], False: []}
    for (a, ta, on), (b, tb, _) in itertools.pairwise(stamps):
        if b == a + 1:
            out[bool(on)].append(tb - ta)
    return out


def _summary(xs: list[float]) -> str:
    trim = sorted(xs)[len(xs) // 10 : len(xs) - len(xs) // 10] or xs
    mean, median = statistics.mean(trim) * 1e3, statistics.median(xs) * 1e3
    return f"{len(xs)} steps, mean {mean:.3f} ms (10 % trimmed), median {median:.3f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--attr", required=True, help="dotted boolean attribute of the worker's ModelRunner")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--scheduler", default="async")
    ap.add_argument("--requests", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--every", type=int, default=16)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.update({_STAMPS: str(Path(tmp) / "stamps.json"), _ATTR: args.attr, _EVERY: str(args.every)})
        from pypto_serving import LLM, SamplingParams

        rng = random.Random(0)
        lens = [128] if args.requests == 1 else [rng.randint(32, 256) for _ in range(args.requests)]
        prompts = [[rng.randrange(1000, 30000) for _ in range(n)] for n in lens]
        llm = LLM(model=args.model, dtype=args.dtype, scheduler=args.scheduler, enable_prefix_caching=False)
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
        llm.generate(prompts[:8], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        for _ in range(args.rounds):
            llm.generate(prompts, params, use_tqdm=False)
        llm.shutdown()
        by = periods(json.loads(Path(os.environ[_STAMPS]).read_text()))
    print(f"{args.attr} on, {args.requests} requests: {_summary(by[True])}")
    print(f"{args.attr} off, {args.requests} requests: {_summary(by[False])}")
    print(f"on / off (medians): {statistics.median(by[True]) / statistics.median(by[False]):.3f}")


if __name__ == "__main__":
    main()
