"""Graph capture of the Qwen decode forward by batch-size buckets.

A decode-only step (every request one query token) is padded up to the next bucket and runs a
forward compiled once per bucket: ``torch.compile`` with inductor (CPU or CUDA), CUDA graphs
(``torch.compile(mode="reduce-overhead")``) or the Ascend graph mode (torchair's NPU backend).
Prefill, mixed and drafting steps, and batches above the largest bucket, run eager.

Padding rows are harmless by construction: they write their K/V into a scratch block that no
request owns (allocated past the engine's blocks), attend to that block's first slot only, and
their rows are dropped before the logits. Shapes inside a captured graph are fixed per bucket: the
block table is widened to the longest sequence the model can hold.

Paged attention needs each request's length. Two attention paths keep the graph free of host reads:

* ``host``: the ``pypto_qwen::decode_attention`` custom op runs the kernels' paged attention with
  the lengths from a small host tensor, so inductor calls it as one opaque kernel (no graph break,
  no recompilation per step). A host tensor cannot be replayed by a device graph, so this path is
  for ``inductor``/``aot_eager``.
* ``static``: attention written in plain tensor ops over the whole padded block table, masked by
  the device ``seq_lens``; its work and memory follow ``bucket x max_model_len``, the price of a
  graph that replays without the host (``cudagraph``, ``npugraph``).

The K/V write is the ``pypto_qwen::write_kv`` custom op, declared as mutating the caches, so the
compiled graph writes them in place instead of copying whole caches back; MoE experts are the
``pypto_qwen::moe_experts`` op. The cache's block count is a dynamic dimension, so a cache of
another size (a memory profile allocates one first) reuses the compiled buckets.

Under tensor parallelism the compiled forward holds the ranks' collectives (dynamo traces the
torch.distributed calls), so ``inductor`` and ``aot_eager`` capture it as they do on one rank;
``cudagraph`` and ``npugraph`` are refused there until replaying collectives in device graphs is
verified on those devices.

Options (``settings.executor_options``, validated at load):

* ``graph_mode``: ``auto`` (the device's default, :data:`_AUTO_MODE`: eager everywhere for now),
  ``eager`` (no capture, vLLM's ``enforce_eager``), ``inductor``, ``cudagraph``, ``npugraph``, or
  ``aot_eager`` (dynamo and AOT tracing without code generation: for tests and debugging).
* ``graph_batch_sizes``: the buckets (default 1, 2, 4, ... 64, up to the one holding ``max_num_seqs``).
* ``graph_warmup``: ``load`` compiles every bucket when the caches are allocated, ``lazy`` when a
  bucket first runs (the executor's ``graph_stats`` keep each bucket's first-call time).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

import pypto_kernels as K

__all__ = [
    "DEFAULT_BATCH_SIZES",
    "GRAPH_MODES",
    "GraphOptions",
    "compile_decode",
    "decode_attention",
    "moe_experts",
    "parse_graph_options",
    "static_decode_attention",
    "write_kv",
]

#: Every value ``executor_options["graph_mode"]`` accepts.
GRAPH_MODES: tuple[str, ...] = ("auto", "eager", "inductor", "cudagraph", "npugraph", "aot_eager")

#: Buckets used when ``graph_batch_sizes`` is not given (those above ``max_num_seqs``' bucket are dropped).
DEFAULT_BATCH_SIZES: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)

#: The modes whose graphs replay without Python, so attention must not read host lengths.
_STATIC_ATTENTION_MODES = frozenset({"cudagraph", "npugraph"})

#: ``graph_mode="auto"`` per device type. The CPU stays eager: on a 2-core machine shared with other
#: jobs (benchmarks/graph_capture.py, inductor against eager in one run), qwen3-small's decode step
#: was 1.09-1.10x / 1.06-1.08x / 0.95-1.05x as fast captured at batch 1 / 8 / 32 over two one-thread
#: runs and 1.08-1.32x / 1.19-1.33x / 0.80-1.10x over two two-thread runs, qwen3-0.6b's 0.97x at
#: batch 1 and 32, while compiling took 20-80 s per bucket for qwen3-small and 330-430 s for
#: qwen3-0.6b with an empty inductor cache (9-14 s warm): a few percent, within the noise at batch
#: 32, is not worth minutes of start-up per bucket. CUDA and NPU stay eager until their captured
#: paths are measured on the devices.
_AUTO_MODE: dict[str, str] = {"cpu": "eager", "cuda": "eager", "npu": "eager"}

_OPTION_KEYS = (
    "graph_mode",
    "graph_batch_sizes",
    "graph_warmup",
    "cpu_linear",
    "tied_head_copy",
    "native_decoder",
    "cpu_warmup",
)


@dataclass(frozen=True, slots=True)
class GraphOptions:
    """The resolved graph-capture options of one executor.

    :param mode: ``eager`` (no capture) or the capture mode, never ``auto``.
    :param batch_sizes: ascending buckets a decode batch is padded up to.
    :param warmup: ``load`` compiles every bucket when the caches are allocated, ``lazy`` on first use.
    :param attention: ``host`` (the paged kernel with host lengths, as a custom op) or ``static``
        (tensor ops only, for graphs that replay without Python); follows from ``mode``.
    """

    mode: str
    batch_sizes: tuple[int, ...]
    warmup: str
    attention: str = "host"


def parse_graph_options(options: Mapping[str, Any], device: torch.device, max_num_seqs: int) -> GraphOptions:
    """Validate the graph keys of ``settings.executor_options``; raises ValueError naming the bad key."""
    unknown = sorted(set(options) - set(_OPTION_KEYS))
    if unknown:
        raise ValueError(f"unknown qwen executor option(s) {unknown}; known options: {list(_OPTION_KEYS)}")
    mode = options.get("graph_mode", "auto")
    if mode not in GRAPH_MODES:
        raise ValueError(f"executor_options graph_mode must be one of {list(GRAPH_MODES)}, got {mode!r}")
    if mode == "auto":
        mode = _AUTO_MODE.get(device.type, "eager")
    if mode == "cudagraph" and device.type != "cuda":
        raise ValueError(f"graph_mode 'cudagraph' needs a CUDA device, the executor runs on {device}")
    if mode == "npugraph" and device.type != "npu":
        raise ValueError(f"graph_mode 'npugraph' needs an Ascend NPU device, the executor runs on {device}")
    if mode == "npugraph":
        _import_torchair()  # fails at load, not at the first decode
    warmup = options.get("graph_warmup", "load")
    if warmup not in ("load", "lazy"):
        raise ValueError(f"executor_options graph_warmup must be 'load' or 'lazy', got {warmup!r}")
    attention = "static" if mode in _STATIC_ATTENTION_MODES else "host"
    return GraphOptions(mode=mode, batch_sizes=_batch_sizes(options, max_num_seqs), warmup=warmup, attention=attention)


def _batch_sizes(options: Mapping[str, Any], max_num_seqs: int) -> tuple[int, ...]:
    if "graph_batch_sizes" not in options:
        # Keep the buckets up to the first one that holds max_num_seqs: larger ones never run.
        kept = [b for b in DEFAULT_BATCH_SIZES if b < max_num_seqs]
        return (*kept, min(b for b in (*DEFAULT_BATCH_SIZES[len(kept) :], max_num_seqs)))
    sizes = options["graph_batch_sizes"]
    if (
        not isinstance(sizes, list | tuple)
        or not sizes
        or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in sizes)
    ):
        raise ValueError(f"executor_options graph_batch_sizes must be a non-empty list of positive ints, got {sizes!r}")
    return tuple(sorted(set(sizes)))


@torch.library.custom_op("pypto_qwen::write_kv", mutates_args=("key_cache", "value_cache"))
def write_kv(
    key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, slots: torch.Tensor
) -> None:
    """:func:`pypto_kernels.write_kv_cache` as an op a compiled graph calls in place."""
    K.write_kv_cache(key, value, key_cache, value_cache, slots)


@write_kv.register_fake
def _write_kv_fake(
    key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, slots: torch.Tensor
) -> None:
    return None


@torch.library.custom_op("pypto_qwen::decode_attention", mutates_args=())
def decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    seq_lens_cpu: torch.Tensor,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """Paged attention of one query row per request, lengths from ``seq_lens_cpu`` (a host tensor)."""
    lens = [int(n) for n in seq_lens_cpu.tolist()]
    qsl = torch.arange(len(lens) + 1, dtype=torch.int32, device=query.device)
    out: torch.Tensor = K.paged_attention(
        query,
        key_cache,
        value_cache,
        block_tables,
        qsl,
        seq_lens,
        scale,
        sliding_window=sliding_window,
        query_lens_host=[1] * len(lens),
        seq_lens_host=lens,
    )
    return out


@decode_attention.register_fake
def _decode_attention_fake(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    seq_lens_cpu: torch.Tensor,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    return query.new_empty((query.shape[0], query.shape[1], value_cache.shape[-1]))


@torch.library.custom_op("pypto_qwen::moe_experts", mutates_args=())
def moe_experts(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """:func:`pypto_kernels.moe_experts` as one opaque op: ``_grouped_mm``'s shape function takes
    only bfloat16, so tracing the kernel itself fails for the CPU's float32 models."""
    out: torch.Tensor = K.moe_experts(x, gate_up, down, weights, ids)
    return out


