"""DeepSeek-V4 tensor and expert parallel on two spawned gloo ranks against one rank, and the two
tensor namings the loader reads.

One pair of ranks runs every scenario (tp_ranks.run): greedy generation with MTP k=2 on the tiny
checkpoint made predictable (so drafts are accepted and multi-token commits happen), under
tensor-parallel MoE, expert parallel, chunked prefill, a block-FP8 copy whose blocks straddle the
rank boundaries, the release layout, a copy whose routed experts stay block FP8 (tensor and expert
parallel), an msModelSlim W8A8_DYNAMIC copy (tensor and expert parallel) and a copy saved under
transformers' names. Each must give, on both ranks, the
single rank's greedy tokens and MTP drafts exactly, and its logits within 1e-4 (float32: the
all-reduces sum partial products in another order than one rank does, so bitwise equality is not
expected; the measured gap is about 3e-6).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from pypto_serving.parallel import ParallelContext
from pypto_serving_deepseek_mtp import DeepseekConfigError, parse_config
from pypto_serving_deepseek_mtp.release import write_release_layout
from pypto_serving_deepseek_mtp.sharding import ShardPlan, TensorPart

from .helpers import Checkpoint, make_predictable
from .test_release_layout import convert as convert_to_release_layout
from .test_w8a8 import w8a8_copy
from .tp_ranks import Scenario, run, run_ranks

ATOL = 1e-4
FP8_BLOCK = (24, 24)  # 24 does not divide the ranks' halves (e.g. 32 of 64 rows): parts start mid-block


@pytest.fixture(scope="module")
def predictable(checkpoints: dict[str, Checkpoint], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of ``mixed_yarn`` whose drafts are often right (helpers.make_predictable)."""
    path = tmp_path_factory.mktemp("tp") / "predictable"
    shutil.copytree(checkpoints["mixed_yarn"].path, path)
    make_predictable(path)
    return path


def _single_file(path: Path) -> dict[str, torch.Tensor]:
    files = list(path.glob("*.safetensors"))
    assert len(files) == 1
    return load_file(str(files[0]))


def _copy_with(src: Path, dest: Path, tensors: dict[str, torch.Tensor], config: dict[str, Any] | None = None) -> Path:
    dest.mkdir(parents=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors":
            shutil.copy(f, dest / f.name)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(dest / "model.safetensors"))
    if config is not None:
        raw = json.loads((dest / "config.json").read_text())
        (dest / "config.json").write_text(json.dumps({**raw, **config}))
    return dest


def _fp8_copies(src: Path, dest: Path) -> tuple[Path, Path]:
    """(block-FP8 copy, float32 copy holding exactly the values the FP8 weights stand for)."""
    from tests.core.test_quantization import quantize

    quant: dict[str, torch.Tensor] = {}
    exact: dict[str, torch.Tensor] = {}
    for name, t in _single_file(src).items():
        if t.dim() == 2 and name.endswith(".weight") and min(t.shape) >= 8 and ("attn.w" in name or "ffn." in name):
            q, scale = quantize(t.float(), FP8_BLOCK)
            quant[name], quant[name + "_scale_inv"] = q, scale
            grid = torch.kron(scale, torch.ones(FP8_BLOCK))[: t.shape[0], : t.shape[1]]
            exact[name] = q.float() * grid
        else:
            quant[name] = exact[name] = t
    cfg = {"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(FP8_BLOCK)}}
    return _copy_with(src, dest / "fp8", quant, cfg), _copy_with(src, dest / "fp8_exact", exact)


def _transformers_names(ckpt: Checkpoint, dest: Path) -> Path:
    """The checkpoint under transformers' in-memory names: the main model's and each MTP block's
    ``state_dict`` (fused experts, ``self_attn.q_a_proj``, ``attn_hc.fn`` ...) as transformers
    holds them, plus the MTP-only tensors."""
    tensors = dict(ckpt.hf.state_dict())
    for d, m in enumerate(ckpt.mtp):
        for k, v in m["hf"].state_dict().items():
            if k.startswith("model.layers.0."):
                tensors[f"mtp.{d}." + k[len("model.layers.0.") :]] = v
        sd = m["hf"].state_dict()
        tensors[f"mtp.{d}.norm.weight"] = sd["model.norm.weight"]
        for a in ("fn", "base", "scale"):
            tensors[f"mtp.{d}.hc_head.hc_{a}"] = sd[f"model.hc_head.hc_{a}"]
        for name in ("e_proj.weight", "h_proj.weight", "enorm.weight", "hnorm.weight"):
            tensors[f"mtp.{d}.{name}"] = m[name]
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in tensors)
    return _copy_with(ckpt.path, dest, tensors)


