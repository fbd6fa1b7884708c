"""The native decoder (pypto_kernels.NativeDecoder): a decode step's decoder layers in one C call.

It calls the kernels the eager CPU forward calls one by one, with the same arguments, so the two are
compared bit for bit (logits and the K/V the steps wrote) on ragged decode steps between prefill and
mixed steps (which stay eager); its parity with transformers is the bfloat16 panels test's in
test_qwen_model.py, which runs its decode steps through it.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

import pypto_kernels as K
from pypto_serving import StepInterrupt
from pypto_serving_qwen.executor import QwenExecutor
from pypto_serving_qwen.model import QwenSparseMoe
from tests.plugins.qwen.qwen_fixtures import PagedBatchBuilder, qwen_settings, scheduled_chunks

pytestmark = pytest.mark.skipif(K.native.library() is None, reason="no native CPU kernels (no C compiler)")


def _executor(path: Path, dtype: str, **options: Any) -> QwenExecutor:
    ex = QwenExecutor(
        qwen_settings(path, dtype=dtype, max_num_seqs=4, executor_options={"cpu_linear": "panels", **options})
    )
    ex.load()
    ex.init_kv_cache({"kv": 64})
    return ex


@pytest.mark.parametrize(
    ("name", "dtype"),
    [
        ("qwen3", "float32"),
        ("qwen3", "bfloat16"),
        ("qwen2", "float32"),
        ("qwen2", "bfloat16"),
        ("qwen3_sliding", "float32"),
        ("qwen3_moe", "float32"),
        ("qwen3_moe", "bfloat16"),
        ("qwen3_moe_plain", "bfloat16"),
    ],
)
def test_native_decode_steps_equal_the_kernel_by_kernel_forward(
    name: str, dtype: str, qwen_checkpoints: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Qwen3 (q/k norms), Qwen2 (q/k/v biases, no norms), sliding-window layers and Qwen3-MoE (routed
    experts beside a dense layer; packed as panels, or left plain), float32 and bfloat16: every step's
    logits and the caches the steps wrote are bitwise those of the forward calling each kernel from
    Python; every step but the one with a prefill of more than 16 queries takes the native call, but
    with plain experts in bfloat16 the 17-row step (34 routes over 4 experts, past the grouped GEMV's 8
    an expert: torch's grouped GEMM runs it in either forward)."""
    plain = name == "qwen3_moe_plain"
    if plain:  # experts left as the CPUs whose projections are not panels keep them
        monkeypatch.setattr(QwenSparseMoe, "pack_experts", lambda self: False)
    path = qwen_checkpoints("qwen3_moe" if plain else name)
    native, eager = _executor(path, dtype), _executor(path, dtype, native_decoder=False)
    moe = [m for m in native.model.modules() if isinstance(m, QwenSparseMoe)] if native.model is not None else []
    assert all(isinstance(m.gate_up, K.native.PackedExperts) != plain for m in moe)
    assert len(moe) == (2 if "moe" in name else 0)
    gen = torch.Generator().manual_seed(3)
    prompts = {rid: torch.randint(4, 300, (n,), generator=gen).tolist() for rid, n in zip("abcd", (9, 3, 17, 5))}
    # A prefill of more than 16 queries (eager), ragged decodes, a short prompt joining decodes,
    # decodes of a subset, verification-like steps (a few queries a request, up to 16), decodes.
    schedule: list[list[tuple[str, int]]] = [[("a", 9), ("b", 3), ("c", 17)]]
    schedule += [[("a", 1), ("b", 1), ("c", 1)]] * 3 + [[("c", 1), ("d", 5), ("a", 1)]]
    schedule += [[("b", 1), ("d", 1)]] * 2 + [[("a", 3), ("b", 1), ("c", 4), ("d", 2)], [("b", 16), ("d", 1)]]
    schedule += [[("a", 1), ("b", 1), ("c", 1), ("d", 1)]] * 6
    builder = PagedBatchBuilder(block_size=4, num_blocks=64)
    for step, chunks in enumerate(scheduled_chunks(prompts, schedule, gen)):
        batch = builder.step(chunks)  # every row's logits
        ours, theirs = native.execute(batch), eager.execute(batch)
        assert torch.equal(ours, theirs), f"step {step}: max |diff| {float((ours - theirs).abs().max()):.3g}"
    short_steps = sum(all(n <= 16 for _, n in plan) for plan in schedule)
    assert short_steps == len(schedule) - 1 == 14
    assert native.graph_stats.native_decoder_steps == short_steps - plain  # plain: the [16 + 1]-row step
    assert eager.graph_stats.native_decoder_steps == 0
    for (k1, v1), (k2, v2) in zip(native.kv_caches, eager.kv_caches, strict=True):
        assert torch.equal(k1[1:], k2[1:]) and torch.equal(v1[1:], v2[1:])  # block 0 pads the tables


