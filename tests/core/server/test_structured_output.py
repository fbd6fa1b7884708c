"""Structured output end to end: the official ``openai`` SDK against a real server on the embedded
trained tiny Qwen3 (a real model with a real tokenizer), so sampled outputs go wherever the model
leads and the grammar alone keeps them valid; plus the 400s of bad grammars, and async == sync and
n-gram and MTP speculation == none with grammars on."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from tests.conftest import plugin_installed
from tests.core.server.conftest import LiveServer

pytestmark = pytest.mark.requires_plugin("sync_sched")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"enum": ["cat", "dog", "fish"]},
    },
    "required": ["name", "age", "pet"],
    "additionalProperties": False,
}


def _tiny_qwen3() -> Any:
    qwen = pytest.importorskip("pypto_serving_qwen.plugin")
    return qwen.TINY_QWEN3


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
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def _chat(client: Any, **kw: Any) -> Any:
    return client.chat.completions.create(
        model="tiny-qwen3", messages=[{"role": "user", "content": "Describe a person as JSON."}], **kw
    )


def test_sampled_json_schema_outputs_all_validate(client: Any) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    chat = _chat(client, response_format=fmt, n=25, temperature=1.0, seed=1, max_tokens=64)
    text = client.completions.create(
        model="tiny-qwen3",
        prompt="A person:",
        n=25,
        temperature=1.0,
        seed=2,
        max_tokens=64,
        extra_body={"guided_json": SCHEMA},
    )
    outputs = [c.message.content for c in chat.choices] + [c.text for c in text.choices]
    assert len(outputs) == 50
    for c in [*chat.choices, *text.choices]:
        assert c.finish_reason == "stop"
    for out in outputs:
        jsonschema.validate(json.loads(out), SCHEMA)
    assert len(set(outputs)) > 5  # sampled, not one greedy answer


def test_json_object_is_parseable(client: Any) -> None:
    resp = _chat(client, response_format={"type": "json_object"}, n=4, temperature=0.7, seed=3, max_tokens=200)
    for c in resp.choices:
        if c.finish_reason == "stop":
            assert isinstance(json.loads(c.message.content), dict)
    assert any(c.finish_reason == "stop" for c in resp.choices)


def test_guided_choice_returns_a_choice(client: Any) -> None:
    choices = ["positive", "negative", 'neutral "maybe"']
    resp = client.completions.create(
        model="tiny-qwen3", prompt="Sentiment:", n=8, temperature=1.0, seed=4, max_tokens=16,
        extra_body={"guided_choice": choices},
    )  # fmt: skip
    assert all(c.text in choices and c.finish_reason == "stop" for c in resp.choices)


def test_guided_regex_matches(client: Any) -> None:
    pattern = r"[A-Z][a-z]{2,5}-[0-9]{3}"
    resp = _chat(client, n=8, temperature=1.0, seed=5, max_tokens=16, extra_body={"guided_regex": pattern})
    assert all(re.fullmatch(pattern, c.message.content) for c in resp.choices)


@pytest.mark.parametrize("extra", [{"ignore_eos": True}, {"min_tokens": 60}, {"ignore_eos": True, "min_tokens": 60}])
def test_the_grammar_end_ends_the_output_whatever_ignore_eos_and_min_tokens_say(
    client: Any, extra: dict[str, Any]
) -> None:
    """A complete grammar allows only EOS, and that EOS ends the request (finish_reason "stop"): with
    ``ignore_eos``, and before ``min_tokens``, rather than EOS tokens up to ``max_tokens``."""
    jsonschema = pytest.importorskip("jsonschema")
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    resp = _chat(
        client, response_format=fmt, n=3, temperature=1.0, seed=6, max_tokens=64, logprobs=True, extra_body=extra
    )
    for c in resp.choices:
        assert c.finish_reason == "stop", c.message.content
        jsonschema.validate(json.loads(c.message.content), SCHEMA)
        assert len(c.logprobs.content) < 60  # one entry per token: none ran on to min_tokens with EOS
    # Before min_tokens EOS waits while the grammar can go on: "yes" goes on to the longer choice.
    text = client.completions.create(
        model="tiny-qwen3", prompt="Answer:", n=4, temperature=1.0, seed=7, max_tokens=16,
        extra_body={**extra, "min_tokens": 10, "guided_choice": ["yes", "yes and no"]},
    )  # fmt: skip
    assert [(c.text, c.finish_reason) for c in text.choices] == [("yes and no", "stop")] * 4


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}}, "response_format"),
        ({"guided_regex": "[a-"}, "guided_regex"),
        ({"guided_choice": ["a", ""]}, "guided_choice"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
    ],
)  # fmt: skip
def test_bad_grammars_are_400s(client: Any, extra: dict[str, Any], param: str) -> None:
    openai = pytest.importorskip("openai")
    with pytest.raises(openai.BadRequestError) as info:
        _chat(client, max_tokens=4, extra_body=extra)
    assert info.value.status_code == 400
    assert info.value.body["param"] == param


def _offline(scheduler: str, spec: dict[str, Any] | None, stats: dict[str, Any] | None = None) -> list[str]:
    """The four grammar requests' texts; ``stats`` (when given) receives the engine's stats after them."""
    from pypto_serving import LLM, SamplingParams
    from pypto_serving.structured import StructuredSpec

    model = _tiny_qwen3()
    grammars = [
        StructuredSpec("json", json.dumps(SCHEMA)),
        StructuredSpec("regex", r"(ab|cd)+[0-9]{2}"),
        StructuredSpec("json_object"),
    ]
    prompts = ["A person:", "Letters: abab", "JSON: {"]
    params = [SamplingParams(temperature=0, max_tokens=48, structured=g) for g in grammars]
    params.append(SamplingParams(temperature=0.8, seed=7, max_tokens=48, structured=grammars[0]))
    prompts.append("Another person:")
    with LLM(model=str(model), device="cpu", worker_mode="inproc", scheduler=scheduler, speculative_config=spec) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        if stats is not None and llm.engine is not None:
            stats.update(llm.engine.stats())
    return [o.outputs[0].text for o in outs]


def test_async_and_ngram_speculation_equal_sync_with_grammars() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    plain = _offline("sync", None)
    jsonschema.validate(json.loads(plain[0]), SCHEMA)
    jsonschema.validate(json.loads(plain[3]), SCHEMA)
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "policy": "fixed", "prompt_lookup_min": 1}
    stats: dict[str, Any] = {}
    assert _offline("sync", ngram, stats) == plain
    # Equal outputs prove nothing unless drafts were verified under the grammars, some kept.
    assert stats["spec_drafted"] > 0 and stats["spec_accepted"] > 0
    if plugin_installed("async_sched"):
        assert _offline("async", None) == plain
        stats.clear()
        assert _offline("async", ngram, stats) == plain
        assert stats["spec_drafted"] > 0 and stats["spec_accepted"] > 0


def test_mtp_equals_no_speculation_with_grammars() -> None:
    """MTP drafts on the tiny DeepSeek-V4 are verified under the grammar (drafted rows get the mask
    after their drafts): the output equals decoding without speculation, greedy and seeded."""
    from pypto_serving import LLM, SamplingParams
    from pypto_serving.request import StructuredSpec

    model = pytest.importorskip("pypto_serving_deepseek_mtp.plugin").TINY_DEEPSEEK_V4
    grammars = [StructuredSpec("json", json.dumps(SCHEMA)), StructuredSpec("regex", r"(ab|cd)+[0-9]{2}")]
    params = [SamplingParams(temperature=0, max_tokens=32, structured=g) for g in grammars]
    params.append(SamplingParams(temperature=0.8, seed=3, max_tokens=32, structured=grammars[0]))
    prompts = ["A person:", "Letters: abab", "Another:"]
    runs = []
    for spec in (None, {"method": "mtp", "num_speculative_tokens": 2}):
        with LLM(
            model=str(model), device="cpu", worker_mode="inproc", scheduler="sync", speculative_config=spec
        ) as llm:
            runs.append([o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)])
            assert llm.engine is not None
            drafted = llm.engine.stats()["spec_drafted"]
    assert drafted > 0
    assert runs[0] == runs[1]


def test_grammar_masks_fill_beside_the_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every constrained step fills its masks on the worker's mask thread while its forward runs
    (the fill sees the forward in progress, and the forward sees the fill start), and the outputs,
    drafted rows included, equal filling the masks on the step's own thread before the forward."""
    from pypto_serving import runner
    from pypto_serving_qwen.executor import QwenExecutor

    ngram = {"method": "ngram", "num_speculative_tokens": 3, "policy": "fixed", "prompt_lookup_min": 1}
    monkeypatch.setattr(runner.ModelRunner, "overlap_grammar_masks", False)
    serial = _offline("sync", ngram)
    monkeypatch.setattr(runner.ModelRunner, "overlap_grammar_masks", True)

    forward, filling = threading.Event(), threading.Event()
    overlapped: list[bool] = []
    started: list[bool] = []  # per step: whether it fills masks
    fill, start, execute = runner.fill_step_mask, runner.ModelRunner._start_masks, QwenExecutor.execute

    def probed_fill(entries: Any, greedy: bool) -> Any:
        overlapped.append(forward.wait(timeout=2) and threading.current_thread() is not threading.main_thread())
        filling.set()
        return fill(entries, greedy)

    def probed_start(self: runner.ModelRunner, *args: Any) -> Any:
        pending = start(self, *args)
        started.append(pending is not None)
        return pending

    def probed_execute(self: QwenExecutor, batch: Any) -> Any:
        forward.set()
        try:
            return execute(self, batch)
        finally:
            if started and started[-1]:  # the executor's CPU warm-up steps run before any step
                filling.wait(timeout=2)
            forward.clear()
            filling.clear()

    monkeypatch.setattr(runner.ModelRunner, "_start_masks", probed_start)
    monkeypatch.setattr(runner, "fill_step_mask", probed_fill)
    monkeypatch.setattr(QwenExecutor, "execute", probed_execute)
    assert _offline("sync", ngram) == serial
    assert overlapped and all(overlapped) and len(overlapped) == sum(started)