def _official_names(src: Path, dest: Path) -> Path:
    """The checkpoint under the names of DeepSeek's release: no ``model.`` prefix, ``embed.weight``,
    ``norm.weight``, ``hc_head_fn``..."""
    top = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight"}
    top.update({f"model.hc_head.hc_{a}": f"hc_head_{a}" for a in ("fn", "base", "scale")})
    out = {}
    for k, v in _single_file(src).items():
        name = top.get(k, k.removeprefix("model."))
        out[name] = v
    assert "layers.0.attn.wq_a.weight" in out and "embed.weight" in out
    return _copy_with(src, dest, out)


def _assert_same_run(got: dict[str, Any], ref: dict[str, Any], what: str) -> None:
    assert got["tokens"] == ref["tokens"], what
    assert got["drafts"] == ref["drafts"], what
    assert len(got["logits"]) == len(ref["logits"]), what
    for a, b in zip(got["logits"], ref["logits"]):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=ATOL, msg=what)


def test_two_ranks_match_one(predictable: Path, checkpoints: dict[str, Checkpoint], tmp_path: Path) -> None:
    path = str(predictable)
    fp8, fp8_exact = _fp8_copies(predictable, tmp_path)
    hf_names = _transformers_names(checkpoints["mixed_yarn"], tmp_path / "hf")
    plain = str(checkpoints["mixed_yarn"].path)
    release, release_exact = tmp_path / "release", tmp_path / "release_exact"
    convert_to_release_layout(predictable, release, release_exact)  # UE8M0 FP8, MXFP4 experts
    fp8_experts = tmp_path / "fp8_experts"
    fp8_experts.mkdir()
    # Block-FP8 routed experts kept FP8 on each rank: 8x8 blocks, which the ranks' halves meet whole.
    write_release_layout(predictable, fp8_experts, (8, 8), expert_dtype="fp8")
    # msModelSlim W8A8_DYNAMIC: wo_b and the shared and routed experts' w2 are row-parallel, each rank
    # quantising its slice of a row with the whole row's per-token scale, so the ranks match one rank.
    w8a8, w8a8_plain = tmp_path / "w8a8", tmp_path / "w8a8_plain"
    w8a8_copy(predictable, w8a8, w8a8_plain)
    cases = {
        "tensor-parallel MoE": (Scenario(path), Scenario(path)),
        "expert parallel": (Scenario(path, expert_parallel=True), Scenario(path)),
        "chunked prefill": (Scenario(path, chunk=5), Scenario(path, chunk=5)),
        "fp8": (Scenario(str(fp8)), Scenario(str(fp8_exact))),
        "release layout": (Scenario(str(release)), Scenario(str(release_exact))),
        "release layout, expert parallel": (Scenario(str(release), expert_parallel=True), Scenario(str(release_exact))),
        "transformers names": (Scenario(str(hf_names)), Scenario(plain)),
        "fp8 experts": (Scenario(str(fp8_experts)), Scenario(str(fp8_experts))),
        "fp8 experts, expert parallel": (Scenario(str(fp8_experts), expert_parallel=True), Scenario(str(fp8_experts))),
        "w8a8": (Scenario(str(w8a8)), Scenario(str(w8a8))),
        "w8a8, expert parallel": (Scenario(str(w8a8), expert_parallel=True), Scenario(str(w8a8))),
    }
    ranks = run_ranks([tp for tp, _ in cases.values()], tmp_path)
    for i, (what, (_, one)) in enumerate(cases.items()):
        ref = run(one)
        assert sum(map(len, (d for step in ref["drafts"] for d in step))) > 0, what
        for rank, results in enumerate(ranks):
            _assert_same_run(results[i], ref, f"{what}, rank {rank}")
        # Every rank sees bit-identical logits, so every rank samples the same tokens.
        for a, b in zip(ranks[0][i]["logits"], ranks[1][i]["logits"]):
            assert torch.equal(a, b), what
        # A rank holds its slices only: the replicated parts (norms, hyper-connections, K=V head,
        # compressors, indexer, router, MTP projections) keep it above half here.
        assert ranks[0][i]["elements"] < 0.7 * ref["elements"], what