def test_native_decoder_refusals(qwen_checkpoints: Callable[[str], Path]) -> None:
    """Layers the eager forward would not run natively end to end are refused with the reason; bad
    step inputs are refused before any cache is written."""
    ex = _executor(qwen_checkpoints("qwen3"), "float32")
    model = ex.model
    assert model is not None
    builder = PagedBatchBuilder(block_size=4, num_blocks=64)
    ex.execute(builder.step([("a", [5, 6, 7])]))
    ex.execute(builder.step([("a", [8])]))
    decoder = model._native[1] if model._native is not None else None
    assert isinstance(decoder, K.NativeDecoder) and ex.graph_stats.native_decoder_steps == 2  # 3 queries, 1
    layer, cfg = decoder._held[0], ex.config
    assert cfg is not None
    onednn = K.pack_linear(layer.o.plain(), 4, library="onednn")
    assert onednn is not None
    shape: dict[str, Any] = {
        "heads": cfg.num_heads, "kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "rotary_dim": cfg.rotary_dim, "eps": cfg.rms_norm_eps, "scale": cfg.head_dim**-0.5,
    }  # fmt: skip
    with pytest.raises(ValueError, match=r"layer 0 o: the onednn torch\.float32 weight is not a torch\.float32 panels"):
        K.NativeDecoder([replace(layer, o=onednn)], **shape)
    with pytest.raises(ValueError, match=r"layer 0: cache torch\.bfloat16"):
        K.NativeDecoder([replace(layer, value_cache=layer.value_cache.bfloat16())], **shape)
    hidden = torch.zeros(1, layer.input_norm.shape[0])
    cos = sin = torch.zeros(1, cfg.rotary_dim)
    tables, slot = torch.zeros(1, 4, dtype=torch.int32), torch.zeros(1, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"hidden torch\.bfloat16"):
        decoder.run(hidden.bfloat16(), (cos, sin), slot, tables, [1], [1])
    with pytest.raises(ValueError, match=r"request 0: 1 queries over 17 keys \(1-16, within 16\)"):
        decoder.run(hidden, (cos, sin), slot, tables, [1], [17])  # past its table's 4 blocks of 4
    rows = 17
    with pytest.raises(ValueError, match="request 0: 17 queries"):
        decoder.run(hidden.expand(rows, -1), (cos.expand(rows, -1),) * 2, slot.expand(rows), tables, [rows], [rows])
    before = [c.clone() for c in model._native[0][0]]  # type: ignore[index]
    with pytest.raises(IndexError, match="slot_mapping holds a slot outside"):
        decoder.run(hidden, (cos, sin), torch.tensor([decoder._shape.num_slots]), tables, [1], [1])
    assert all(torch.equal(a, b) for a, b in zip(before, model._native[0][0], strict=True))  # type: ignore[index]


def test_native_decoder_option(qwen_checkpoints: Callable[[str], Path]) -> None:
    """``native_decoder`` takes true or false."""
    with pytest.raises(ValueError, match="native_decoder must be true or false"):
        _executor(qwen_checkpoints("qwen3"), "float32", native_decoder="yes")