@moe_experts.register_fake
def _moe_experts_fake(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    return torch.empty_like(x)


def static_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:
    """One query row per request [B, Hq, D] over every block of its table row; float32 softmax; [B, Hq, Dv].

    Key ``j`` of request ``b`` is visible when ``j < seq_lens[b]`` (and within the window of the
    query at ``seq_lens[b] - 1``). Everything is a tensor op of fixed shape: no host read.
    """
    batch, num_q_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    group = num_q_heads // num_kv_heads
    tables = block_tables.to(torch.int64)
    keys = key_cache[tables].flatten(1, 2)  # [B, L, Hkv, D]
    values = value_cache[tables].flatten(1, 2)
    key_pos = torch.arange(keys.shape[1], device=query.device).unsqueeze(0)
    lens = seq_lens.to(torch.int64).unsqueeze(1)
    hidden = key_pos >= lens  # [B, L] keys the query may not see
    if sliding_window is not None:
        hidden = hidden | (key_pos <= lens - 1 - sliding_window)
    qf = query.float().view(batch, num_kv_heads, group, head_dim)
    scores = torch.einsum("bhgd,blhd->bhgl", qf, keys.float()).mul_(scale)
    probs = torch.softmax(scores.masked_fill_(hidden.view(batch, 1, 1, -1), float("-inf")), dim=-1)
    # Slots past a request's length may hold anything (even NaN): zero them before the weighted sum.
    values = values.float().masked_fill_(hidden.view(batch, -1, 1, 1), 0.0)
    out = torch.einsum("bhgl,blhd->bhgd", probs, values)
    return out.reshape(batch, num_q_heads, -1).to(query.dtype)


def compile_decode(fn: Callable[..., Any], mode: str) -> Callable[..., Any]:
    """``fn`` compiled for ``mode`` with static shapes (one graph per bucket)."""
    if mode == "inductor":
        return torch.compile(fn, backend="inductor", dynamic=False, fullgraph=True)
    if mode == "aot_eager":
        return torch.compile(fn, backend="aot_eager", dynamic=False, fullgraph=True)
    if mode == "cudagraph":
        return torch.compile(fn, mode="reduce-overhead", dynamic=False, fullgraph=True)
    if mode == "npugraph":
        return torch.compile(fn, backend=_npu_backend(), dynamic=False, fullgraph=True)
    raise ValueError(f"no graph capture for mode {mode!r}")


def _npu_backend() -> Any:
    """torchair's NPU graph backend (aclgraph capture)."""
    torchair = _import_torchair()
    config = torchair.CompilerConfig()
    config.mode = "reduce-overhead"
    return torchair.get_npu_backend(compiler_config=config)


def _import_torchair() -> Any:
    """The torchair module, or a RuntimeError naming it (there is no silent eager fallback)."""
    try:
        return importlib.import_module("torchair")
    except ImportError as exc:
        raise RuntimeError(
            "graph_mode 'npugraph' needs torchair (Ascend's torch.compile backend, shipped with torch_npu or "
            f"`pip install torchair`), which is not importable ({exc}); set executor_options "
            "graph_mode='eager' to run without graph capture"
        ) from exc
