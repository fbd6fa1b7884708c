"""Speculative decoding against none, side by side in one run, on the embedded trained models.

Suites (each configuration runs the same prompts through ``LLM.generate``, in-process worker, CPU):

* ``default``: ``tiny-deepseek-v4`` with only ``{"method": "mtp", "num_speculative_tokens": 2}``
  (what a vLLM user writes: the default policy) against no speculation, at temperatures 0 and 0.7,
  concurrency 1 (``--prompts`` held-out prompts one after another) and 32; ``--policies`` adds other
  policies beside it;
* ``mtp``: ``tiny-deepseek-v4`` at concurrency 1, MTP k = 2 (policy ``fixed``) against k = 0 at
  temperature 0 and at temperature 0.7;
* ``ngram``: ``tiny-qwen3`` on a code-editing workload (each prompt holds a function and asks for it
  again with a change, so the answer can repeat the prompt), n-gram k = 3 against none at
  concurrency 1 and 16;
* ``adaptive``: ``tiny-deepseek-v4`` at concurrency 1 and 32, policy ``adaptive`` (k up to 3) against
  fixed k = 1, 2, 3 and none.

Decode throughput is output tokens after each request's first, over the time from the first first token to the
last finish (at concurrency 1, the sum of each request's first token to finish). "CPU-time tok/s" is output
tokens over the process's CPU time (run with ``--threads 1``): on cores that other jobs share it moves far
less than wall time. Each run first generates 24 tokens for every prompt with other seeds, so a policy that
measures (``adaptive``) has seen the workload, as on a server that has been running. Prompts are cut from the
files the models held out from training (the split recorded next to them, ``benchmarks/held_out.py``). Outputs
are checked equal to the configuration without speculation where verification keeps them equal token by token
(greedy, and sampling verified by sample-and-compare, since every configuration draws the same seeds from the
engine's ``seed``; a request with its own ``seed`` always takes sample-and-compare); sampled MTP drafts are
verified by rejection sampling, which keeps only the distribution ("dist." in the table). At temperature 0.7
the ``mtp`` suite also runs MTP k = 2 with rejection sampling switched off (``sample-and-compare``: argmax
drafts, kept when the target's own draw matches), for the acceptance rate before and after.

``--repeat N`` runs every configuration of a table N times, alternating, and reports medians (for
machines whose other load varies).

    python benchmarks/speculation.py --suite default --max-tokens 64 --threads 1 --repeat 3
    python benchmarks/speculation.py --suite mtp ngram adaptive [--max-tokens 96] [--threads 2] [--repeat 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for benchmarks.held_out

from benchmarks.held_out import held_out_texts


@dataclass(frozen=True, slots=True)
class Config:
    label: str
    spec: dict[str, Any] | None
    compare: bool = False  # sampled drafts verified by sample-and-compare instead of rejection sampling


@contextmanager
def sample_and_compare(on: bool) -> Iterator[None]:
    """Switch the in-process worker's rejection sampling off while ``on``: every request then keeps
    argmax drafts and the sample-and-compare verification."""
    from pypto_serving import runner

    before = runner.WorkerRequest.rejection_sampled
    if on:
        runner.WorkerRequest.rejection_sampled = property(lambda self: False)  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        runner.WorkerRequest.rejection_sampled = before  # type: ignore[method-assign]


def held_out_code(count: int, lines: int, model: str = "tiny-deepseek-v4") -> list[str]:
    """``count`` snippets of ``lines`` lines from the files ``model`` held out from training (the split
    recorded next to it, ``benchmarks/held_out.py``)."""
    out: list[str] = []
    for text in held_out_texts(model):
        rows = text.splitlines()
        for start in range(0, len(rows) - lines, 8 * lines):
            snippet = "\n".join(rows[start : start + lines])
            if snippet.strip():
                out.append(snippet)
    step = max(1, len(out) // count)
    return out[::step][:count]


def editing_prompts(count: int) -> list[str]:
    """A function, then the request to write it again with one change: the answer repeats the prompt."""
    return [
        f"{code}\n\n# The same code again, unchanged:\n{code.splitlines()[0]}\n"
        for code in held_out_code(count, 24, "tiny-qwen3")
    ]


def continuation_prompts(count: int) -> list[str]:
    return [code + "\n" for code in held_out_code(count, 12)]


def run(
    model: str, cfg: Config, prompts: list[str], *, temperature: float, max_tokens: int, concurrency: int = 0
) -> dict[str, Any]:
    """One configuration over ``prompts``, ``concurrency`` at a time (0: all at once)."""
    from pypto_serving import LLM, SamplingParams

    llm = LLM(
        model=model,
        device="cpu",
        dtype="float32",
        worker_mode="inproc",
        block_size=16,
        max_num_seqs=concurrency or len(prompts),
        max_num_batched_tokens=2048,
        seed=0,  # requests draw their seeds from it: a user seed would take sample-and-compare
        speculative_config=cfg.spec,
    )
    try:
        # Warm-up: the same prompts, other seeds, 24 tokens, so a policy that measures (adaptive) has
        # seen this workload's steps before the measured run, as it has on a server that has run a while.
        warm = [SamplingParams(temperature=temperature, max_tokens=24) for _ in prompts]
        llm.generate(prompts, warm, use_tqdm=False)
        engine = llm.engine
        assert engine is not None
        before = engine.stats()
        params = [
            SamplingParams(temperature=temperature, top_p=1.0, max_tokens=max_tokens, ignore_eos=True) for _ in prompts
        ]
        cpu0 = time.process_time()
        outs = llm.generate(prompts, params, use_tqdm=False)
        cpu = time.process_time() - cpu0
        after = engine.stats()
    finally:
        llm.shutdown()
    drafted = after["spec_drafted"] - before["spec_drafted"]
    accepted = after["spec_accepted"] - before["spec_accepted"]
    return {
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
        "tok_s": sum(len(o.outputs[0].token_ids) - 1 for o in outs) / _decode_seconds(outs, concurrency == 1),
        # Output tokens per second of the process's CPU time (in-process worker, set --threads 1): on a
        # machine whose cores other jobs share, it moves far less than wall time does.
        "cpu_tok_s": sum(len(o.outputs[0].token_ids) for o in outs) / cpu,
        "acceptance": accepted / drafted if drafted else 0.0,
        "steps": after["num_steps"] - before["num_steps"],
    }


def _decode_seconds(outs: list[Any], one_at_a_time: bool) -> float:
    """From the first first token to the last finish; one request at a time, the sum of each request's
    first token to finish (the next request's prefill is not decoding)."""
    m = [o.metrics for o in outs if o.metrics and o.metrics.first_token_time and o.metrics.finished_time]
    if one_at_a_time:
        return float(sum(x.finished_time - x.first_token_time for x in m))
    return float(max(x.finished_time for x in m) - min(x.first_token_time for x in m))


@dataclass(frozen=True, slots=True)
class Options:
    max_tokens: int
    repeat: int  # runs of every configuration per table, alternating
    temperatures: tuple[float, ...]  # the mtp and default suites'
    prompts: int = 6  # the default suite's at concurrency 1
    policies: tuple[str, ...] = ()  # the default suite's other policies, side by side


def table(title: str, model: str, configs: list[Config], prompts: list[str], repeat: int, **kw: Any) -> None:
    print(f"\n### {title}\n")
    runs: list[list[dict[str, Any]]] = [[] for _ in configs]
    for _ in range(repeat):
        for cfg, out in zip(configs, runs):
            with sample_and_compare(cfg.compare):
                out.append(run(model, cfg, prompts, **kw))
    if repeat > 1:
        print(
            f"medians of {repeat} alternated runs; tok/s per run: "
            + "; ".join(
                f"{c.label}: " + ", ".join(f"{r['tok_s']:.1f} ({r['cpu_tok_s']:.1f} CPU)" for r in rs)
                for c, rs in zip(configs, runs)
            )
            + "\n"
        )
    print(
        "| configuration | decode tok/s | vs none | CPU-time tok/s | vs none | draft acceptance | steps "
        "| output equals none |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    base = runs[0][0]
    base_tok_s = statistics.median(r["tok_s"] for r in runs[0])
    base_cpu = statistics.median(r["cpu_tok_s"] for r in runs[0])
    sampled = kw.get("temperature", 0.0) > 0
    for cfg, rs in zip(configs, runs):
        r = rs[0]
        tok_s = statistics.median(x["tok_s"] for x in rs)
        cpu = statistics.median(x["cpu_tok_s"] for x in rs)
        exact = not sampled or cfg.compare or cfg.spec is None or cfg.spec.get("method") != "mtp"
        same = ("yes" if r["tokens"] == base["tokens"] else "NO") if exact else "dist."
        print(
            f"| {cfg.label} | {tok_s:.1f} | {tok_s / base_tok_s:.2f}x | {cpu:.1f} | {cpu / base_cpu:.2f}x | "
            f"{statistics.median(x['acceptance'] for x in rs):.1%} | {r['steps']} | {same} |",
            flush=True,
        )


def mtp(k: int, policy: str = "fixed") -> dict[str, Any]:
    return {"method": "mtp", "num_speculative_tokens": k, "policy": policy}


def suite_mtp(opt: Options) -> None:
    prompts = continuation_prompts(1)
    for temperature in opt.temperatures:
        configs = [Config("none", None), Config("MTP k=2", mtp(2))]
        if temperature > 0:
            configs.append(Config("MTP k=2, sample-and-compare", mtp(2), compare=True))
        table(
            f"MTP, tiny-deepseek-v4, c=1, T={temperature}",
            "tiny-deepseek-v4",
            configs,
            prompts,
            temperature=temperature,
            max_tokens=opt.max_tokens,
            repeat=opt.repeat,
        )


def suite_ngram(opt: Options) -> None:
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "policy": "fixed"}
    for c in (1, 16):
        configs = [Config("none", None), Config("n-gram k=3", ngram)]
        table(
            f"n-gram, tiny-qwen3, code editing, c={c}",
            "tiny-qwen3",
            configs,
            editing_prompts(c),
            temperature=0.0,
            max_tokens=opt.max_tokens,
            repeat=opt.repeat,
        )


def suite_adaptive(opt: Options) -> None:
    for c in (1, 32):
        configs = [
            Config("none", None),
            *(Config(f"fixed k={k}", mtp(k)) for k in (1, 2, 3)),
            Config("adaptive (k<=3)", mtp(3, "adaptive")),
        ]
        table(
            f"adaptive, tiny-deepseek-v4, c={c}",
            "tiny-deepseek-v4",
            configs,
            continuation_prompts(c),
            temperature=0.0,
            max_tokens=opt.max_tokens,
            repeat=opt.repeat,
        )


#: What a vLLM user writes: no policy, so the default one runs.
DEFAULT_MTP = {"method": "mtp", "num_speculative_tokens": 2}


def suite_default(opt: Options) -> None:
    """Only ``{"method": "mtp", "num_speculative_tokens": 2}`` against no speculation, at every
    temperature, at concurrency 1 (``opt.prompts`` held-out prompts one after another) and 32."""
    extra = [Config(f"policy {p}", {**DEFAULT_MTP, "policy": p}) for p in opt.policies]
    for temperature in opt.temperatures:
        for c in (1, 32):
            table(
                f"default policy, tiny-deepseek-v4, c={c}, T={temperature}",
                "tiny-deepseek-v4",
                [Config("none", None), Config("MTP k=2, default policy", DEFAULT_MTP), *extra],
                continuation_prompts(opt.prompts if c == 1 else c),
                temperature=temperature,
                max_tokens=opt.max_tokens,
                repeat=opt.repeat,
                concurrency=c,
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    suites = {"mtp": suite_mtp, "ngram": suite_ngram, "adaptive": suite_adaptive, "default": suite_default}
    ap.add_argument("--suite", nargs="+", choices=list(suites), default=["default", "mtp", "ngram", "adaptive"])
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--repeat", type=int, default=1, help="alternated runs per configuration; medians reported")
    ap.add_argument(
        "--temperatures", type=float, nargs="+", default=[0.0, 0.7], help="mtp/default suites' temperatures"
    )
    ap.add_argument("--prompts", type=int, default=6, help="default suite: held-out prompts at concurrency 1")
    ap.add_argument("--policies", nargs="*", default=[], help="default suite: other policies to run beside it")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    opt = Options(
        max_tokens=args.max_tokens,
        repeat=args.repeat,
        temperatures=tuple(args.temperatures),
        prompts=args.prompts,
        policies=tuple(args.policies),
    )
    for name in args.suite:
        suites[name](opt)


if __name__ == "__main__":
    main()
