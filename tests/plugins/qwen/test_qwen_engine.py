"""End-to-end greedy generation through the engine vs transformers' greedy ``generate``.

Skipped until the engine (``pypto_serving.LLM``) and the scheduler plugins are available.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
import torch

pypto_serving = pytest.importorskip("pypto_serving")
if not hasattr(pypto_serving, "LLM"):
    pytest.skip("pypto_serving.LLM is not built yet", allow_module_level=True)

from pypto_serving import LLM, SamplingParams  # noqa: E402

MAX_TOKENS = 32
PROMPT_LENGTHS = [3, 5, 8, 11, 16, 21, 27, 34]
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _prompts(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(4, vocab, (n,), generator=gen).tolist() for n in lengths]


def _shared_prefix_prompts(vocab: int) -> list[list[int]]:
    """Eight prompts over one 16-token prefix (four whole blocks of 4) plus distinct tails."""
    prefix = _prompts(vocab, [16], seed=11)[0]
    return [prefix + tail for tail in _prompts(vocab, [1, 2, 3, 4, 5, 7, 9, 12], seed=12)]


def _hf_greedy(hf: Any, prompts: list[list[int]]) -> list[list[int]]:
    """transformers greedy decoding of exactly MAX_TOKENS tokens per prompt through HF's own KV cache.

    A hand loop rather than ``generate``: generate() refills ``eos_token_id=None`` from the model's
    generation config, and ignore_eos needs eos fully off."""
    outs = []
    for p in prompts:  # one at a time: no padding, so the reference is exactly the unbatched model
        tokens: list[int] = []
        with torch.no_grad():
            out = hf(input_ids=torch.tensor([p]), use_cache=True)
            for _ in range(MAX_TOKENS):
                tokens.append(int(out.logits[0, -1].argmax()))
                out = hf(input_ids=torch.tensor([tokens[-1:]]), cache=out.cache, use_cache=True)
        outs.append(tokens)
    return outs


def _plugin_manager() -> Any:
    """Entry-point plugins, plus this plugin in-process when it is not pip-installed yet."""
    if "qwen" in {ep.name for ep in metadata.entry_points(group="pypto_serving")}:
        return None
    from pypto_serving.plugins import PluginManager
    from pypto_serving_qwen import plugin

    return PluginManager(extra_plugins=[plugin])


@pytest.fixture
def make_llm() -> Iterator[Callable[..., Any]]:
    made: list[Any] = []

    def make(path: Path, **settings: Any) -> Any:
        values: dict[str, Any] = dict(
            device="cpu", dtype="float32", block_size=4, max_model_len=128, worker_mode="inproc", seed=0
        )
        values.update(settings)
        try:
            llm = LLM(model=str(path), plugins=_plugin_manager(), **values)
        except Exception as e:
            if "scheduler" in str(e) and "unknown" in str(e):
                pytest.skip(f"scheduler plugins are not installed: {e}")
            raise
        made.append(llm)
        return llm

    yield make
    for llm in made:
        llm.shutdown()


def _generate(llm: Any, prompts: list[list[int]]) -> list[list[int]]:
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert len(outputs) == len(prompts)
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.mark.parametrize("name", ["qwen2", "qwen3", "qwen3_moe"])
def test_greedy_matches_transformers(
    name: str,
    qwen_checkpoints: Callable[[str], Path],
    hf_reference: Callable[[Path], Any],
    make_llm: Callable[..., Any],
) -> None:
    path = qwen_checkpoints(name)
    prompts = _prompts(320, PROMPT_LENGTHS, seed=10)
    llm = make_llm(path)
    assert _generate(llm, prompts) == _hf_greedy(hf_reference(path), prompts)
    # The cos/sin rows came from the model's table (RopeTable), grown to the longest sequence.
    model = llm.engine.worker._runner.executor.model
    assert model.rope_table.rows >= max(PROMPT_LENGTHS) + MAX_TOKENS


@pytest.mark.parametrize("library", ["mkl", "onednn"])
@pytest.mark.parametrize("name", ["qwen2", "qwen3"])
def test_greedy_matches_transformers_with_packed_linears(
    name: str,
    library: str,
    qwen_checkpoints: Callable[[str], Path],
    hf_reference: Callable[[Path], Any],
    make_llm: Callable[..., Any],
) -> None:
    """Float32 greedy decoding is token for token transformers' with every projection packed: MKL's
    copy for the 8-row decode steps of max_num_seqs=8, or oneDNN's for every step."""
    path = qwen_checkpoints(name)
    prompts = _prompts(320, PROMPT_LENGTHS, seed=10)
    llm = make_llm(path, max_num_seqs=8, executor_options={"cpu_linear": library})
    assert _generate(llm, prompts) == _hf_greedy(hf_reference(path), prompts)


