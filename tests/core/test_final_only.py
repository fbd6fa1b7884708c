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
    llm = make_llm(block_size=4, num_kv_blocks=64)
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
