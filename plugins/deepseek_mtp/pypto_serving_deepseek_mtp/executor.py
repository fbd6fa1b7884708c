"""The DeepSeek-V4 executor: paged hybrid-attention caches plus MTP drafting."""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any

import torch
from torch.profiler import record_function

from pypto_kernels import auto_dtype, describe_kernel, interleaved_rope_cos_sin, native, select_device, upload
from pypto_serving import (
    BatchInput,
    CacheGroupSpec,
    DraftSampler,
    Executor,
    ExecutorInfo,
    argmax_rows,
    read_generation_config,
)
from pypto_serving.lora_weights import LoraAdapter, LoraContext, batch_onehot, read_adapter
from pypto_serving.parallel import ParallelContext
from pypto_serving.quantization import QuantizedWeight, read_quantization_config

from . import ops
from .config import CSA, HCA, SLIDING, DeepseekConfigError, DeepseekV4Config, load_config
from .lora import attach_loras, explain, lora_shapes, shard_adapter, write_lora
from .model import FP32_SUFFIXES, STATE_GROUP, CompressorRing, DeepseekV4Model, Params, Segments, _layer_params, linear
from .sharding import ShardPlan
from .weights import load_weights, mtp_depths

logger = logging.getLogger(__name__)

ARCHITECTURE = "DeepseekV4ForCausalLM"
MAX_DRAFT_TOKENS = 8
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class MtpConfigError(ValueError):
    """Speculative decoding was asked for in a way this checkpoint cannot serve."""


#: Positions one MTP carry ring holds per request and depth: the inputs a depth still needs from
#: earlier steps are the few positions past its frontier (at most ``num_draft + 1``).
CARRY_LEN = 2 * MAX_DRAFT_TOKENS + 4

MTP_STATE_GROUP = "mtp_state"
"""The cache group of MTP input snapshots, one per hit unit: entry ``E / unit - 1`` holds, per depth
``d``, that depth's input at position ``E - d - 1`` (depth ``d - 1``'s output, the main model's
streams for ``d = 0``), the one input a computation from a prefix hit at ``E`` cannot make itself."""