def test_native_decoder_refuses_what_its_moe_block_does_not_run(qwen_checkpoints: Callable[[str], Path]) -> None:
    """Routed experts the native block does not take, a layer with both or neither MLP and MoE layers
    of different shapes are refused with the reason; with plain experts a step routing more than the
    grouped GEMV's limit (8 routes an expert in bfloat16) is refused by :meth:`run` and left to the
    eager forward, while experts packed as panels take every row count."""
    ex = _executor(qwen_checkpoints("qwen3_moe"), "bfloat16")
    builder = PagedBatchBuilder(block_size=4, num_blocks=64)
    ex.execute(builder.step([("a", [5, 6, 7])]))
    ex.execute(builder.step([("a", [8])]))
    assert ex.model is not None and ex.model._native is not None
    decoder, cfg = ex.model._native[1], ex.config
    assert isinstance(decoder, K.NativeDecoder) and cfg is not None and ex.graph_stats.native_decoder_steps == 2
    moe, dense = decoder._held[0], decoder._held[1]  # mlp_only_layers=[1]
    assert moe.experts is not None and dense.experts is None
    shape: dict[str, Any] = {
        "heads": cfg.num_heads, "kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "rotary_dim": cfg.rotary_dim, "eps": cfg.rms_norm_eps, "scale": cfg.head_dim**-0.5,
    }  # fmt: skip
    experts = moe.experts
    assert isinstance(experts.gate_up, K.native.PackedExperts) and isinstance(experts.down, K.native.PackedExperts)
    with pytest.raises(ValueError, match=r"layer 0: the native MoE block does not take the torch\.float32 router"):
        K.NativeDecoder([replace(moe, experts=replace(experts, router=experts.router.float()))], **shape)
    with pytest.raises(ValueError, match="layer 0: the native MoE block does not take"):  # one plain, one packed
        K.NativeDecoder([replace(moe, experts=replace(experts, down=experts.down.plain()))], **shape)
    with pytest.raises(ValueError, match="layer 0: both a dense MLP and routed experts"):
        K.NativeDecoder([replace(moe, gate_up=dense.gate_up, down=dense.down)], **shape)
    with pytest.raises(ValueError, match="layer 0: neither a dense MLP nor routed experts"):
        K.NativeDecoder([replace(moe, experts=None)], **shape)
    several = r"MLPs of several shapes: .* routed blocks \[\(4, 1, 32, 1\), \(4, 2, 32, 1\)\]"
    with pytest.raises(ValueError, match=several):
        K.NativeDecoder([moe, replace(moe, experts=replace(moe.experts, top_k=1))], **shape)
    assert decoder.takes_rows(10**4)
    plain_experts = replace(experts, gate_up=experts.gate_up.plain(), down=experts.down.plain())
    decoder = K.NativeDecoder([replace(moe, experts=plain_experts), dense], **shape)
    assert decoder.takes_rows(16) and not decoder.takes_rows(17)  # 2 routes a row, 8 an expert of 4
    rows = 17
    hidden, cos = torch.zeros(rows, cfg.hidden_size, dtype=torch.bfloat16), torch.zeros(rows, cfg.rotary_dim)
    tables = torch.zeros(rows, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match="17 rows route more tokens to the experts than the native block takes"):
        decoder.run(hidden, (cos.bfloat16(),) * 2, torch.zeros(rows), tables, [1] * rows, [1] * rows)


