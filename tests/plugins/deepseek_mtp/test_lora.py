"""Multi-LoRA on the DeepSeek-V4 executor: two random PEFT adapters (attention projections with
their low-rank parts, the shared expert; rsLoRA) and the base model mixed in one batch give, request
by request, transformers' greedy tokens with that adapter merged (``merge_and_unload``), with MTP
speculation off and on (the MTP layers take no adapter; the main model verifies every draft, so the
tokens stay exact); modules that take no adapter are refused by name; adapters load and unload at
run time, and on two tensor-parallel ranks."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from .helpers import Checkpoint, make_predictable, plugin_manager

peft = pytest.importorskip("peft")

from pypto_serving import LLM, SamplingParams  # noqa: E402

MAX_TOKENS = 8
NUM_PROMPTS = 6
LAYER_SCALE = 0.05  # helpers.make_predictable's scale of the output projections
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
#: name -> (rank, alpha, targets, rslora)
ADAPTERS: dict[str, tuple[int, int, list[str], bool]] = {
    "attn": (4, 8, ["q_a_proj", "self_attn.q_b_proj", "self_attn.kv_proj", "o_b_proj"], False),
    "mlp": (2, 6, ["shared_experts.gate_proj", "up_proj", "down_proj", "self_attn.kv_proj"], True),
}


def _make_adapter(base: Path, dst: Path, seed: int, rank: int, alpha: int, targets: list[str], rslora: bool) -> Path:
    """A PEFT adapter over ``base`` with every LoRA weight drawn at random (PEFT's init zeroes B,
    which would make every adapter the base model); the output projections' B scaled as
    make_predictable scales their weights, so MTP drafts of the adapters' requests are accepted too."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=rslora)
    wrapped = peft.get_peft_model(model, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if "lora_" in name:
                scale = LAYER_SCALE if "lora_B" in name and ("o_b_proj" in name or "down_proj" in name) else 1.0
                p.copy_(0.3 * scale * torch.randn(p.shape, generator=gen))
    wrapped.save_pretrained(str(dst))
    return dst


def _hf_greedy(base: Path, adapter: Path | None, prompts: list[list[int]]) -> list[list[int]]:
    """transformers' greedy tokens of each prompt, with ``adapter`` merged into the base model."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32).eval()
    if adapter is not None:
        hf = peft.PeftModel.from_pretrained(hf, str(adapter)).merge_and_unload().eval()
    out = []
    with torch.no_grad():
        for prompt in prompts:
            tokens: list[int] = []
            for _ in range(MAX_TOKENS):
                tokens.append(int(hf(input_ids=torch.tensor([prompt + tokens])).logits[0, -1].argmax()))
            out.append(tokens)
    return out


@pytest.fixture(scope="module")
def base(checkpoints: dict[str, Checkpoint], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``mixed_yarn`` (sliding, CSA and HCA layers; two MTP depths) made predictable, so that MTP
    drafts are often accepted (helpers.make_predictable)."""
    dst = tmp_path_factory.mktemp("lora_base") / "model"
    shutil.copytree(checkpoints["mixed_yarn"].path, dst)
    make_predictable(dst, layer_scale=LAYER_SCALE)
    return dst


@pytest.fixture(scope="module")
def adapters(base: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ds_loras")
    return {
        name: _make_adapter(base, root / name, seed, *spec) for seed, (name, spec) in enumerate(ADAPTERS.items(), 1)
    }


@pytest.fixture(scope="module")
def refs(base: Path, adapters: dict[str, Path]) -> dict[str | None, list[list[int]]]:
    """transformers' greedy tokens of ``_prompts(NUM_PROMPTS)`` for the base (None) and each adapter merged."""
    return {name: _hf_greedy(base, adapters.get(name or ""), _prompts(NUM_PROMPTS)) for name in (None, *ADAPTERS)}


@pytest.fixture
def make_llm(base: Path) -> Iterator[Callable[..., LLM]]:
    made: list[LLM] = []

    def make(k: int = 0, **settings: Any) -> LLM:
        # A fixed k: the adaptive policy may stop drafting after a run of rejections, and the
        # acceptance check below needs drafts on every step.
        spec = {"method": "mtp", "num_speculative_tokens": k, "policy": "fixed"} if k else None
        values: dict[str, Any] = dict(device="cpu", dtype="float32", block_size=4, worker_mode="inproc", seed=0)
        llm = LLM(model=str(base), plugins=plugin_manager(), speculative_config=spec, **{**values, **settings})
        made.append(llm)
        return llm

    yield make
    for llm in made:
        llm.shutdown()


def _prompts(n: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(0, 96, (5 + 3 * i,), generator=gen).tolist() for i in range(n)]


def _modules(adapters: dict[str, Path]) -> list[str]:
    return [f"{name}={path}" for name, path in adapters.items()]


@pytest.mark.parametrize("k", [0, 2])
def test_mixed_batch_matches_merged_adapters(
    k: int, adapters: dict[str, Path], refs: dict[str | None, list[list[int]]], make_llm: Callable[..., LLM]
) -> None:
    """Six requests of two adapters and the base in one batch, MTP off and on (k = 2): each equals
    its merged model's greedy tokens, so MTP on equals MTP off with adapters."""
    loras: list[str | None] = ["attn", None, "mlp", "mlp", "attn", None]
    prompts = _prompts(NUM_PROMPTS)
    llm = make_llm(k, lora_modules=_modules(adapters), max_lora_rank=4)
    got = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, GREEDY, use_tqdm=False, lora=loras)]
    want = [refs[name][i] for i, name in enumerate(loras)]
    assert got == want
    # Each adapter changes the output: a broken delta (e.g. always zero) could not pass.
    assert refs["attn"] != refs[None] and refs["mlp"] != refs[None]
    if k:
        # The adapters' requests alone, again: the same tokens in another batch, and drafts of theirs
        # accepted (the MTP layers run without the adapter; the adapter's verification keeps them exact).
        assert llm.engine is not None
        before = llm.engine.stats()
        at = [i for i, n in enumerate(loras) if n is not None]
        again = llm.generate([prompts[i] for i in at], GREEDY, use_tqdm=False, lora=[loras[i] for i in at])
        assert [list(o.outputs[0].token_ids) for o in again] == [want[i] for i in at]
        after = llm.engine.stats()
        assert after["spec_drafted"] > before["spec_drafted"], "the adapters' requests were not drafted for"
        assert after["spec_accepted"] > before["spec_accepted"], "no draft of an adapter's request was accepted"


