"""A request's grammar compiles in the worker while the request waits, never inside a step (issue 25,
vLLM's WAITING_FOR_FSM): the engine sends the grammar when the request is added, the scheduler passes
the request over until a result says it is compiled, and the requests behind it keep stepping. The
worker's compile is made slow here (1.5 s), so a step that waited on it would show."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from pypto_serving.request import StructuredSpec
from pypto_serving.structured import GrammarCompiler
from tests.core.server.server_helpers import write_fake_model

pytestmark = pytest.mark.requires_plugin("sync_sched")

VOCAB, EOS = 320, 2
SLOW = StructuredSpec("choice", json.dumps(["yes", "yes and", "yes and no"]))
OTHER = StructuredSpec("regex", "[a-c]{2}( [a-c]{2}){0,3}")
DELAY = 1.5


@pytest.fixture
def model(tmp_path: Path) -> Path:
    return write_fake_model(tmp_path / "m", VOCAB)


@pytest.fixture
def slow_compile(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The worker's compile of ``SLOW`` takes ``DELAY`` more seconds; returns when each ended."""
    ends: list[float] = []
    compile_one = GrammarCompiler._compile

    def slow(self: GrammarCompiler, spec: StructuredSpec, eos: tuple[int, ...]) -> Any:
        if spec == SLOW:
            time.sleep(DELAY)
        out = compile_one(self, spec, eos)
        ends.append(time.monotonic())
        return out

    monkeypatch.setattr(GrammarCompiler, "_compile", slow)
    return ends


