"""Multi-LoRA on the Qwen executor: three random PEFT adapters (different ranks, targets, rsLoRA) and
the base model mixed in one batch give, request by request, transformers' greedy tokens with that
adapter merged (``merge_and_unload``); prefix-cache hits never cross adapters; unusable adapters are
refused with clear errors."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from pypto_serving import LLM, SamplingParams
from pypto_serving.config import ServingSettings

peft = pytest.importorskip("peft")

MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
#: name -> (rank, alpha, targets, rslora)
ADAPTERS: dict[str, tuple[int, int, list[str], bool]] = {
    "attn": (4, 8, ["q_proj", "k_proj", "v_proj", "o_proj"], False),
    "mlp": (8, 16, ["gate_proj", "up_proj", "down_proj"], True),
    "mixed": (2, 6, ["q_proj", "v_proj", "o_proj", "down_proj", "up_proj"], False),
}


def _make_adapter(base: Path, dst: Path, seed: int, rank: int, alpha: int, targets: list[str], rslora: bool) -> Path:
    """A PEFT adapter over ``base`` with every LoRA weight drawn at random (PEFT's init zeroes B,
    which would make every adapter the base model)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=rslora)
    wrapped = peft.get_peft_model(model, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if "lora_" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
    wrapped.save_pretrained(str(dst))
    return dst


def _merged(base: Path, adapter: Path | None) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32).eval()
    if adapter is None:
        return model
    return peft.PeftModel.from_pretrained(model, str(adapter)).merge_and_unload().eval()


def _hf_greedy(hf: Any, prompt: list[int]) -> list[int]:
    tokens: list[int] = []
    with torch.no_grad():
        for _ in range(MAX_TOKENS):
            logits = hf(input_ids=torch.tensor([prompt + tokens])).logits
            tokens.append(int(logits[0, -1].argmax()))
    return tokens


@pytest.fixture(scope="module")
def adapters(qwen_checkpoints: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base, root = qwen_checkpoints("qwen3"), tmp_path_factory.mktemp("loras")
    return {
        name: _make_adapter(base, root / name, seed, *spec)
        for seed, (name, spec) in enumerate(ADAPTERS.items(), start=1)
    }


@pytest.fixture
def make_llm(qwen_checkpoints: Callable[[str], Path]) -> Iterator[Callable[..., LLM]]:
    made: list[LLM] = []

    def make(**settings: Any) -> LLM:
        values: dict[str, Any] = dict(
            device="cpu", dtype="float32", block_size=4, max_model_len=128, worker_mode="inproc", seed=0
        )
        llm = LLM(model=str(qwen_checkpoints("qwen3")), **{**values, **settings})
        made.append(llm)
        return llm

    yield make
    for llm in made:
        llm.shutdown()


def _modules(adapters: dict[str, Path]) -> list[str]:
    return [f"{name}={path}" for name, path in adapters.items()]


def _prompts(n: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(4, 320, (5 + 3 * i,), generator=gen).tolist() for i in range(n)]


@pytest.mark.parametrize("cpu_linear", ["reference", "onednn"])
def test_mixed_batch_matches_merged_adapters(
    cpu_linear: str, adapters: dict[str, Path], qwen_checkpoints: Callable[[str], Path], make_llm: Callable[..., LLM]
) -> None:
    """Eight requests of three adapters and the base in one batch: each equals its merged model."""
    base = qwen_checkpoints("qwen3")
    loras: list[str | None] = ["attn", None, "mlp", "mixed", "mixed", "attn", None, "mlp"]
    prompts = _prompts(len(loras))
    llm = make_llm(lora_modules=_modules(adapters), max_lora_rank=8, executor_options={"cpu_linear": cpu_linear})
    outs = llm.generate(prompts, GREEDY, use_tqdm=False, lora=loras)
    got = [list(o.outputs[0].token_ids) for o in outs]
    refs = {name: _merged(base, None if name is None else adapters[name]) for name in set(loras)}
    want = [_hf_greedy(refs[name], p) for name, p in zip(loras, prompts, strict=True)]
    assert got == want
    # The adapters change the output: a broken delta (e.g. always zero) could not pass.
    assert len({tuple(_hf_greedy(refs[n], prompts[0])) for n in refs}) == len(refs)


def test_prefix_cache_never_crosses_adapters(adapters: dict[str, Path], make_llm: Callable[..., LLM]) -> None:
    prompt = _prompts(1)[0] * 4  # 20 tokens: four whole blocks of 4 to share
    llm = make_llm(lora_modules=_modules(adapters), max_lora_rank=8, enable_prefix_caching=True)
    first = llm.generate([prompt], GREEDY, use_tqdm=False, lora="attn")[0]
    other = llm.generate([prompt], GREEDY, use_tqdm=False, lora="mlp")[0]
    base = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    again = llm.generate([prompt], GREEDY, use_tqdm=False, lora="attn")[0]
    assert [o.num_cached_tokens for o in (first, other, base)] == [0, 0, 0]
    assert again.num_cached_tokens > 0  # the same adapter does hit
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


def test_unknown_adapter_is_refused(adapters: dict[str, Path], make_llm: Callable[..., LLM]) -> None:
    llm = make_llm(lora_modules=_modules(adapters), max_lora_rank=8)
    with pytest.raises(ValueError, match=r"unknown LoRA adapter 'nope'; loaded: \['attn', 'mixed', 'mlp'\]"):
        llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False, lora="nope")