def test_accepted_drafts_exercise_multi_token_commits(predictable: Path) -> None:
    """The reference the two ranks are compared with accepts drafts (a k=2 step commits up to 3 tokens)."""
    ref = run(Scenario(str(predictable)))
    steps = len(ref["logits"])
    generated = sum(len(t) for t in ref["tokens"].values())
    assert steps < generated  # fewer forwards than tokens: some steps committed accepted drafts


def _cfg(**overrides: Any) -> Any:
    raw = {
        "vocab_size": 96,
        "hidden_size": 32,
        "moe_intermediate_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "head_dim": 16,
        "o_groups": 2,
        "o_lora_rank": 8,
        "n_routed_experts": 4,
        "index_n_heads": 8,
        "index_head_dim": 8,
        "layer_types": ["sliding_attention"],
        "mlp_layer_types": ["moe"],
    }
    return parse_config({**raw, **overrides})


@pytest.mark.parametrize(
    ("world", "overrides", "ep", "named"),
    [
        (3, {}, False, "num_attention_heads"),
        (4, {}, False, "o_groups"),
        (2, {"vocab_size": 95}, False, "vocab_size"),
        (2, {"moe_intermediate_size": 15}, False, "moe_intermediate_size"),
        (2, {"n_routed_experts": 5}, True, "n_routed_experts"),
        (2, {"layer_types": ["compressed_sparse_attention"], "index_n_heads": 3}, False, "index_n_heads"),
    ],
)
def test_a_world_size_that_does_not_divide_is_refused(world: int, overrides: dict[str, Any], ep: bool, named: str):
    plan = ShardPlan(_cfg(**overrides), ParallelContext(rank=0, world_size=world), expert_parallel=ep)
    with pytest.raises(ValueError, match=f"tensor_parallel_size={world} does not divide the {named}"):
        plan.check()