def _run(engine: Any) -> dict[str, list[float]]:
    """Step ``engine`` until it is idle; per request, when each step that touched it ended."""
    seen: dict[str, list[float]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            seen.setdefault(out.request_id, []).append(time.monotonic())
    return seen


@pytest.mark.parametrize("scheduler", ["sync", "async"])
def test_other_requests_keep_stepping_while_a_grammar_compiles(
    make_llm: Any, model: Path, slow_compile: list[float], scheduler: str
) -> None:
    """The grammar requests come first, yet the free request keeps stepping while their grammar
    compiles (no step waits on it); they are admitted once the worker reports it compiled, while the
    free request still runs, and their outputs (greedy and seeded) are those they have alone."""
    from pypto_serving import SamplingParams

    if scheduler == "async":
        pytest.importorskip("pypto_serving_async_sched")
    options = {"vocab": VOCAB, "eos": EOS, "step_sleep": 0.04}  # the free request outlasts the compile
    llm = make_llm(model=str(model), executor_options=options, scheduler=scheduler)
    engine = llm.engine
    structured = [
        SamplingParams(temperature=0, max_tokens=24, structured=SLOW),
        SamplingParams(temperature=1.0, seed=3, max_tokens=24, structured=SLOW),
    ]
    start = time.monotonic()
    engine.add_request("slow", [5, 6, 7], structured[0])
    engine.add_request("seeded", [8, 9], structured[1])
    engine.add_request("free", [5, 6], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    requests = {r.request_id: r for r in engine.scheduler.live_requests()}
    seen = _run(engine)
    compiled = slow_compile[0]
    assert compiled - start >= DELAY
    free_done = requests["free"].metrics.finished_time
    assert free_done is not None and free_done > compiled
    gaps = [b - a for a, b in zip([start, *seen["free"]], seen["free"])]
    assert len(gaps) == 50 and max(gaps) < DELAY / 3, "a step waited on the compile"
    for rid in ("slow", "seeded"):  # admitted when the compile is reported, beside the free request
        first = requests[rid].metrics.first_scheduled_time
        assert first is not None and compiled <= first < free_done
    alone = llm.generate([[5, 6, 7], [8, 9]], structured, use_tqdm=False)  # compiled by now: no wait
    assert [o.outputs[0].token_ids for o in alone] == [requests[r].output_token_ids for r in ("slow", "seeded")]
    assert alone[0].outputs[0].text in json.loads(SLOW.source)
    assert engine.kv.usage == 0.0


def test_a_grammar_request_alone_is_admitted_before_its_compile_ends(
    make_llm: Any, model: Path, slow_compile: list[float]
) -> None:
    """With nothing else to run the request is admitted at once: its first step waits on the compile
    (nobody else waits), and no empty steps poll for it."""
    from pypto_serving import SamplingParams

    llm = make_llm(model=str(model), executor_options={"vocab": VOCAB, "eos": EOS})
    engine = llm.engine
    engine.add_request("slow", [5, 6, 7], SamplingParams(temperature=0, max_tokens=24, structured=SLOW))
    request = engine.scheduler.live_requests()[0]
    _run(engine)
    assert request.metrics.first_scheduled_time is not None
    assert request.metrics.first_scheduled_time < slow_compile[0]
    assert engine.scheduler.stats.num_steps == len(request.output_token_ids)  # one step per token, none empty
    assert request.error is None and request.out.detokenizer is not None


def test_aborting_a_request_whose_grammar_compiles_frees_everything(
    make_llm: Any, model: Path, slow_compile: list[float]
) -> None:
    """Aborted while its grammar waits for the compile thread: the worker cancels that compile and
    forgets the request; blocks and scheduler state are all given back."""
    from pypto_serving import SamplingParams

    llm = make_llm(model=str(model), executor_options={"vocab": VOCAB, "eos": EOS})
    engine = llm.engine
    compiler: GrammarCompiler = engine.worker._runner._grammars
    engine.add_request("slow", [5, 6, 7], SamplingParams(temperature=0, max_tokens=8, structured=SLOW))
    engine.add_request("queued", [8, 9], SamplingParams(temperature=0, max_tokens=8, structured=OTHER))
    engine.add_request("free", [5, 6], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    engine.step()  # sends both grammars: SLOW compiles, OTHER waits behind it on the compile thread
    engine.abort("queued")
    engine.abort("slow")
    _run(engine)
    assert not compiler._requests and not compiler._unreported
    assert (OTHER, (EOS,)) not in compiler._templates  # cancelled before it started
    assert not engine.scheduler.requests and not engine.scheduler.waiting
    assert engine.kv.usage == 0.0


# ----------------------------------------------------------------------------- the scheduler alone


def _sched(max_num_seqs: int = 8, num_blocks: int = 32) -> Any:
    from pypto_serving import ServingSettings
    from pypto_serving.kv_cache import KVCacheManager
    from pypto_serving.scheduler import Scheduler, SchedulerConfig
    from pypto_serving.speculative import no_speculation
    from tests.fakes import FakeExecutor

    settings = ServingSettings(block_size=4)
    info = FakeExecutor(settings).load()
    kv = KVCacheManager(info.cache_groups, {"kv": num_blocks})
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_model_len=info.max_model_len)
    return Scheduler(config, kv, info, no_speculation(settings))


def _req(rid: str, spec: StructuredSpec | None = None) -> Any:
    from pypto_serving.request import Request, SamplingParams

    return Request(rid, [1, 2, 3], SamplingParams(max_tokens=4, structured=spec), (EOS,))


def _step(s: Any, ready: list[str] | None = None) -> Any:
    from pypto_serving.messages import StepResult

    out = s.schedule()
    sampled = {e.request_id: [7] for e in out.command.entries if e.sample}
    s.grammars_compiled(ready or [])
    s.update(out, StepResult(out.command.step_id, sampled=sampled))
    return out


def test_admission_passes_over_a_request_whose_grammar_compiles() -> None:
    """The grammar goes out with the first command; the request waits, in its place, while others
    are admitted behind it; once reported compiled it is admitted; preemption keeps that."""
    s = _sched()
    s.add_request(_req("g", SLOW))
    s.add_request(_req("a"))
    first = _step(s)
    assert [g.request_id for g in first.command.compile_grammars] == ["g"]
    assert [e.request_id for e in first.command.entries] == ["a"]
    assert [r.request_id for r in s.waiting] == ["g"]
    s.add_request(_req("b"))
    second = _step(s, ready=["g"])  # "g" is reported with this step's result: admitted next step
    assert [e.request_id for e in second.command.entries] == ["a", "b"] and not second.command.compile_grammars
    third = _step(s)
    assert "g" in [e.request_id for e in third.command.entries]
    from pypto_serving.scheduler import _StepBuilder

    s._preempt(s.requests["g"], _StepBuilder(step_id=3, budget=0, uniform=False))
    assert s.requests["g"].sched.grammar_ready  # readiness outlives preemption


def test_alone_a_grammar_request_is_admitted_and_finishing_forgets_its_grammar() -> None:
    """Nothing else to run: the first not-ready request is admitted at once (and only it). A request
    that finishes before its grammar is sent takes it back; one sent tells the worker to forget it."""
    s = _sched()
    s.add_request(_req("g1", SLOW))
    s.add_request(_req("g2", OTHER))
    first = _step(s)
    assert [e.request_id for e in first.command.entries] == ["g1"]
    s.add_request(_req("g3", OTHER))
    s.abort(["g3"])  # never sent
    s.abort(["g2"])  # sent
    out = s.schedule()
    assert not out.command.compile_grammars and out.command.forget_grammars == ["g2"]
