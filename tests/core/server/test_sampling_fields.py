"""vLLM's remaining sampling fields through the official ``openai`` SDK against a real server on the
embedded trained tiny Qwen3: ``logit_bias``, ``allowed_token_ids``, ``bad_words``,
``include_stop_str_in_output`` (their 400s too), checked against hand-written expectations built from
the same server's unconstrained greedy output; and offline, n-gram speculation and async scheduling
give the same tokens as plain sync decoding for requests that use them."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.conftest import plugin_installed
from tests.core.server.conftest import LiveServer

pytestmark = pytest.mark.requires_plugin("sync_sched")
pytest.importorskip("openai")

PROMPT = "The quick brown fox"


def _tiny_qwen3() -> Any:
    return pytest.importorskip("pypto_serving_qwen.plugin").TINY_QWEN3


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    from pypto_serving import PluginManager, ServingSettings
    from pypto_serving.server import AsyncLLM, build_app

    settings = ServingSettings(
        model=str(_tiny_qwen3()), device="cpu", worker_mode="inproc", scheduler="sync", engine_mode="thread"
    )
    llm = AsyncLLM(settings, PluginManager())
    llm.wait_ready(60)
    live = LiveServer(build_app(llm, manage_engine=False), llm=llm)
    yield live
    live.stop()
    llm.shutdown(10)


@pytest.fixture(scope="module")
def client(server: LiveServer) -> Any:
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def tok() -> Any:
    from pypto_serving.tokenizer import Tokenizer

    return Tokenizer(_tiny_qwen3())


def _complete(client: Any, **kw: Any) -> Any:
    body = {"model": "tiny-qwen3", "prompt": PROMPT, "max_tokens": 12, "temperature": 0.0, **kw}
    extra = {
        k: body.pop(k)
        for k in ("allowed_token_ids", "bad_words", "include_stop_str_in_output", "ignore_eos")
        if k in body
    }
    return client.completions.create(extra_body=extra, **body).choices[0]


def test_logit_bias_forces_a_token(client: Any, tok: Any) -> None:
    (x,) = tok.encode("x")
    out = _complete(client, logit_bias={str(x): 100}, max_tokens=6, ignore_eos=True)
    assert out.text == "x" * 6
    chat = client.chat.completions.create(
        model="tiny-qwen3", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0.0,
        logit_bias={str(x): 100}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert chat.choices[0].message.content == "x" * 4


def test_allowed_token_ids_limit_sampled_text(client: Any, tok: Any) -> None:
    ids = [tok.encode(c)[0] for c in "ab"]
    resp = client.completions.create(
        model="tiny-qwen3", prompt=PROMPT, max_tokens=10, temperature=1.0, n=4, seed=1,
        extra_body={"allowed_token_ids": ids, "ignore_eos": True},
    )  # fmt: skip
    for c in resp.choices:
        assert len(c.text) == 10 and set(c.text) <= set("ab"), c.text


def test_bad_words_change_the_greedy_text(client: Any, tok: Any) -> None:
    plain = _complete(client).text
    ids = tok.encode(plain)
    word = tok.decode(ids[1:3])  # a word of two tokens the model writes greedily
    assert word and word in plain
    banned = _complete(client, bad_words=[word]).text
    assert banned != plain and word not in banned
    assert banned.startswith(tok.decode(ids[:2]))  # the text before the word's last token is unchanged


@pytest.mark.parametrize("stream", [False, True])
def test_include_stop_str_in_output(client: Any, stream: bool) -> None:
    plain = _complete(client, max_tokens=16).text
    stop = plain[4:7]
    cut = plain.index(stop)
    for include, expected in ((False, plain[:cut]), (True, plain[: cut + len(stop)])):
        kw = {"stop": [stop], "max_tokens": 16, "include_stop_str_in_output": include}
        if stream:
            extra = {"include_stop_str_in_output": include}
            chunks = client.completions.create(
                model="tiny-qwen3", prompt=PROMPT, temperature=0.0, max_tokens=16, stop=[stop], stream=True,
                extra_body=extra,
            )  # fmt: skip
            text = "".join(c.choices[0].text for c in chunks if c.choices)
        else:
            text = _complete(client, **kw).text
        assert text == expected, (include, stop)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
        ({"logit_bias": {"999999": 1}}, "logit_bias"),
        ({"logit_bias": {"a": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"allowed_token_ids": [999999]}, "allowed_token_ids"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"bad_words": [""]}, "bad_words"),
    ],
)
def test_bad_token_fields_are_400s(client: Any, body: dict[str, Any], param: str) -> None:
    import openai

    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny-qwen3", prompt=PROMPT, max_tokens=2, extra_body=body)
    assert info.value.body["param"] == param


def _offline(scheduler: str, spec: dict[str, Any] | None) -> list[list[int]]:
    from pypto_serving import LLM, SamplingParams

    model = _tiny_qwen3()
    with LLM(model=str(model), device="cpu", worker_mode="inproc", scheduler=scheduler, speculative_config=spec) as llm:
        assert llm.engine is not None and llm.engine.tokenizer is not None
        ids = llm.engine.tokenizer.encode("abcabcabcabc abcabc")
        params = [
            SamplingParams(temperature=0.0, max_tokens=24, logit_bias={ids[0]: 4.0, ids[1]: -3.0}),
            SamplingParams(temperature=0.8, seed=5, max_tokens=24, allowed_token_ids=[*ids[:3], ids[-1]]),
            SamplingParams(temperature=0.0, max_tokens=24, bad_words_token_ids=[ids[1:3], [ids[0]]]),
            SamplingParams(temperature=0.9, top_p=0.9, seed=6, max_tokens=24, logit_bias={ids[2]: 2.0}),
        ]
        outs = llm.generate([ids] * len(params), params, use_tqdm=False)
        drafted = llm.engine.stats()["spec_drafted"]
    if spec is not None:
        assert drafted > 0  # the drafts were verified under the edits, not skipped
    return [o.outputs[0].token_ids for o in outs]


def test_speculation_and_async_equal_sync_with_token_fields() -> None:
    plain = _offline("sync", None)
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "policy": "fixed", "prompt_lookup_min": 1}
    assert _offline("sync", ngram) == plain
    if plugin_installed("async_sched"):
        assert _offline("async", None) == plain


def test_mtp_equals_no_speculation_with_token_fields() -> None:
    """MTP drafts on the tiny DeepSeek-V4 are verified through the same sampler rows, edits and bad-word
    bans included (a drafted row's bans follow its drafts): the tokens equal decoding without drafts."""
    from pypto_serving import LLM, SamplingParams

    model = pytest.importorskip("pypto_serving_deepseek_mtp.plugin").TINY_DEEPSEEK_V4
    runs = []
    for spec in (None, {"method": "mtp", "num_speculative_tokens": 2}):
        with LLM(
            model=str(model), device="cpu", worker_mode="inproc", scheduler="sync", speculative_config=spec
        ) as llm:
            assert llm.engine is not None and llm.engine.tokenizer is not None
            ids = llm.engine.tokenizer.encode("abcabcabcabc abcabc")
            greedy = llm.generate([ids], SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
            common = greedy.outputs[0].token_ids[:3]
            params = [
                SamplingParams(temperature=0.0, max_tokens=24, logit_bias={common[0]: 3.0, ids[1]: -3.0}),
                SamplingParams(temperature=0.8, seed=5, max_tokens=24, allowed_token_ids=[*ids[:3], *common]),
                SamplingParams(temperature=0.0, max_tokens=24, bad_words_token_ids=[common[1:3]]),
            ]
            outs = llm.generate([ids] * len(params), params, use_tqdm=False)
            runs.append([o.outputs[0].token_ids for o in outs])
            drafted = llm.engine.stats()["spec_drafted"]
    assert drafted > 0
    assert runs[0] == runs[1]
