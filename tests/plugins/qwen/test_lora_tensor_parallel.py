"""Multi-LoRA over tensor parallelism (two gloo ranks, spawned processes): each rank holds its part of
every adapter (B's rows of column-parallel q/k/v and gate/up, A's columns of row-parallel o_proj and
down_proj, whose partial deltas the layer's all-reduce adds up), so a TP=2 engine's greedy tokens
for requests of two adapters and the base in one batch, and of an adapter loaded at run time, are
transformers' with that adapter merged. One TP=2 engine serves the whole module."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from pypto_serving import LLM
from pypto_serving.lora_weights import LoraAdapter
from pypto_serving.parallel import ParallelContext
from pypto_serving_qwen.loader import read_config
from pypto_serving_qwen.model import QwenForCausalLM
from pypto_serving_qwen.sharding import QwenSharding
from tests.plugins.qwen.qwen_fixtures import make_qwen_checkpoint
from tests.plugins.qwen.test_lora import GREEDY, _hf_greedy, _merged, _prompts, adapters

__all__ = ["adapters"]  # the adapters fixture of test_lora, shared here

WORLD = 2


@pytest.fixture(scope="module")
def tp_llm(adapters: dict[str, Path], qwen_checkpoints: Callable[[str], Path]) -> Iterator[LLM]:
    llm = LLM(
        model=str(qwen_checkpoints("qwen3")),
        tensor_parallel_size=WORLD,
        lora_modules=[f"attn={adapters['attn']}", f"mlp={adapters['mlp']}"],
        max_lora_rank=8,
        max_loras=3,
        device="cpu",
        dtype="float32",
        block_size=4,
        max_model_len=128,
        worker_threads=1,
        seed=0,
    )
    try:
        assert llm.engine is not None and len(llm.engine.worker.pids) == WORLD
        yield llm
    finally:
        llm.shutdown()


def test_tp2_mixed_batch_matches_merged_adapters(
    tp_llm: LLM, adapters: dict[str, Path], qwen_checkpoints: Callable[[str], Path]
) -> None:
    """Six requests of two adapters (attention-only; MLP-only with rsLoRA) and the base in one batch."""
    loras: list[str | None] = ["attn", None, "mlp", "mlp", "attn", None]
    prompts = _prompts(len(loras))
    got = [list(o.outputs[0].token_ids) for o in tp_llm.generate(prompts, GREEDY, use_tqdm=False, lora=loras)]
    base = qwen_checkpoints("qwen3")
    refs = {name: _merged(base, None if name is None else adapters[name]) for name in set(loras)}
    assert got == [_hf_greedy(refs[name], p) for name, p in zip(loras, prompts, strict=True)]
    assert len({tuple(t) for t in got[:3]}) == 3  # the adapters change the output


def test_tp2_loads_an_adapter_at_run_time(
    tp_llm: LLM, adapters: dict[str, Path], qwen_checkpoints: Callable[[str], Path]
) -> None:
    """Every rank reads the adapter loaded at run time and installs its own part (attention and MLP
    modules, so both kinds of cut run)."""
    tp_llm.load_lora("mixed", str(adapters["mixed"]))
    loras: list[str | None] = ["mixed", "attn", None]
    prompts = _prompts(4)[1:]
    got = [list(o.outputs[0].token_ids) for o in tp_llm.generate(prompts, GREEDY, use_tqdm=False, lora=loras)]
    base = qwen_checkpoints("qwen3")
    assert got == [_hf_greedy(_merged(base, None if n is None else adapters[n]), p) for n, p in zip(loras, prompts)]


def _rank_models(path: Path) -> list[QwenForCausalLM]:
    cfg = read_config(path)
    plans = [QwenSharding.plan(cfg, ParallelContext(rank=r, world_size=WORLD), expert_parallel=False) for r in (0, 1)]
    return [QwenForCausalLM(cfg, torch.device("cpu"), torch.float32, plan) for plan in plans]


def test_ranks_parts_of_an_adapter_add_up_to_its_delta(tmp_path: Path) -> None:
    """With one KV head replicated over both ranks (its B rows held whole by each), every projection's
    per-rank stacks give: column-parallel, this rank's columns of the full delta; row-parallel, partial
    deltas that sum to the full one (``x @ A^T @ B^T``)."""
    kv1 = make_qwen_checkpoint(tmp_path / "kv1", "qwen3", num_key_value_heads=1)
    cfg = read_config(kv1)
    shapes = QwenForCausalLM(cfg, torch.device("cpu"), torch.float32).lora_shapes()
    gen = torch.Generator().manual_seed(3)
    adapter = LoraAdapter("a", 3, 1.0)  # random A/B pairs of layer 0's projections
    for module, (out, inp) in shapes.items():
        if module.startswith("model.layers.0."):
            adapter.pairs[module] = (torch.randn(3, inp, generator=gen), torch.randn(out, 3, generator=gen))
    ranks = _rank_models(kv1)
    parts: list[LoraAdapter] = [m.shard_lora(adapter) for m in ranks]
    contexts = [m.attach_loras([p]) for m, p in zip(ranks, parts, strict=True)]
    for ctx in contexts:
        ctx.onehot = torch.tensor([[0.0, 1.0]] * 3)
    d, attn = cfg.head_dim, [m.layers[0].self_attn for m in ranks]
    assert [layer.shards.kv_heads for layer in attn] == [slice(0, 1), slice(0, 1)]
    # q/k/v, gate/up column-parallel: rank r's outputs are its q heads' and intermediate rows' columns
    # and the one (whole) KV head's.
    x = torch.randn(3, cfg.hidden_size, generator=gen)
    want = {n: x @ a.T @ b.T for n, (a, b) in adapter.pairs.items() if not n.endswith(("o_proj", "down_proj"))}
    q, i = cfg.num_heads * d // WORLD, cfg.intermediate_size // WORLD
    for r, m in enumerate(ranks):
        layer, mlp = m.layers[0].self_attn, m.layers[0].mlp
        assert layer.lora_qkv is not None and mlp.lora_gate_up is not None and layer.q_size == q
        got = layer.lora_qkv.add_delta(x, torch.zeros(3, q + 2 * d))
        parts = [want[f"model.layers.0.self_attn.{p}_proj"] for p in "qkv"]
        torch.testing.assert_close(got, torch.cat([parts[0][:, r * q : (r + 1) * q], parts[1], parts[2]], 1))
        got = mlp.lora_gate_up.add_delta(x, torch.zeros(3, 2 * i))
        parts = [want[f"model.layers.0.mlp.{p}_proj"][:, r * i : (r + 1) * i] for p in ("gate", "up")]
        torch.testing.assert_close(got, torch.cat(parts, 1))
    # o_proj and down_proj row-parallel: the ranks' partial deltas of their input parts sum to the delta.
    for name, width, stacks in (
        ("self_attn.o_proj", cfg.num_heads * d, [layer.lora_o for layer in attn]),
        ("mlp.down_proj", cfg.intermediate_size, [m.layers[0].mlp.lora_down for m in ranks]),
    ):
        a, b = adapter.pairs[f"model.layers.0.{name}"]
        y = torch.randn(3, width, generator=gen)
        half = width // WORLD
        summed = sum(
            s.add_delta(y[:, r * half : (r + 1) * half], torch.zeros(3, cfg.hidden_size))
            for r, s in enumerate(stacks)
            if s is not None
        )
        torch.testing.assert_close(summed, y @ a.T @ b.T)