def test_new_caches_free_the_old_ones(qwen_checkpoints: Callable[[str], Path]) -> None:
    """The decoder holds the caches it was made over: caches allocated again (after a memory profile)
    free the old ones, and the next decode step makes a decoder over the new ones."""
    ex = _executor(qwen_checkpoints("qwen3"), "float32")
    builder = PagedBatchBuilder(block_size=4, num_blocks=64)
    ex.execute(builder.step([("a", [5, 6, 7])]))
    first = ex.execute(builder.step([("a", [8])]))
    old = weakref.ref(ex.kv_caches[0][0])
    ex.init_kv_cache({"kv": 64})
    gc.collect()
    assert old() is None
    builder = PagedBatchBuilder(block_size=4, num_blocks=64)
    ex.execute(builder.step([("a", [5, 6, 7])]))
    assert torch.equal(ex.execute(builder.step([("a", [8])])), first)
    assert ex.graph_stats.native_decoder_steps == 4  # every step: none has more than 16 queries


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_rows_logits_alone_are_its_logits_in_a_batch(dtype: str, qwen_checkpoints: Callable[[str], Path]) -> None:
    """A tied output projection (its plain matrix held as the embedding beside the panels copy) gives
    a decode row the same logits, bit for bit, alone and among other rows: one row runs the panels too
    (it ran a GEMV over the plain matrix, whose sums are in another order), so a seeded or greedy
    request's tokens do not depend on the batch it is in."""
    path = qwen_checkpoints("qwen3_tied")
    prompts = {"a": [5, 6, 7, 9, 11], "b": [8, 3], "c": [12, 40, 41]}
    runs = []
    for rids in (["a"], list(prompts)):
        ex = _executor(path, dtype)
        head = ex.model.lm_head_packed if ex.model is not None else None
        assert head is not None and head.weight is not None and head.library == "panels"
        builder = PagedBatchBuilder(block_size=4, num_blocks=64)
        ex.execute(builder.step([(rid, prompts[rid]) for rid in rids], all_logits=False))
        runs.append([ex.execute(builder.step([(rid, [20 + i]) for rid in rids]))[0] for i in range(3)])
    for alone, batched in zip(*runs, strict=True):
        assert torch.equal(alone, batched)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_prompt_cut_anywhere_ends_in_the_same_logits(dtype: str, qwen_checkpoints: Callable[[str], Path]) -> None:
    """Given the batch's prompt rows (``BatchInput.prompt_rows``), a prompt's rows take the prefill
    kernel at any chunk length (such a step runs eager), so a 24-token prompt prefilled in one chunk
    or cut into 19 + 5 or 20 + 3 + 1 beside another request's decode rows ends in the same logits,
    bit for bit, and so does its decode step after; by run length alone its short last chunk took
    the row kernel (the native decoder's), whose sums are in another order."""
    path = qwen_checkpoints("qwen3_tied")
    prompt = [(7 * i + 3) % 300 + 4 for i in range(24)]

    def run(cuts: list[int], given: bool) -> tuple[torch.Tensor, torch.Tensor]:
        ex = _executor(path, dtype)
        builder = PagedBatchBuilder(block_size=4, num_blocks=64)
        ex.execute(builder.step([("o", [5, 6, 7])], all_logits=False))
        lo, last = 0, torch.empty(0)
        for n in cuts:
            batch = builder.step([("o", [9]), ("p", prompt[lo : lo + n])], all_logits=False)
            batch.prompt_rows = [0, n] if given else None
            last = ex.execute(batch)[1]  # the prompt's last row so far
            lo += n
        decode = builder.step([("p", [11])])
        decode.prompt_rows = [0] if given else None
        return last, ex.execute(decode)[0]

    whole = run([24], True)
    for cuts in ([19, 5], [20, 3, 1]):
        got = run(cuts, True)
        assert torch.equal(got[0], whole[0]) and torch.equal(got[1], whole[1])
    if dtype == "float32":
        assert not torch.equal(run([19, 5], False)[0], whole[0])


def _tokens(ex: QwenExecutor, batch: Any) -> list[int]:
    """The step's greedy tokens as the runner reads them: the maxima the output projection took (the
    argmax of the logits where it took none)."""
    batch.greedy_maxima = batch.maxima_only = True
    logits = ex.execute(batch)
    maxima = ex.logits_maxima()
    return (maxima[1] if maxima is not None else logits.argmax(dim=-1)).tolist()


def _prefilled(ex: QwenExecutor, prompts: dict[str, list[int]]) -> tuple[PagedBatchBuilder, dict[str, int]]:
    builder = PagedBatchBuilder(block_size=4, num_blocks=64)
    first = _tokens(ex, builder.step(list(prompts.items()), all_logits=False))
    return builder, dict(zip(prompts, first, strict=True))


