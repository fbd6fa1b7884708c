"""Tensor and expert parallelism of the Qwen executor on two gloo ranks (spawned processes) against
one rank: the same logits (float32, within summation-order error) and the same greedy tokens over a
few decode steps, for Qwen3, Qwen3-MoE with split experts and with expert parallelism, Qwen2 with
biases and a tied embedding, Qwen3 with attention biases, a KV head replicated over the ranks, a
checkpoint in several safetensors files, a block-FP8 one and W8A8_DYNAMIC ones (dense, MoE split
and expert parallel: the row-parallel projections quantise with the whole row's per-token scale, so
their logits too are within summation-order error). Each rank reads exactly the parameters it
holds (and the FP8 block scales) from the safetensors files, holds about half the model, and
reports a KV block of half the bytes. One spawned pair of ranks runs every case."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from pypto_serving import LLM, SamplingParams
from pypto_serving.parallel import ParallelContext
from pypto_serving.quantization import UnsupportedQuantizationError, dequantize_fp8_blocks
from pypto_serving_qwen import loader
from pypto_serving_qwen.executor import QwenExecutor
from pypto_serving_qwen.graph import GraphOptions
from pypto_serving_qwen.loader import read_config
from pypto_serving_qwen.sharding import QwenSharding
from tests.distributed_helpers import run_ranks
from tests.plugins.qwen.qwen_fixtures import PagedBatchBuilder, make_qwen_checkpoint, qwen_settings
from tests.plugins.qwen.test_qwen_fp8 import _fp8_copy
from tests.plugins.qwen.test_qwen_w8a8 import _static_copy, _w8a8_copy

WORLD = 2
PROMPTS = {"a": [3, 17, 5, 99, 42, 7, 250], "b": [11, 300, 8, 64, 1]}
DECODE_STEPS = 4

# name -> executor settings beyond the model; the checkpoint is ``root / name.split("+")[0]``.
CASES: dict[str, dict[str, Any]] = {
    "qwen3": {},
    "qwen3_moe": {},
    "qwen3_moe+ep": {"enable_expert_parallel": True},
    "qwen2_tied": {},
    "qwen3_kv1": {},
    "qwen3_fp8": {},
    "qwen3_moe_fp8": {},  # FP8 routed experts: every rank holds its block-aligned part of each
    "qwen3_moe_fp8+ep": {"enable_expert_parallel": True},
    # W8A8_DYNAMIC projections (o_proj and down_proj quantise with the whole row's scale) and output
    # projection (each rank its vocabulary rows of it)
    "qwen3_w8a8": {},
    "qwen3_moe_w8a8": {},  # W8A8_DYNAMIC routed experts, int8 rows of every expert per rank
    "qwen3_moe_w8a8+ep": {"enable_expert_parallel": True},
    "qwen3_bias": {},
    "qwen3_sharded": {},
}


class _CountingSlice:
    def __init__(self, inner: Any, counts: dict[str, int]) -> None:
        self.inner, self.counts = inner, counts

    def get_shape(self) -> list[int]:
        return list(self.inner.get_shape())

    def get_dtype(self) -> str:
        return str(self.inner.get_dtype())

    def __getitem__(self, index: Any) -> torch.Tensor:
        t: torch.Tensor = self.inner[index]
        self.counts["read"] += t.numel()
        self.counts["largest"] = max(self.counts["largest"], t.numel())
        return t


class _CountingFile:
    """A safetensors handle that counts the elements read through it."""

    def __init__(self, inner: Any, counts: dict[str, int]) -> None:
        self.inner, self.counts = inner, counts

    def keys(self) -> list[str]:
        return list(self.inner.keys())

    def get_slice(self, name: str) -> _CountingSlice:
        return _CountingSlice(self.inner.get_slice(name), self.counts)

    def get_tensor(self, name: str) -> torch.Tensor:
        t: torch.Tensor = self.inner.get_tensor(name)
        self.counts["read"] += t.numel()
        self.counts["largest"] = max(self.counts["largest"], t.numel())
        return t


@contextlib.contextmanager
def _counting_reads() -> Iterator[dict[str, int]]:
    counts = {"read": 0, "largest": 0}
    real = loader.safe_open

    @contextlib.contextmanager
    def counting_open(*args: Any, **kwargs: Any) -> Iterator[_CountingFile]:
        with real(*args, **kwargs) as f:
            yield _CountingFile(f, counts)

    loader.safe_open = counting_open  # type: ignore[assignment]
    try:
        yield counts
    finally:
        loader.safe_open = real


def _generate(path: str, options: dict[str, Any]) -> dict[str, Any]:
    """Load ``path`` on this process's ranks, prefill both prompts in one step (every row's logits)
    and decode greedily; returns the logits of every step, the tokens and what the rank holds."""
    with _counting_reads() as counts:
        ex = QwenExecutor(
            qwen_settings(Path(path), tensor_parallel_size=ParallelContext.current().world_size, **options)
        )
        info = ex.load()
    ex.init_kv_cache({"kv": 32})
    assert ex.model is not None
    builder = PagedBatchBuilder(4, 32)
    logits = [ex.execute(builder.step(list(PROMPTS.items())))]
    ends = [len(PROMPTS["a"]) - 1, len(PROMPTS["a"]) + len(PROMPTS["b"]) - 1]
    tokens: dict[str, list[int]] = {"a": [], "b": []}
    for _ in range(DECODE_STEPS):
        last = logits[-1] if len(logits) > 1 else logits[0][ends]
        for rid, row in zip(("a", "b"), last.argmax(-1).tolist(), strict=True):
            tokens[rid].append(row)
        logits.append(ex.execute(builder.step([(rid, [toks[-1]]) for rid, toks in tokens.items()], all_logits=False)))
    return {
        "logits": logits,
        "tokens": tokens,
        "read": counts["read"],
        "largest_read": counts["largest"],
        # Parameters plus the weights kept in their stored precision (data, or its oneDNN-packed copy,
        # and scales; W8A8's all-zero offsets, as large as its scales, are read and then dropped).
        "held": sum(p.numel() for p in ex.model.parameters())
        + sum(
            (w.data.numel() if w.packed is None else w.packed.nbytes)
            + w.scale.numel() * (2 if w.scheme == "w8a8_dynamic" else 1)
            for w in ex.model.quantized_weights()
        ),
        "bytes_per_block": info.cache_groups[0].bytes_per_block,
        "kv_shape": tuple(ex.kv_caches[0][0].shape),
        "graph_steps": dict(ex.graph_stats.graph_steps),
        "experts_shape": tuple(getattr(ex.model.layers[0].mlp, "gate_up", torch.empty(0)).shape),
    }


GRAPHS = {"graph_mode": "aot_eager", "graph_batch_sizes": [2], "graph_warmup": "lazy"}


def _device_graph_refusal(path: str) -> str:
    """What a rank says to a device-replayed graph mode (set directly: this CPU cannot parse one)."""
    ex = QwenExecutor(qwen_settings(Path(path), tensor_parallel_size=WORLD))
    ex.graph_options = GraphOptions(mode="cudagraph", batch_sizes=(2,), warmup="load", attention="static")
    try:
        ex._plan_shards(read_config(path))
    except ValueError as e:
        return str(e)
    return "accepted"


def _rank_cases(paths: dict[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {name: _generate(paths[name], CASES[name]) for name in CASES}
    out["captured"] = _generate(paths["qwen3"], {"executor_options": GRAPHS})
    out["device_graph_refusal"] = _device_graph_refusal(paths["qwen3"])
    out["static_w8a8"] = _generate(paths["static_w8a8"], {})
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory, qwen_checkpoints: Callable[[str], Path]) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tp_ckpts")
    kv1 = make_qwen_checkpoint(root / "qwen3_kv1", "qwen3", num_key_value_heads=1, num_hidden_layers=2)
    bias = make_qwen_checkpoint(root / "qwen3_bias", "qwen3", attention_bias=True, num_hidden_layers=2)
    paths = {
        "qwen3": qwen_checkpoints("qwen3"),
        "qwen3_moe": qwen_checkpoints("qwen3_moe"),
        "qwen2_tied": qwen_checkpoints("qwen2_tied"),
        "qwen3_kv1": kv1,
        "qwen3_fp8": _fp8_copy(qwen_checkpoints("qwen3"), root / "qwen3_fp8"),
        "qwen3_moe_fp8": _fp8_copy(qwen_checkpoints("qwen3_moe"), root / "qwen3_moe_fp8"),
        "qwen3_w8a8": _w8a8_copy(qwen_checkpoints("qwen3"), root / "qwen3_w8a8", head=True),
        "qwen3_moe_w8a8": _w8a8_copy(qwen_checkpoints("qwen3_moe"), root / "qwen3_moe_w8a8"),
        "qwen3_bias": bias,  # o_proj's bias is added once, after the all-reduce
        "qwen3_sharded": qwen_checkpoints("qwen3_sharded"),  # slices read across safetensors files
    }
    cases = {name: str(paths[name.split("+")[0]]) for name in CASES}
    # Outside CASES: static W8A8's per-tensor scales are read once per fused weight, so what a rank
    # reads is not what it holds (test_each_rank_reads_only_what_it_holds).
    return cases | {"static_w8a8": str(_static_copy(qwen_checkpoints("qwen3"), root / "static_w8a8"))}


@pytest.fixture(scope="module")
def single(checkpoints: dict[str, str]) -> dict[str, Any]:
    """Every case on one rank (this process, no process group)."""
    return {name: _generate(checkpoints[name], CASES[name]) for name in CASES}


@pytest.fixture(scope="module")
def ranks(checkpoints: dict[str, str]) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = run_ranks(_rank_cases, WORLD, checkpoints)
    return results


@pytest.mark.parametrize("case", list(CASES))
def test_two_ranks_give_the_logits_and_greedy_tokens_of_one(
    case: str, single: dict[str, Any], ranks: list[dict[str, Any]]
) -> None:
    want = single[case]
    for rank in ranks:
        got = rank[case]
        assert got["tokens"] == want["tokens"]
        assert len(got["logits"]) == len(want["logits"]) == DECODE_STEPS + 1
        for g, w in zip(got["logits"], want["logits"], strict=True):
            assert g.shape == w.shape and g.shape[-1] == 320
            # W8A8 too: the row-parallel projections (o_proj, down_proj, the split experts' down)
            # quantise each rank's half of a row with the whole row's per-token scale, so the int8
            # activations are one rank's and only the float summation order differs. That order can
            # still move an activation across an int8 rounding boundary (one step of 1/127 of its
            # row's maximum): qwen3_moe_w8a8's single-rank logits move by 0.017 at its fourth step
            # when one float pass sums its squares in another order. So W8A8 logits agree to a few
            # int8 steps' worth, the others to float rounding.
            tolerance = 5e-2 if "w8a8" in case else 1e-4
            torch.testing.assert_close(g, w, rtol=1e-4, atol=tolerance)
    # Both ranks hold the very same logits, so their samplers draw the same tokens.
    for g0, g1 in zip(ranks[0][case]["logits"], ranks[1][case]["logits"], strict=True):
        assert torch.equal(g0, g1)


def test_static_w8a8_ranks_give_the_logits_and_greedy_tokens_of_one(
    checkpoints: dict[str, str], ranks: list[dict[str, Any]]
) -> None:
    """msModelSlim static W8A8: the per-tensor input scale quantises every rank's slice as one rank
    does, and a row-parallel projection's quant_bias (the activation offset times the whole row's
    weight sum) is added by one rank only, so the ranks' partial sums add up to one rank's."""
    want = _generate(checkpoints["static_w8a8"], {})
    for rank in ranks:
        got = rank["static_w8a8"]
        assert got["tokens"] == want["tokens"]
        for g, w in zip(got["logits"], want["logits"], strict=True):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


def _scale_elements(path: str) -> int:
    """How many FP8 block-scale values the checkpoint holds (every rank reads them all)."""
    total = 0
    for shard in Path(path).glob("*.safetensors"):
        with safe_open(str(shard), framework="pt") as f:
            total += sum(f.get_tensor(n).numel() for n in f.keys() if n.endswith("_scale_inv"))  # noqa: SIM118
    return total


@pytest.mark.parametrize("case", list(CASES))
def test_each_rank_reads_only_what_it_holds(
    case: str, single: dict[str, Any], ranks: list[dict[str, Any]], checkpoints: dict[str, str]
) -> None:
    scales = _scale_elements(checkpoints[case])
    assert ("fp8" in case) == (scales > 0)
    # FP8 projections keep their data and block scales as stored: what is read is what is held.
    assert single[case]["read"] == single[case]["held"]
    for rank in ranks:
        # FP8 parts start on a scale block, which this model's shards do, so nothing extra is read.
        assert rank[case]["read"] == rank[case]["held"], "a rank read checkpoint data it does not keep"
        # Half of everything but the norms and the router; the replicated KV head keeps a bit more.
        assert rank[case]["held"] < 0.56 * single[case]["held"]
        assert rank[case]["largest_read"] < single[case]["largest_read"]


def test_each_rank_caches_its_kv_heads_only(single: dict[str, Any], ranks: list[dict[str, Any]]) -> None:
    for case in ("qwen3", "qwen3_moe", "qwen2_tied"):
        assert single[case]["kv_shape"][2] == 2
        for rank in ranks:
            assert rank[case]["kv_shape"][2] == 1
            assert rank[case]["bytes_per_block"] * 2 == single[case]["bytes_per_block"]
    # One KV head for two ranks: each rank caches it whole (replicated), so the block is not halved.
    for rank in ranks:
        assert rank["qwen3_kv1"]["kv_shape"][2] == 1
        assert rank["qwen3_kv1"]["bytes_per_block"] == single["qwen3_kv1"]["bytes_per_block"]


def test_moe_ranks_split_every_expert_or_hold_whole_experts(ranks: list[dict[str, Any]]) -> None:
    for rank in ranks:  # 4 experts, intermediate 32: gate/up stacked as [E, 2I, H]
        assert rank["qwen3_moe"]["experts_shape"] == (4, 32, 64)
        assert rank["qwen3_moe+ep"]["experts_shape"] == (2, 64, 64)


def test_captured_decode_graphs_hold_the_collectives(single: dict[str, Any], ranks: list[dict[str, Any]]) -> None:
    """aot_eager decode graphs over two ranks give the eager single rank's logits and tokens."""
    want = single["qwen3"]
    for rank in ranks:
        got = rank["captured"]
        assert got["graph_steps"] == {2: DECODE_STEPS}  # every decode step ran the captured bucket
        assert got["tokens"] == want["tokens"]
        for g, w in zip(got["logits"], want["logits"], strict=True):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)


