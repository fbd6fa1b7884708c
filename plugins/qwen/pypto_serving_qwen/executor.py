"""QwenExecutor: the pypto-serving :class:`Executor` for Qwen2 / Qwen3 / Qwen3-MoE checkpoints."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import time
from itertools import pairwise
from typing import Any

import torch

import pypto_kernels as K
from pypto_serving import BatchInput, CacheGroupSpec, Executor, ExecutorInfo, LoopDraw, read_generation_config
from pypto_serving.lora_weights import LoraAdapter, LoraContext, batch_onehot, read_adapter
from pypto_serving.parallel import ParallelContext

from .capture import DecodeGraphs, GraphStats
from .graph import GraphOptions, parse_graph_options
from .loader import QwenConfig, load_weights, plan_quantization, read_config, read_kv_scales, resolve_dtype
from .model import AttentionMetadata, KVCache, QwenAttention, QwenForCausalLM, QwenSparseMoe
from .quantized import finish_loading
from .sharding import QwenSharding
from .warmup import warmup_batches, warmup_plan

__all__ = ["KV_GROUP", "QwenExecutor"]

logger = logging.getLogger(__name__)

KV_GROUP = "kv"  # the single cache group: one K and one V entry per token per layer

#: Graph modes that replay on the device without Python; refused over several ranks (see _plan_shards).
_DEVICE_GRAPH_MODES = frozenset({"cudagraph", "npugraph"})

#: ``executor_options["cpu_linear"]`` -> the library :meth:`QwenForCausalLM.pack_linears` packs for
#: (None: :func:`pypto_kernels.packing_rule`); ``reference`` is absent: nothing is packed.
_CPU_LINEAR = {"auto": None, "mkl": "mkl", "onednn": "onednn", "panels": "panels"}


def _return_freed_heap() -> None:
    """Give the heap the replaced plain matrices freed back to the OS: glibc serves them from its heap
    once its dynamic mmap threshold has grown past their size (the loader's larger buffers grow it),
    and keeps the freed blocks resident (1.10x the checkpoint on the memory test's float32 load
    without this, 0.99x with it); elsewhere a no-op."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


class QwenExecutor(Executor):
    """Loads a local HF checkpoint into :class:`QwenForCausalLM` and runs one forward per step.

    ``settings.executor_options`` (all optional): ``graph_mode`` (``auto``, ``eager``, ``inductor``,
    ``cudagraph``, ``npugraph``, ``aot_eager``), ``graph_batch_sizes`` (the decode buckets) and
    ``graph_warmup`` (``load`` or ``lazy``); see :mod:`pypto_serving_qwen.graph`. ``cpu_linear``
    (``auto``, ``mkl``, ``onednn``, ``panels``, ``reference``): on the CPU in eager mode, ``auto``
    packs by :func:`pypto_kernels.packing_rule` (bfloat16 projections: oneDNN's layout, in place of
    the plain weights, or the native column panels for those of 64 Ki elements or more with an even
    input count on a non-Intel x86 CPU with AVX-512 and AVX512-BF16 where the native kernels are
    built; float32 ones of 512 Ki elements or more on an x86 CPU without AVX-512 too, and of 64 Ki
    or more on a non-Intel x86 CPU with AVX-512, there into the native column panels where the
    native kernels are built; other float32: none), the output projection by the same rule;
    ``onednn`` every float projection and the output projection so, ``panels`` every float one into
    the native column panels (refused without the native kernels), ``mkl`` every float32
    projection and the output projection for MKL's packed SGEMM at a full batch of ``max_num_seqs`` rows
    (beside the plain weights: twice their memory),
    ``reference`` none. A tied output projection (the embedding too) keeps its plain matrix and gets a
    copy beside it, the vocabulary matrix held twice, unless ``tied_head_copy`` is false
    (:meth:`QwenForCausalLM.pack_linears`). Except with ``reference``, the output projection and every
    projection left plain run :func:`pypto_kernels.linear`, whose CPU fast path multiplies the plain
    float32 ``lm_head_t`` transposed in chunks at 16 rows or more (no copy of it), and decoder
    projections of 512 Ki elements or more so at 2-128 rows. ``native_decoder`` (true by default):
    where every decoder projection got native panels (and the layers are dense, without LoRA, on
    one rank), a decode step (or one verifying drafted tokens) runs the decoder layers as one native call
    (:class:`pypto_kernels.NativeDecoder`: the same kernels and results, without Python between
    them); false keeps one kernel call at a time. ``cpu_warmup`` (true by default): on the CPU in eager
    mode on one rank, :meth:`init_kv_cache` runs a short prefill and two decode steps of
    ``max_num_seqs`` rows over the fresh caches and sets heap aside for a chunk of
    ``max_num_batched_tokens``, so the first batch's buffers need no fresh memory (the written blocks
    are zeroed after; :meth:`_warm_up`); false skips it. Any other key is refused at load.

    With ``tensor_parallel_size > 1`` the worker runs one executor per rank inside torch.distributed's
    default process group; each loads and holds its shards (:mod:`pypto_serving_qwen.sharding`), its
    KV cache holds only its KV heads, and every rank returns the same full logits.
    """

    def __init__(self, settings: Any) -> None:
        if not settings.model:
            raise ValueError("the qwen executor needs settings.model (a local Hugging Face model directory)")
        self.settings = settings
        self.config: QwenConfig | None = None
        self.model: QwenForCausalLM | None = None
        self.device = torch.device("cpu")
        self.draws: K.native.SampleDraw | None = None  # draw_kernel's, once asked
        self.dtype = torch.float32
        self.kv_caches: list[KVCache] = []
        self.graph_options: GraphOptions | None = None
        self.graphs: DecodeGraphs | None = None
        self.eager_steps = 0
        self._maxima: tuple[torch.Tensor, torch.Tensor] | None = None  # the last execute's (logits_maxima)
        self.cpu_warmup = True
        self.lora: LoraContext | None = None
        self.lora_slots: dict[str, int] = {}  # adapter name -> its slot in the stacked weights (0: base)

    def load(self) -> ExecutorInfo:
        s = self.settings
        cfg = read_config(s.model)
        self.device = K.select_device(s.device)
        self.dtype = resolve_dtype(s.dtype, cfg, s.model, self.device)
        if s.dtype != "auto" and cfg.torch_dtype in ("bfloat16", "float16") and self.dtype == torch.float32:
            # The user's choice, so said at info level (the CLI keeps stderr to errors); 'auto' says
            # why it upcasts on a CPU without 16-bit instructions itself (pypto_kernels.auto_dtype).
            logger.info(
                "%s checkpoint loaded as float32 on %s because dtype=%r: twice its weight memory; "
                "dtype='auto' keeps it as stored",
                cfg.torch_dtype,
                self.device,
                s.dtype,
            )
        self.graph_options = parse_graph_options(s.executor_options, self.device, s.max_num_seqs)
        self.cpu_warmup = s.executor_options.get("cpu_warmup", True)
        if not isinstance(self.cpu_warmup, bool):
            raise ValueError(f"executor_options cpu_warmup must be true or false, got {self.cpu_warmup!r}")
        cache_dtype = self._kv_cache_dtype()  # refuses what it cannot run before weights load
        shards = self._plan_shards(cfg)
        # Seeded so that anything random during start-up, such as a kernel warm-up, is reproducible.
        torch.manual_seed(s.seed)
        model = QwenForCausalLM(cfg, self.device, self.dtype, shards, plan_quantization(s.model, cfg))
        targets, required = model.weight_targets()
        load_weights(s.model, targets, required, cfg.quantization)
        del targets  # views of the plain matrices: packing below frees those it replaces
        if cache_dtype == torch.float8_e4m3fn:
            self._set_kv_scales(model, cfg, shards.kv_heads)
        named = model.named_quantized_weights()
        finish_loading([w for _, w in named], [n for n, _ in named])
        model.eval()
        self._attach_loras(model)
        self._pack_linears(model)
        self.config, self.model = cfg, model
        self._log_kernels(cfg)

        gen_eos, generation_defaults = read_generation_config(s.model)
        eos = list(dict.fromkeys([*gen_eos, *cfg.eos_token_ids]))  # generation_config first, no duplicates
        dtype_bytes = torch.empty((), dtype=cache_dtype).element_size()
        # This rank's memory: its KV heads only.
        bytes_per_block = 2 * cfg.num_layers * s.block_size * self._kv_heads(cfg) * cfg.head_dim * dtype_bytes
        logger.info(
            "loaded %s from %s on %s as %s (%d layers%s)",
            cfg.architecture,
            s.model,
            self.device,
            self.dtype,
            cfg.num_layers,
            f", {cfg.num_experts} experts top-{cfg.num_experts_per_tok}" if cfg.num_experts else "",
        )
        return ExecutorInfo(
            cache_groups=[CacheGroupSpec(KV_GROUP, block_size=s.block_size, bytes_per_block=bytes_per_block)],
            vocab_size=cfg.vocab_size,
            max_model_len=s.max_model_len or cfg.max_position_embeddings,
            eos_token_ids=eos,
            architecture=cfg.architecture,
            supports_pipelining=True,
            can_verify_drafts=True,  # any number of query rows per request, as in chunked prefill
            generation_defaults=generation_defaults,
            kv_cache_dtypes=("auto", "bfloat16", "fp8"),
            supports_lora=True,
            thread_count_invariant=self._thread_count_invariant(quantized=bool(named)),
        )

    def _thread_count_invariant(self, *, quantized: bool) -> bool:
        """Whether this model's logits are bitwise the same on any number of CPU threads: the eager CPU
        forward with packed float projections is, its routed experts (if any) packed as panels too
        (tests/plugins/qwen/test_thread_count.py); plain experts' larger calls go through MKL's grouped
        GEMM, whose last bits differ between one and two threads, and LoRA's and the quantized
        products are not tested for it."""
        assert self.model is not None
        routed = [m for m in self.model.modules() if isinstance(m, QwenSparseMoe)]
        packed = all(isinstance(m.gate_up, K.native.PackedExperts) for m in routed)
        float_only = packed and self.lora is None and not quantized
        return self.device.type == "cpu" and self.model.lm_head_kernel and float_only

    def _pack_linears(self, model: QwenForCausalLM) -> None:
        """oneDNN-packed weight copies for the eager CPU forward (``executor_options["cpu_linear"]``);
        captured graphs and other devices keep the plain weights."""
        choice = self.settings.executor_options.get("cpu_linear", "auto")
        if choice not in (*_CPU_LINEAR, "reference"):
            known = [*_CPU_LINEAR, "reference"]
            raise ValueError(f"executor_options cpu_linear must be one of {known}, got {choice!r}")
        tied_copy = self.settings.executor_options.get("tied_head_copy", True)
        if not isinstance(tied_copy, bool):
            raise ValueError(f"executor_options tied_head_copy must be true or false, got {tied_copy!r}")
        native_decoder = self.settings.executor_options.get("native_decoder", True)
        if not isinstance(native_decoder, bool):
            raise ValueError(f"executor_options native_decoder must be true or false, got {native_decoder!r}")
        mode = self.graph_options.mode if self.graph_options is not None else "eager"
        if choice == "reference" or self.device.type != "cpu" or mode != "eager":
            return
        count = model.pack_linears(self.settings.max_num_seqs, _CPU_LINEAR[choice], tied_head_copy=tied_copy)
        model.native_decoder_enabled = native_decoder
        _return_freed_heap()
        head, stored = model.lm_head_packed, model.lm_head_q
        label = K.describe_kernel("linear", self.device, dtype=self.dtype)
        if stored is not None:
            where = f"{stored.scheme}, {'oneDNN prepacked' if stored.packed is not None else 'as stored'}"
        elif head is None:
            where = "not packed"
        else:
            where = f"{head.library}, {'beside' if head.weight is not None else 'in place of'} the plain matrix"
        logger.info(
            "cpu_linear=%s: %d matrices packed (output projection: %s): linear runs %s", choice, count, where, label
        )

    def _attach_loras(self, model: QwenForCausalLM) -> None:
        """With LoRA enabled (``enable_lora`` or ``lora_modules``), give the model its adapter stacks
        and read ``lora_modules``' PEFT adapters into them (each rank reads them whole and keeps its
        part, see :meth:`QwenForCausalLM.shard_lora`). Refused with graph capture (the captured
        decode step holds no per-token adapter input)."""
        s = self.settings
        # name=path entries, already checked by the settings (names unique, at most max_loras).
        paths = dict(entry.split("=", 1) for entry in s.lora_modules)
        if not paths and not getattr(s, "enable_lora", False):
            return
        what = "lora_modules" if paths else "enable_lora"
        mode = self.graph_options.mode if self.graph_options is not None else "eager"
        if mode != "eager":
            raise ValueError(
                f"{what} is not supported with executor_options graph_mode={mode!r}: captured decode "
                "graphs take no per-token adapter; use graph_mode='eager'"
            )
        shapes = model.lora_shapes()
        adapters = [model.shard_lora(read_adapter(n, path, s.max_lora_rank, shapes)) for n, path in paths.items()]
        # Every slot is made now: a run-time load then copies into its slot, nothing else moves.
        self.lora = model.attach_loras(adapters, s.max_loras + 1)
        self.lora_slots = {a.name: i for i, a in enumerate(adapters, start=1)}
        logger.info("LoRA adapters %s (ranks %s) loaded", list(self.lora_slots), [a.rank for a in adapters])

    def read_lora(self, key: str, path: str) -> LoraAdapter:
        """Read and check the PEFT adapter at ``path`` (in a background thread while steps run: it
        reads the model's shapes only), its weights already in the model's dtype and cut to this
        tensor-parallel rank (every rank reads the adapter)."""
        if self.lora is None or self.model is None:
            raise ValueError("LoRA is not enabled: start with enable_lora (or lora_modules) to load adapters")
        whole = read_adapter(key.partition("\0")[0], path, self.settings.max_lora_rank, self.model.lora_shapes())
        adapter = self.model.shard_lora(whole)
        adapter.pairs = {k: (a.to(self.dtype), b.to(self.dtype)) for k, (a, b) in adapter.pairs.items()}
        return adapter

    def install_lora(self, key: str, adapter: Any, slot: int) -> None:
        """Copy a read adapter into ``slot`` (replacing the adapter the engine freed there)."""
        assert self.lora is not None and self.model is not None and isinstance(adapter, LoraAdapter)
        self.model.write_lora(self.lora, slot, adapter)
        self.lora_slots = {k: s for k, s in self.lora_slots.items() if s != slot} | {key: slot}
        logger.info("LoRA adapter %r (rank %d) loaded into slot %d", adapter.name, adapter.rank, slot)

    def _lora_onehot(self, batch: BatchInput) -> torch.Tensor | None:
        """Each token's adapter slot as a one-hot ``[T, slots]`` (None: the whole step runs the base)."""
        if batch.loras is None or self.lora is None:
            return None
        return batch_onehot(
            batch.loras, batch.query_start_loc_host, self.lora_slots, self.lora.slots, self.dtype, self.device
        )

    def _kv_cache_dtype(self) -> torch.dtype:
        """The cache's element type: the model's, or ``fp8`` where the eager paged kernels run (the
        captured decode graphs read the cache in its own dtype). Where the native CPU kernels are
        built a bfloat16 model's CPU cache is bfloat16, read in place by the C kernel. Without them it
        is float32 in eager mode: the torch decode path reads a float32 cache in place and gathers any
        other (torch's sampled product takes float32 only; over a gathered bfloat16 cache a 64-stream
        Qwen3-0.6B step was 1.6x slower, docs/benchmarks.md, "The AVX-512 AMD machine"), at twice a
        bfloat16 cache's bytes per token, which ``kv_cache_dtype = "bfloat16"`` keeps."""
        mode = self.graph_options.mode if self.graph_options is not None else "eager"
        setting = getattr(self.settings, "kv_cache_dtype", "auto")
        if setting == "bfloat16":  # asked for: half the bytes
            return torch.bfloat16
        if setting != "fp8":
            cpu_eager = self.device.type == "cpu" and mode == "eager"
            gathered = not K.native.reads_dtypes(torch.bfloat16, torch.bfloat16)
            return torch.float32 if cpu_eager and self.dtype == torch.bfloat16 and gathered else self.dtype
        if mode != "eager":
            raise ValueError(
                f"kv_cache_dtype='fp8' is not supported with executor_options graph_mode={mode!r}: the captured "
                "decode attention reads the cache unscaled; use graph_mode='eager' (the default on every device)"
            )
        return torch.float8_e4m3fn

    def _plan_shards(self, cfg: QwenConfig) -> QwenSharding:
        """This rank's layout; refuses a process group that does not match ``tensor_parallel_size``,
        a world size that does not divide a split dimension, and device-replayed graphs over several
        ranks (inductor and aot_eager graphs trace torch.distributed's calls and run them)."""
        ctx = ParallelContext.current()
        wanted = int(getattr(self.settings, "tensor_parallel_size", 1))
        if ctx.world_size != wanted:
            raise ValueError(
                f"tensor_parallel_size={wanted} but this worker's process group has {ctx.world_size} rank(s); "
                "start one worker per rank with torch.distributed initialised"
            )
        mode = self.graph_options.mode if self.graph_options is not None else "eager"
        if ctx.enabled and mode in _DEVICE_GRAPH_MODES:
            raise ValueError(
                f"executor_options graph_mode={mode!r} is not supported with tensor_parallel_size={ctx.world_size}: "
                "replaying the collectives inside device graphs is not verified; use 'inductor' or 'aot_eager' "
                "(their compiled graphs call the collectives) or 'eager'"
            )
        ep = bool(getattr(self.settings, "enable_expert_parallel", False))
        return QwenSharding.plan(cfg, ctx, expert_parallel=ep)

    def _layout(self, cfg: QwenConfig) -> QwenSharding:
        """The loaded model's layout (one rank when no model is loaded yet)."""
        return self.model.shards if self.model is not None else QwenSharding.single(cfg)

    def _set_kv_scales(self, model: QwenForCausalLM, cfg: QwenConfig, heads: slice) -> None:
        """Give each layer the checkpoint's FP8 KV cache scales of this rank's KV heads (vLLM's
        ``self_attn.k_scale`` / ``v_scale``); a layer without them keeps 1.0."""
        scales = read_kv_scales(self.settings.model, cfg.num_layers, cfg.num_kv_heads)
        for i, layer in enumerate(model.layers):
            attn = layer.self_attn
            assert isinstance(attn, QwenAttention)
            if (i, "k") in scales or (i, "v") in scales:
                k, v = (scales.get((i, w), torch.ones(cfg.num_kv_heads))[heads] for w in "kv")
                attn.kv_scales = (k.to(self.device), v.to(self.device))
        if scales:
            per_head = any(bool((t != t[0]).any()) for t in scales.values())
            logger.info("FP8 KV cache: %s scales from the checkpoint", "per-head" if per_head else "per-tensor")

    def _kv_heads(self, cfg: QwenConfig) -> int:
        """The KV heads this rank's cache holds."""
        kv = self._layout(cfg).kv_heads
        return int(kv.stop) - int(kv.start)

    def _log_kernels(self, cfg: QwenConfig) -> None:
        """Say which implementation runs each kind of attention layer on this device (fast path or reference)."""
        shards, cache_dtype = self._layout(cfg), self._kv_cache_dtype()
        head_major = K.paged_cache_layout(cache_dtype, self.device) == "head_major"
        common = {
            "dtype": self.dtype,
            "cache_dtype": cache_dtype,
            "value_dtype": cache_dtype,
            "block_size": self.settings.block_size,
            "num_heads": shards.q_heads.stop - shards.q_heads.start,
            "num_kv_heads": shards.kv_heads.stop - shards.kv_heads.start,
            "head_dim": cfg.head_dim,
            "value_head_dim": cfg.head_dim,
            "host_lengths": True,
            "contiguous_cache": not head_major,
            "head_major_cache": head_major,
            "options": ["k_scale", "v_scale"] if cache_dtype == torch.float8_e4m3fn else [],
        }
        for window in sorted(set(cfg.layer_windows), key=lambda w: -1 if w is None else w):
            kind = "full attention" if window is None else f"sliding window {window}"
            backend = K.describe_kernel("paged_attention", self.device, sliding_window=window, sinks=False, **common)
            logger.info("%s layers: paged_attention runs %s", kind, backend)
        logger.info("KV writes: write_kv_cache runs %s", K.describe_kernel("write_kv_cache", self.device))
        if cfg.num_experts:
            # Float experts run routed_moe (router, routing and experts; its reference calls moe_experts).
            for name in ("routed_moe", "moe_experts"):
                logger.info("routed experts: %s runs %s", name, K.describe_kernel(name, self.device))
        stored = self.model.quantized_weights() if self.model is not None else []
        for scheme in sorted({w.scheme for w in stored}):
            backend = K.describe_kernel("quant_linear", self.device, scheme=scheme, dtype=self.dtype)
            logger.info("%s projections (kept as stored): quant_linear runs %s", scheme, backend)

    def init_kv_cache(self, num_blocks: dict[str, int]) -> None:
        cfg = self._loaded_config()
        if KV_GROUP not in num_blocks:
            raise ValueError(f"init_kv_cache needs blocks for cache group {KV_GROUP!r}, got {sorted(num_blocks)}")
        capture = self.graph_options is not None and self.graph_options.mode != "eager"
        # Graph capture adds one scratch block past the engine's blocks for the padding rows.
        blocks = num_blocks[KV_GROUP] + int(capture)
        shape = (blocks, self.settings.block_size, self._kv_heads(cfg), cfg.head_dim)
        cache_dtype = self._kv_cache_dtype()
        # The previous caches are freed before the new ones are made (a memory profile's first).
        self.kv_caches = []
        if self.model is not None:
            self.model.drop_native_decoder()
        # Uninitialised on purpose: zero-filling gigabytes of cache would dominate start-up, and no
        # slot is read before it is written (attention reads exactly seq_len keys of each request,
        # all written by this or an earlier step; tests fill the caches with NaN to prove it).
        # In the layout this device's attention reads fastest (head-major for the CPU's in-place reads).
        self.kv_caches = [
            (
                K.empty_paged_cache(shape, device=self.device, dtype=cache_dtype),
                K.empty_paged_cache(shape, device=self.device, dtype=cache_dtype),
            )
            for _ in range(cfg.num_layers)
        ]
        if capture:
            self._init_graphs(cfg, scratch_block=blocks - 1)
        elif self.cpu_warmup and self.device.type == "cpu" and self.model is not None:
            self._warm_up(cfg, num_blocks[KV_GROUP])

    def _warm_up(self, cfg: QwenConfig, num_blocks: int) -> None:
        """Decode steps of the most rows over the fresh caches, after a short prefill step
        (:mod:`pypto_serving_qwen.warmup`), their logits held together, then room for a prefill
        chunk's activations: the worker's heap grows to hold a step's buffers now, not during the
        first batch. A chunk of the most tokens is not computed (on two cores a Qwen3-0.6B one takes
        5 s; a bigger model's, minutes) but its activations' bytes are taken and given back. The
        blocks the steps wrote are zeroed again and the step counters reset, so nothing of it shows.
        One rank only (the steps would need every rank)."""
        s, model = self.settings, self.model
        assert model is not None
        plan = warmup_plan(num_blocks, s.block_size, 2 * s.max_num_seqs, s.max_num_seqs)
        if plan is None or model.shards.ctx.enabled:
            return
        start = time.perf_counter()
        # Each step's logits kept while the next runs, as the runner keeps a step's until it is sampled.
        held = [self.execute(batch) for batch in warmup_batches(plan, s.block_size, cfg.vocab_size, KV_GROUP)]
        # Two logits buffers more (the real steps' shapes fragment the heap a little) and a chunk's
        # activations: residual, hidden, norms, qkv, queries, attention out, o, gate-up, SwiGLU.
        q_width, qkv_width = cfg.num_heads * cfg.head_dim, (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
        row = 5 * cfg.hidden_size + qkv_width + 2 * q_width + 3 * cfg.intermediate_size
        size = self.dtype.itemsize * s.max_num_batched_tokens * row + 4 * 2 * plan.requests * cfg.vocab_size
        held.append(torch.empty(size, dtype=torch.uint8).fill_(0))  # every page touched
        del held
        for pair in self.kv_caches:
            for cache in pair:
                cache[: plan.used_blocks].zero_()  # block b is [b] in either layout
        self.eager_steps, model.native_decoder_steps = 0, 0
        logger.info(
            "warm-up: a %d-token prefill step, two %d-row decode steps and %d MiB of heap in %.2f s "
            "(executor_options cpu_warmup)",
            plan.requests * plan.prompt,
            plan.requests,
            size >> 20,
            time.perf_counter() - start,
        )

    def kv_cache_blocks(self) -> dict[str, list[torch.Tensor]] | None:
        """Every layer's key and value cache, dimensions in memory order (a block's bytes as they
        lie): all state of a request lives in its blocks."""
        return {KV_GROUP: [K.memory_order(t) for pair in self.kv_caches for t in pair]}

    def _init_graphs(self, cfg: QwenConfig, scratch_block: int) -> None:
        assert self.graph_options is not None and self.model is not None
        for key_cache, value_cache in self.kv_caches:
            # Padding rows read the scratch block's first slot: keep it finite before any write.
            key_cache[scratch_block].zero_()
            value_cache[scratch_block].zero_()
        if self.graphs is None:
            block_size = self.settings.block_size
            max_len = self.settings.max_model_len or cfg.max_position_embeddings
            self.graphs = DecodeGraphs(
                self.model,
                self.graph_options,
                scratch_block=scratch_block,
                block_size=block_size,
                table_width=-(-max_len // block_size),
                device=self.device,
            )
        self.graphs.use_caches(self.kv_caches, scratch_block)
        opts = self.graph_options
        if opts.warmup == "load":
            seconds = self.graphs.warm_up(self.kv_caches)
            logger.info(
                "decode graphs (%s) for batch sizes %s compiled in %.1f s", opts.mode, opts.batch_sizes, seconds
            )
        else:
            logger.info("decode graphs (%s) for batch sizes %s compile on first use", opts.mode, opts.batch_sizes)

    @property
    def graph_stats(self) -> GraphStats:
        """Which path the steps took (captured per bucket, or eager)."""
        stats = self.graphs.stats if self.graphs is not None else GraphStats()
        stats.eager_steps = self.eager_steps
        stats.native_decoder_steps = self.model.native_decoder_steps if self.model is not None else 0
        return stats

    def execute(self, batch: BatchInput) -> torch.Tensor:
        if self.model is None:
            raise RuntimeError("execute() before load()")
        if not self.kv_caches:
            raise RuntimeError("execute() before init_kv_cache()")
        self._maxima = None
        bucket = self.graphs.bucket(batch) if self.graphs is not None else None
        if self.graphs is not None and bucket is not None:
            return self.graphs.run(batch, bucket, self.kv_caches)
        self.eager_steps += 1
        rows = batch.logits_indices.shape[0]
        # The output projection takes the greedy rows' maxima as it writes the logits, where it can.
        if batch.greedy_maxima and self.model.takes_maxima(rows):
            peak, index = torch.empty(rows, device=self.device), torch.empty(rows, dtype=torch.long, device=self.device)
            self._maxima = (peak, index)
        qsl = batch.query_start_loc_host
        meta = AttentionMetadata(
            slot_mapping=batch.slot_mapping[KV_GROUP],
            block_tables=batch.block_tables[KV_GROUP],
            query_start_loc=batch.query_start_loc,
            seq_lens=batch.seq_lens,
            query_lens_host=[end - start for start, end in pairwise(qsl)],
            seq_lens_host=batch.seq_lens_host,
            prompt_rows_host=batch.prompt_rows,
        )
        if self.lora is not None:
            self.lora.onehot = self._lora_onehot(batch)
        with torch.inference_mode():
            # A step that reads only the maxima leaves the logits unwritten where the product can.
            store = self._maxima is None or not batch.maxima_only
            logits: torch.Tensor = self.model(
                batch.input_ids, batch.positions, meta, self.kv_caches, batch.logits_indices, self._maxima, store
            )
        return logits

    def draw_kernel(self) -> K.native.SampleDraw | None:
        """The native CPU draw of sampled rows (``pypto_kernels.native.sample_rows``) where the logits
        lie in host memory and the C kernels are built (kept as :attr:`draws`, which counts its rows)."""
        self.draws = K.native.SampleDraw() if self.device.type == "cpu" and K.native.library() is not None else None
        return self.draws

    def logits_maxima(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        return self._maxima

    def greedy_steps(self, batch: BatchInput, steps: int, stop_ids: list[frozenset[int]]) -> list[list[int]] | None:
        """:meth:`QwenForCausalLM.greedy_steps` over the caches, where the eager forward runs (no captured
        graphs) and no request names a LoRA adapter."""
        if self.model is None or not self.kv_caches:
            raise RuntimeError("greedy_steps() before load() and init_kv_cache()")
        if self.graphs is not None or (batch.loras is not None and any(batch.loras)):
            return None
        with torch.inference_mode():
            return self.model.greedy_steps(
                batch.input_ids,
                batch.positions,
                batch.block_tables[KV_GROUP],
                self.kv_caches,
                steps,
                stop_ids,
                batch.interrupt,
            )

    def sampled_steps(
        self, batch: BatchInput, steps: int, stop_ids: list[frozenset[int]], draws: list[LoopDraw | None]
    ) -> list[list[int]] | None:
        """:meth:`greedy_steps`' loops with the sampled requests' tokens drawn from each forward's stored
        logits in C (:meth:`QwenForCausalLM.greedy_steps` with their draws), where :meth:`draw_kernel`
        draws on the CPU (the loop draws as it does); None otherwise."""
        if self.draws is None or self.model is None or not self.kv_caches:
            return None
        if self.graphs is not None or (batch.loras is not None and any(batch.loras)):
            return None
        runs = [
            None if d is None else K.SampledRun(d.temperature, d.top_k, d.top_p, d.min_p, d.seed, d.first_index)
            for d in draws
        ]
        with torch.inference_mode():
            return self.model.greedy_steps(
                batch.input_ids, batch.positions, batch.block_tables[KV_GROUP], self.kv_caches, steps, stop_ids,
                batch.interrupt, runs,
            )  # fmt: skip

    def shutdown(self) -> None:
        self.kv_caches = []
        if self.model is not None:
            self.model.drop_native_decoder()
        self.graphs = None
        self.model = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _loaded_config(self) -> QwenConfig:
        if self.config is None:
            raise RuntimeError("init_kv_cache() before load()")
        return self.config