def _edited(src: Path, dst: Path, **config: Any) -> Path:
    dst.mkdir()
    (dst / "adapter_model.safetensors").write_bytes((src / "adapter_model.safetensors").read_bytes())
    cfg = json.loads((src / "adapter_config.json").read_text())
    (dst / "adapter_config.json").write_text(json.dumps({**cfg, **config}))
    return dst


def test_bad_adapters_are_refused(adapters: dict[str, Path], tmp_path: Path, make_llm: Callable[..., LLM]) -> None:
    with pytest.raises(ValueError, match="rank 8 exceeds max_lora_rank=4"):
        make_llm(lora_modules=[f"mlp={adapters['mlp']}"], max_lora_rank=4)
    saved = _edited(adapters["attn"], tmp_path / "saved", modules_to_save=["lm_head"])
    with pytest.raises(ValueError, match=r"modules_to_save \['lm_head'\] .* is not supported"):
        make_llm(lora_modules=[f"s={saved}"])
    embed = _edited(adapters["attn"], tmp_path / "embed", target_modules=["q_proj", "embed_tokens"])
    with pytest.raises(ValueError, match=r"target modules \['embed_tokens'\] are not supported"):
        make_llm(lora_modules=[f"e={embed}"])
    narrow = _edited(adapters["attn"], tmp_path / "narrow")
    tensors = load_file(str(narrow / "adapter_model.safetensors"))
    key = next(k for k in tensors if "lora_A" in k)
    tensors[key] = tensors[key][:, :32].contiguous()  # an adapter of a model with hidden size 32
    save_file(tensors, str(narrow / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match="do not fit the base model's"):
        make_llm(lora_modules=[f"n={narrow}"])
    with pytest.raises(ValueError, match="not a PEFT adapter directory"):
        make_llm(lora_modules=[f"x={tmp_path}"])
    with pytest.raises(ValueError, match="lora_modules has 3 adapters but max_loras=2"):
        ServingSettings(lora_modules=_modules(adapters), max_loras=2)
    with pytest.raises(ValueError, match="is not 'name=path'"):
        ServingSettings(lora_modules=["no-path"])
    with pytest.raises(ValueError, match="graph_mode='inductor'"):
        make_llm(lora_modules=[f"a={adapters['attn']}"], executor_options={"graph_mode": "inductor"})
    with pytest.raises(ValueError, match="enable_lora is not supported with executor_options graph_mode='inductor'"):
        make_llm(enable_lora=True, executor_options={"graph_mode": "inductor"})


def test_server_selects_adapters_by_model(
    adapters: dict[str, Path], qwen_checkpoints: Callable[[str], Path], make_llm: Callable[..., LLM]
) -> None:
    """Concurrent completions naming three adapters and the base model: each request's tokens are its
    merged model's; /v1/models lists the adapters under the base; an unknown model is a 404."""
    from concurrent.futures import ThreadPoolExecutor

    from fastapi.testclient import TestClient

    from pypto_serving.server import AsyncLLM, build_app

    base = qwen_checkpoints("qwen3")
    settings = ServingSettings(
        model=str(base),
        served_model_name="base",
        device="cpu",
        dtype="float32",
        block_size=4,
        max_model_len=128,
        worker_mode="inproc",
        lora_modules=_modules(adapters),
        max_lora_rank=8,
    )
    models = ["attn", "base", "mlp", "mixed", "attn", "mixed"]
    prompts = _prompts(len(models))
    server = AsyncLLM(settings)
    try:
        server.wait_ready(120)
        with TestClient(build_app(server, manage_engine=False)) as client:
            listed = client.get("/v1/models").json()["data"]
            missing = client.post("/v1/completions", json={"model": "nope", "prompt": [5, 6], "max_tokens": 2})

            def complete(model: str, prompt: list[int]) -> Any:
                body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": 0}
                return client.post("/v1/completions", json={**body, "ignore_eos": True})

            with ThreadPoolExecutor(len(models)) as pool:
                replies = list(pool.map(complete, models, prompts))
            streamed = client.post("/v1/completions", json={"model": "mlp", "prompt": [5, 6], "stream": True})
    finally:
        server.shutdown(10)
    assert [(m["id"], m.get("parent")) for m in listed] == [
        ("base", None),
        ("attn", "base"),
        ("mlp", "base"),
        ("mixed", "base"),
    ]
    assert missing.status_code == 404 and "'nope' does not exist" in missing.json()["error"]["message"]
    for r in replies:
        assert r.status_code == 200, r.text
    got = [[int(t.removeprefix("token_id:")) for t in r.json()["choices"][0]["logprobs"]["tokens"]] for r in replies]
    refs = {m: _merged(base, adapters.get(m)) for m in set(models)}
    assert got == [_hf_greedy(refs[m], p) for m, p in zip(models, prompts, strict=True)]
    assert [r.json()["model"] for r in replies] == models
    chunks = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    assert chunks and {c["model"] for c in chunks} == {"mlp"}


def test_lora_modules_flag_takes_several_adapters() -> None:
    import argparse

    from pypto_serving.config import add_settings_arguments, lora_paths, settings_from_args

    parser = argparse.ArgumentParser()
    add_settings_arguments(parser)
    for words in (["a=/x", "b=/y"], ["a=/x,b=/y"]):
        settings = settings_from_args(parser.parse_args(["--lora-modules", *words]))
        assert lora_paths(settings) == {"a": "/x", "b": "/y"}
    with pytest.raises(ValueError, match="names each adapter once"):
        ServingSettings(lora_modules="a=/x,a=/y")


def test_mixed_adapters_run_on_the_device(adapters: dict[str, Path], qwen_checkpoints: Callable[[str], Path]) -> None:
    """Device discipline with adapters: a prefill and a decode step mixing three adapters and the base
    run on a fake CUDA device with no host read (the one-hot is uploaded, never read back)."""
    import dataclasses

    from pypto_serving.lora_weights import read_adapter
    from pypto_serving_qwen.loader import read_config
    from pypto_serving_qwen.model import QwenForCausalLM
    from tests.plugins.qwen.fake_cuda import fake_cuda, on_device
    from tests.plugins.qwen.qwen_fixtures import PagedBatchBuilder
    from tests.plugins.qwen.test_fake_device import BLOCK_SIZE, NUM_BLOCKS, _execute, _fake_executor

    path = qwen_checkpoints("qwen3")
    builder = PagedBatchBuilder(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS)
    steps = [
        ([("a", list(range(4, 13))), ("b", list(range(5, 11))), ("c", list(range(6, 9)))], ["attn", None, "mixed"]),
        ([("a", [7]), ("b", [8]), ("c", [9]), ("d", list(range(30, 35)))], ["attn", None, "mixed", "mlp"]),
    ]
    # Adapters are read from disk before the fake device exists (their shapes from a real CPU model).
    shapes = QwenForCausalLM(read_config(path), torch.device("cpu"), torch.float32).lora_shapes()
    loaded = [read_adapter(name, p, 8, shapes) for name, p in adapters.items()]
    with fake_cuda() as mode:
        for adapter in loaded:  # the read weights become fake (CPU) tensors, moved to the device below
            adapter.pairs = {k: (mode.from_tensor(a), mode.from_tensor(b)) for k, (a, b) in adapter.pairs.items()}
        ex = _fake_executor(path, torch.float32)
        assert ex.model is not None and ex.config is not None
        ex.lora = ex.model.attach_loras(loaded)
        ex.lora_slots = {a.name: i for i, a in enumerate(loaded, start=1)}
        for chunks, names in steps:
            batch = dataclasses.replace(on_device(builder.step(chunks, all_logits=False)), loras=names)
            _execute(ex, batch, ex.config.vocab_size)


# ---------------------------------------------------------------------------- loads at run time


def _drive(engine: Any, outs: dict[str, Any], steps: int | None = None) -> None:
    """Step the engine ``steps`` times (None: until nothing is left), keeping the finished outputs."""
    while (steps is None and engine.has_unfinished()) or (steps is not None and steps > 0):
        outs.update({o.request_id: o for o in engine.step() if o.finished})
        steps = None if steps is None else steps - 1


@pytest.mark.parametrize(
    "async_scheduling",
    [
        pytest.param(False, marks=pytest.mark.requires_plugin("sync_sched")),
        pytest.param(True, marks=pytest.mark.requires_plugin("async_sched")),
    ],
)
def test_load_and_unload_while_requests_run(
    async_scheduling: bool,
    adapters: dict[str, Path],
    qwen_checkpoints: Callable[[str], Path],
    make_llm: Callable[..., LLM],
) -> None:
    """Requests of the base and of an adapter are mid-generation when another adapter loads and the
    first unloads: every request's tokens are its merged model's; a request naming the unloaded
    adapter is refused at once (404), its running request finishes, and only then is its slot free.

    Steps run while the adapter is read for as long as the read takes, so the request that holds the
    unloaded adapter's slot is added after the load: two steps (of one forward each) cannot finish
    its ten tokens."""
    from dataclasses import replace

    from pypto_serving.lora import LoraError

    llm = make_llm(
        lora_modules=[f"attn={adapters['attn']}"],
        max_lora_rank=8,
        max_loras=2,
        async_scheduling=async_scheduling,
        num_scheduler_steps=1,
    )
    engine, prompts, outs = llm.engine, _prompts(5), {}
    assert engine is not None and engine.scheduler_name == ("async" if async_scheduling else "sync")
    engine.add_request("base", prompts[0], GREEDY)
    engine.add_request("attn", prompts[1], replace(GREEDY, lora="attn"))
    _drive(engine, outs, 3)
    assert not outs and engine.has_unfinished()  # both run while the adapter loads
    keep = lambda done: outs.update({o.request_id: o for o in done if o.finished})  # noqa: E731
    assert engine.load_lora("mlp", str(adapters["mlp"]), on_outputs=keep) >= 0.0
    engine.add_request("mlp", prompts[2], replace(GREEDY, lora="mlp"))
    engine.add_request("attn-2", prompts[3], replace(GREEDY, lora="attn"))
    _drive(engine, outs, 2)
    engine.unload_lora("attn")
    assert engine.stats()["lora_adapters"] == ["mlp"]
    with pytest.raises(LoraError, match="unknown LoRA adapter 'attn'") as refused:
        engine.add_request("attn-late", prompts[0], replace(GREEDY, lora="attn"))
    assert refused.value.status == 404
    # The unloaded adapter's request still runs, so its slot is held: the two slots are taken.
    assert "attn-2" not in outs
    with pytest.raises(LoraError, match="no free LoRA slot") as full:
        engine.load_lora("mixed", str(adapters["mixed"]))
    assert full.value.status == 409
    _drive(engine, outs)
    engine.load_lora("mixed", str(adapters["mixed"]))  # the slot is free once attn's requests ended
    engine.add_request("mixed", prompts[4], replace(GREEDY, lora="mixed"))
    _drive(engine, outs)
    base = qwen_checkpoints("qwen3")
    order = {"base": (None, 0), "attn": ("attn", 1), "mlp": ("mlp", 2), "attn-2": ("attn", 3), "mixed": ("mixed", 4)}
    assert sorted(outs) == sorted(order)
    models = {a: _merged(base, adapters.get(a) if a else None) for a, _ in order.values()}
    refs = {n: _hf_greedy(models[a], prompts[i]) for n, (a, i) in order.items()}
    assert {n: list(outs[n].outputs[0].token_ids) for n in order} == refs


def test_prefix_cache_never_crosses_a_reloaded_name(
    adapters: dict[str, Path], qwen_checkpoints: Callable[[str], Path], make_llm: Callable[..., LLM]
) -> None:
    """A name unloaded and loaded again (here with another adapter, into the same slot) is a new
    adapter: the KV cached under the old one is never served to it, while it hits its own."""
    prompt, base = _prompts(1)[0] * 4, qwen_checkpoints("qwen3")
    llm = make_llm(lora_modules=[f"attn={adapters['attn']}"], max_lora_rank=8, enable_prefix_caching=True)
    first = llm.generate([prompt], GREEDY, use_tqdm=False, lora="attn")[0]
    llm.unload_lora("attn")
    llm.load_lora("attn", str(adapters["mixed"]))
    reloaded = llm.generate([prompt], GREEDY, use_tqdm=False, lora="attn")[0]
    again = llm.generate([prompt], GREEDY, use_tqdm=False, lora="attn")[0]
    assert (first.num_cached_tokens, reloaded.num_cached_tokens) == (0, 0)
    assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == reloaded.outputs[0].token_ids
    assert list(reloaded.outputs[0].token_ids) == _hf_greedy(_merged(base, adapters["mixed"]), prompt)
    assert reloaded.outputs[0].token_ids != first.outputs[0].token_ids


def test_server_loads_and_unloads_adapters_under_load(
    adapters: dict[str, Path], qwen_checkpoints: Callable[[str], Path], tmp_path: Path
) -> None:
    """Through the admin routes of a server (engine-core process): an adapter loaded while requests
    of the base and of another adapter run, then that one unloaded: every reply's tokens are its
    merged model's, /v1/models follows, and each refusal has its 4xx."""
    from concurrent.futures import ThreadPoolExecutor

    from fastapi.testclient import TestClient

    from pypto_serving.server import AsyncLLM, build_app

    base = qwen_checkpoints("qwen3")
    settings = ServingSettings(
        model=str(base),
        served_model_name="base",
        device="cpu",
        dtype="float32",
        block_size=4,
        max_model_len=128,
        worker_mode="inproc",
        lora_modules=[f"attn={adapters['attn']}"],
        max_lora_rank=4,
        max_loras=2,
        admin_api_key=["admin-secret"],
    )
    admin = {"Authorization": "Bearer admin-secret"}
    prompts = _prompts(3)
    embed = _edited(adapters["attn"], tmp_path / "embed", target_modules=["q_proj", "embed_tokens"])
    server = AsyncLLM(settings)
    try:
        server.wait_ready(120)
        with TestClient(build_app(server, manage_engine=False)) as client:

            def complete(model: str, prompt: list[int]) -> Any:
                body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "logprobs": 0}
                return client.post("/v1/completions", json={**body, "ignore_eos": True})

            def admin_post(route: str, name: str, path: Path | str | None = None) -> Any:
                body = {"lora_name": name} if path is None else {"lora_name": name, "lora_path": str(path)}
                return client.post(f"/v1/{route}_lora_adapter", json=body, headers=admin)

            with ThreadPoolExecutor(3) as pool:
                running = [pool.submit(complete, m, p) for m, p in (("base", prompts[0]), ("attn", prompts[1]))]
                loaded = admin_post("load", "mixed", adapters["mixed"])
                mixed = pool.submit(complete, "mixed", prompts[2])
                unloaded = admin_post("unload", "attn")
                late = complete("attn", prompts[1])
                replies = [f.result() for f in (*running, mixed)]
            listed = [m["id"] for m in client.get("/v1/models").json()["data"]]
            other = admin_post("load", "other", adapters["mixed"])  # attn's slot is free once its request ended
            refused = {
                "no admin key": client.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/x"}),
                "duplicate": admin_post("load", "mixed", adapters["mixed"]),
                "base name": admin_post("load", "base", adapters["mixed"]),
                "no slot": admin_post("load", "third", adapters["mixed"]),
            }
            admin_post("unload", "mixed")
            admin_post("unload", "other")
            refused |= {
                "missing dir": admin_post("load", "x", tmp_path / "nowhere"),
                "not peft": admin_post("load", "x", tmp_path),
                "rank": admin_post("load", "x", adapters["mlp"]),
                "targets": admin_post("load", "x", embed),
                "unknown": admin_post("unload", "nope"),
            }
            after = [m["id"] for m in client.get("/v1/models").json()["data"]]
    finally:
        server.shutdown(10)
    assert [r.status_code for r in (loaded, unloaded, other)] == [200, 200, 200], (loaded.text, unloaded.text)
    assert late.status_code == 404 and "'attn' does not exist" in late.json()["error"]["message"]
    for r in replies:
        assert r.status_code == 200, r.text
    got = [[int(t.removeprefix("token_id:")) for t in r.json()["choices"][0]["logprobs"]["tokens"]] for r in replies]
    names = ["base", "attn", "mixed"]
    assert got == [_hf_greedy(_merged(base, adapters.get(n)), p) for n, p in zip(names, prompts, strict=True)]
    assert (listed, after) == (["base", "mixed"], ["base"])
    statuses = {why: r.status_code for why, r in refused.items()}
    assert statuses == {
        "no admin key": 401,
        "duplicate": 409,
        "base name": 409,
        "no slot": 409,
        "missing dir": 400,
        "not peft": 400,
        "rank": 400,
        "targets": 400,
        "unknown": 404,
    }, {why: r.text for why, r in refused.items()}
    messages = {why: r.json()["error"]["message"] for why, r in refused.items()}
    assert "already loaded" in messages["duplicate"] and "no free LoRA slot" in messages["no slot"]
    assert "no such directory" in messages["missing dir"] and "not a PEFT adapter" in messages["not peft"]
    assert "rank 8 exceeds max_lora_rank=4" in messages["rank"] and "embed_tokens" in messages["targets"]


