"""Shared helpers for the async strategy tests: engines over the fake executor, a spy on the
strategy's calls into ``EngineCore``, and a step driver that checks the KV invariant every step."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from pypto_serving import LLM, SamplingParams
from pypto_serving.plugins import PluginManager
from tests.fakes import FakePlugin

VOCAB = 97
BLOCK = 4


def make_llm(
    scheduler: str = "async",
    *,
    k: int = 0,
    err: float = 0.0,
    worker_mode: str = "inproc",
    num_kv_blocks: int = 64,
    max_num_batched_tokens: int = 64,
    max_num_seqs: int = 64,
    options: dict[str, Any] | None = None,
    **settings: Any,
) -> LLM:
    """An engine over the fake executor; ``k`` > 0 turns on the fake drafter with error rate ``err``.
    Skips the calling test when the named strategy's plugin is not installed (tox envs hold one)."""
    if scheduler in ("sync", "async"):
        pytest.importorskip(f"pypto_serving_{scheduler}_sched")
    opts: dict[str, Any] = dict(options or {})
    if k:
        opts.update(max_draft=k, draft_error_rate=err)
        settings["speculative_config"] = {"method": "fake", "num_speculative_tokens": k}
    if scheduler != "auto":
        settings["scheduler"] = scheduler
    return LLM(
        executor="fake",
        plugins=PluginManager(extra_plugins=[FakePlugin]),
        worker_mode=worker_mode,
        block_size=BLOCK,
        num_kv_blocks=num_kv_blocks,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        executor_options=opts,
        **settings,
    )


def state(engine: Any) -> dict[str, tuple[int, int, int]]:
    """rid -> (num_computed_tokens, num_output_placeholders, num_tokens) of every live request."""
    return {
        r.request_id: (r.num_computed_tokens, r.num_output_placeholders, r.num_tokens)
        for r in engine.scheduler.live_requests()
    }


@dataclass
class Dispatch:
    out: Any  # SchedulerOutput
    before: dict[str, tuple[int, int, int]]
    after: dict[str, tuple[int, int, int]]


@dataclass
class Spy:
    """Wraps ``engine.schedule/submit/wait_result/apply`` (the strategy's only calls into the core)."""

    engine: Any
    on_apply: Callable[[Any, Any], None] | None = None  # called before the wrapped apply
    events: list[tuple[str, int]] = field(default_factory=list)
    dispatched: list[Dispatch] = field(default_factory=list)
    applied: list[tuple[Any, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        eng = self.engine
        schedule, submit, wait_result, apply = eng.schedule, eng.submit, eng.wait_result, eng.apply

        def _schedule() -> Any:
            before = state(eng)
            out = schedule()
            if out is not None:
                self.dispatched.append(Dispatch(out, before, state(eng)))
            return out

        def _submit(out: Any) -> None:
            self.events.append(("submit", out.command.step_id))
            submit(out)

        def _wait_result() -> Any:
            result = wait_result()
            self.events.append(("result", result.step_id))
            return result

        def _apply(out: Any, result: Any) -> None:
            if self.on_apply is not None:
                self.on_apply(out, result)
            self.events.append(("apply", out.command.step_id))
            self.applied.append((out, result))
            apply(out, result)

        eng.schedule, eng.submit, eng.wait_result, eng.apply = _schedule, _submit, _wait_result, _apply

    def entries(self) -> Iterable[Any]:
        for d in self.dispatched:
            yield from d.out.command.entries


def check_step_invariants(engine: Any) -> None:
    engine.kv.check_invariants(engine.scheduler.live_requests())
    for r in engine.scheduler.live_requests():
        assert r.num_output_placeholders >= 0, r.request_id
        assert r.num_computed_tokens <= r.num_tokens + r.num_output_placeholders, r.request_id


def run(
    engine: Any,
    requests: Iterable[tuple[str, list[int], SamplingParams]] = (),
    *,
    aborts: dict[int, list[str]] | None = None,
    max_steps: int = 5000,
    before_step: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Add ``requests``, step until all finish (aborting at the given step indices), checking the KV
    invariant after every step; then drain and check that nothing is left behind."""
    for rid, prompt, sp in requests:
        engine.add_request(rid, prompt, sp)
    aborts = aborts or {}
    results: dict[str, Any] = {}
    i = 0
    while engine.has_unfinished():
        if before_step is not None:
            before_step(i)
        for rid in aborts.get(i, []):
            engine.abort(rid)
        for out in engine.step():
            if out.finished:
                results[out.request_id] = out
        check_step_invariants(engine)
        i += 1
        assert i < max_steps, "no progress"
    for _ in range(3):  # the async strategy may still hold a step of finished requests
        engine.step()
        check_step_invariants(engine)
    assert_all_released(engine)
    return results


def assert_all_released(engine: Any) -> None:
    """No live request, no placeholder, no owned block, no step left in flight."""
    sched = engine.scheduler
    assert not sched.live_requests()
    assert not sched.requests
    assert not getattr(engine.strategy, "in_flight", ())
    assert engine.worker.in_flight == 0
    for pool in engine.kv.pools.values():
        assert pool.num_free == pool.num_blocks
        assert not any(pool.ref_cnt)
    engine.kv.check_invariants([])


def tokens(results: dict[str, Any]) -> dict[str, tuple[list[int], str | None]]:
    return {rid: (o.outputs[0].token_ids, o.outputs[0].finish_reason) for rid, o in results.items()}


def blocks_for(num_tokens: int) -> int:
    return math.ceil(num_tokens / BLOCK)


def make_char_tokenizer(path: Path) -> Path:
    """A ``tokenizer.json`` with one printable character per id (VOCAB ids) that decodes by
    concatenation, so stop strings can span several tokens."""
    from tokenizers import Tokenizer, decoders
    from tokenizers.models import WordLevel

    chars = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789!#$%&()*+,-./:;<=>?@[]^_{|}~"
    chars += "".join(chr(0x3B1 + i) for i in range(VOCAB - len(chars)))
    assert len(chars) == VOCAB
    tok = Tokenizer(WordLevel({c: i for i, c in enumerate(chars)}, unk_token="a"))
    tok.decoder = decoders.Fuse()
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    return path