@dataclass
class MtpState:
    """Per-request drafting state; see docs/deepseek_mtp.md ("MTP state") for the invariants.

    Depth ``d`` at position ``i`` consumes the depth ``d-1`` output (the main model's streams for
    ``d = 0``) at ``i`` and the token ``i + d + 1``. Its KV at ``i`` is *canonical* once that token is
    committed; ``frontier[d]`` is the first position that is not canonical yet, so each step only
    (re)computes ``[frontier[d], n - 1]`` and draft-token entries are overwritten later. The canonical
    inputs a depth still needs from earlier steps sit in the executor's carry ring of that depth
    (row ``slot * CARRY_LEN + i % CARRY_LEN``); ``carried[d]`` is the range of positions it holds.

    Only depths below ``active`` run. A policy's drafting depth lowers it and never raises it again:
    a depth that skipped steps has no canonical KV for them, so it could not draft exactly later.
    """

    depth: int
    active: int = -1  # depths that run (``depth`` when -1)
    hv: int = 0  # main-model hidden states are known for positions < hv: the next step starts here
    n: int = -1  # position of the last known token
    tokens: dict[int, int] = field(default_factory=dict)
    frontier: list[int] = field(default_factory=list)
    carried: list[tuple[int, int]] = field(default_factory=list)  # per depth: (first, last) in the ring
    origin: int = 0  # the prefix-cache hit the request started at (0: it computed every position)
    restored: bool = False  # the MTP state at ``origin`` came from the prefix cache (exact at once)

    def __post_init__(self) -> None:
        self.frontier = [self.origin] * self.depth
        self.hv = max(self.hv, self.origin)
        self.carried = [(0, -1)] * self.depth
        if self.active < 0:
            self.active = self.depth

    def exact_depths(self, window: int) -> int:
        """How many depths draft exactly at the last committed position (``n - 1``): every active one,
        unless the request started at a hit whose MTP state did not come from the prefix cache (a
        position that is not a multiple of the hit unit; ``restored`` otherwise, see
        ``DeepseekMTPExecutor._restore_mtp``). Then nothing before ``origin`` was computed here:
        depth 0's KV is exact from ``origin`` (its
        inputs are the main model's streams), so its output from ``origin + window - 1`` (its window
        then holds no position before the hit), depth 1's KV from there, and so on: depth ``d``'s
        output is exact from ``origin + (d + 1) * (window - 1)``."""
        if not self.origin or self.restored:
            return self.active
        return min(self.active, max(0, (self.n - 1 - self.origin) // max(1, window - 1)))


def read_drafts(drafts: torch.Tensor) -> list[int]:
    """The one host read of MTP drafting: a step's drafts, flat ``[N]`` on the device, as a list."""
    return [int(t) for t in drafts.tolist()]


@dataclass
class _Drafting:
    """One ``propose_drafts`` call: host bookkeeping plus the drafts so far, which stay on the device."""

    work: dict[int, tuple[MtpState, bool]]  # batch row -> (state, whether it sampled this step)
    slots: list[int]  # batch row -> carry ring slot
    refs: dict[int, list[int]] = field(default_factory=dict)  # batch row -> its drafts' offsets in drafted
    # Per depth: this step's inputs of that depth (the main streams, then each depth's output) and
    # where each request's run of them sits: batch row -> (first position, first row, count).
    fresh: list[torch.Tensor] = field(default_factory=list)
    fresh_rows: list[dict[int, tuple[int, int, int]]] = field(default_factory=list)
    pieces: list[torch.Tensor] = field(default_factory=list)  # per depth: the tokens it drafted
    sampler: DraftSampler | None = None  # chooses the drafts (None: argmax)
    count: int = 0  # drafts in ``pieces``
    want: dict[int, int] = field(default_factory=dict)  # batch row -> drafts it proposes (its drafting depths)
    catch_up: set[int] = field(default_factory=set)  # sampling rows that run every active depth this step
    starts: dict[int, list[int]] = field(default_factory=dict)  # batch row -> per depth, its first position

    def __post_init__(self) -> None:
        self.refs = {r: [] for r in self.work}

    def drafts_at(self, r: int, d: int) -> bool:
        """Whether batch row ``r`` drafts a token at depth ``d`` (it sampled and proposes more than ``d``)."""
        return self.work[r][1] and d < self.want.get(r, 0)

    def add(self, tokens: torch.Tensor) -> None:
        self.pieces.append(tokens)
        self.count += tokens.shape[0]

    def drafted(self) -> torch.Tensor:
        return self.pieces[0] if len(self.pieces) == 1 else torch.cat(self.pieces)

    def result(self, num_requests: int, device: torch.device) -> list[list[int]]:
        """Each sampling request's drafts, read to the host in one go."""
        keep = [r for r in range(num_requests) if r in self.work and self.work[r][1]]
        order = [o for r in keep for o in self.refs[r]]
        out: list[list[int]] = [[] for _ in range(num_requests)]
        if not order:
            return out
        drafted = self.drafted()
        if order != list(range(self.count)):
            drafted = drafted.index_select(0, upload(order, device))
        values = iter(read_drafts(drafted))
        for r in keep:
            out[r] = [next(values) for _ in self.refs[r]]
        return out


@dataclass
class _DepthInputs:
    """What one MTP depth runs over: spans ``(r, first, last)`` of positions, where each input stream
    comes from (a row of the depth's fresh inputs, or ``-1 - row`` of its carry ring), positions and
    tokens (``(value, -1)`` for committed ones, ``(-1, offset)`` for this step's drafts)."""

    spans: list[tuple[int, int, int]] = field(default_factory=list)
    src: list[int] = field(default_factory=list)
    toks: list[tuple[int, int]] = field(default_factory=list)
    pos: list[int] = field(default_factory=list)

    def hidden(self, fresh: torch.Tensor, carry: torch.Tensor) -> torch.Tensor:
        """The input streams, gathered with one index tensor from the fresh rows and the carry ring."""
        if all(i >= 0 for i in self.src):
            if self.src == list(range(self.src[0], self.src[0] + len(self.src))):
                return fresh.narrow(0, self.src[0], len(self.src))
            return fresh.index_select(0, upload(self.src, fresh.device))
        flat = carry.view(-1, *carry.shape[2:])
        both = torch.cat([fresh, flat.to(fresh.dtype)])
        at = [i if i >= 0 else fresh.shape[0] - 1 - i for i in self.src]
        return both.index_select(0, upload(at, fresh.device))

    def tokens(self, step: _Drafting, device: torch.device) -> torch.Tensor:
        """The input tokens on the device: committed ones from the host, drafts gathered from ``step``."""
        tok = upload([v for v, _ in self.toks], device, torch.long)
        at = [i for i, (_, ref) in enumerate(self.toks) if ref >= 0]
        if at:
            refs = upload([self.toks[i][1] for i in at], device)
            tok = tok.index_copy(0, upload(at, device), step.drafted().index_select(0, refs))
        return tok


class DeepseekMTPExecutor(Executor):
    def __init__(self, settings: Any) -> None:
        self.settings = settings
        self.model: DeepseekV4Model | None = None
        self.mtp_layers: list[Params] = []
        # Quantized checkpoints keep their stored precision (FP8 projections, MXFP4 experts); False
        # dequantizes them at load (the comparison the tests and benchmarks/quant_load.py make).
        self.stored_precision = True
        self.num_draft = 0
        self.slots: dict[str, int] = {}
        self.free_slots: list[int] = []
        self.num_slots = 0
        self.mtp_state: dict[str, MtpState] = {}
        self.hit_starts: dict[str, int] = {}  # request -> the prefix-cache hit it started at
        # The positions a prefix hit may start at are multiples of this (0: prefix caching off):
        # MTP depths compute what a hit there needs (_first_positions) and snapshot its inputs.
        self.hit_unit = 0
        self.carry: list[torch.Tensor] = []  # per MTP depth: [slots, CARRY_LEN, hc, D] canonical inputs
        self.cache_dtype = torch.float32  # the paged caches' element type, set at load
        self._last: tuple[BatchInput, Segments, torch.Tensor] | None = None
        self.lora: LoraContext | None = None
        self.lora_slots: dict[str, int] = {}  # adapter key -> its slot in the stacked weights (0: base)

    # ------------------------------------------------------------------ load

    def load(self) -> ExecutorInfo:
        s = self.settings
        if not s.model:
            raise DeepseekConfigError("settings.model must name a DeepSeek-V4 checkpoint directory")
        model_dir = Path(s.model)
        cfg = load_config(model_dir)
        raw = json.loads((model_dir / "config.json").read_text())
        archs = raw.get("architectures") or []
        if archs and archs[0] != ARCHITECTURE:
            raise DeepseekConfigError(f"{model_dir} is a {archs[0]} checkpoint, not {ARCHITECTURE}")
        device = select_device(s.device)
        stored = _DTYPES.get(cfg.torch_dtype, torch.bfloat16)
        dtype = auto_dtype(stored, device) if s.dtype == "auto" else _DTYPES[s.dtype]
        quantization = read_quantization_config(raw, str(model_dir / "config.json"))
        plan = self._shard_plan(cfg)
        weights = load_weights(model_dir, device, dtype, FP32_SUFFIXES, quantization, plan, self.stored_precision)

        spec = s.speculative_config
        self._check_speculation(spec, mtp_depths(weights), cfg, model_dir)
        self.use_mtp = spec is not None and spec.method == "mtp"
        if self.use_mtp:
            for d in range(mtp_depths(weights)):
                self.mtp_layers.append(self._mtp_params(weights, d, plan, dtype))

        block_size = int(s.block_size)
        self.model = DeepseekV4Model(cfg, weights, device, dtype, block_size, plan.parallel, plan.experts)
        self.cfg, self.device, self.dtype = cfg, device, dtype
        self._attach_loras(plan)
        # kv_cache_dtype = "fp8": every cache group holds float8_e4m3fn entries (scale 1.0, model.py).
        fp8 = getattr(s, "kv_cache_dtype", "auto") == "fp8"
        self.cache_dtype = torch.float8_e4m3fn if fp8 else dtype
        self.groups = self._cache_groups(cfg, block_size, self.cache_dtype)
        self._log_kernels(cfg)
        gen_eos, generation_defaults = read_generation_config(model_dir)
        eos = list(dict.fromkeys([*cfg.eos_token_ids, *gen_eos]))  # config.json first, no duplicates
        return ExecutorInfo(
            cache_groups=self.groups,
            vocab_size=cfg.vocab_size,
            max_model_len=int(s.max_model_len or cfg.max_position_embeddings),
            eos_token_ids=eos,
            architecture=ARCHITECTURE,
            supports_pipelining=True,
            uniform_batches=False,
            max_draft_tokens=self.num_draft,
            prefill_barrier=False,
            generation_defaults=generation_defaults,
            kv_cache_dtypes=("auto", "fp8"),
            supports_lora=True,
        )

    def _attach_loras(self, plan: ShardPlan) -> None:
        """With LoRA enabled (``enable_lora`` or ``lora_modules``), give the main model's layers their
        adapter stacks and read ``lora_modules``' PEFT adapters into them (see :mod:`.lora`; the MTP
        layers take none; each tensor-parallel rank keeps its part of every adapter)."""
        s = self.settings
        # name=path entries, already checked by the settings (names unique, at most max_loras).
        paths = dict(entry.split("=", 1) for entry in s.lora_modules)
        if not paths and not getattr(s, "enable_lora", False):
            return
        assert self.model is not None
        shapes, cfg = lora_shapes(self.cfg), self.cfg
        read = [read_adapter(name, path, s.max_lora_rank, shapes, explain) for name, path in paths.items()]
        adapters = [shard_adapter(a, cfg, plan.parallel) for a in read]
        # Every slot is made now: a run-time load then copies into its slot, nothing else moves.
        slots = s.max_loras + 1
        self.lora = attach_loras(self.model.layers, cfg, adapters, slots, self.dtype, self.device, plan.parallel)
        self.lora_slots = {a.name: i for i, a in enumerate(adapters, start=1)}
        logger.info("LoRA adapters %s (ranks %s) loaded", list(self.lora_slots), [a.rank for a in adapters])

    def read_lora(self, key: str, path: str) -> LoraAdapter:
        """Read and check the PEFT adapter at ``path`` (in a background thread while steps run: it
        reads the config's shapes only), its weights already in the model's dtype and cut to this
        tensor-parallel rank (every rank reads the adapter)."""
        if self.lora is None or self.model is None:
            raise ValueError("LoRA is not enabled: start with enable_lora (or lora_modules) to load adapters")
        shapes = lora_shapes(self.cfg)
        whole = read_adapter(key.partition("\0")[0], path, self.settings.max_lora_rank, shapes, explain)
        adapter = shard_adapter(whole, self.cfg, self.model.parallel)
        adapter.pairs = {k: (a.to(self.dtype), b.to(self.dtype)) for k, (a, b) in adapter.pairs.items()}
        return adapter

    def install_lora(self, key: str, adapter: Any, slot: int) -> None:
        """Copy a read adapter into ``slot`` (replacing the adapter the engine freed there)."""
        assert self.lora is not None and self.model is not None and isinstance(adapter, LoraAdapter)
        write_lora(self.model.layers, self.lora, slot, adapter)
        self.lora_slots = {k: s for k, s in self.lora_slots.items() if s != slot} | {key: slot}
        logger.info("LoRA adapter %r (rank %d) loaded into slot %d", adapter.name, adapter.rank, slot)

    def _lora_onehot(self, batch: BatchInput) -> torch.Tensor | None:
        """Each token's adapter slot as a one-hot ``[T, slots]`` (None: the whole step runs the base)."""
        if batch.loras is None or self.lora is None:
            return None
        return batch_onehot(
            batch.loras, batch.query_start_loc_host, self.lora_slots, self.lora.slots, self.dtype, self.device
        )

    def _shard_plan(self, cfg: DeepseekV4Config) -> ShardPlan:
        """This rank's tensor-parallel layout; refuses a world size that does not divide what it splits
        or that differs from ``tensor_parallel_size``."""
        parallel = ParallelContext.current()
        wanted = int(getattr(self.settings, "tensor_parallel_size", 1))
        if parallel.world_size != wanted:
            raise DeepseekConfigError(
                f"tensor_parallel_size={wanted} but this worker's process group has {parallel.world_size} "
                "rank(s); start one worker per rank with torch.distributed initialised"
            )
        plan = ShardPlan(
            cfg,
            parallel,
            expert_parallel=bool(getattr(self.settings, "enable_expert_parallel", False)),
            with_mtp=self.settings.speculative_config is not None,
        )
        plan.check()
        return plan

    def _check_speculation(self, spec: Any, n_mtp: int, cfg: DeepseekV4Config, model_dir: Path) -> None:
        """Refuse a speculative_config this checkpoint cannot serve; sets ``num_draft``."""
        if spec is None:
            return
        k = int(spec.num_speculative_tokens)
        if not 1 <= k <= MAX_DRAFT_TOKENS:
            raise MtpConfigError(
                f"speculative_config.num_speculative_tokens={k} is out of range: use 1..{MAX_DRAFT_TOKENS}"
            )
        if spec.method != "mtp":
            raise MtpConfigError(
                f"speculative_config.method={spec.method!r} is not supported by the deepseek_mtp executor: use 'mtp'"
            )
        if n_mtp == 0:
            raise MtpConfigError(
                f"speculative_config.method='mtp' needs the checkpoint's MTP layers, but {model_dir} "
                f"has no mtp.0.* tensors (num_nextn_predict_layers={cfg.num_nextn_predict_layers}); "
                "use a checkpoint with MTP weights or turn speculative decoding off"
            )
        self.num_draft = k

    def _mtp_params(self, weights: dict[str, Any], d: int, plan: ShardPlan, dtype: torch.dtype) -> Params:
        prefix = f"mtp.{d}."
        if any(k.startswith(prefix + "attn.compressor.") for k in weights):
            raise MtpConfigError(f"{prefix}* has a compressed-attention block; only sliding-window MTP is supported")
        try:
            groups = plan.cfg.o_groups // plan.parallel.world_size
            p = _layer_params(weights, prefix, plan.experts, groups=groups, dtype=dtype)
        except ValueError as e:
            raise MtpConfigError(f"MTP layer {d}: {e}") from None
        needed = [
            "e_proj.weight",
            "h_proj.weight",
            "enorm.weight",
            "hnorm.weight",
            "norm.weight",
            "hc_head_fn",
            "hc_head_base",
            "hc_head_scale",
            "attn.wq_a.weight",
            "attn.wkv.weight",
            "attn_norm.weight",
        ]
        missing = [prefix + n for n in needed if n not in p]
        if missing:
            raise MtpConfigError(f"MTP layer {d} is incomplete; missing {missing}")
        return p

    def _log_kernels(self, cfg: DeepseekV4Config) -> None:
        """Say which implementation runs each attention layer kind's kernels on this device."""
        kernels = {SLIDING: ["sink_attention"], HCA: ["compressor_pool", "sink_attention"]}
        kernels[CSA] = ["compressor_pool", "indexer_topk", "sink_attention"]
        for kind in dict.fromkeys(cfg.layer_types):
            used = ", ".join(f"{k} runs {describe_kernel(k, self.device)}" for k in kernels[kind])
            logger.info("%s layers: %s", kind, used)
        assert self.model is not None
        stored = {
            v.scheme
            for p in self.model.layers
            for k, v in p.items()
            if isinstance(v, QuantizedWeight) and not k.startswith("experts.")
        }
        if "fp8_block" in stored:
            backend = describe_kernel("quant_linear", self.device, scheme="fp8_block", dtype=self.dtype)
            logger.info("FP8 projections (kept as stored): quant_linear runs %s", backend)
        if "w8a8_dynamic" in stored:
            backend = describe_kernel("quant_linear", self.device, scheme="w8a8_dynamic", dtype=self.dtype)
            logger.info("W8A8 projections (kept int8): quant_linear runs %s", backend)
        stacks = [p["experts.gate_up"] for p in self.model.layers]
        experts = {w.scheme for w in stacks if isinstance(w, QuantizedWeight)}
        if experts:
            backend = describe_kernel("quant_moe_experts", self.device)
            logger.info("routed experts kept as stored (%s): %s", ", ".join(sorted(experts)), backend)

    def _cache_groups(self, cfg: DeepseekV4Config, block_size: int, dtype: torch.dtype) -> list[CacheGroupSpec]:
        """The paged groups (docs/deepseek_mtp.md, "Cache groups"). Every group serves exact prefix
        hits: a hit at ``p`` needs the ``swa`` window before ``p``, every compressed entry and indexer
        key, the CSA compressor-state snapshot at ``p`` (``csa_state``), each MTP depth's window
        before ``p`` (``mtp{d}``, shifted so a block is a function of its prefix) and the MTP input
        snapshot at ``p`` (``mtp_state``), so a request starting at a hit drafts at once."""
        elem = torch.tensor([], dtype=dtype).element_size()
        n_csa = cfg.layer_types.count(CSA)
        n_hca = cfg.layer_types.count(HCA)

        def group(name: str, layers: int, width: int, tpe: int = 1, window: int | None = None) -> CacheGroupSpec:
            return CacheGroupSpec(
                name=name,
                block_size=block_size,
                bytes_per_block=layers * block_size * width * elem,
                tokens_per_entry=tpe,
                window_tokens=window,
            )

        # Sliding attention reads the last sliding_window positions of ``swa`` (every layer, compressed
        # ones included), so older blocks can go back to the pool. An MTP depth computes positions up to
        # num_draft + 1 behind the confirmed count (it needs the tokens after them), or up to CARRY_LEN
        # more for a request that deferred it (_plan_depths), hence its margin.
        groups = [group("swa", cfg.num_hidden_layers, cfg.head_dim, window=cfg.sliding_window)]
        if n_csa:
            groups.append(group("csa_kv", n_csa, cfg.head_dim, cfg.csa_rate))
            groups.append(group("csa_index", n_csa, cfg.index_head_dim, cfg.csa_rate))
            # One snapshot per CSA block: the last m rows of both compressors' rings (kv and gate,
            # float32 like the rings); a hit reads only the one ending at it.
            row = 2 * (2 * cfg.head_dim) + 2 * (2 * cfg.index_head_dim)
            groups.append(
                CacheGroupSpec(
                    name=STATE_GROUP,
                    block_size=1,
                    bytes_per_block=n_csa * cfg.csa_rate * row * 4,
                    tokens_per_entry=block_size * cfg.csa_rate,
                    hit_lookback_tokens=1,
                )
            )
        if n_hca:
            groups.append(group("hca_kv", n_hca, cfg.head_dim, cfg.hca_rate))
        if self.use_mtp:
            groups += self._mtp_groups(cfg, groups, block_size, elem)
        return groups

    def _mtp_groups(
        self, cfg: DeepseekV4Config, groups: list[CacheGroupSpec], block_size: int, elem: int
    ) -> list[CacheGroupSpec]:
        """Depth ``d``'s KV at position ``i`` depends on the tokens up to ``i + d + 1``, so ``mtp{d}``
        keeps it at entry ``i + d + 1`` (``slot_shift``): its block ending at ``E`` is then a function
        of the tokens before ``E`` and is cached like a ``swa`` block. A hit at ``E`` recomputes depth
        ``d`` from ``E - d - 1`` (entry ``E``), reading the window's ``sliding_window - 1`` entries
        before it, and takes that depth's input at ``E - d - 1`` from ``mtp_state``."""
        # The window also keeps the positions a deferred depth still computes (see _plan_depths).
        mtp_window = cfg.sliding_window + CARRY_LEN + self.num_draft + 1
        unit = math.lcm(*(g.tokens_per_block for g in groups))
        self.hit_unit = unit if getattr(self.settings, "enable_prefix_caching", True) else 0
        width = cfg.hc_mult * cfg.hidden_size * torch.tensor([], dtype=self.dtype).element_size()
        out = [
            CacheGroupSpec(
                name=f"mtp{d}",
                block_size=block_size,
                bytes_per_block=block_size * cfg.head_dim * elem,
                window_tokens=mtp_window,
                hit_lookback_tokens=cfg.sliding_window - 1,
                slot_shift=d + 1,
            )
            for d in range(self.num_draft)
        ]
        snap = CacheGroupSpec(
            name=MTP_STATE_GROUP,
            block_size=1,
            bytes_per_block=self.num_draft * width,
            tokens_per_entry=unit,
            hit_lookback_tokens=1,
        )
        return [*out, snap]

    # ------------------------------------------------------------------ caches and slots

    def init_kv_cache(self, num_blocks: dict[str, int]) -> None:
        assert self.model is not None
        cfg, bs = self.cfg, self.model.block_size
        layers = {
            "swa": cfg.num_hidden_layers,
            "csa_kv": cfg.layer_types.count(CSA),
            "csa_index": cfg.layer_types.count(CSA),
            "hca_kv": cfg.layer_types.count(HCA),
        }
        for g in self.groups:
            if g.name == STATE_GROUP:  # [CSA layers, blocks, m, row] in float32, as the rings
                n_csa = layers["csa_kv"]
                row = g.bytes_per_block // (4 * n_csa * cfg.csa_rate)
                snapshots = (n_csa, num_blocks[g.name], cfg.csa_rate, row)
                self.model.caches[g.name] = torch.zeros(snapshots, device=self.device, dtype=torch.float32)
                continue
            if g.name == MTP_STATE_GROUP:  # [depths, blocks, hc, D] in the carry rings' dtype
                snapshots = (self.num_draft, num_blocks[g.name], cfg.hc_mult, cfg.hidden_size)
                self.model.caches[g.name] = torch.zeros(snapshots, device=self.device, dtype=self.dtype)
                continue
            self.model.slot_shift[g.name] = g.slot_shift
            width = cfg.index_head_dim if g.name == "csa_index" else cfg.head_dim
            n_layers = layers.get(g.name, 1)
            self.model.caches[g.name] = torch.zeros(
                (n_layers, num_blocks[g.name], bs, width), device=self.device, dtype=self.cache_dtype
            )
        self.num_slots = max(1, int(getattr(self.settings, "max_num_seqs", 8)))
        self.free_slots = list(range(self.num_slots - 1, -1, -1))
        shape = (self.num_slots, CARRY_LEN, cfg.hc_mult, cfg.hidden_size)
        self.carry = [torch.zeros(shape, device=self.device, dtype=self.dtype) for _ in range(self.num_draft)]
        for i, kind in enumerate(cfg.layer_types):
            if kind == SLIDING:
                continue
            rate = cfg.compress_rates[kind]
            # 2*m - 1 older source tokens may still be needed, plus up to num_draft clobbered positions.
            ring_len = 2 * rate + self.num_draft + 1
            width = 2 * cfg.head_dim if kind == CSA else cfg.head_dim
            self.model.rings[(i, "kv")] = CompressorRing(self.num_slots, ring_len, width, self.device, torch.float32)
            if kind == CSA:
                self.model.rings[(i, "index")] = CompressorRing(
                    self.num_slots, ring_len, 2 * cfg.index_head_dim, self.device, torch.float32
                )

    def draw_kernel(self) -> native.SampleDraw | None:
        """The native CPU draw of sampled rows (``pypto_kernels.native.sample_rows``) where the logits
        lie in host memory and the C kernels are built."""
        return native.SampleDraw() if self.device.type == "cpu" and native.library() is not None else None

    def kv_cache_blocks(self) -> dict[str, list[torch.Tensor]] | None:
        """Every group's per-layer caches (block id first; per depth for ``mtp_state``), the snapshots
        and the MTP groups included. A decode engine starts a pulled request as a prefix-cache hit,
        which needs nothing outside the blocks: the compressor rings restart from the ``csa_state``
        snapshot at the hit, the MTP carry from the ``mtp_state`` one, and the MTP windows move with
        the other groups' blocks."""
        assert self.model is not None
        # Each cache is [layers, blocks, ...]: one view per layer, writes land in the cache itself.
        return {name: list(cache.unbind(0)) for name, cache in self.model.caches.items()}

    def _slot(self, request_id: str, first_pos: int, hits: dict[str, int]) -> int:
        """The request's ring slot; a request new to the executor at ``first_pos > 0`` starts at a
        prefix-cache hit and is recorded in ``hits``."""
        slot = self.slots.get(request_id)
        if slot is not None:
            return slot
        if first_pos:
            hits[request_id] = first_pos
        if not self.free_slots:  # more live requests than max_num_seqs (e.g. preempted ones): grow
            old, self.num_slots = self.num_slots, self.num_slots * 2
            self.free_slots = list(range(self.num_slots - 1, old - 1, -1))
            assert self.model is not None
            for ring in self.model.rings.values():
                ring.grow(self.num_slots)
            self.carry = [torch.cat([c, c.new_zeros((self.num_slots - old, *c.shape[1:]))]) for c in self.carry]
        slot = self.free_slots.pop()
        self.slots[request_id] = slot
        return slot

    def release(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            slot = self.slots.pop(rid, None)
            if slot is not None:
                self.free_slots.append(slot)
            self.mtp_state.pop(rid, None)
            self.hit_starts.pop(rid, None)

    def weights_held(self) -> list[torch.Tensor]:
        """Every tensor of the weights this executor holds (stored-precision ones as their data and
        scales), not the caches or the RoPE tables."""
        assert self.model is not None
        m = self.model
        out = [m.embed, m.head, m.norm, *m.hc_head]
        for p in [*m.layers, *self.mtp_layers]:
            for v in p.values():
                if isinstance(v, QuantizedWeight):
                    out += v.tensors()
                elif isinstance(v, torch.Tensor):
                    out.append(v)
        return out

    def weight_bytes(self) -> int:
        """Bytes the weights hold in memory: each storage once (a tied head, fused views)."""
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in self.weights_held()}
        return sum(storages.values())

    def shutdown(self) -> None:
        if self.model is not None:
            self.model.caches.clear()
            self.model.rings.clear()
        self.carry = []
        self.model = None
        self._last = None

    # ------------------------------------------------------------------ execute

    @torch.inference_mode()
    def execute(self, batch: BatchInput) -> torch.Tensor:
        """One forward step. Per-request shapes come from the batch's host lists: no device read."""
        assert self.model is not None
        starts = [int(x) for x in batch.query_start_loc_host]
        # A request's first row sits at its cached length minus this step's rows.
        pos0 = [int(batch.seq_lens_host[r]) - (b - a) if a < b else 0 for r, (a, b) in enumerate(pairwise(starts))]
        for r, rid in enumerate(batch.request_ids):
            if pos0[r] == 0 and starts[r] < starts[r + 1]:
                # A request (re)starting from scratch: drop anything left from an earlier life.
                self.mtp_state.pop(rid, None)
        hits: dict[str, int] = {}
        slots = [self._slot(rid, pos0[r], hits) for r, rid in enumerate(batch.request_ids)]
        if hits:
            self.hit_starts.update(hits)
            rows = {r: (slots[r], pos0[r]) for r, rid in enumerate(batch.request_ids) if rid in hits}
            if STATE_GROUP in batch.block_tables:
                self.model.restore_compressor_state(rows, batch.block_tables[STATE_GROUP])
        seg = Segments(
            starts=starts,
            pos0=pos0,
            positions=batch.positions,
            input_ids=batch.input_ids,
            block_tables={k: v.long() for k, v in batch.block_tables.items()},
            ring_slots=slots,
        )
        if self.lora is not None:
            self.lora.onehot = self._lora_onehot(batch)
        streams = self.model.forward(seg)
        self._last = (batch, seg, streams)
        return self.model.logits(streams[batch.logits_indices])

    # ------------------------------------------------------------------ MTP

    def propose_drafts(self, batch: BatchInput, accepted: list[list[int]]) -> list[list[int]]:
        """Up to ``num_draft`` argmax drafts per sampling request (see :meth:`_propose`)."""
        return self._propose(batch, accepted, None)

    def propose_sampled_drafts(
        self, batch: BatchInput, accepted: list[list[int]], sampler: DraftSampler
    ) -> list[list[int]]:
        """Up to ``num_draft`` drafts per sampling request, each depth's chosen by ``sampler``."""
        return self._propose(batch, accepted, sampler)

    @torch.inference_mode()
    def _propose(self, batch: BatchInput, accepted: list[list[int]], sampler: DraftSampler | None) -> list[list[int]]:
        """Every depth runs once over all requests, its inputs gathered with one index tensor; the
        tokens stay on the device and the host reads them once, at the end (:func:`read_drafts`)."""
        if not self.use_mtp or self._last is None or self._last[0] is not batch:
            return [[] for _ in batch.request_ids]
        _, seg, streams = self._last
        assert seg.ring_slots is not None
        work, rows = self._commit(batch, seg, accepted)
        cap = self.num_draft if batch.draft_depth is None else max(0, min(self.num_draft, batch.draft_depth))
        for st, _ in work.values():
            st.active = min(st.active, cap)
        step = _Drafting(work, seg.ring_slots, fresh=[streams], fresh_rows=[rows], sampler=sampler)
        _plan_depths(step, batch.num_drafts, self.cfg.sliding_window, self.hit_unit)
        for d in range(max((st.active for st, _ in work.values()), default=0)):
            ran = self._draft_depth(d, step, batch)
            self._carry(d, step)
            if not ran:
                break
        for st, _ in step.work.values():
            low = min(st.frontier[: st.active]) if st.active else st.n
            st.tokens = {i: t for i, t in st.tokens.items() if i >= low}
        return step.result(len(batch.request_ids), self.device)

    def _commit(
        self, batch: BatchInput, seg: Segments, accepted: list[list[int]]
    ) -> tuple[dict[int, tuple[MtpState, bool]], dict[int, tuple[int, int, int]]]:
        """Record this step's committed tokens; returns the requests to draft for (batch row ->
        (state, whether it sampled this step)) and where their committed main-model streams sit
        (batch row -> (first position, first row, count)).

        A row that sampled but comes with no accepted tokens is one the worker does not draft for
        (the policy never gives that request drafts, ``pypto_serving.speculative.drafts_for``): its
        state goes and no MTP depth runs for it again, so it costs no drafting work; with no such
        row left, :meth:`_propose` runs no MTP forward at all."""
        k = self.num_draft
        work: dict[int, tuple[MtpState, bool]] = {}
        rows: dict[int, tuple[int, int, int]] = {}
        ids = batch.input_ids_host
        restore: list[tuple[int, MtpState]] = []
        for r, rid in enumerate(batch.request_ids):
            a, b = seg.rows(r)
            if a == b:
                continue
            s = seg.pos0[r]
            st = self.mtp_state.get(rid)
            if s == 0 or (st is None and self.hit_starts.get(rid) == s):
                st = MtpState(k, origin=s)  # a fresh request, or one starting at a prefix-cache hit
                if s:
                    restore.append((r, st))
            elif st is None or st.hv != s:
                # State lost or out of step (should not happen): stop drafting for this request rather
                # than risk drafts from stale state; verification keeps the output exact regardless.
                self.mtp_state.pop(rid, None)
                continue
            acc = accepted[r] if r < len(accepted) else []
            sampling = batch.num_logits[r] > 0
            if sampling and not acc:
                self.mtp_state.pop(rid, None)
                continue
            valid = (b - a) - (batch.num_logits[r] - len(acc)) if sampling else b - a
            for j in range(valid):
                st.tokens[s + j] = int(ids[a + j])
            rows[r] = (s, a, valid)
            st.hv = s + valid
            if sampling:
                st.n = s + valid
                st.tokens[st.n] = int(acc[-1])
            else:
                st.n = s + valid - 1
            self.mtp_state[rid] = st
            work[r] = (st, sampling)
        self._restore_mtp(restore, seg)
        return work, rows

    def _restore_mtp(self, starts: list[tuple[int, MtpState]], seg: Segments) -> None:
        """Start the MTP state of requests at a prefix-cache hit ``p`` from the cache: depth ``d``'s
        KV before ``p - d - 1`` is in its cached window blocks, its input at ``p - d - 1`` in the
        ``mtp_state`` snapshot ending at ``p`` (copied to its carry ring, one gather per depth); it
        computes from ``p - d - 1`` on, so every depth drafts exactly from the first step."""
        unit = self.hit_unit
        starts = [(r, st) for r, st in starts if unit and st.origin % unit == 0 and st.origin > st.depth]
        if not starts or MTP_STATE_GROUP not in seg.block_tables:
            return
        assert seg.ring_slots is not None and self.model is not None
        dev = self.device
        req = upload([r for r, _ in starts], dev)
        index = upload([st.origin // self.hit_unit - 1 for _, st in starts], dev)
        blocks = seg.block_tables[MTP_STATE_GROUP][req, index].long()
        snaps = self.model.caches[MTP_STATE_GROUP]
        for d in range(self.num_draft):
            rows = [seg.ring_slots[r] * CARRY_LEN + (st.origin - d - 1) % CARRY_LEN for r, st in starts]
            flat = self.carry[d].view(-1, *self.carry[d].shape[2:])
            flat.index_copy_(0, upload(rows, dev), snaps[d].index_select(0, blocks).to(flat.dtype))
        for _, st in starts:
            st.restored = True
            st.frontier = [st.origin - d - 1 for d in range(st.depth)]
            st.carried = [(st.origin - d - 1, st.origin - d - 1) for d in range(st.depth)]

    def _draft_depth(self, d: int, step: _Drafting, batch: BatchInput) -> bool:
        """Run MTP depth ``d`` over every request's pending positions at once; False when none has any."""
        rows = self._depth_inputs(d, step, batch)
        if not rows.spans:
            return False
        tok = rows.tokens(step, self.device)
        out = self._run_mtp(d, rows.spans, rows.hidden(step.fresh[d], self.carry[d]), tok, rows.pos)
        off = 0
        picks: list[int] = []  # output rows whose next token is a draft
        pick_rows: list[int] = []  # the batch row each of them drafts for
        made: dict[int, tuple[int, int, int]] = {}
        for r, c, last in rows.spans:
            st = step.work[r][0]
            made[r] = (c, off, last - c + 1)
            if step.drafts_at(r, d):
                step.refs[r].append(step.count + len(picks))
                picks.append(off + last - c)
                pick_rows.append(r)
            off += last - c + 1
            st.frontier[d] = max(c, st.n - d, 0)
        step.fresh.append(out)
        step.fresh_rows.append(made)
        if picks:
            sel = out if picks == list(range(off)) else out.index_select(0, upload(picks, self.device))
            logits = self._mtp_logits(d, sel)
            step.add(argmax_rows(logits)[1] if step.sampler is None else step.sampler.pick(logits, pick_rows))
        return True

    def _carry(self, d: int, step: _Drafting) -> None:
        """Keep depth ``d``'s canonical inputs of this step that later steps still need (positions from
        its frontier on) in its carry ring, with one scatter over all requests."""
        if d >= len(step.fresh_rows):
            return
        src: list[int] = []
        dst: list[int] = []
        snaps: list[tuple[int, int, int]] = []  # (fresh row, batch row, mtp_state entry)
        for r, (p, row, n) in step.fresh_rows[d].items():
            st = step.work[r][0]
            if d >= st.active:
                continue
            hi = p + n - 1 if d == 0 else min(p + n - 1, st.n - d)
            snaps += [(row + i - p, r, (i + d + 1) // self.hit_unit - 1) for i in self._snapshot_at(d, st, p, hi)]
            lo = max(p, st.frontier[d], hi - CARRY_LEN + 1)
            if hi < lo:
                continue
            src += range(row + lo - p, row + hi - p + 1)
            dst += [step.slots[r] * CARRY_LEN + i % CARRY_LEN for i in range(lo, hi + 1)]
            old_lo, old_hi = st.carried[d]
            joined = old_lo <= lo <= old_hi + 1
            top = max(hi, old_hi) if joined else hi
            st.carried[d] = (max(old_lo if joined else lo, top - CARRY_LEN + 1), top)
        if src:
            flat = self.carry[d].view(-1, *self.carry[d].shape[2:])
            dev = self.device
            picked = step.fresh[d].index_select(0, upload(src, dev))
            flat.index_copy_(0, upload(dst, dev), picked.to(flat.dtype))
        if snaps:
            self._write_snapshots(d, step.fresh[d], snaps)

    def _snapshot_at(self, d: int, st: MtpState, first: int, last: int) -> range:
        """Positions among ``[first, last]`` (depth ``d``'s canonical inputs of this step) whose input a
        hit at a later multiple ``E`` of the hit unit takes from ``mtp_state``: ``E - d - 1``."""
        unit = self.hit_unit
        if not unit or d >= st.active:
            return range(0)
        lo = max(first + d + 1, st.origin + 1)
        e0 = -(-lo // unit) * unit
        return range(e0 - d - 1, last + 1, unit)

    def _write_snapshots(self, d: int, fresh: torch.Tensor, snaps: list[tuple[int, int, int]]) -> None:
        """Write depth ``d``'s inputs ``(fresh row, batch row, entry)`` to the requests' ``mtp_state``
        entries, block ids gathered from the step's table on the device."""
        assert self._last is not None and self.model is not None
        table = self._last[1].block_tables.get(MTP_STATE_GROUP)
        if table is None:
            return
        dev = self.device
        req = upload([r for _, r, _ in snaps], dev)
        entry = upload([e for _, _, e in snaps], dev)
        rows = fresh.index_select(0, upload([i for i, _, _ in snaps], dev))
        cache = self.model.caches[MTP_STATE_GROUP][d]
        cache.index_copy_(0, table[req, entry].long(), rows.to(cache.dtype))

    def _depth_inputs(self, d: int, step: _Drafting, batch: BatchInput) -> _DepthInputs:
        """Host bookkeeping of depth ``d``: which positions each request (re)computes, where their
        input streams are and their tokens (committed ones by value, this step's drafts by reference)."""
        rows = _DepthInputs()
        for r, (st, sampling) in step.work.items():
            if d >= st.active:
                continue
            drafts = step.drafts_at(r, d)
            if sampling and not drafts and r not in step.catch_up:
                continue  # deferred: its inputs wait in the carry ring (see _plan_depths)
            c = step.starts[r][d]
            last = st.n - 1 if drafts else st.n - 1 - d
            if last < c:
                continue
            src = self._sources(d, step, r, st, c, last)
            toks = self._depth_tokens(d, st, step.refs[r], c, last)
            if src is None or toks is None:
                # Inconsistent bookkeeping (should not happen): stop drafting for this request
                # rather than guess; verification keeps the output exact regardless.
                step.work[r] = (st, False)
                step.refs[r] = []
                self.mtp_state.pop(batch.request_ids[r], None)
                continue
            rows.src += src
            rows.toks += toks
            rows.pos += range(c, last + 1)
            rows.spans.append((r, c, last))
        return rows

    @staticmethod
    def _sources(d: int, step: _Drafting, r: int, st: MtpState, c: int, last: int) -> list[int] | None:
        """Where request ``r``'s depth-``d`` inputs at ``[c, last]`` sit: fresh rows, or ``-1 - row`` of
        the carry ring; None when one is in neither."""
        p, row, n = step.fresh_rows[d].get(r, (0, 0, 0))
        lo, hi = st.carried[d]
        out: list[int] = []
        for i in range(c, last + 1):
            if p <= i < p + n:
                out.append(row + i - p)
            elif lo <= i <= hi:
                out.append(-1 - (step.slots[r] * CARRY_LEN + i % CARRY_LEN))
            else:
                return None
        return out

    @staticmethod
    def _depth_tokens(d: int, st: MtpState, refs: list[int], c: int, last: int) -> list[tuple[int, int]] | None:
        """Depth ``d``'s input tokens at ``[c, last]``: (committed token, -1) or (-1, draft reference);
        None when one is missing."""
        out: list[tuple[int, int]] = []
        for i in range(c, last + 1):
            t = i + d + 1
            j = t - st.n - 1  # index into this step's drafts when token t is not committed yet
            committed = st.tokens.get(t, -2) if t <= st.n else -1
            ref = refs[j] if committed == -1 and j < len(refs) else -1
            if committed == -2 or (committed == -1 and ref < 0):
                return None
            out.append((committed, ref))
        return out

    def _run_mtp(
        self, d: int, rows: list[tuple[int, int, int]], hidden: torch.Tensor, tok: torch.Tensor, pos: list[int]
    ) -> torch.Tensor:
        """One MTP depth over the flat rows (``tok`` their input tokens, on the device); returns its
        output streams per row."""
        assert self.model is not None and self._last is not None
        m, cfg, seg = self.model, self.cfg, self._last[1]
        p = self.mtp_layers[min(d, len(self.mtp_layers) - 1)]
        group = f"mtp{d}"
        positions = upload(pos, self.device, torch.long)
        starts = [0]
        for _, c, last in rows:
            starts.append(starts[-1] + last - c + 1)
        bt = seg.block_tables[group].index_select(0, upload([r for r, _, _ in rows], self.device))
        mseg = Segments(
            starts=starts,
            pos0=[c for _, c, _ in rows],
            positions=positions,
            input_ids=tok,
            block_tables={group: bt},
        )
        e = ops.rms_norm(m.embed_tokens(tok), p["enorm.weight"], cfg.rms_norm_eps)
        h = ops.rms_norm(hidden, p["hnorm.weight"], cfg.rms_norm_eps)
        x = linear(e, p["e_proj.weight"]).unsqueeze(1) + linear(h, p["h_proj.weight"])
        # An MTP block is a sliding layer: it only reads the main RoPE table.
        inv, scaling = m.inv_freq["main"]
        rope = {"main": interleaved_rope_cos_sin(positions, inv, scaling)}
        with record_function(f"layer mtp{d}"):
            return m.decoder_layer(p, x, mseg, rope, layer=-1, kind=SLIDING, swa=m.caches[group][0], swa_group=group)

    def _mtp_logits(self, d: int, streams: torch.Tensor) -> torch.Tensor:
        """Depth ``d``'s logits of the rows that draft a token."""
        assert self.model is not None
        p = self.mtp_layers[min(d, len(self.mtp_layers) - 1)]
        return self.model.logits(
            streams, hc=(p["hc_head_fn"], p["hc_head_base"], p["hc_head_scale"]), norm=p["norm.weight"]
        )


def _plan_depths(step: _Drafting, num_drafts: list[int] | None, window: int, unit: int = 0) -> None:
    """Which depths each request runs this step (``step.want``, ``step.catch_up``), and from which
    position (``step.starts``, see :func:`_first_positions`).

    A sampling request runs the depths of the drafts it proposes (``BatchInput.num_drafts``, within
    its active depths); the others it defers: they run nothing for it, its frontier there stays, and
    the inputs they will need stay in the carry ring, which holds ``CARRY_LEN`` positions a depth.
    Once a deferred depth's frontier is about to fall out of the ring, the request catches up: every
    active depth runs over its canonical positions (no draft, no head), so no depth's MTP KV ever has
    a hole, and the request drafts exactly whenever it is asked to again. Rows that did not sample
    (prefill chunks) run every active depth over their canonical positions, as ever."""
    for r, (st, sampling) in step.work.items():
        n = -1 if num_drafts is None or r >= len(num_drafts) else num_drafts[r]
        exact = st.exact_depths(window)
        want = min(st.active if n < 0 else n, exact)
        step.want[r] = want
        # A request still rebuilding its MTP KV after a prefix-cache hit (exact < active) runs every
        # depth, like a catch-up, and drafts only from the exact ones.
        behind = st.n - min(st.frontier[: st.active], default=st.n) >= CARRY_LEN - st.active
        if sampling and want < st.active and (exact < st.active or behind):
            step.catch_up.add(r)
        # Per depth: the last position whose output it needs now (a draft's), -1 when deferred.
        last = [st.n - 1 if sampling and d < want else st.n - d for d in range(st.active)]
        if sampling and r not in step.catch_up:
            last = [x if d < want else -1 for d, x in enumerate(last)]
        step.starts[r] = _first_positions(st, last, window, unit)


def _first_positions(st: MtpState, last: list[int], window: int, unit: int = 0) -> list[int]:
    """Per depth, the first position a request's run computes: its frontier, or later where nothing
    reads the positions before. An MTP block is a sliding layer: its KV at a position depends on that
    position's input only, and its output at ``j`` reads its KV at ``(j - window, j]``. So depth ``d``
    needs KV from ``(q - window`` on, ``q`` being the lowest of: the first position its later queries
    take (its next frontier, ``n - d``), the position of the draft it picks now (``last[d]``, -1: the
    depth is deferred), and where the next depth's inputs start (its run's start, or, deferred, its
    frontier). A long prefill thus runs each depth over its last positions only, and with prefix
    caching (``unit``: the hit unit) also over what a later hit at a multiple ``E`` of it reads: the
    KV before ``E - d - 1`` in the window and the output at ``E - d - 2`` (the next depth's input
    that ``mtp_state`` snapshots), once the tokens before ``E`` are known."""
    starts = list(st.frontier)
    need = st.n  # the first position whose output the next depth reads (none past the last depth)
    for d in reversed(range(st.active)):
        if last[d] < 0:
            need = st.frontier[d]
            continue
        q = min(st.n - d, last[d], need)
        if unit:
            e = max(unit, -(-(st.frontier[d] + d + 2) // unit) * unit)  # the first hit still to serve
            if e <= st.n + 1:
                q = min(q, e - d - 2)
        starts[d] = need = max(st.frontier[d], q - window + 1)
    return starts


def make_executor(settings: Any) -> DeepseekMTPExecutor:
    return DeepseekMTPExecutor(settings)