def _edited(src: Path, dst: Path, config: dict[str, Any], rename: tuple[str, str] | None = None) -> Path:
    """A copy of adapter ``src`` with ``config`` merged into its adapter_config.json and, with
    ``rename``, its first weight pair moved to another module (``(old, new)`` parts of its key)."""
    dst.mkdir()
    tensors = load_file(str(src / "adapter_model.safetensors"))
    if rename is not None:
        tensors = {key.replace(*rename): t for key, t in tensors.items()}
    save_file(tensors, str(dst / "adapter_model.safetensors"))
    cfg = json.loads((src / "adapter_config.json").read_text())
    (dst / "adapter_config.json").write_text(json.dumps({**cfg, **config}))
    return dst


def test_modules_that_take_no_adapter_are_refused(
    base: Path, adapters: dict[str, Path], tmp_path: Path, make_llm: Callable[..., LLM]
) -> None:
    """The grouped o_a_proj, a bare ``kv_proj`` (it also names the compressors' projections), routed
    experts (as PEFT's target_parameters, or as weights) and unknown modules: refused at start with
    the module named."""
    o_a = _make_adapter(base, tmp_path / "o_a", 5, 2, 4, ["o_a_proj"], False)
    with pytest.raises(ValueError, match=r"\[.o_a_proj.\] are not supported \(o_a_proj: the grouped o_a_proj takes no"):
        make_llm(lora_modules=[f"o_a={o_a}"])
    bare = _make_adapter(base, tmp_path / "bare", 6, 2, 4, ["kv_proj"], False)
    compressor = r"self_attn\.compressor\.\S*kv_proj\.lora_A\.weight: compressor and indexer projections take no"
    with pytest.raises(ValueError, match=compressor):
        make_llm(lora_modules=[f"bare={bare}"])
    params = _edited(adapters["attn"], tmp_path / "params", {"target_parameters": ["mlp.experts.gate_up_proj"]})
    with pytest.raises(ValueError, match=r"target_parameters \['mlp.experts.gate_up_proj'\] .* not supported"):
        make_llm(lora_modules=[f"p={params}"])
    experts = _edited(adapters["mlp"], tmp_path / "experts", {}, ("mlp.shared_experts.", "mlp.experts.0."))
    with pytest.raises(ValueError, match=r"mlp\.experts\.0\.\w+_proj.*routed experts and the router take no"):
        make_llm(lora_modules=[f"e={experts}"])
    unknown = _edited(adapters["attn"], tmp_path / "unknown", {"target_modules": ["q_a_proj", "wq_c"]})
    with pytest.raises(ValueError, match=r"modules \['wq_c'\] are not supported; LoRA applies to \[.*'o_b_proj'"):
        make_llm(lora_modules=[f"u={unknown}"])