def test_device_graphs_over_ranks_are_refused(ranks: list[dict[str, Any]]) -> None:
    for rank in ranks:
        assert "graph_mode='cudagraph' is not supported with tensor_parallel_size=2" in rank["device_graph_refusal"]


def test_a_world_size_that_does_not_divide_a_dimension_is_refused_by_name(
    qwen_checkpoints: Callable[[str], Path],
) -> None:
    cfg = read_config(qwen_checkpoints("qwen3"))  # 4 query heads, 2 KV heads
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 does not divide the num_attention_heads \(4\)"):
        QwenSharding.plan(cfg, ParallelContext(rank=0, world_size=3), expert_parallel=False)
    six = dataclasses.replace(cfg, num_heads=6)
    with pytest.raises(ValueError, match=r"not a multiple of it"):
        QwenSharding.plan(six, ParallelContext(rank=0, world_size=3), expert_parallel=False)
    moe = read_config(qwen_checkpoints("qwen3_moe"))  # 4 experts
    with pytest.raises(ValueError, match=r"does not divide the num_experts \(expert parallel\) \(4\)"):
        QwenSharding.plan(
            dataclasses.replace(moe, num_heads=8, num_kv_heads=8, intermediate_size=96, vocab_size=96),
            ParallelContext(rank=0, world_size=8),
            expert_parallel=True,
        )


