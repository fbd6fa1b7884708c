"""Host time of the worker's batch building and sampling-parameter preparation per decode step,
for two source trees side by side (e.g. a worktree of the commit before the persistent input batch
and the working tree), at a few numbers of running decode requests.

The executor is a stub on the CPU that returns zero logits, so the step time is the runner's own
work: building the batch (``ModelRunner._build_batch``), preparing the sampler's parameters (the
runner's ``_row_params`` or ``_sampling_rows``, whichever the tree has), sampling a small vocabulary
and committing the tokens. Each tree runs in its own process, alternately, and each number is the
median over the repeats of the mean per step, in thread CPU time (``time.thread_time``): on a
shared machine, time spent waiting for a core does not count.

``--stream-mib N`` reads N MiB between steps (outside the timed step), as a real decode step's output
projection streams its weights past the caches before the next step's host work: that work then
starts on cold caches, as it does in a worker (about 75 MiB for the small benchmark shape in bfloat16).

Usage: python benchmarks/input_batch.py --before /tmp/base-ib [--after .] [--rows 32 64] [--steps 200] [--repeats 5]
       [--stream-mib 0]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TIMED = ("_build_batch", "_row_params", "_sampling_rows")  # the runner methods each tree may have
BLOCK = 16
PROMPT = 500
VOCAB = 1024


def _sampling(i: int) -> dict[str, Any]:
    """Four kinds of request in turn: greedy, top-p, top-k, plain temperature (seeded)."""
    kinds: list[dict[str, Any]] = [
        {"temperature": 0.0},
        {"temperature": 0.8, "top_p": 0.9},
        {"temperature": 1.0, "top_k": 50},
        {"temperature": 0.7, "seed": 11},
    ]
    return kinds[i % 4]


def measure(rows: int, steps: int, stream_mib: int = 0) -> dict[str, float]:
    """Mean seconds per decode step of each timed method and of the whole ``ModelRunner.step``
    (``stream_mib`` MiB read between steps, untimed)."""
    import torch

    torch.set_num_threads(1)  # the host path under test is single-threaded; spare cores only add noise
    from pypto_serving import BatchInput, CacheGroupSpec, Executor, ExecutorInfo, SamplingParams, ServingSettings
    from pypto_serving.messages import NewRequestData, ScheduledEntry, StepCommand, wire_sampling
    from pypto_serving.runner import ModelRunner

    logits = torch.zeros(rows, VOCAB)

    class Stub(Executor):
        def load(self) -> ExecutorInfo:
            self.device = torch.device("cpu")
            return ExecutorInfo([CacheGroupSpec("kv", BLOCK, 1)], VOCAB, 4096)

        def init_kv_cache(self, num_blocks: dict[str, int]) -> None:
            pass

        def execute(self, batch: BatchInput) -> torch.Tensor:
            return logits[: len(batch.request_ids)]

    settings = ServingSettings.load(executor="fake", block_size=BLOCK, executor_options={})
    runner = ModelRunner(Stub(), settings)
    runner.load()
    spent: dict[str, float] = defaultdict(float)
    for name in TIMED:
        if hasattr(runner, name):
            setattr(runner, name, _timed(getattr(runner, name), name, spent))
    ids = [f"r{i}" for i in range(rows)]
    new = [
        NewRequestData(
            request_id=rid,
            prompt_token_ids=[(7 * i + k) % VOCAB for k in range(PROMPT)],
            output_token_ids=[],
            sampling=wire_sampling(SamplingParams(**_sampling(i)), (2,)),
            seed=i,
        )
        for i, rid in enumerate(ids)
    ]
    next_block = iter(range(10**9))
    num_blocks = dict.fromkeys(ids, 0)

    def entry(rid: str, pos: int, tokens: list[int]) -> ScheduledEntry:
        need = -(-(pos + max(1, len(tokens))) // BLOCK) - num_blocks[rid]
        num_blocks[rid] += need
        blocks = [next(next_block) for _ in range(need)]
        return ScheduledEntry(
            request_id=rid,
            token_ids=tokens,
            use_last_sampled=not tokens,
            num_draft=0,
            start_pos=pos,
            rejected_seen=0,
            new_block_ids={"kv": blocks},
            sample=True,
        )

    prefill = StepCommand(0, new, [entry(n.request_id, 0, n.prompt_token_ids) for n in new], [])
    assert runner.step(prefill).error is None
    spent.clear()
    stream = torch.ones(stream_mib * 2**18)  # float32: 4 bytes an element
    total = 0.0
    for s in range(steps):
        cmd = StepCommand(s + 1, [], [entry(rid, PROMPT + s, []) for rid in ids], [])
        stream.sum()
        t0 = time.thread_time()
        res = runner.step(cmd)
        total += time.thread_time() - t0
        assert res.error is None, res.error
    return {"step": total / steps, **{k: v / steps for k, v in spent.items()}}


def _timed(fn: Any, name: str, spent: dict[str, float]) -> Any:
    def wrapper(*args: Any, **kw: Any) -> Any:
        t = time.thread_time()
        try:
            return fn(*args, **kw)
        finally:
            spent[name] += time.thread_time() - t

    return wrapper


def _child(tree: str, rows: int, steps: int, stream_mib: int) -> dict[str, float]:
    code = (
        f"import sys; sys.path[:0] = [{str(Path(tree) / 'core')!r}, {str(ROOT)!r}]; "
        "import json, benchmarks.input_batch as b; "
        f"print(json.dumps(b.measure({rows}, {steps}, {stream_mib})))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    if out.returncode:
        raise RuntimeError(f"measuring {tree} failed:\n{out.stderr}")
    result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", required=True, help="source tree of the baseline (a git worktree)")
    ap.add_argument("--after", default=str(ROOT), help="source tree to compare (default: this one)")
    ap.add_argument("--rows", type=int, nargs="+", default=[32, 64])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--stream-mib", type=int, default=0, help="MiB read between steps (cold caches), untimed")
    args = ap.parse_args()
    trees = {"before": args.before, "after": args.after}
    print(
        f"command: python benchmarks/input_batch.py --before {args.before} --after {args.after} "
        f"--rows {' '.join(map(str, args.rows))} --steps {args.steps} --repeats {args.repeats} "
        f"--stream-mib {args.stream_mib}\n"
    )
    for rows in args.rows:
        runs: dict[str, list[dict[str, float]]] = {k: [] for k in trees}
        for _ in range(args.repeats):
            for label, tree in trees.items():
                runs[label].append(_child(tree, rows, args.steps, args.stream_mib))
        print(f"{rows} running decode requests (microseconds per step, median of {args.repeats}):")
        for label, rs in runs.items():
            med = {k: statistics.median(r.get(k, 0.0) for r in rs) * 1e6 for k in rs[0]}
            prep = sum(v for k, v in med.items() if k != "step")
            parts = ", ".join(f"{k} {v:.0f}" for k, v in med.items() if k != "step")
            print(f"  {label:6s} build+params {prep:7.0f}  ({parts});  whole step {med['step']:7.0f}")
        print()


if __name__ == "__main__":
    main()