def test_load_and_unload_at_run_time(
    adapters: dict[str, Path], refs: dict[str | None, list[list[int]]], make_llm: Callable[..., LLM]
) -> None:
    """With one slot: an adapter loaded at run time runs beside the base, is unloaded, and another
    loaded into its slot runs its own merged model's tokens (with MTP on)."""
    prompts = _prompts(2)
    llm = make_llm(2, enable_lora=True, max_loras=1, max_lora_rank=4)
    llm.load_lora("attn", str(adapters["attn"]))
    first = llm.generate(prompts, GREEDY, use_tqdm=False, lora=["attn", None])
    llm.unload_lora("attn")
    llm.load_lora("mlp", str(adapters["mlp"]))
    second = llm.generate(prompts, GREEDY, use_tqdm=False, lora=["mlp", None])
    with pytest.raises(ValueError, match="unknown LoRA adapter 'attn'"):
        llm.generate(prompts[:1], GREEDY, use_tqdm=False, lora="attn")
    assert [list(o.outputs[0].token_ids) for o in first] == [refs["attn"][0], refs[None][1]]
    assert [list(o.outputs[0].token_ids) for o in second] == [refs["mlp"][0], refs[None][1]]


def test_adapters_stay_on_the_device(base: Path, adapters: dict[str, Path]) -> None:
    """Device discipline with adapters: a step of three requests of two adapters and the base runs on
    a fake CUDA device with no host read (the per-token slots are uploaded, nothing is read back).
    One step only: fake tensors make each step cost seconds, and the adapter path is the same for
    every row kind (test_fake_device covers decodes, verifications and drafting without adapters)."""
    import dataclasses

    from pypto_serving.lora_weights import read_adapter
    from pypto_serving_deepseek_mtp.lora import attach_loras, explain, lora_shapes

    from .fake_cuda import CudaBindings, fake_cuda, fake_mode
    from .helpers import FakeCore
    from .test_fake_device import BLOCKS, _executor, _fake_batch

    ex, info = _executor(base)
    core = FakeCore(ex, info, num_blocks=BLOCKS)
    entries = [("a", list(range(3, 12)), 0, 1), ("b", list(range(20, 26)), 0, 1), ("c", list(range(60, 65)), 0, 1)]
    batch = core.batch(entries)
    # Adapters are read from disk before the fake device exists.
    loaded = [read_adapter(name, path, 4, lora_shapes(ex.cfg), explain) for name, path in adapters.items()]
    with fake_mode(), CudaBindings():
        model, memo = ex.model, {}
        for name in ("embed", "head", "norm", "hc_head", "layers", "inv_freq"):
            setattr(model, name, fake_cuda(getattr(model, name), memo))
        ex.mtp_layers = fake_cuda(ex.mtp_layers, memo)
        ex.device = model.device = torch.device("cuda")
        ex.init_kv_cache({g.name: BLOCKS for g in info.cache_groups})
        for adapter in loaded:
            adapter.pairs = fake_cuda(adapter.pairs, memo)
        ex.lora = attach_loras(model.layers, ex.cfg, loaded, 3, ex.dtype, ex.device)
        ex.lora_slots = {a.name: i for i, a in enumerate(loaded, start=1)}
        logits = ex.execute(dataclasses.replace(_fake_batch(batch), loras=["attn", None, "mlp"]))
        assert logits.device.type == "cuda" and logits.shape == (3, info.vocab_size)
        assert ex.lora.onehot is not None and ex.lora.onehot.device.type == "cuda"
        assert ex.lora.onehot.shape == (len(batch.input_ids_host), 3)


def test_tensor_parallel_ranks_serve_their_parts_of_the_adapters(
    base: Path, adapters: dict[str, Path], refs: dict[str | None, list[list[int]]]
) -> None:
    """Two ranks (spawned processes), each holding its part of every adapter (q_b_proj and the shared
    gate/up by output rows, o_b_proj and the shared down_proj by input columns, the replicated
    q_a_proj and kv_proj whole): requests of one adapter loaded at start, one loaded at run time (every
    rank reads it and installs its part) and the base, in one batch, give the merged models' tokens."""
    llm = LLM(
        model=str(base),
        plugins=plugin_manager(),
        device="cpu",
        dtype="float32",
        block_size=4,
        seed=0,
        tensor_parallel_size=2,
        worker_mode="process",
        lora_modules=[f"attn={adapters['attn']}"],
        max_lora_rank=4,
        max_loras=2,
    )
    try:
        assert llm.engine is not None and len(llm.engine.worker.pids) == 2
        llm.load_lora("mlp", str(adapters["mlp"]))
        loras: list[str | None] = ["attn", None, "mlp", "mlp", "attn", None]
        outs = llm.generate(_prompts(NUM_PROMPTS), GREEDY, use_tqdm=False, lora=loras)
    finally:
        llm.shutdown()
    assert [list(o.outputs[0].token_ids) for o in outs] == [refs[name][i] for i, name in enumerate(loras)]