def test_greedy_steps_take_the_maxima_the_output_projection_writes(
    qwen_checkpoints: Callable[[str], Path],
    hf_reference: Callable[[Path], Any],
    make_llm: Callable[..., Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With the native panels, a greedy step's argmax is taken by the output projection as it writes
    the logits: every greedy step whose row count its panels take (``takes_maxima``) hands the sampler
    maxima equal to the logits' ``amax`` and ``argmax``, the others none; a step that reads only the
    maxima (``maxima_only``, every other such step here) gets no logits written (``[rows, 0]``); the
    tokens stay transformers'."""
    import pypto_kernels as K
    from pypto_serving_qwen.executor import QwenExecutor

    if K.native.library() is None:
        pytest.skip("no native CPU kernels on this machine (no C compiler)")
    path = qwen_checkpoints("qwen3")
    steps: list[tuple[int, bool]] = []
    execute, maxima = QwenExecutor.execute, QwenExecutor.logits_maxima

    def spy(self: QwenExecutor, batch: Any) -> torch.Tensor:
        assert batch.maxima_only == batch.greedy_maxima  # greedy requests that read nothing else
        batch.maxima_only = batch.maxima_only and len(steps) % 2 == 0
        logits = execute(self, batch)
        got = maxima(self)
        rows = batch.logits_indices.shape[0]
        if batch.greedy_maxima:
            assert self.model is not None and (got is not None) == self.model.takes_maxima(rows)
            steps.append((rows, got is not None))
        if got is not None and batch.maxima_only:
            assert logits.shape == (rows, 0)  # nothing written: the sampler reads the maxima only
        elif got is not None:
            assert torch.equal(got[0], logits.amax(-1)) and torch.equal(got[1], logits.argmax(-1))
        return logits

    monkeypatch.setattr(QwenExecutor, "execute", spy)
    prompts = _prompts(320, PROMPT_LENGTHS, seed=10)
    # One forward a command: every decode step goes through ``execute`` (auto runs several a command
    # as the executor's greedy loop, which test_native_decoder.py checks).
    llm = make_llm(path, max_num_seqs=8, executor_options={"cpu_linear": "panels"}, num_scheduler_steps=1)
    assert _generate(llm, prompts) == _hf_greedy(hf_reference(path), prompts)
    assert sum(taken for _, taken in steps) >= MAX_TOKENS - 1  # the 8-row decode steps at least
    assert sum(taken for _, taken in steps[::2]) >= (MAX_TOKENS - 1) // 2  # half of them unwritten


def test_chunked_prefill(
    qwen_checkpoints: Callable[[str], Path], hf_reference: Callable[[Path], Any], make_llm: Callable[..., Any]
) -> None:
    """A budget of 8 tokens per step splits every longer prompt into chunks mixed with decodes."""
    path = qwen_checkpoints("qwen3")
    prompts = _prompts(320, PROMPT_LENGTHS, seed=13)
    llm = make_llm(path, max_num_batched_tokens=8, max_num_seqs=4, enable_chunked_prefill=True)
    assert _generate(llm, prompts) == _hf_greedy(hf_reference(path), prompts)


def test_prefix_caching_shared_prefix(
    qwen_checkpoints: Callable[[str], Path], hf_reference: Callable[[Path], Any], make_llm: Callable[..., Any]
) -> None:
    path = qwen_checkpoints("qwen2")
    prompts = _shared_prefix_prompts(320)
    llm = make_llm(path, enable_prefix_caching=True)
    expected = _hf_greedy(hf_reference(path), prompts)
    assert _generate(llm, prompts[:1]) == expected[:1]  # warm the cache with the prefix
    assert _generate(llm, prompts) == expected  # the rest reuse its blocks


def test_kv_pressure_preemption(
    qwen_checkpoints: Callable[[str], Path], hf_reference: Callable[[Path], Any], make_llm: Callable[..., Any]
) -> None:
    """24 blocks of 4 tokens hold one longest request (34 + 32 tokens = 17 blocks) but nowhere near
    all eight, so requests are preempted and recomputed; outputs must not change."""
    path = qwen_checkpoints("qwen3_moe")
    prompts = _prompts(320, PROMPT_LENGTHS, seed=14)
    llm = make_llm(path, num_kv_blocks=24, enable_prefix_caching=False)
    assert _generate(llm, prompts) == _hf_greedy(hf_reference(path), prompts)


def test_worker_process_mode(
    qwen_checkpoints: Callable[[str], Path], hf_reference: Callable[[Path], Any], make_llm: Callable[..., Any]
) -> None:
    path = qwen_checkpoints("qwen3_sharded")
    prompts = _prompts(320, PROMPT_LENGTHS, seed=15)
    llm = make_llm(path, worker_mode="process", max_num_batched_tokens=16)
    assert _generate(llm, prompts) == _hf_greedy(hf_reference(path), prompts)


def test_several_forwards_a_command_keep_every_token(
    qwen_checkpoints: Callable[[str], Path], hf_reference: Callable[[Path], Any], make_llm: Callable[..., Any]
) -> None:
    """num_scheduler_steps=4 in a worker process under async scheduling: greedy tokens are
    transformers', seeded sampled tokens with a penalty and their logprobs are those of one forward a
    command, and the worker really ran several forwards a command (fewer steps)."""
    path = qwen_checkpoints("qwen3")
    prompts = _prompts(320, PROMPT_LENGTHS[:4], seed=16)
    sampled = SamplingParams(
        temperature=0.8, top_p=0.9, seed=7, max_tokens=MAX_TOKENS, ignore_eos=True, repetition_penalty=1.3, logprobs=2
    )
    runs = []
    for steps in (1, 4):
        llm = make_llm(path, worker_mode="process", scheduler="async", num_scheduler_steps=steps)
        greedy = _generate(llm, prompts)
        outs = [o.outputs[0] for o in llm.generate(prompts, sampled, use_tqdm=False)]
        runs.append((greedy, [(o.token_ids, o.logprobs) for o in outs], llm.engine.stats()["num_steps"]))
    assert runs[1][:2] == runs[0][:2]
    assert runs[0][0] == _hf_greedy(hf_reference(path), prompts)
    assert runs[1][2] < runs[0][2] / 2


def test_one_request_runs_its_later_greedy_forwards_as_a_native_loop(
    qwen_checkpoints: Callable[[str], Path], hf_reference: Callable[[Path], Any], make_llm: Callable[..., Any]
) -> None:
    """A request alone on the CPU (auto: up to 8 forwards a command) over a tied head packed as panels
    (what the engine's rule picks on the benchmark shapes; this tiny one is left plain otherwise):
    each command's forwards after its first run as the native loop (``NativeDecoder.greedy_run``),
    its tokens transformers'; a stop token met inside the loop ends the request there."""
    path = qwen_checkpoints("qwen3_tied")
    prompts = _prompts(320, [6, 13], seed=17)
    llm = make_llm(path, executor_options={"cpu_linear": "panels"})
    ref = _hf_greedy(hf_reference(path), prompts)
    assert [_generate(llm, [p])[0] for p in prompts] == ref
    model = llm.engine.worker._runner.executor.model
    assert model.greedy_loop_steps > len(prompts) * MAX_TOKENS // 2
    stop = ref[0][11]  # where it first comes in the output
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, stop_token_ids=[stop], ignore_eos=True)
    out = llm.generate([prompts[0]], params, use_tqdm=False)[0].outputs[0]
    assert (out.token_ids, out.finish_reason) == (ref[0][: ref[0].index(stop) + 1], "stop")


def test_sampled_rows_are_drawn_by_the_native_kernel_with_the_torch_draws_tokens(
    qwen_checkpoints: Callable[[str], Path], make_llm: Callable[..., Any]
) -> None:
    """On the CPU the executor hands the runner its C draw (``draw_kernel``): seeded requests with a
    temperature, top-k, top-p and min-p are drawn by it (its row count grows), their tokens are those
    the sampler's torch ops draw for the same logits, and a request's tokens alone are its tokens in
    the batch."""
    llm = make_llm(qwen_checkpoints("qwen3"))
    prompts = _prompts(320, [5, 9, 14, 7], seed=23)
    filters: list[dict[str, Any]] = [{}, {"top_k": 12}, {"top_p": 0.8}, {"min_p": 0.05, "top_p": 0.95}]
    params = [
        SamplingParams(temperature=0.9, seed=40 + i, max_tokens=MAX_TOKENS, ignore_eos=True, **f)
        for i, f in enumerate(filters)
    ]

    def run(batch: list[int]) -> list[list[int]]:
        outs = llm.generate([prompts[i] for i in batch], [params[i] for i in batch], use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    runner = llm.engine.worker._runner
    kernel = runner.executor.draws
    assert kernel is not None and runner.draw is kernel
    with_kernel = run([0, 1, 2, 3])
    assert kernel.rows >= len(prompts) * MAX_TOKENS
    assert run([2]) == [with_kernel[2]]
    runner.draw = None  # the sampler's torch ops
    assert run([0, 1, 2, 3]) == with_kernel
    assert len({tuple(t) for t in with_kernel}) == len(prompts)


def test_a_lone_sampled_request_runs_its_forwards_as_the_native_loop_with_the_samplers_tokens(
    qwen_checkpoints: Callable[[str], Path], make_llm: Callable[..., Any]
) -> None:
    """A request alone on the CPU with a temperature, top-k, top-p or min-p (and nothing else read of
    its logits) runs each command's forwards as the native loop drawing its tokens
    (``Executor.sampled_steps``), and they are the tokens of its forwards one by one through the
    sampler; several requests' loops (greedy and sampled rows together) too; a stop token drawn inside
    the loop ends it there; a request with penalties declines."""
    path = qwen_checkpoints("qwen3_tied")
    llm = make_llm(path, executor_options={"cpu_linear": "panels"})
    prompts = _prompts(320, [6, 13, 9], seed=29)
    filters: list[dict[str, Any]] = [{"top_p": 0.9}, {"top_k": 7, "min_p": 0.02}, {}]
    params = [
        SamplingParams(temperature=1.1, seed=60 + i, max_tokens=MAX_TOKENS, ignore_eos=True, **f)
        for i, f in enumerate(filters)
    ]

    def run(i: int, sp: SamplingParams | None = None) -> Any:
        return llm.generate([prompts[i]], sp or params[i], use_tqdm=False)[0].outputs[0]

    runner, model = llm.engine.worker._runner, llm.engine.worker._runner.executor.model
    looped = [list(run(i).token_ids) for i in range(len(prompts))]
    assert model.sampled_loop_steps > len(prompts) * MAX_TOKENS // 2
    runner._sampled_loops = False  # the forwards one by one through the sampler (its native draw)
    before = model.sampled_loop_steps
    assert [list(run(i).token_ids) for i in range(len(prompts))] == looped
    assert model.sampled_loop_steps == before
    # Several requests at once (their forwards a command as one loop through the model's forward,
    # greedy and sampled rows together): the tokens of their forwards one by one.
    batch = [*params, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)]
    prompts_all = [*prompts, prompts[0]]
    one_by_one = [list(o.outputs[0].token_ids) for o in llm.generate(prompts_all, batch, use_tqdm=False)]
    runner._sampled_loops = True
    before = model.sampled_loop_steps
    together = [list(o.outputs[0].token_ids) for o in llm.generate(prompts_all, batch, use_tqdm=False)]
    assert together == one_by_one and model.sampled_loop_steps > before
    stop = looped[0][9]
    out = run(0, SamplingParams(temperature=1.1, seed=60, top_p=0.9, max_tokens=MAX_TOKENS, stop_token_ids=[stop]))
    assert (out.token_ids, out.finish_reason) == (looped[0][: looped[0].index(stop) + 1], "stop")
    before = model.sampled_loop_steps
    run(1, SamplingParams(temperature=1.1, seed=61, max_tokens=8, presence_penalty=0.5, ignore_eos=True))
    assert model.sampled_loop_steps == before


# ----------------------------------------------------------------------------- generation_config.json

GEN_DEFAULTS = {"temperature": 0.0, "min_p": 0.2, "repetition_penalty": 1.8, "presence_penalty": 1.5}


@pytest.fixture
def qwen_with_defaults(qwen_checkpoints: Callable[[str], Path], tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    """A copy of the qwen3 checkpoint whose generation_config.json also sets min_p and penalties;
    returns it with every sampling default the file now holds."""
    path = tmp_path / "qwen3_defaults"
    shutil.copytree(qwen_checkpoints("qwen3"), path)
    gen = {**json.loads((path / "generation_config.json").read_text()), **GEN_DEFAULTS}
    (path / "generation_config.json").write_text(json.dumps(gen))
    return path, {k: gen[k] for k in ("temperature", "top_p", "top_k", *GEN_DEFAULTS)}


def test_generation_config_defaults_are_all_applied(
    qwen_with_defaults: tuple[Path, dict[str, Any]], make_llm: Callable[..., Any]
) -> None:
    path, expected = qwen_with_defaults
    llm = make_llm(path)
    assert llm.engine.info.generation_defaults == expected
    defaults = llm.default_sampling_params()
    assert (defaults.min_p, defaults.repetition_penalty, defaults.presence_penalty) == (0.2, 1.8, 1.5)
    prompt = _prompts(320, [9], seed=16)[0]

    def tokens(params: SamplingParams | None) -> list[int]:
        return list(llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids)

    explicit = SamplingParams(**expected)  # and SamplingParams()'s max_tokens, as the defaults have
    assert tokens(None) == tokens(explicit)
    assert tokens(explicit) != tokens(SamplingParams(temperature=0.0))  # the penalties change the output


def test_server_applies_every_generation_config_default(
    qwen_with_defaults: tuple[Path, dict[str, Any]], make_llm: Callable[..., Any]
) -> None:
    """A completion that sets no sampling field samples as the checkpoint's defaults say."""
    from fastapi.testclient import TestClient

    from pypto_serving import ServingSettings
    from pypto_serving.server import AsyncLLM, build_app

    path, expected = qwen_with_defaults
    prompt = _prompts(320, [9], seed=16)[0]
    params = SamplingParams(**{**expected, "max_tokens": 12})
    llm = make_llm(path)
    offline = list(llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids)
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    assert offline != list(llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids)
    settings = ServingSettings(
        model=str(path), device="cpu", dtype="float32", block_size=4, max_model_len=128, worker_mode="inproc"
    )
    server = AsyncLLM(settings, _plugin_manager())
    try:
        server.wait_ready(120)
        with TestClient(build_app(server, manage_engine=False)) as client:
            r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 12, "logprobs": 0})
        assert r.status_code == 200, r.text
        served = [int(t.removeprefix("token_id:")) for t in r.json()["choices"][0]["logprobs"]["tokens"]]
    finally:
        server.shutdown(10)
    assert served == offline