def test_loading_needs_lora_enabled(adapters: dict[str, Path], make_llm: Callable[..., LLM]) -> None:
    from pypto_serving.lora import LoraError

    llm = make_llm()
    with pytest.raises(LoraError, match="LoRA is not enabled") as off:
        llm.load_lora("attn", str(adapters["attn"]))
    assert off.value.status == 400
    with pytest.raises(LoraError, match="'nope' is not loaded") as missing:
        llm.unload_lora("nope")
    assert missing.value.status == 404
    enabled = make_llm(enable_lora=True, max_lora_rank=8)
    enabled.load_lora("attn", str(adapters["attn"]))  # LoRA on with no adapter at start
    assert enabled.engine is not None and enabled.engine.stats()["lora_adapters"] == ["attn"]


def test_a_new_engine_serves_the_adapters_loaded_at_run_time(
    adapters: dict[str, Path], make_llm: Callable[..., LLM]
) -> None:
    """After a failure the LLM starts a new engine with the adapters served at that moment: one
    loaded at run time is still served, one unloaded is not."""
    from pypto_serving.lora import LoraError

    prompt = _prompts(1)[0]
    llm = make_llm(lora_modules=[f"attn={adapters['attn']}"], max_lora_rank=8)
    llm.load_lora("mlp", str(adapters["mlp"]))
    llm.unload_lora("attn")
    before = llm.generate([prompt], GREEDY, use_tqdm=False, lora="mlp")[0]
    old = llm.engine
    assert old is not None
    old._die("a simulated worker failure")
    after = llm.generate([prompt], GREEDY, use_tqdm=False, lora="mlp")[0]
    assert llm.engine is not old and llm.settings.lora_modules == [f"mlp={adapters['mlp']}"]
    assert after.outputs[0].token_ids == before.outputs[0].token_ids
    with pytest.raises(LoraError, match="unknown LoRA adapter 'attn'"):
        llm.generate([prompt], GREEDY, use_tqdm=False, lora="attn")
