"""``LLM.generate`` reads finished outputs only, so its requests are added ``final_only`` (vLLM's
``RequestOutputKind.FINAL_ONLY``): the engine builds each one's output once, finished, where a
request added without it is reported after every step; an abort still reports a final-only request."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

import pypto_serving.engine as engine_module
from pypto_serving import SamplingParams

pytestmark = pytest.mark.requires_plugin("sync_sched")

GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)


def test_generate_builds_each_output_once_finished(
    make_llm: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    llm = make_llm(block_size=4, num_kv_blocks=64)
    built: list[tuple[str, bool]] = []
    inner = engine_module._output

    def counted(choices: list[Any]) -> Any:
        out = inner(choices)
        built.append((out.request_id, out.finished))
        return out

    monkeypatch.setattr(engine_module, "_output", counted)
    two = SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True, n=2, seed=4)
    outs = llm.generate([[1, 2, 3], [4, 5], [6]], [GREEDY, two, GREEDY], use_tqdm=False)
    assert [len(c.token_ids) for o in outs for c in o.outputs] == [5, 3, 3, 5]
    assert sorted(built) == sorted((o.request_id, True) for o in outs)  # one output each, finished


def test_a_request_added_without_final_only_is_reported_every_step(make_llm: Callable[..., Any]) -> None:
    llm = make_llm(block_size=4, num_kv_blocks=64, num_scheduler_steps=1)  # one token a step
    engine = llm._live_engine()
    engine.add_request("every", [1, 2, 3], GREEDY)
    engine.add_request("final", [1, 2, 3], GREEDY, final_only=True)
    seen: dict[str, list[tuple[int, bool]]] = {"every": [], "final": []}
    while engine.has_unfinished():
        for out in engine.step():
            seen[out.request_id].append((len(out.outputs[0].token_ids), out.finished))
    assert seen["final"] == [(5, True)]
    assert seen["every"] == [(n, n == 5) for n in range(1, 6)]
    engine.add_request("aborted", [1, 2], GREEDY, final_only=True)
    assert engine.step() == []  # running: nothing to report yet
    engine.abort("aborted")
    (out,) = engine.step()
    assert out.request_id == "aborted" and out.finished and out.outputs[0].finish_reason == "abort"


class CountingTokenizer:
    """Decodes each token id to its own piece of text (``<id>``) and counts the calls."""

    def __init__(self) -> None:
        self.calls = 0

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        self.calls += 1
        return "".join(f"<{t}>" for t in ids)


def test_a_final_only_requests_text_is_decoded_once_it_finishes(make_llm: Callable[..., Any]) -> None:
    """A final-only request's text is left to its end (nobody reads it before), then decoded from
    all its tokens: the same text a request reported every step ends with, finished or aborted."""
    llm = make_llm(block_size=4, num_kv_blocks=64, executor_options={"vocab": 97}, num_scheduler_steps=1)
    engine = llm._live_engine()
    tok = engine.tokenizer = CountingTokenizer()
    engine.add_request("every", [5, 6, 7], GREEDY)
    engine.add_request("final", [5, 6, 7], GREEDY, final_only=True)
    texts: dict[str, str] = {}
    while engine.has_unfinished():
        before = tok.calls
        outs = engine.step()
        texts.update((o.request_id, o.outputs[0].text) for o in outs)
        if "final" not in texts:  # only the request reported every step decoded (two calls a token)
            assert tok.calls - before <= 2
    assert (
        texts["final"]
        == texts["every"]
        == "".join(f"<{t}>" for t in llm.generate([[5, 6, 7]], GREEDY)[0].outputs[0].token_ids)
    )
    engine.add_request("aborted", [5, 6, 7], GREEDY, final_only=True)
    engine.step()
    engine.step()
    engine.abort("aborted")
    (out,) = engine.step()
    assert out.outputs[0].finish_reason == "abort" and len(out.outputs[0].token_ids) == 2
    assert out.outputs[0].text == "".join(f"<{t}>" for t in out.outputs[0].token_ids)