def test_kv_heads_are_replicated_to_the_ranks_whose_query_heads_read_them(
    qwen_checkpoints: Callable[[str], Path],
) -> None:
    cfg = read_config(qwen_checkpoints("qwen3"))  # 4 query heads in 2 groups of 2
    plans = [QwenSharding.plan(cfg, ParallelContext(rank=r, world_size=4), expert_parallel=False) for r in range(4)]
    assert [(p.q_heads.start, p.kv_heads.start, p.kv_heads.stop) for p in plans] == [
        (0, 0, 1),
        (1, 0, 1),
        (2, 1, 2),
        (3, 1, 2),
    ]


def test_a_process_group_of_another_size_is_refused(qwen_checkpoints: Callable[[str], Path]) -> None:
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 but this worker's process group has 1 rank"):
        QwenExecutor(qwen_settings(qwen_checkpoints("qwen3"), tensor_parallel_size=2)).load()


# ---------------------------------------------------------------------------------------------------
# Through the engine: a TP=2 worker group (one spawned process per rank, gloo) against TP=1 in-process.

ENGINE_PROMPTS = [[3, 17, 5, 99, 42, 7, 250], [11, 300, 8], [64, 1, 2, 90, 91, 92, 93, 94, 95, 10, 12]]
ENGINE_PARAMS = [
    SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
    SamplingParams(temperature=0.8, seed=7, max_tokens=8, ignore_eos=True),  # the same logits draw the same
]
ENGINE_BASE: dict[str, Any] = dict(
    device="cpu", dtype="float32", block_size=4, max_model_len=64, num_kv_blocks=64, worker_threads=1, seed=0
)


