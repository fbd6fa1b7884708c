"""Structured output's per-token cost: grammar-constrained decoding against unconstrained, side by side.

The same ``--concurrency`` prompts decode ``--max-tokens`` tokens each (``ignore_eos``, so every
configuration produces the same number of tokens) through ``LLM.generate`` with the in-process
worker on the CPU, once unconstrained and once under each grammar; configurations alternate over
``--repeats`` rounds and the fastest round of each counts. The grammars keep the output open for the
whole run: a JSON schema whose one string field must be long (inside a string nearly every token is
allowed, the mask's most expensive case), and a regex of words.

Reported per configuration: the worker's time per pure decode step (forward, grammar masks,
sampling; steps where requests enter are left out), the host time spent filling grammar bitmasks
per step (``structured.fill_step_mask``: llguidance's masks and the listing of rows by id, on the
worker's mask thread beside the forward), and the overhead against unconstrained decoding. The
machine's other load moves every number: compare rows of one run only.

    python benchmarks/structured.py [--model /work/models/qwen3-small] [--concurrency 16]
        [--max-tokens 64] [--repeats 3] [--threads 2] [--temperature 0.8] [--unlisted] [--overlap]

``--unlisted`` adds each grammar once more with no row listed by allowed id
(``structured.SparseRows``), every row masked through its bitmask: the two sampler paths side by
side. ``--overlap`` adds each grammar twice more, its masks filled on a thread beside the forward
(``_overlap``) and on the step's thread before it (``_serial``), whatever
``ModelRunner.overlap_grammar_masks`` would choose on this machine: the two side by side.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

SCHEMA = {
    "type": "object",
    "properties": {"text": {"type": "string", "minLength": 400}},
    "required": ["text"],
}
REGEX = r"([a-z]+ )+"


@dataclass(slots=True)
class Timing:
    wall: list[float] = field(default_factory=list)
    mask: list[float] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)


def _counting_step_mask(totals: dict[str, float]) -> Callable[..., Any]:
    """``structured.fill_step_mask`` that adds its time and calls to ``totals``."""
    from pypto_serving import structured

    inner = structured.fill_step_mask

    def timed(*args: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return inner(*args, **kw)
        finally:
            totals["seconds"] += time.perf_counter() - t0
            totals["calls"] += 1

    return timed


def _counting_step(totals: dict[str, float]) -> None:
    """Counts and times the worker's pure decode steps (no request enters: admission, where each
    constrained request builds its matcher, is not a per-token cost)."""
    from pypto_serving import runner

    inner = runner.ModelRunner.step

    def step(self: Any, cmd: Any) -> Any:
        if not cmd.entries or cmd.new_requests:
            return inner(self, cmd)
        t0 = time.perf_counter()
        try:
            return inner(self, cmd)
        finally:
            totals["step_seconds"] += time.perf_counter() - t0
            totals["steps"] += 1

    runner.ModelRunner.step = step  # type: ignore[method-assign]


@contextlib.contextmanager
def _unlisted(on: bool) -> Iterator[None]:
    """While ``on``: no grammar row is listed by allowed id, so every row goes through its bitmask
    (the sampler's general path, to compare against the listed rows' path in one run)."""
    from pypto_serving import structured

    inner = structured.list_rows
    if on:
        structured.list_rows = lambda *a: None  # type: ignore[assignment]
    try:
        yield
    finally:
        structured.list_rows = inner


@contextlib.contextmanager
def _overlap(name: str) -> Iterator[None]:
    """For configs named ``*_overlap`` / ``*_serial``: the worker fills grammar masks beside the
    forward / before it, on the step's own thread (others: the runner's own choice)."""
    from pypto_serving.runner import ModelRunner

    inner = ModelRunner.overlap_grammar_masks
    if name.endswith(("_overlap", "_serial")):
        ModelRunner.overlap_grammar_masks = name.endswith("_overlap")
    try:
        yield
    finally:
        ModelRunner.overlap_grammar_masks = inner


def run(args: argparse.Namespace) -> None:
    from pypto_serving import LLM, SamplingParams, runner
    from pypto_serving.structured import StructuredSpec

    torch.set_num_threads(args.threads)
    totals = {"seconds": 0.0, "calls": 0.0, "steps": 0.0, "step_seconds": 0.0}
    runner.fill_step_mask = _counting_step_mask(totals)
    _counting_step(totals)
    configs: dict[str, StructuredSpec | None] = {
        "none": None,
        "json_schema": StructuredSpec("json", json.dumps(SCHEMA)),
        "regex": StructuredSpec("regex", REGEX),
    }
    if args.unlisted:
        configs["json_unlisted"] = configs["json_schema"]
        configs["regex_unlisted"] = configs["regex"]
    if args.overlap:
        for mode in ("overlap", "serial"):
            configs[f"json_{mode}"] = configs["json_schema"]
            configs[f"regex_{mode}"] = configs["regex"]
    prompts = [f"Write item {i} of the list:" for i in range(args.concurrency)]
    timings = {name: Timing() for name in configs}
    with LLM(model=args.model, device="cpu", worker_mode="inproc", scheduler="sync", max_num_seqs=64) as llm:
        for round_ in range(args.repeats + 1):  # round 0 warms up (the grammar tokenizer is built there)
            for name, spec in configs.items():
                params = SamplingParams(
                    temperature=args.temperature, seed=1, max_tokens=args.max_tokens, ignore_eos=True, structured=spec
                )
                totals.update(seconds=0.0, calls=0.0, steps=0.0, step_seconds=0.0)
                with _unlisted(name.endswith("_unlisted")), _overlap(name):
                    outs = llm.generate(prompts, params, use_tqdm=False)
                wall = totals["step_seconds"]
                assert all(len(o.outputs[0].token_ids) == args.max_tokens for o in outs)
                if round_:
                    timings[name].wall.append(wall)
                    timings[name].mask.append(totals["seconds"])
                    timings[name].steps.append(int(totals["steps"]))
    _report(timings, args)


def _report(timings: dict[str, Timing], args: argparse.Namespace) -> None:
    print(
        f"model {args.model}, {args.concurrency} concurrent requests x {args.max_tokens} tokens, "
        f"{args.threads} threads, temperature {args.temperature}, best of {args.repeats}"
    )
    base = min(timings["none"].wall) / timings["none"].steps[0]
    print(f"{'config':<12} {'step ms':>8} {'mask ms/step':>13} {'mask/step':>10} {'overhead':>9}")
    for name, t in timings.items():
        best = min(range(len(t.wall)), key=lambda i: t.wall[i])
        step = t.wall[best] / t.steps[best]
        mask = t.mask[best] / t.steps[best]
        print(f"{name:<12} {1e3 * step:>8.2f} {1e3 * mask:>13.3f} {mask / step:>9.1%} {(step - base) / base:>9.1%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="/work/models/qwen3-small")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--temperature", type=float, default=0.8, help="0: greedy (the mask then costs no draw)")
    parser.add_argument(
        "--unlisted", action="store_true", help="also run each grammar with every row through its bitmask"
    )
    parser.add_argument(
        "--overlap", action="store_true", help="also run each grammar with its masks filled beside / before the forward"
    )
    run(parser.parse_args())


if __name__ == "__main__":
    main()
