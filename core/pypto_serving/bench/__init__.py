"""``pypto-serving bench``: offline throughput through :class:`~pypto_serving.LLM` and online latency
against an OpenAI-compatible server. The pieces are importable for scripts (``benchmarks/compare.py``):
:func:`make_prompts` (the seeded workload), :func:`summarize` / :func:`percentile` (the statistics),
:func:`run_throughput` and :func:`run_serve`."""

from .serve import ServeConfig, run_serve
from .stats import percentile, summarize
from .throughput import ThroughputConfig, run_throughput
from .workload import make_prompts, prompt_vocab_size

__all__ = [
    "ServeConfig",
    "ThroughputConfig",
    "make_prompts",
    "percentile",
    "prompt_vocab_size",
    "run_serve",
    "run_throughput",
    "summarize",
]
