"""Graph capture of the Qwen decode forward (pypto_serving_qwen.graph / capture).

The captured executors compile with ``graph_mode="aot_eager"``: the same dynamo graph, custom ops
and padding as inductor, without inductor's C++ code generation (tens of seconds per bucket on two
cores; ``benchmarks/graph_capture.py`` checks inductor's tokens against eager on real shapes).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch._dynamo.utils import counters

import pypto_kernels as K
from pypto_serving_qwen.executor import KV_GROUP, QwenExecutor
from pypto_serving_qwen.graph import GraphOptions, compile_decode, parse_graph_options, static_decode_attention
from pypto_serving_qwen.loader import read_config
from pypto_serving_qwen.model import QwenForCausalLM
from tests.plugins.qwen.fake_cuda import CUDA, fake_cuda, on_device
from tests.plugins.qwen.qwen_fixtures import PagedBatchBuilder, qwen_settings

BLOCK_SIZE = 4
NUM_BLOCKS = 48
PROMPTS = {"a": [5, 9, 17, 33, 2, 71], "b": [8, 8, 40], "c": [101, 3, 7, 19, 250, 6, 6, 12, 1], "d": [44, 45]}


def _executor(path: Path, **options: Any) -> QwenExecutor:
    ex = QwenExecutor(qwen_settings(path, block_size=BLOCK_SIZE, max_model_len=64, executor_options=options))
    ex.load()
    return ex


def _init_with_nan(ex: QwenExecutor) -> None:
    """Caches full of NaN (the scratch block excepted): a read of any slot not written yet poisons the logits."""
    ex.init_kv_cache({KV_GROUP: NUM_BLOCKS})
    for key_cache, value_cache in ex.kv_caches:
        key_cache[:NUM_BLOCKS].fill_(float("nan"))
        value_cache[:NUM_BLOCKS].fill_(float("nan"))


def _decode(ex: QwenExecutor, builder: PagedBatchBuilder, rids: list[str], tokens: dict[str, int]) -> torch.Tensor:
    return ex.execute(builder.step([(rid, [tokens[rid]]) for rid in rids], all_logits=False))


def _hf_last_logits(model: Any, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        out: torch.Tensor = model(input_ids=torch.tensor([tokens])).logits[0, -1]
    return out


def test_captured_decode_matches_eager_and_transformers_over_buckets_with_padding(
    qwen_checkpoints: Callable[[str], Path], hf_reference: Callable[[Path], Any]
) -> None:
    path = qwen_checkpoints("qwen3")
    eager = _executor(path, graph_mode="eager")
    captured = _executor(path, graph_mode="aot_eager", graph_batch_sizes=[2, 4])
    captured.init_kv_cache({KV_GROUP: 8})  # as a memory profile does before the real cache
    assert captured.graph_stats.first_call_seconds.keys() == {2, 4}  # warm-up at load compiled both buckets
    graphs = counters["stats"]["unique_graphs"]
    assert graphs >= 2  # the counter counts compiled graphs (one per bucket here)
    for ex in (eager, captured):
        _init_with_nan(ex)
    assert counters["stats"]["unique_graphs"] == graphs  # another cache size reuses the graphs
    builders = {id(ex): PagedBatchBuilder(BLOCK_SIZE, NUM_BLOCKS, seed=3) for ex in (eager, captured)}
    seqs = {rid: list(p) for rid, p in PROMPTS.items()}
    tokens: dict[int, dict[str, int]] = {}
    for ex in (eager, captured):  # one prefill step of all four: not decode-only, so eager by design
        logits = ex.execute(builders[id(ex)].step(list(PROMPTS.items()), all_logits=False))
        tokens[id(ex)] = dict(zip(PROMPTS, logits.argmax(-1).tolist(), strict=True))
    assert captured.graph_stats.eager_steps == 1 and not captured.graph_stats.graph_steps
    # 4 requests (a full bucket), then 3 and 1 (padded to 4 and 2), then 2 (a full bucket).
    for rids in (["a", "b", "c", "d"], ["a", "b", "c"], ["c"], ["a", "c"], ["b", "c", "d"]):
        out = {id(ex): _decode(ex, builders[id(ex)], rids, tokens[id(ex)]) for ex in (eager, captured)}
        torch.testing.assert_close(out[id(captured)], out[id(eager)], rtol=1e-4, atol=1e-4)
        hf = hf_reference(path)
        for row, rid in enumerate(rids):
            seqs[rid].append(tokens[id(eager)][rid])
            torch.testing.assert_close(out[id(captured)][row], _hf_last_logits(hf, seqs[rid]), rtol=1e-4, atol=1e-4)
        for ex in (eager, captured):
            tokens[id(ex)].update(zip(rids, out[id(ex)].argmax(-1).tolist(), strict=True))
        assert tokens[id(captured)] == tokens[id(eager)]
    stats = captured.graph_stats
    assert (stats.graph_steps, stats.eager_steps) == ({4: 3, 2: 2}, 1)
    assert eager.graph_stats.eager_steps == 6 and not eager.graph_stats.graph_steps
    # Padding rows wrote only the scratch block: the blocks no request owns are still NaN.
    owned = {b for req in builders[id(captured)].reqs.values() for b in req.blocks}
    unowned = [b for b in range(NUM_BLOCKS) if b not in owned]
    assert all(torch.isnan(k[unowned]).all() and torch.isnan(v[unowned]).all() for k, v in captured.kv_caches)


def test_mixed_batches_and_batches_past_the_largest_bucket_run_eager(
    qwen_checkpoints: Callable[[str], Path], hf_reference: Callable[[Path], Any]
) -> None:
    path = qwen_checkpoints("qwen3_moe")  # the experts run as one opaque op inside the graph
    ex = _executor(path, graph_mode="aot_eager", graph_batch_sizes=[2], graph_warmup="lazy")
    _init_with_nan(ex)
    assert not ex.graph_stats.first_call_seconds  # lazy: nothing compiled at load
    builder = PagedBatchBuilder(BLOCK_SIZE, NUM_BLOCKS)
    ex.execute(builder.step([("a", PROMPTS["a"]), ("b", PROMPTS["b"]), ("c", PROMPTS["c"])], all_logits=False))
    ex.execute(builder.step([("a", [1]), ("d", PROMPTS["d"])], all_logits=False))  # decode + prefill: mixed
    ex.execute(builder.step([("a", [1]), ("b", [2]), ("c", [3])], all_logits=False))  # 3 decodes > bucket 2
    ex.execute(builder.step([("a", [4, 5])], all_logits=False))  # two query tokens (a draft): not a decode
    assert (ex.graph_stats.graph_steps, ex.graph_stats.eager_steps) == ({}, 4)
    logits = ex.execute(builder.step([("b", [6])], all_logits=False))
    assert (ex.graph_stats.graph_steps, ex.graph_stats.eager_steps) == ({2: 1}, 4)
    assert ex.graph_stats.first_call_seconds.keys() == {2}
    expected = _hf_last_logits(hf_reference(path), [*PROMPTS["b"], 2, 6])
    torch.testing.assert_close(logits[0], expected, rtol=1e-4, atol=1e-4)


def test_static_attention_path_matches_eager_in_a_sliding_window_model(
    qwen_checkpoints: Callable[[str], Path],
) -> None:
    """The attention CUDA/NPU graphs replay (tensor ops only), captured on the CPU for the comparison."""
    path = qwen_checkpoints("qwen3_sliding")
    eager, captured = _executor(path, graph_mode="eager"), _executor(path, graph_mode="aot_eager")
    captured.graph_options = GraphOptions(mode="aot_eager", batch_sizes=(4,), warmup="lazy", attention="static")
    for ex in (eager, captured):
        _init_with_nan(ex)
    outs = []
    for ex in (eager, captured):
        builder = PagedBatchBuilder(BLOCK_SIZE, NUM_BLOCKS, seed=5)
        ex.execute(builder.step([(rid, PROMPTS[rid]) for rid in "abc"], all_logits=False))
        outs.append([_decode(ex, builder, ["a", "b", "c"], {"a": 7 + i, "b": 8, "c": 9}) for i in range(3)])
    for got, want in zip(outs[1], outs[0], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert captured.graph_stats.graph_steps == {4: 3}


@pytest.mark.parametrize("name", ["qwen3_sliding", "qwen3_moe"])
def test_the_captured_forward_reads_nothing_back_on_a_fake_cuda_device(
    name: str, qwen_checkpoints: Callable[[str], Path]
) -> None:
    """The padding and the static attention path under the fake CUDA of test_fake_device: a host read
    or a CPU tensor in the step raises. The graph itself runs uncompiled (fake tensors hold no data)."""
    path = qwen_checkpoints(name)
    builder = PagedBatchBuilder(BLOCK_SIZE, NUM_BLOCKS)
    steps = [[(rid, PROMPTS[rid]) for rid in "abc"], *[[("a", [7]), ("b", [8]), ("c", [9])]] * 2]
    with fake_cuda():
        ex = QwenExecutor(qwen_settings(path, block_size=BLOCK_SIZE, max_model_len=64))
        ex.config = read_config(path)
        ex.device, ex.dtype = CUDA, torch.bfloat16
        ex.model = QwenForCausalLM(ex.config, CUDA, torch.bfloat16).eval()
        ex.graph_options = GraphOptions(mode="cudagraph", batch_sizes=(4,), warmup="lazy", attention="static")
        ex.init_kv_cache({KV_GROUP: NUM_BLOCKS})
        assert ex.graphs is not None
        ex.graphs._compiled = ex.graphs._forward  # what the graph would capture, run as it is
        for chunks in steps:
            logits = ex.execute(on_device(builder.step(chunks, all_logits=False)))
            assert (logits.device, tuple(logits.shape)) == (CUDA, (3, ex.config.vocab_size))
    assert (ex.graph_stats.graph_steps, ex.graph_stats.eager_steps) == ({4: 2}, 1)


@pytest.mark.parametrize("window", [None, 3])
def test_static_decode_attention_equals_the_paged_kernel(window: int | None) -> None:
    gen = torch.Generator().manual_seed(0)
    blocks, heads, kv_heads, dim = 12, 4, 2, 8
    key_cache = torch.randn((blocks, BLOCK_SIZE, kv_heads, dim), generator=gen)
    value_cache = torch.randn((blocks, BLOCK_SIZE, kv_heads, dim), generator=gen)
    key_cache[-1, -1] = value_cache[-1, -1] = float("nan")  # past every request's length: must not leak
    tables = torch.tensor([[3, 7, 11, 0], [5, 0, 0, 0], [2, 9, 4, 11]], dtype=torch.int32)
    seq_lens = torch.tensor([10, 1, 15], dtype=torch.int32)
    query = torch.randn((3, heads, dim), generator=gen)
    want = K.paged_attention(
        query, key_cache, value_cache, tables, torch.arange(4, dtype=torch.int32), seq_lens, 0.3, sliding_window=window
    )
    got = static_decode_attention(query, key_cache, value_cache, tables, seq_lens, 0.3, window)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"graph_mode": "fast"}, "graph_mode must be one of"),
        ({"compile": "inductor"}, r"unknown qwen executor option\(s\) \['compile'\]"),
        ({"graph_mode": "cudagraph"}, "'cudagraph' needs a CUDA device"),
        ({"graph_mode": "npugraph"}, "'npugraph' needs an Ascend NPU device"),
        ({"graph_batch_sizes": []}, "graph_batch_sizes must be a non-empty list of positive ints"),
        ({"graph_batch_sizes": [1, 0]}, "graph_batch_sizes must be a non-empty list of positive ints"),
        ({"graph_batch_sizes": "8"}, "graph_batch_sizes must be a non-empty list of positive ints"),
        ({"graph_warmup": "never"}, "graph_warmup must be 'load' or 'lazy'"),
    ],
)
def test_bad_options_fail_at_load_with_a_clear_message(
    qwen_checkpoints: Callable[[str], Path], options: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        _executor(qwen_checkpoints("qwen3"), **options)


def test_option_defaults() -> None:
    cpu = torch.device("cpu")
    auto = parse_graph_options({}, cpu, max_num_seqs=64)
    assert (auto.mode, auto.batch_sizes, auto.warmup) == ("eager", (1, 2, 4, 8, 16, 32, 64), "load")
    assert parse_graph_options({}, cpu, max_num_seqs=12).batch_sizes == (1, 2, 4, 8, 12)
    assert parse_graph_options({}, cpu, max_num_seqs=4).batch_sizes == (1, 2, 4)
    chosen = parse_graph_options({"graph_mode": "inductor", "graph_batch_sizes": [8, 1, 8]}, cpu, 64)
    assert (chosen.mode, chosen.batch_sizes, chosen.attention) == ("inductor", (1, 8), "host")


def test_npu_graph_mode_without_torchair_names_what_is_missing() -> None:
    try:
        import torchair  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("torchair is installed here")
    with pytest.raises(RuntimeError, match="needs torchair"):
        compile_decode(lambda x: x, "npugraph")


def test_the_engine_decodes_the_same_tokens_with_graph_capture() -> None:
    """Through the runner and the pipelined scheduler: greedy tokens of four requests equal eager's."""
    from pypto_serving import LLM, SamplingParams
    from pypto_serving_qwen.plugin import TINY_QWEN3

    prompts = [[3, 4, 5], [7, 8], [9, 10, 11, 12], [13]]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    tokens, stats = {}, {}
    for mode in ("eager", "aot_eager"):
        options = {"graph_mode": mode, "graph_batch_sizes": [4], "graph_warmup": "lazy"}
        with LLM(
            model=str(TINY_QWEN3), worker_mode="inproc", num_kv_blocks=64, max_num_seqs=4, executor_options=options
        ) as llm:
            tokens[mode] = [r.outputs[0].token_ids for r in llm.generate(prompts, params)]
            stats[mode] = llm.engine.worker._runner.executor.graph_stats
    assert tokens["aot_eager"] == tokens["eager"]
    assert stats["aot_eager"].graph_steps == {4: 5} and stats["aot_eager"].eager_steps == 1
