"""Prompt logprobs (vLLM's ``prompt_logprobs``, and ``echo`` with ``logprobs`` on /v1/completions)
against an independent reference: ``log_softmax`` over transformers' logits of the tiny Qwen3 on the
whole prompt. The engine computes them in prefill chunks (a small token budget splits the prompt) and
even when the prompt sits in the prefix cache (such a request bypasses the cache)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.core.server.conftest import LiveServer

pytestmark = pytest.mark.requires_plugin("sync_sched")
pytest.importorskip("transformers.models.qwen3", reason="transformers with Qwen3 not installed")

PROMPT = "def main():\n    print('hello world')\n    return 0\n\nif __name__ == '__main__':\n    main()\n"
ATOL = 2e-3  # our CPU kernels and transformers' differ in summation order only


def _tiny_qwen3() -> Any:
    return pytest.importorskip("pypto_serving_qwen.plugin").TINY_QWEN3


@pytest.fixture(scope="module")
def reference() -> tuple[list[int], torch.Tensor]:
    """The prompt's ids and transformers' log-probabilities ``[len, vocab]`` of each next token."""
    from transformers import AutoModelForCausalLM

    from pypto_serving.tokenizer import Tokenizer

    model = AutoModelForCausalLM.from_pretrained(str(_tiny_qwen3()), torch_dtype=torch.float32).eval()
    ids = Tokenizer(_tiny_qwen3()).encode(PROMPT)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return ids, torch.log_softmax(logits, dim=-1)


def _check(ids: list[int], ref: torch.Tensor, got: list[dict[int, float] | None], k: int) -> None:
    assert len(got) == len(ids) and got[0] is None
    for i in range(1, len(ids)):
        entry = got[i]
        assert entry is not None
        assert abs(entry[ids[i]] - float(ref[i - 1, ids[i]])) < ATOL, i
        top = ref[i - 1].topk(k)
        others = {t: v for t, v in entry.items() if t != ids[i] or t in top.indices.tolist()}
        assert sorted(others) == sorted(top.indices.tolist()), i
        for t, v in zip(top.indices.tolist(), top.values.tolist()):
            assert abs(entry[t] - v) < ATOL


def test_prompt_logprobs_over_chunks_and_a_cached_prompt(reference: tuple[list[int], torch.Tensor]) -> None:
    from pypto_serving import LLM, SamplingParams

    ids, ref = reference
    assert len(ids) > 24  # the 8-token budget splits the prompt into several chunks
    settings = {"device": "cpu", "worker_mode": "inproc", "scheduler": "sync", "max_num_batched_tokens": 8}
    with LLM(model=str(_tiny_qwen3()), block_size=4, **settings) as llm:
        llm.generate([ids], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)  # caches the prompt
        again = llm.generate([ids], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0]
        assert again.num_cached_tokens > 0  # the prompt is in the prefix cache
        out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3), use_tqdm=False)[0]
    assert out.num_cached_tokens == 0  # it was computed, not taken from the cache
    assert out.prompt_logprobs is not None
    _check(ids, ref, out.prompt_logprobs, 3)
    assert out.outputs[0].token_ids == again.outputs[0].token_ids


@pytest.mark.parametrize("scheduler", ["sync", "async"])
def test_prompt_logprobs_survive_preemption(reference: tuple[list[int], torch.Tensor], scheduler: str) -> None:
    """Two requests too long for the KV blocks together: one is preempted and recomputed (its prompt
    scored again), and each keeps exactly one entry per prompt token, equal to the reference."""
    from pypto_serving import LLM, SamplingParams

    if scheduler == "async":
        pytest.importorskip("pypto_serving_async_sched")
    ids, ref = reference
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, prompt_logprobs=1)
    settings = {"device": "cpu", "worker_mode": "inproc", "max_num_batched_tokens": 16, "block_size": 4}
    # One forward a command keeps the two decodes in step, so they run out of blocks together
    # (under auto one takes its blocks ahead, runs ahead and finishes first: no preemption).
    settings["num_scheduler_steps"] = 1
    with LLM(model=str(_tiny_qwen3()), scheduler=scheduler, num_kv_blocks=24, **settings) as llm:
        outs = llm.generate([ids, ids], params, use_tqdm=False)
        assert llm.engine is not None
        assert llm.engine.stats()["num_preemptions"] > 0
    for out in outs:
        assert out.prompt_logprobs is not None
        _check(ids, ref, out.prompt_logprobs, 1)


@pytest.fixture(scope="module")
def client() -> Iterator[Any]:
    openai = pytest.importorskip("openai")
    from pypto_serving import PluginManager, ServingSettings
    from pypto_serving.server import AsyncLLM, build_app

    settings = ServingSettings(
        model=str(_tiny_qwen3()), device="cpu", worker_mode="inproc", scheduler="sync", engine_mode="thread",
        max_num_batched_tokens=16,
    )  # fmt: skip
    llm = AsyncLLM(settings, PluginManager())
    llm.wait_ready(60)
    live = LiveServer(build_app(llm, manage_engine=False), llm=llm)
    yield openai.OpenAI(base_url=f"{live.url}/v1", api_key="unused", max_retries=0)
    live.stop()
    llm.shutdown(10)


def test_server_prompt_logprobs(client: Any, reference: tuple[list[int], torch.Tensor]) -> None:
    ids, ref = reference
    resp = client.completions.create(
        model="tiny-qwen3", prompt=PROMPT, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 2}
    )
    got = resp.choices[0].model_extra["prompt_logprobs"]
    assert got[0] is None and len(got) == len(ids)
    for i in range(1, len(ids)):
        entry = got[i][str(ids[i])]
        assert abs(entry["logprob"] - float(ref[i - 1, ids[i]])) < ATOL
        rank = int((ref[i - 1] > ref[i - 1, ids[i]]).sum()) + 1
        assert entry["rank"] == (rank if rank <= 2 else None)  # ranks are known within the top 2
    chat = client.chat.completions.create(
        model="tiny-qwen3",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=2,
        extra_body={"prompt_logprobs": 0},
    )
    assert chat.model_extra["prompt_logprobs"][0] is None and len(chat.model_extra["prompt_logprobs"]) > 3


def _echo_logprobs(client: Any, stream: bool, n: int) -> tuple[str, dict[str, list[Any]]]:
    """The text and the ``logprobs`` lists of an echoed greedy completion, streamed chunks joined."""
    kw = {"model": "tiny-qwen3", "prompt": PROMPT, "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": n}
    keys = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    if not stream:
        choice = client.completions.create(**kw).choices[0]
        return choice.text, {k: list(getattr(choice.logprobs, k)) for k in keys}
    chunks = [c.choices[0] for c in client.completions.create(stream=True, **kw) if c.choices]
    parts = [c.logprobs for c in chunks if c.logprobs is not None]
    return "".join(c.text for c in chunks), {k: [x for p in parts for x in getattr(p, k)] for k in keys}


@pytest.mark.parametrize("n", [1, 3])
def test_echo_with_logprobs_scores_the_prompt(client: Any, reference: tuple[list[int], torch.Tensor], n: int) -> None:
    """Echoed prompt tokens carry their logprob and the top ``logprobs`` tokens, as the outputs do,
    streamed or not; both responses agree entry by entry."""
    from pypto_serving.tokenizer import Tokenizer

    ids, ref = reference
    tok = Tokenizer(_tiny_qwen3())

    def name(t: int) -> str:  # as the server names a token in top_logprobs
        text = tok.decode([t], skip_special_tokens=False)
        return f"token_id:{t}" if "\ufffd" in text else text

    got = {stream: _echo_logprobs(client, stream, n) for stream in (False, True)}
    for text, lp in got.values():
        assert text.startswith(PROMPT)
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert len(lp["tokens"]) == len(lp["top_logprobs"]) == len(ids) + 3
        for i in range(1, len(ids)):
            assert abs(lp["token_logprobs"][i] - float(ref[i - 1, ids[i]])) < ATOL
            top = ref[i - 1].topk(n)
            assert set(lp["top_logprobs"][i]) == {name(t) for t in [*top.indices.tolist(), ids[i]]}, i
            for t, v in zip(top.indices.tolist(), top.values.tolist()):
                assert abs(lp["top_logprobs"][i][name(t)] - v) < ATOL
        for i in range(len(ids), len(ids) + 3):  # the outputs: the top n and the sampled token
            assert n <= len(lp["top_logprobs"][i]) <= n + 1
    (text, whole), (streamed_text, streamed) = got[False], got[True]
    assert streamed_text == text
    assert streamed["tokens"] == whole["tokens"] and streamed["text_offset"] == whole["text_offset"]
    assert streamed["token_logprobs"][1:] == pytest.approx(whole["token_logprobs"][1:], abs=ATOL)
    for a, b in zip(streamed["top_logprobs"][1:], whole["top_logprobs"][1:]):
        assert a.keys() == b.keys() and list(a.values()) == pytest.approx(list(b.values()), abs=ATOL)


def test_prompt_logprobs_refusals(client: Any) -> None:
    import openai

    for extra, param in (({"prompt_logprobs": 21}, "prompt_logprobs"),):
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model="tiny-qwen3", prompt="hi", max_tokens=2, extra_body=extra)
        assert info.value.body["param"] == param
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(
            model="tiny-qwen3", prompt="hi", max_tokens=2, stream=True, extra_body={"prompt_logprobs": 1}
        )
    assert info.value.body["param"] == "prompt_logprobs"