def _forward_by_forward(ex: QwenExecutor, prompts: dict[str, list[int]], steps: int) -> list[list[int]]:
    builder, last = _prefilled(ex, prompts)
    forwards = []
    for _ in range(steps):
        last = dict(zip(last, _tokens(ex, builder.step([(rid, [t]) for rid, t in last.items()])), strict=True))
        forwards.append(list(last.values()))
    return forwards


def _greedy(
    ex: QwenExecutor,
    prompts: dict[str, list[int]],
    steps: int,
    stops: list[frozenset[int]],
    interrupt: StepInterrupt | None = None,
) -> Any:
    builder, last = _prefilled(ex, prompts)
    for rid in last:  # blocks for the run's positions, as the scheduler gives a multi-step decode
        req = builder.reqs[rid]
        while len(req.blocks) * builder.block_size < req.computed + steps:
            req.blocks.append(builder.free.pop())
    batch = builder.step([(rid, [t]) for rid, t in last.items()])
    batch.greedy_maxima = batch.maxima_only = True
    batch.interrupt = interrupt
    return ex.greedy_steps(batch, steps, stops)


@pytest.mark.parametrize(
    ("name", "dtype"),
    [("qwen3_tied", "bfloat16"), ("qwen3_tied", "float32"), ("qwen3", "bfloat16"), ("qwen3_sliding", "float32"),
     ("qwen3_moe_tied", "bfloat16"), ("qwen3_moe", "float32")],
)  # fmt: skip
def test_greedy_steps_give_the_tokens_of_the_forwards_one_by_one(
    name: str, dtype: str, qwen_checkpoints: Callable[[str], Path]
) -> None:
    """One request and three, their greedy forwards as one loop (``QwenExecutor.greedy_steps``: the
    native loop for one request, whose output projection, tied or not, is a panels copy, else the
    forward's calls):
    the tokens of the forwards one by one, every position; a stop token ends the run after it, and a
    counted arrival after its first forward (none: not at all)."""
    path = qwen_checkpoints(name)
    gen = torch.Generator().manual_seed(5)
    prompts = {rid: torch.randint(4, 300, (n,), generator=gen).tolist() for rid, n in zip("abc", (7, 3, 12))}
    steps = 14  # past a few blocks of 4 and the sliding window of 6
    for rows in (1, 3):
        mine = {rid: prompts[rid] for rid in list(prompts)[:rows]}
        ref = _forward_by_forward(_executor(path, dtype), mine, steps)
        varied = max(len({tokens[i] for tokens in ref}) for i in range(rows))
        assert varied > steps // 3  # tokens that follow what the layers compute
        ex = _executor(path, dtype)
        assert ex.model is not None and (ex.model._greedy_tail(rows, 64) is not None) == (rows == 1)
        assert _greedy(ex, mine, steps, [frozenset()] * rows) == ref
        assert ex.model.greedy_loop_steps == steps
        last = [tokens[-1] for tokens in ref]  # the last request's sixth token ends it, where it first comes
        stops = [frozenset()] * (rows - 1) + [frozenset({last[5]})]
        assert _greedy(_executor(path, dtype), mine, steps, stops) == ref[: last.index(last[5]) + 1]
        interrupt = StepInterrupt()
        assert _greedy(_executor(path, dtype), mine, steps, [frozenset()] * rows, interrupt) == ref
        interrupt.arrive()
        assert _greedy(_executor(path, dtype), mine, steps, [frozenset()] * rows, interrupt) == ref[:1]


def test_greedy_steps_stop_before_a_forward_with_non_finite_logits(qwen_checkpoints: Callable[[str], Path]) -> None:
    """Logits with NaN: the run stops before that forward (the runner computes it again and fails the
    request), one request (the native loop) or three (the forward's calls)."""
    path = qwen_checkpoints("qwen3_tied")
    prompts = {"a": [5, 6, 7], "b": [9, 4], "c": [11]}
    for rows in (1, 3):
        ex = _executor(path, "bfloat16")
        head = ex.model.lm_head_packed if ex.model is not None else None
        assert head is not None and head.weight is not None
        with torch.inference_mode():
            head.packed[0].fill_(float("nan"))  # the panels of outputs 0-63, which one row reads too
        mine = {rid: prompts[rid] for rid in list(prompts)[:rows]}
        assert _greedy(ex, mine, 4, [frozenset()] * rows) == []
        assert ex.model is not None and ex.model.greedy_loop_steps == 0