def test_each_rank_gets_its_heads_groups_and_experts() -> None:
    """Rank 1 of 2: the second half of the heads (wq_b rows, sinks), of the output groups (wo_a rows,
    wo_b columns), of the index heads, of each expert's intermediate dimension, of the vocabulary;
    whole experts 2-3 under expert parallel; replicated tensors whole."""
    cfg = _cfg()
    plan = ShardPlan(cfg, ParallelContext(rank=1, world_size=2))
    assert plan.part_of("layers.0.attn.wq_b.weight", [64, 16]) == TensorPart(0, slice(32, 64))
    assert plan.part_of("mtp.0.attn.attn_sink", [4]) == TensorPart(0, slice(2, 4))
    assert plan.part_of("layers.0.attn.wo_a.weight", [16, 32]) == TensorPart(0, slice(8, 16))
    assert plan.part_of("layers.0.attn.wo_b.weight", [32, 16]) == TensorPart(1, slice(8, 16))
    assert plan.part_of("layers.0.ffn.experts.3.w1.weight", [16, 32]) == TensorPart(0, slice(8, 16))
    assert plan.part_of("layers.0.ffn.experts.3.w2.weight", [32, 16]) == TensorPart(1, slice(8, 16))
    assert plan.part_of("layers.0.ffn.shared_experts.w3.weight", [16, 32]) == TensorPart(0, slice(8, 16))
    assert plan.part_of("head.weight", [96, 32]) == TensorPart(0, slice(48, 96))
    for replicated in ("layers.0.attn.wkv.weight", "layers.0.attn.wq_a.weight", "layers.0.ffn.gate.weight"):
        assert plan.part_of(replicated, [16, 32]) is None
    assert plan.part_of("layers.0.attn.indexer.wq_b.weight", [64, 16]) == TensorPart(0, slice(32, 64))
    assert plan.part_of("layers.0.attn.indexer.weights_proj.weight", [8, 32]) == TensorPart(0, slice(4, 8))
    assert plan.part_of("layers.0.attn.compressor.wkv.weight", [32, 32]) is None
    assert plan.experts == range(4) and plan.wanted("layers.0.ffn.experts.0.w1.weight")
    ep = ShardPlan(cfg, ParallelContext(rank=1, world_size=2), expert_parallel=True)
    assert ep.experts == range(2, 4)
    assert not ep.wanted("layers.0.ffn.experts.1.w1.weight") and ep.wanted("mtp.0.ffn.experts.2.w2.weight")
    assert ep.part_of("layers.0.ffn.experts.2.w1.weight", [16, 32]) is None  # whole experts
    assert ep.part_of("layers.0.ffn.shared_experts.w2.weight", [32, 16]) == TensorPart(1, slice(8, 16))


def test_tensor_parallel_size_without_a_process_group_is_refused(checkpoints: dict[str, Checkpoint]) -> None:
    from pypto_serving.config import ServingSettings
    from pypto_serving_deepseek_mtp import DeepseekMTPExecutor

    s = ServingSettings(model=str(checkpoints["sliding_only"].path), device="cpu", tensor_parallel_size=2)
    with pytest.raises(DeepseekConfigError, match="tensor_parallel_size=2 but this worker's process group has 1"):
        DeepseekMTPExecutor(s).load()


def test_official_and_transformers_names_load_the_same_model(checkpoints: dict[str, Checkpoint], tmp_path: Path):
    """The same tiny checkpoint saved under DeepSeek's release names, under transformers' in-memory
    names (fused experts) and as transformers writes it back gives bit-identical logits and drafts."""
    ckpt = checkpoints["mixed_yarn"]
    dirs = {
        "as saved": ckpt.path,
        "official": _official_names(ckpt.path, tmp_path / "official"),
        "transformers": _transformers_names(ckpt, tmp_path / "transformers"),
    }
    runs = {what: run(Scenario(str(d))) for what, d in dirs.items()}
    ref = runs.pop("as saved")
    for what, got in runs.items():
        assert got["tokens"] == ref["tokens"] and got["drafts"] == ref["drafts"], what
        assert all(torch.equal(a, b) for a, b in zip(got["logits"], ref["logits"])), what


ENGINE_PROMPTS = ([5, 17, 3, 88, 41, 9, 60, 2, 33], [7, 7, 19, 54, 23], list(range(20, 41)))
ENGINE_MAX_TOKENS = (14, 9, 11)


def _engine_run(path: Path, tp: int, scheduler: str, ep: bool = False) -> tuple[list[list[int]], dict[str, Any]]:
    """Greedy tokens and stats of ``LLM.generate`` with MTP k=2 on ``tp`` ranks (``ep``: expert parallel)."""
    from pypto_serving import LLM, SamplingParams

    from .helpers import plugin_manager

    llm = LLM(
        model=str(path),
        plugins=plugin_manager(),
        dtype="float32",
        device="cpu",
        block_size=4,
        max_num_batched_tokens=16,
        # Policy fixed: drafts every step, so acceptance on two ranks is certain to be exercised (the
        # default, adaptive, may measure that drafting does not pay on a loaded CPU and stop).
        speculative_config={"method": "mtp", "num_speculative_tokens": 2, "policy": "fixed"},
        scheduler=scheduler,
        tensor_parallel_size=tp,
        enable_expert_parallel=ep,
        worker_mode="process" if tp > 1 else "inproc",
    )
    try:
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in ENGINE_MAX_TOKENS]
        outs = llm.generate([list(p) for p in ENGINE_PROMPTS], params, use_tqdm=False)
        stats = llm.engine.stats()
    finally:
        llm.shutdown()
    return [list(o.outputs[0].token_ids) for o in outs], stats