def _engine_tokens(path: Path, **settings: Any) -> list[list[int]]:
    llm = LLM(model=str(path), **{**ENGINE_BASE, **settings})
    try:
        if settings.get("tensor_parallel_size", 1) > 1:
            assert llm.engine is not None and len(llm.engine.worker.pids) == settings["tensor_parallel_size"]
        outs = llm.generate(ENGINE_PROMPTS, ENGINE_PARAMS, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]
    finally:
        llm.shutdown()


@pytest.mark.parametrize(
    ("name", "scheduler", "options"),
    [
        ("qwen3", "sync", {}),
        ("qwen3_moe", "sync", {}),
        ("qwen3_moe", "async", {}),
        ("qwen3_moe", "sync", {"enable_expert_parallel": True}),
        ("qwen3_moe", "async", {"enable_expert_parallel": True}),
    ],
)
def test_a_tp2_engine_generates_what_a_tp1_engine_does(
    name: str, scheduler: str, options: dict[str, Any], qwen_checkpoints: Callable[[str], Path]
) -> None:
    pytest.importorskip(f"pypto_serving_{scheduler}_sched")
    path = qwen_checkpoints(name)
    want = _engine_tokens(path, worker_mode="inproc", scheduler=scheduler, **options)
    got = _engine_tokens(path, tensor_parallel_size=2, scheduler=scheduler, **options)
    assert got == want
    assert [len(t) for t in got] == [8, 6, 8]