def test_greedy_run_refuses_bad_inputs(qwen_checkpoints: Callable[[str], Path]) -> None:
    """Inputs of other dtypes or shapes (an output projection that is not a panels copy serving one
    row), a table or RoPE tables short of the run's positions and a token outside the embeddings are
    refused before any forward; a block outside the caches at the
    slot check of its forward (nothing written there)."""
    ex = _executor(qwen_checkpoints("qwen3_tied"), "float32")
    builder, last = _prefilled(ex, {"a": [5, 6, 7]})
    ex.execute(builder.step([("a", [last["a"]])]))  # a decode step makes the native decoder
    model = ex.model
    assert model is not None and model._native is not None and model._native[1] is not None
    decoder, tail = model._native[1], model._greedy_tail(1, 32)
    assert tail is not None
    table = torch.tensor(builder.reqs["a"].blocks + [builder.free.pop()] * 4)
    with pytest.raises(ValueError, match=r"embed torch\.bfloat16"):
        decoder.greedy_run(replace(tail, embed=tail.embed.bfloat16()), 9, 4, table, 4, frozenset())
    head = tail.head
    with pytest.raises(ValueError, match=r"is not a torch\.float32 panels copy serving one row"):
        decoder.greedy_run(replace(tail, head=replace(head, min_rows=2)), 9, 4, table, 4, frozenset())
    with pytest.raises(ValueError, match=r"the head's panels of \(320, 32\) are not \[1..320, 64\]"):
        decoder.greedy_run(replace(tail, head=replace(head, packed=head.packed[:, :32])), 9, 4, table, 4, frozenset())
    with pytest.raises(ValueError, match="does not cover 40 positions"):
        decoder.greedy_run(tail, 9, 4, table, 36, frozenset())
    with pytest.raises(ValueError, match="cos covers 128 positions"):  # the tables grow 128 at a time
        decoder.greedy_run(tail, 9, 126, table[:1].repeat(40), 4, frozenset())
    with pytest.raises(ValueError, match="token 320 is outside the 320 embeddings"):
        decoder.greedy_run(tail, 320, 4, table, 4, frozenset())
    with pytest.raises(IndexError, match="position 4 a slot outside the caches"):
        decoder.greedy_run(tail, 9, 4, torch.tensor([0, 10**6]), 4, frozenset())
    assert decoder.greedy_run(tail, 9, 4, table, 4, frozenset()) != []


def test_small_layer_panels_share_one_huge_page_buffer_in_read_order(qwen_checkpoints: Callable[[str], Path]) -> None:
    """The decoder projections' panels (all under 2 MiB here) are moved into one buffer advised onto
    huge pages (``pypto_kernels.on_huge_pages``), laid out layer by layer in the order a step reads
    them, and the native decoder reads them there."""
    ex = _executor(qwen_checkpoints("qwen3"), "float32")
    model = ex.model
    assert model is not None
    order = ("qkv_weight", "o_weight", "gate_up_weight", "down_weight")
    panels = [getattr(m, a) for layer in model.layers for m in layer.modules() for a in order if hasattr(m, a)]
    assert len(panels) == 4 * len(model.layers) and all(w.library == "panels" for w in panels)
    ptrs = [w.packed.data_ptr() for w in panels]
    assert ptrs == sorted(ptrs) and ptrs[0] % K.HUGE_PAGE == 0
    assert len({w.packed.untyped_storage().data_ptr() for w in panels}) == 1
    builder, last = _prefilled(ex, {"a": [5, 6, 7]})
    ex.execute(builder.step([("a", [last["a"]])]))  # a decode step makes the native decoder
    assert model._native is not None and model._native[1] is not None
    assert model._native[1]._layers[0].qkv == ptrs[0]
