"""A decode step's decoder layers in one native call (``csrc/decode_layers.c``).

The eager CPU forward calls nine kernels per decoder layer from Python (two RMSNorms, four products
over the native column panels, the q/k norm + RoPE + cache write, paged attention, SwiGLU). At one
row each call's own C is a few to a few tens of microseconds, and the Python around it (argument
checks, tensors made for the outputs, the registry's dispatch) cost about as much again: on
Qwen3-0.6B about 8 ms of a 38-46 ms token on the Zen 4 EPYC of docs/benchmarks.md. A
:class:`NativeDecoder` holds every layer's weight and cache pointers, prepared once, and runs a
decode step's layers as one C call that calls the same kernels with the same arguments, so its
hidden states are the eager forward's bit for bit (tested) at a fraction of the overhead.

It takes what the eager forward would run natively end to end: float32 or bfloat16 weights packed as
panels (:func:`pypto_kernels.pack_linear`, ``panels``) serving every row count, or in place of a
layer's MLP a mixture of experts' routed block (:class:`RoutedExperts`, the eager forward's
:func:`pypto_kernels.routed_moe` as one native call; plain experts within the grouped GEMV's row limit,
:meth:`NativeDecoder.takes_rows`), caches of
:data:`pypto_kernels.native.NATIVE_DTYPES`, no sinks, value heads as wide as the keys; and steps whose
requests each have at most :data:`MAX_QUERIES` query rows (decode steps, speculative verification),
which the eager attention attends row by row. The model keeps its eager forward for the rest.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from . import native
from .attention import NATIVE_MAX_QUERIES
from .dense import NEVER, PackedLinearWeight

__all__ = ["MAX_QUERIES", "DecoderLayerWeights", "GreedyTail", "NativeDecoder", "RoutedExperts", "SampledRun"]

#: Most query rows of one request a step may give :meth:`NativeDecoder.run`: the runs the eager
#: attention attends row by row (longer prefill chunks take the native prefill kernel, which sums in
#: another order).
MAX_QUERIES = NATIVE_MAX_QUERIES

_PTR = ctypes.c_void_p
_I64 = ctypes.c_int64


class _Layer(ctypes.Structure):
    """``DecoderLayer`` of ``csrc/decode_layers.c``."""

    _fields_ = [
        ("input_norm", _PTR), ("post_norm", _PTR), ("qkv", _PTR), ("qkv_bias", _PTR), ("q_norm", _PTR),
        ("k_norm", _PTR), ("o", _PTR), ("gate_up", _PTR), ("down", _PTR), ("router", _PTR),
        ("experts_gate_up", _PTR), ("experts_down", _PTR), ("expert_strides", _I64 * 2), ("expert_panels", _I64),
        ("key_cache", _PTR),
        ("value_cache", _PTR), ("k_strides", _I64 * 3), ("v_strides", _I64 * 3), ("window", _I64),
    ]  # fmt: skip


class _Shape(ctypes.Structure):
    """``DecoderShape`` of ``csrc/decode_layers.c``."""

    _fields_ = [
        ("kind", ctypes.c_int), ("cache_kind", ctypes.c_int), ("bf16_dot", ctypes.c_int), ("hidden", _I64),
        ("heads", _I64), ("kv_heads", _I64), ("head_dim", _I64), ("inter", _I64), ("rotary", _I64),
        ("block_size", _I64), ("num_slots", _I64), ("eps", ctypes.c_float), ("scale", ctypes.c_float),
        ("experts", _I64), ("top_k", _I64), ("moe_inter", _I64), ("norm_topk", ctypes.c_int),
    ]  # fmt: skip


@dataclass(frozen=True, slots=True)
class RoutedExperts:
    """A mixture of experts' routed block, in place of a layer's dense MLP, as
    :func:`pypto_kernels.routed_moe` takes it (:func:`pypto_kernels.native.moe_block` runs it).

    :param router: ``[experts, hidden]``, dense.
    :param gate_up: ``[experts, 2 inter, hidden]``; ``down`` ``[experts, hidden, inter]``; plain with
        rows dense, or both panels (:func:`pypto_kernels.native.pack_experts`).
    :param top_k: experts a token is routed to; ``norm_topk_prob`` whether their weights are divided
        by their sum.
    """

    router: torch.Tensor
    gate_up: torch.Tensor | native.PackedExperts
    down: torch.Tensor | native.PackedExperts
    top_k: int
    norm_topk_prob: bool


@dataclass(frozen=True, slots=True)
class DecoderLayerWeights:
    """One decoder layer as the eager forward runs it.

    :param input_norm: ``[hidden]`` RMSNorm weight before attention; ``post_norm`` the one before the MLP.
    :param qkv: the fused q/k/v projection ``[(heads + 2 kv_heads) head_dim, hidden]``, panels.
    :param qkv_bias: its bias or None.
    :param q_norm: ``[head_dim]`` per-head RMSNorm weights of q and k (Qwen3), or both None.
    :param o: the output projection ``[hidden, heads head_dim]``; ``gate_up`` ``[2 inter, hidden]``;
        ``down`` ``[hidden, inter]``: panels, no bias; None both where ``experts`` is given.
    :param key_cache: ``[blocks, block_size, kv_heads, head_dim]``; ``value_cache`` the same.
    :param window: the sliding window in keys, or None.
    :param experts: a mixture of experts' routed block in place of the dense MLP, or None.
    """

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: PackedLinearWeight
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: PackedLinearWeight
    gate_up: PackedLinearWeight | None
    down: PackedLinearWeight | None
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    window: int | None
    experts: RoutedExperts | None = None


@dataclass(frozen=True, slots=True)
class GreedyTail:
    """What :meth:`NativeDecoder.greedy_run` reads around the layers, of the layers' dtype.

    :param embed: ``[vocab, hidden]`` token embeddings, rows dense.
    :param norm: ``[hidden]`` the final RMSNorm's weight; ``eps`` its epsilon.
    :param head: the output projection's panels copy (:func:`pypto_kernels.pack_linear`, library
        ``panels``) serving one row, of ``vocab' <= vocab`` outputs and ``hidden`` inputs: the product
        a one-row step's logits take in the eager forward too, summed as in any batch.
    :param cos: ``[positions, rotary_dim]`` RoPE tables (rows dense), ``sin`` the same, covering every
        position of the run.
    """

    embed: torch.Tensor
    norm: torch.Tensor
    eps: float
    head: PackedLinearWeight
    cos: torch.Tensor
    sin: torch.Tensor


@dataclass(frozen=True, slots=True)
class SampledRun:
    """A sampled request's draw for :meth:`NativeDecoder.greedy_run`: each forward's token drawn from
    its stored logits by :func:`pypto_kernels.native.sample_rows`' rule, with the uniform
    ``pypto_serving.sampler.uniforms`` gives ``(seed, first_index + the forward's number)``: the
    sampler's draw of the request's next output, bit for bit.

    :param temperature: > 0; ``top_k`` (0: none), ``top_p`` (1: none), ``min_p`` (0: none) as the
        sampler takes them.
    :param seed: the request's seed; ``first_index`` the output index the run's first forward samples.
    """

    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int
    first_index: int


class _Draw(ctypes.Structure):
    """``SampledRun`` of ``csrc/decode_layers.c``."""

    _fields_ = [
        ("temperature", ctypes.c_float), ("top_p", ctypes.c_float), ("min_p", ctypes.c_float), ("top_k", _I64),
        ("seed", _I64), ("index", _I64), ("logits", _PTR),
    ]  # fmt: skip


class _Tail(ctypes.Structure):
    """``GreedyTail`` of ``csrc/decode_layers.c``."""

    _fields_ = [
        ("embed", _PTR), ("norm", _PTR), ("head", _PTR), ("embed_stride", _I64), ("head_rows", _I64),
        ("cos", _PTR), ("sin", _PTR), ("cos_stride", _I64), ("eps", ctypes.c_float),
    ]  # fmt: skip


class _GreedyBuffers(ctypes.Structure):
    """``GreedyBuffers`` of ``csrc/decode_layers.c``: the rows one :meth:`NativeDecoder.greedy_run`
    writes, made once and kept (``held``) while the decoder is."""

    _fields_ = [("hidden", _PTR), ("residual", _PTR), ("normed", _PTR), ("summed", _PTR)]

    def __init__(self, dtype: torch.dtype, hidden: int) -> None:
        self.held = [torch.empty(hidden, dtype=dtype) for _ in range(4)]
        super().__init__(*(t.data_ptr() for t in self.held))


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _check_panels(name: str, weight: PackedLinearWeight, dtype: torch.dtype, shape: tuple[int, int]) -> None:
    # A held plain matrix would take the one-row GEMV in the eager forward: another summation order.
    serves_all = weight.min_rows <= 1 and weight.max_rows >= NEVER and weight.weight is None
    if weight.library != "panels" or weight.dtype != dtype or not serves_all:
        what = f"{weight.library} {weight.dtype}"
        raise ValueError(f"{name}: the {what} weight is not a {dtype} panels copy serving every row count")
    packed = weight.packed
    inputs = packed.shape[1] * (2 if dtype == torch.bfloat16 else 1)
    if (weight.out_features, inputs) != shape or not packed.is_contiguous():
        raise ValueError(f"{name}: panels of {(weight.out_features, inputs)}, expected {shape}")


def _mlp_widths(layers: Sequence[DecoderLayerWeights], dtype: torch.dtype) -> tuple[int, tuple[int, int, int, int]]:
    """The dense MLPs' width (0: none) and the routed blocks' experts, top-k, width and
    ``norm_topk_prob`` (zeros: none), each the same in every layer of its kind."""
    pairs = 2 if dtype == torch.bfloat16 else 1
    dense = {w.down.packed.shape[1] * pairs for w in layers if w.down is not None}
    routed = {(e.router.shape[0], e.top_k, e.down.shape[-1], int(e.norm_topk_prob)) for e in _experts(layers)}
    if len(dense) > 1 or len(routed) > 1:
        raise ValueError(f"MLPs of several shapes: dense widths {sorted(dense)}, routed blocks {sorted(routed)}")
    widths = routed.pop() if routed else (0, 0, 0, 0)
    if widths[0] and not 0 < widths[1] <= widths[0]:
        raise ValueError(f"top_k {widths[1]} of {widths[0]} experts")
    return (dense.pop() if dense else 0), widths


def _experts(layers: Sequence[DecoderLayerWeights]) -> list[RoutedExperts]:
    return [w.experts for w in layers if w.experts is not None]


def _check_vector(name: str, t: torch.Tensor | None, dtype: torch.dtype, size: int) -> None:
    if t is not None and (t.dtype != dtype or t.shape != (size,) or t.stride(0) != 1 or t.device.type != "cpu"):
        raise ValueError(f"{name}: {t.dtype} {tuple(t.shape)}, expected a dense {dtype} [{size}]")


class NativeDecoder:
    """A model's decoder layers (dense, or some of them a mixture of experts'), run for a decode (or
    verification) step by one call of ``csrc/decode_layers.c``.

    :param layers: every layer's weights and caches, in order.
    :param heads: query heads; ``kv_heads`` key/value heads; ``head_dim`` their width.
    :param rotary_dim: values of each head rotated (the cos/sin rows' width).
    :param eps: every RMSNorm's epsilon; ``scale`` attention's score scale.
    :raises ValueError: a layer the eager forward would not run natively end to end (the message says
        which and why), or the native kernels are not built.
    """

    def __init__(
        self,
        layers: Sequence[DecoderLayerWeights],
        *,
        heads: int,
        kv_heads: int,
        head_dim: int,
        rotary_dim: int,
        eps: float,
        scale: float,
    ) -> None:
        if native.library() is None:
            raise ValueError("the native CPU kernels are not built")
        if not layers:
            raise ValueError("no layers")
        first = layers[0]
        dtype, cache_dtype = first.input_norm.dtype, first.key_cache.dtype
        if dtype not in native.NATIVE_DTYPES or cache_dtype not in native.NATIVE_DTYPES:
            raise ValueError(f"{dtype} weights over a {cache_dtype} cache are not native dtypes")
        if not 0 < head_dim <= native.MAX_HEAD_DIM or rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
            raise ValueError(f"head_dim {head_dim} with rotary_dim {rotary_dim} is not taken")
        hidden, (inter, routed) = first.input_norm.shape[0], _mlp_widths(layers, dtype)
        self._dtype, self._cache_dtype = dtype, cache_dtype
        self._hidden, self._rotary = hidden, rotary_dim
        blocks, block_size = first.key_cache.shape[:2]
        cache_shape = (blocks, block_size, kv_heads, head_dim)
        self._layers = (_Layer * len(layers))(
            *(self._layer(i, w, (heads, kv_heads, head_dim, inter), cache_shape) for i, w in enumerate(layers))
        )
        # The eager attention reads a bfloat16 query as it is where the bf16 dot product applies.
        bf16_dot = dtype == cache_dtype == torch.bfloat16 and head_dim % 32 == 0 and native.bf16_dot_available()
        self._shape = _Shape(
            native.NATIVE_DTYPES[dtype], native.NATIVE_DTYPES[cache_dtype], int(bf16_dot), hidden, heads, kv_heads,
            head_dim, inter, rotary_dim, block_size, blocks * block_size, eps, scale, *routed,
        )  # fmt: skip
        self._held = list(layers)  # the pointers above stay valid while these are referenced
        # Panels serve every row count (the eager forward's routed_moe takes them at any): no limit.
        self._expert_panels = all(isinstance(e.gate_up, native.PackedExperts) for e in _experts(layers))
        self._scratch = torch.empty(0, dtype=torch.uint8)
        self._greedy: _GreedyBuffers | None = None  # greedy_run's buffers, made at its first call
        self._logits: torch.Tensor | None = None  # a sampled greedy_run's logits row

    def _layer(
        self, index: int, w: DecoderLayerWeights, widths: tuple[int, int, int, int], cache_shape: tuple[int, ...]
    ) -> _Layer:
        """The C description of layer ``index``; ``widths``: heads, KV heads, head dim, MLP width."""
        (heads, kv_heads, d, inter), dtype, hidden, name = widths, self._dtype, self._hidden, f"layer {index}"
        for vector, size in ((w.input_norm, hidden), (w.post_norm, hidden), (w.q_norm, d), (w.k_norm, d)):
            _check_vector(name, vector, dtype, size)
        if (w.q_norm is None) != (w.k_norm is None):
            raise ValueError(f"{name}: q and k norms must both be given or both be None")
        qkv = (heads + 2 * kv_heads) * d
        _check_vector(name, w.qkv_bias, dtype, qkv)
        _check_panels(f"{name} qkv", w.qkv, dtype, (qkv, hidden))
        _check_panels(f"{name} o", w.o, dtype, (hidden, heads * d))
        for cache in (w.key_cache, w.value_cache):
            dense = cache.device.type == "cpu" and cache.dim() == 4 and cache.stride(-1) == 1
            if not dense or cache.dtype != self._cache_dtype or cache.shape != cache_shape:
                got = f"{cache.dtype} {tuple(cache.shape)}"
                raise ValueError(f"{name}: cache {got} is not {self._cache_dtype} {cache_shape}, dense heads")
        return _Layer(
            w.input_norm.data_ptr(), w.post_norm.data_ptr(), w.qkv.packed.data_ptr(), _ptr(w.qkv_bias),
            _ptr(w.q_norm), _ptr(w.k_norm), w.o.packed.data_ptr(), *self._mlp(name, w, inter),
            w.key_cache.data_ptr(), w.value_cache.data_ptr(), (_I64 * 3)(*w.key_cache.stride()[:3]),
            (_I64 * 3)(*w.value_cache.stride()[:3]), w.window or 0,
        )  # fmt: skip

    def _mlp(self, name: str, w: DecoderLayerWeights, inter: int) -> tuple[object, ...]:
        """The C layer's dense panels, router, experts and expert strides, checked."""
        dtype, hidden, e = self._dtype, self._hidden, w.experts
        if e is None:
            if w.gate_up is None or w.down is None:
                raise ValueError(f"{name}: neither a dense MLP nor routed experts")
            _check_panels(f"{name} gate_up", w.gate_up, dtype, (2 * inter, hidden))
            _check_panels(f"{name} down", w.down, dtype, (hidden, inter))
            return w.gate_up.packed.data_ptr(), w.down.packed.data_ptr(), None, None, None, (_I64 * 2)(0, 0), 0
        if w.gate_up is not None or w.down is not None:
            raise ValueError(f"{name}: both a dense MLP and routed experts")
        if not native.moe_block_takes(torch.empty(1, hidden, dtype=dtype), e.router, e.gate_up, e.down):
            what = f"{e.router.dtype} router {tuple(e.router.shape)}, experts {tuple(e.gate_up.shape)}"
            raise ValueError(f"{name}: the native MoE block does not take the {what} / {tuple(e.down.shape)}")
        (g, gs, panels), (d, ds, _) = native.expert_operands(e.gate_up), native.expert_operands(e.down)
        return None, None, e.router.data_ptr(), g, d, (_I64 * 2)(gs, ds), int(panels)

    def takes_rows(self, rows: int) -> bool:
        """Whether :meth:`run` takes a step of ``rows`` rows: every one where the layers are dense or
        their routed experts are panels; with plain experts, those whose routes the eager forward's
        :func:`pypto_kernels.routed_moe` runs natively too
        (:data:`pypto_kernels.native.MOE_ROUTES_PER_EXPERT`), so that both give the same bits."""
        experts, top_k, packed = self._shape.experts, self._shape.top_k, self._expert_panels
        return not experts or packed or rows * top_k <= native.MOE_ROUTES_PER_EXPERT[self._dtype] * experts

    def run(
        self,
        hidden: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor],
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        query_lens: Sequence[int],
        seq_lens: Sequence[int],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every layer over a step whose requests each have at most :data:`MAX_QUERIES` query rows (a
        decode step, or one verifying drafted tokens): the rows of ``hidden`` are request 0's, then
        request 1's, ...; request ``r``'s ``query_lens[r]`` rows are the last of its ``seq_lens[r]`` keys.

        :param hidden: ``[T, hidden]`` embeddings of the weights' dtype.
        :param rotary: cos and sin ``[T, rotary_dim]`` of that dtype, one layout.
        :param slot_mapping: ``[T]`` cache slots of the rows' keys and values.
        :param block_tables: ``[R, max_blocks]``, each request's keys within its table.
        :param query_lens: ``R`` host counts (1 to :data:`MAX_QUERIES` each, summing to ``T``);
            ``seq_lens``: ``R`` host key counts.
        :return: ``(hidden, residual)`` of the last layer (new tensors; their sum is the final hidden state).
        :raises ValueError: inputs of other shapes, dtypes or lengths; IndexError: a slot outside the
            caches (nothing is written).
        """
        t, (cos, sin) = hidden.shape[0], rotary
        if hidden.dtype != self._dtype or hidden.shape != (t, self._hidden) or hidden.device.type != "cpu":
            raise ValueError(f"hidden {hidden.dtype} {tuple(hidden.shape)} is not {self._dtype} [T, {self._hidden}]")
        if cos.dtype != self._dtype or cos.shape != (t, self._rotary) or cos.stride(1) != 1:
            want = f"{self._dtype} [{t}, {self._rotary}]"
            raise ValueError(f"cos {cos.dtype} {tuple(cos.shape)} is not {want} with dense rows")
        if sin.shape != cos.shape or sin.stride() != cos.stride() or sin.dtype != cos.dtype:
            raise ValueError(f"sin {tuple(sin.shape)} must have cos's shape, strides and dtype")
        if not self.takes_rows(t):
            raise ValueError(f"{t} rows route more tokens to the experts than the native block takes")
        slots, tables = slot_mapping.to(torch.int64).contiguous(), block_tables.to(torch.int64).contiguous()
        rows = self._rows(t, tables, query_lens, seq_lens)
        if slots.shape != (t,):
            raise ValueError(f"{t} rows need [{t}] slots, got {tuple(slots.shape)}")
        out, residual = hidden.contiguous().clone(), torch.empty_like(hidden, memory_format=torch.contiguous_format)
        lib = native.library()  # looked up per call, as every native wrapper's (a benchmark swaps builds)
        if lib is None:
            raise RuntimeError("the native CPU kernels are not available (see the log)")
        if t == 0:
            return out, residual
        self._grow_scratch(lib, t)
        status = lib.pypto_decode_layers(
            self._layers, len(self._layers), ctypes.byref(self._shape), out.data_ptr(), residual.data_ptr(), t,
            cos.data_ptr(), sin.data_ptr(), cos.stride(0), slots.data_ptr(), tables.data_ptr(), tables.stride(0),
            rows[0].data_ptr(), rows[1].data_ptr(), self._scratch.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        self._check_status(status, "slot_mapping holds a slot")
        return out, residual

    def greedy_run(
        self,
        tail: GreedyTail,
        token: int,
        position: int,
        table: torch.Tensor,
        steps: int,
        stop: frozenset[int],
        interrupt: ctypes.c_int32 | None = None,
        seen: int = 0,
        draw: SampledRun | None = None,
    ) -> list[int]:
        """Up to ``steps`` decode forwards of one request back to back, each on the greedy token of the
        one before, in one C call (``pypto_greedy_run``: a token of a small model costs its engine a
        third again of its kernels' time otherwise, and the interpreter between the kernels 8 %).
        Each forward is the one a model runs a row at a time: the token's embedding row, :meth:`run`'s
        layers, the final RMSNorm over their output and residual (:func:`pypto_kernels.native.rms_norm`),
        the output projection's panels product of the row taking its maximum
        (:func:`pypto_kernels.native.panel_linear` with ``maxima``, no logits stored): the same kernels
        on the same values, so the tokens are those forwards', bit for bit (tested), and those the
        request gets in any batch.

        :param token: the request's last token, at ``position``; the run writes the keys and values
            of positions ``position`` to ``position + steps - 1``.
        :param table: ``[blocks]`` the request's block table, covering those positions.
        :param stop: tokens after which the run stops.
        :param interrupt: a 32-bit count another thread or process may move meanwhile: the run stops
            after any forward where it differs from ``seen``, the first too (read between forwards).
        :param draw: a sampled request's draw: each forward's product stores its logits (as the eager
            forward's does) and the token is drawn from them instead of their maximum's.
        :return: the tokens, one a forward: ``steps`` of them, fewer where one is in ``stop`` (the
            last), where ``interrupt`` moved, or where a forward's maximum logit is not finite
            (NaN or infinite: that forward's token is left out).
        :raises ValueError: tensors of other dtypes or shapes, or positions the table or the RoPE
            tables do not cover (nothing is run); IndexError: a table entry naming a block outside the
            caches (the forwards before it ran).
        """
        lib = native.library()
        if lib is None:
            raise RuntimeError("the native CPU kernels are not available (see the log)")
        table = table.to(torch.int64).contiguous()
        self._check_greedy(tail, token, position + steps, table)
        if self._greedy is None:
            self._greedy = _GreedyBuffers(self._dtype, self._hidden)
        self._grow_scratch(lib, 1)
        c_tail = _Tail(
            tail.embed.data_ptr(), tail.norm.data_ptr(), tail.head.packed.data_ptr(), tail.embed.stride(0),
            tail.head.out_features, tail.cos.data_ptr(), tail.sin.data_ptr(), tail.cos.stride(0), tail.eps,
        )  # fmt: skip
        stops = torch.tensor(sorted(stop), dtype=torch.int64)
        tokens, status = torch.empty(max(steps, 1), dtype=torch.int64), ctypes.c_int(0)
        c_draw = None
        if draw is not None:
            if self._logits is None or self._logits.numel() != tail.head.out_features:
                self._logits = torch.empty(tail.head.out_features, dtype=torch.float32)
            k = draw.top_k if 0 < draw.top_k < tail.head.out_features else 0
            logits = self._logits.data_ptr()
            c_draw = _Draw(draw.temperature, draw.top_p, draw.min_p, k, draw.seed, draw.first_index, logits)
        n = lib.pypto_greedy_run(
            self._layers, len(self._layers), ctypes.byref(self._shape), ctypes.byref(c_tail),
            ctypes.byref(self._greedy), table.data_ptr(), table.numel(), token, position, steps,
            stops.data_ptr(), stops.numel(), None if interrupt is None else ctypes.addressof(interrupt),
            ctypes.c_int32(seen), None if c_draw is None else ctypes.byref(c_draw), self._scratch.data_ptr(),
            tokens.data_ptr(), ctypes.byref(status),
            torch.get_num_threads(),
        )  # fmt: skip
        if status.value == -2:
            raise MemoryError("the output projection's panels product could not allocate its scratch")
        self._check_status(status.value, f"the table gives position {position + n} a slot")
        return tokens[:n].tolist()

    def _grow_scratch(self, lib: ctypes.CDLL, rows: int) -> None:
        """The scratch a decode call of ``rows`` rows needs, grown where smaller."""
        need = lib.pypto_decode_scratch_bytes(ctypes.byref(self._shape), rows)
        if self._scratch.numel() < need:
            self._scratch = torch.empty(need, dtype=torch.uint8)

    def _check_status(self, status: int, slot: str) -> None:
        """``pypto_decode_layers``' status as an exception (``slot``: what named the slot outside the caches)."""
        if status == 1:
            raise IndexError(f"{slot} outside the caches' {self._shape.num_slots}")
        if status != 0:
            raise MemoryError("the native paged attention could not allocate its per-thread scratch")

    def _check_greedy(self, tail: GreedyTail, token: int, end: int, table: torch.Tensor) -> None:
        """:meth:`greedy_run`'s inputs (positions below ``end``), or ValueError."""
        vocab, hidden, dtype = tail.embed.shape[0], self._hidden, self._dtype
        _check_vector("the final norm", tail.norm, dtype, hidden)
        m = tail.embed
        if m.dtype != dtype or m.dim() != 2 or m.stride(1) != 1 or m.device.type != "cpu" or m.shape[1] != hidden:
            raise ValueError(f"embed {m.dtype} {tuple(m.shape)} is not {dtype} [rows, {hidden}] with dense rows")
        head = tail.head
        if head.library != "panels" or head.dtype != dtype or not head.serves(1):
            what = f"{head.library} {head.dtype}"
            raise ValueError(f"the head's {what} copy is not a {dtype} panels copy serving one row")
        inputs = head.packed.shape[1] * (2 if dtype == torch.bfloat16 else 1)
        if inputs != hidden or not head.packed.is_contiguous() or not 0 < head.out_features <= vocab:
            raise ValueError(
                f"the head's panels of {(head.out_features, inputs)} are not [1..{vocab}, {hidden}] and contiguous"
            )
        for name, t in (("cos", tail.cos), ("sin", tail.sin)):
            if t.dtype != dtype or t.dim() != 2 or t.shape[1] != self._rotary or t.stride() != tail.cos.stride():
                raise ValueError(f"{name} {t.dtype} {tuple(t.shape)} is not {dtype} [positions, {self._rotary}]")
            if t.stride(1) != 1 or t.shape[0] < end:
                raise ValueError(f"{name} covers {t.shape[0]} positions with rows dense: the run needs {end}")
        if table.dim() != 1 or (end - 1) // self._shape.block_size >= table.numel():
            raise ValueError(f"a table of {tuple(table.shape)} blocks does not cover {end} positions")
        if not 0 <= token < vocab:
            raise ValueError(f"token {token} is outside the {vocab} embeddings")

    def _rows(self, t: int, tables: torch.Tensor, query_lens: Sequence[int], seq_lens: Sequence[int]) -> torch.Tensor:
        """int64 ``[2, T]``: each query row's request and the keys it sees (its position + 1), checked
        against the tables (the kernels read the blocks the lengths name)."""
        capacity = tables.shape[1] * self._shape.block_size if tables.dim() == 2 else 0
        if tables.dim() != 2 or tables.shape[0] != len(query_lens) or len(seq_lens) != len(query_lens):
            raise ValueError(f"{len(query_lens)} requests need as many lengths and [R, blocks] tables")
        requests: list[int] = []
        ends: list[int] = []
        for r, (n, seq) in enumerate(zip(query_lens, seq_lens, strict=True)):
            if not 1 <= n <= MAX_QUERIES or not n <= seq <= capacity:
                raise ValueError(f"request {r}: {n} queries over {seq} keys (1-{MAX_QUERIES}, within {capacity})")
            requests += [r] * n
            ends += range(seq - n + 1, seq + 1)
        if len(requests) != t:
            raise ValueError(f"query_lens sum to {len(requests)}, hidden has {t} rows")
        return torch.tensor([requests, ends], dtype=torch.int64)