@pytest.mark.parametrize(
    ("dim", "rows"), [(0, slice(10, 30)), (1, slice(5, 20)), (0, slice(16, 40)), (1, slice(0, 24))]
)
def test_an_fp8_part_is_the_part_of_the_dequantized_weight(tmp_path: Path, dim: int, rows: slice) -> None:
    """A part that starts inside a scale block is read from that block's start and trimmed."""
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(40, 24, generator=gen).to(torch.float8_e4m3fn)
    scale = torch.rand(3, 2, generator=gen) + 0.5  # 16x16 blocks over 40x24
    save_file({"w": weight}, str(tmp_path / "w.safetensors"))
    whole = dequantize_fp8_blocks(weight, scale, (16, 16))
    full = weight.shape[dim]
    part = loader.WeightTarget(torch.empty(0), ("w",), rows, dim, full)
    with safe_open(str(tmp_path / "w.safetensors"), framework="pt") as f:
        got = loader._dequantized_part(f.get_slice("w"), scale, part, (16, 16))
    assert torch.equal(got, whole[part.index()])


def test_an_fp8_weight_without_its_scales_is_refused_by_name(
    tmp_path: Path, qwen_checkpoints: Callable[[str], Path]
) -> None:
    fp8 = _fp8_copy(qwen_checkpoints("qwen3"), tmp_path / "fp8")
    (shard,) = fp8.glob("*.safetensors")
    tensors = load_file(str(shard))
    del tensors["model.layers.1.mlp.down_proj.weight_scale_inv"]
    save_file(tensors, str(shard))
    with pytest.raises(UnsupportedQuantizationError, match=r"without _scale_inv scales: model.layers.1.mlp.down_proj"):
        QwenExecutor(qwen_settings(fp8)).load()