@pytest.fixture(scope="module")
def engine_reference(predictable: Path) -> list[list[int]]:
    tokens, _ = _engine_run(predictable, 1, "sync")
    assert [len(t) for t in tokens] == list(ENGINE_MAX_TOKENS)
    return tokens


@pytest.mark.requires_plugin("sync_sched")
@pytest.mark.requires_plugin("async_sched")
@pytest.mark.parametrize(("scheduler", "ep"), [("sync", False), ("async", False), ("async", True)])
def test_engine_on_two_ranks_matches_one(
    predictable: Path, engine_reference: list[list[int]], scheduler: str, ep: bool
):
    """``LLM`` with tensor_parallel_size=2 and MTP k=2 gives the single rank's greedy tokens under
    the sync and the async strategy, and with expert parallel, with drafts accepted (multi-token
    commits on two ranks)."""
    tokens, stats = _engine_run(predictable, 2, scheduler, ep)
    assert tokens == engine_reference
    assert stats["spec_accepted"] > 0


def test_fp8_scales_in_another_shard_file_and_missing_scales(predictable: Path, tmp_path: Path) -> None:
    """A block-FP8 checkpoint split over two files, every scale in the other file from its weight,
    loads as the single-file one (the loader pairs tensors by name across files); a weight whose
    scale is missing, or a scale without its weight, is refused by name."""
    from pypto_serving.quantization import UnsupportedQuantizationError

    fp8, _ = _fp8_copies(predictable, tmp_path)
    tensors = _single_file(fp8)
    split = tmp_path / "split"
    shutil.copytree(fp8, split)
    (split / "model.safetensors").unlink()
    weights = {k: v for k, v in tensors.items() if not k.endswith("_scale_inv")}
    save_file(weights, str(split / "model-00001-of-00002.safetensors"))
    save_file({k: v for k, v in tensors.items() if k not in weights}, str(split / "model-00002-of-00002.safetensors"))
    ref, got = run(Scenario(str(fp8))), run(Scenario(str(split)))
    assert got["tokens"] == ref["tokens"] and got["drafts"] == ref["drafts"]
    assert all(torch.equal(a, b) for a, b in zip(got["logits"], ref["logits"]))

    lost = "model.layers.1.attn.wq_b.weight_scale_inv"
    assert lost in tensors
    for name, drop in (("no_scale", lost), ("no_weight", lost.removesuffix("_scale_inv"))):
        broken = _copy_with(fp8, tmp_path / name, {k: v for k, v in tensors.items() if k != drop})
        with pytest.raises(UnsupportedQuantizationError, match=r"model\.layers\.1\.attn\.wq_b\.weight"):
            run(Scenario(str(broken)))


def test_mtp_layers_are_not_read_without_speculation(checkpoints: dict[str, Checkpoint]) -> None:
    from pypto_serving_deepseek_mtp.config import load_config
    from pypto_serving_deepseek_mtp.model import FP32_SUFFIXES
    from pypto_serving_deepseek_mtp.weights import load_weights

    path = checkpoints["mixed_yarn"].path
    cfg = load_config(path)
    for with_mtp in (True, False):
        plan = ShardPlan(cfg, ParallelContext(), with_mtp=with_mtp)
        names = load_weights(path, torch.device("cpu"), torch.float32, FP32_SUFFIXES, plan=plan).keys()
        assert any(k.startswith("mtp.1.") for k in names) == with_mtp
        assert "layers.2.ffn.experts.3.w2.weight" in names
