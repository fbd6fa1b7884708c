"""Offline throughput: every prompt of the workload submitted at once to :class:`~pypto_serving.LLM`,
timed from submission to the last output."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, replace
from typing import Any

from ..config import ServingSettings
from ..request import SamplingParams
from .workload import make_prompts, prompt_vocab_size

__all__ = ["ThroughputConfig", "run_throughput", "sampling_params"]


@dataclass(frozen=True, slots=True)
class ThroughputConfig:
    """The workload and sampling of one run (see ``pypto-serving bench throughput --help``)."""

    num_prompts: int = 64
    min_len: int = 32
    max_len: int = 256
    max_tokens: int = 128
    seed: int = 0
    vocab_size: int | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    ignore_eos: bool = True
    warmup: bool = True


def sampling_params(config: ThroughputConfig, seed: int | None = None) -> SamplingParams:
    return SamplingParams(
        temperature=config.temperature,
        top_p=config.top_p,
        top_k=config.top_k,
        max_tokens=config.max_tokens,
        ignore_eos=config.ignore_eos,
        seed=seed,
    )


def run_throughput(
    settings: ServingSettings, config: ThroughputConfig, *, plugins: Any = None, keep_outputs: bool = False
) -> dict[str, Any]:
    """Load the engine, optionally warm it up with one short request, then time the whole workload.

    Returns the figures (``requests_per_s``, ``output_tok_s``, ``total_tok_s``, ``wall_s``, token
    counts, engine steps); with ``keep_outputs`` also ``outputs``: the generated token ids in prompt order."""
    from ..engine import LLM

    vocab = config.vocab_size or prompt_vocab_size(settings.model)
    prompts = make_prompts(config.num_prompts, config.min_len, config.max_len, vocab, config.seed)
    seeds = [None if config.temperature == 0 else config.seed + i for i in range(len(prompts))]
    params = [sampling_params(config, s) for s in seeds]
    with LLM(settings=settings, plugins=plugins) as llm:
        if config.warmup:
            warm = replace(config, max_tokens=min(2, config.max_tokens))
            # A prompt of its own (another seed), so no block of the workload is in the prefix cache.
            warm_prompt = make_prompts(1, config.min_len, config.min_len, vocab, config.seed + 1_000_003)
            llm.generate(warm_prompt, sampling_params(warm, 0), use_tqdm=False)
        before = _engine_counters(llm)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=sys.stderr.isatty())
        wall = time.perf_counter() - start
        after = _engine_counters(llm)
    generated = [list(o.outputs[0].token_ids) for o in outputs]
    result = throughput_figures(config, settings, [len(p) for p in prompts], [len(g) for g in generated], wall)
    result["scheduler"] = after.pop("scheduler")
    result.update({k: v - before[k] for k, v in after.items() if k != "spec_accepted_per_pos"})
    result["spec_accepted_per_pos"] = [
        a - b for a, b in zip(after["spec_accepted_per_pos"], before["spec_accepted_per_pos"])
    ]
    result.update(_spec_figures(settings, result))
    if keep_outputs:
        result["outputs"] = generated
    return result


def _engine_counters(llm: Any) -> dict[str, Any]:
    engine = llm.engine
    stats = engine.stats()
    return {
        "scheduler": engine.scheduler_name,
        "num_steps": stats["num_steps"],
        "num_preemptions": stats["num_preemptions"],
        "spec_drafted": stats["spec_drafted"],
        "spec_accepted": stats["spec_accepted"],
        "spec_verify_steps": stats["spec_verify_steps"],
        "spec_accepted_per_pos": list(stats["spec_accepted_per_pos"]),
    }


def _spec_figures(settings: ServingSettings, result: dict[str, Any]) -> dict[str, Any]:
    """The speculation method and policy, the acceptance rate and the mean accepted drafts per
    verifying request-step, over the timed workload only."""
    spec = settings.speculative_config
    drafted, steps = result["spec_drafted"], result["spec_verify_steps"]
    return {
        "spec_method": spec.method if spec else None,
        "spec_policy": spec.policy if spec else None,
        "spec_k": spec.num_speculative_tokens if spec else 0,
        "spec_acceptance_rate": result["spec_accepted"] / drafted if drafted else 0.0,
        "spec_mean_accepted_length": result["spec_accepted"] / steps if steps else 0.0,
    }


def throughput_figures(
    config: ThroughputConfig, settings: ServingSettings, prompt_lens: list[int], output_lens: list[int], wall: float
) -> dict[str, Any]:
    prompt_tokens, output_tokens = sum(prompt_lens), sum(output_lens)
    return {
        "benchmark": "throughput",
        "model": settings.model,
        "scheduler": settings.scheduler,
        "dtype": settings.dtype,
        "device": settings.device,
        "max_num_seqs": settings.max_num_seqs,
        "worker_threads": settings.worker_threads,
        "num_requests": len(prompt_lens),
        "prompt_len_range": [config.min_len, config.max_len],
        "max_tokens": config.max_tokens,
        "temperature": config.temperature,
        "ignore_eos": config.ignore_eos,
        "seed": config.seed,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "wall_s": wall,
        "requests_per_s": len(prompt_lens) / wall,
        "output_tok_s": output_tokens / wall,
        "total_tok_s": (prompt_tokens + output_tokens) / wall,
    }