@pytest.fixture
def info_logging() -> Iterator[str]:
    """This process's logging as ``pypto-serving serve`` sets it (a root handler at INFO, its format);
    restored after."""
    import logging

    root = logging.getLogger()
    handler = logging.StreamHandler()
    fmt = "%(levelname)s from %(name)s: %(message)s"
    handler.setFormatter(logging.Formatter(fmt))
    levels = root.level, logging.getLogger("pypto_serving").level
    root.handlers.insert(0, handler)  # first: the one a child copies (pytest's capture handlers follow)
    root.setLevel(logging.INFO)
    logging.getLogger("pypto_serving").setLevel(logging.INFO)
    try:
        yield fmt
    finally:
        root.removeHandler(handler)
        root.setLevel(levels[0])
        logging.getLogger("pypto_serving").setLevel(levels[1])


def test_a_spawned_worker_logs_as_the_engine_does(
    make_llm: Callable[..., Any], qwen_checkpoints: Callable[[str], Path], info_logging: str, capfd: Any
) -> None:
    """The worker process copies the engine's logging (level and format), so what the executor says
    at load (its INFO lines) reaches the operator as the engine's own lines do."""
    make_llm(qwen_checkpoints("qwen3"), worker_mode="process")
    err = capfd.readouterr().err
    assert "INFO from pypto_serving_qwen.executor: loaded Qwen3ForCausalLM" in err, err[-2000:]
