"""The engine process keeps one record per request: every per-request fact is on the ``Request``,
and at most two maps keyed by request id exist in a running engine (issue 26)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from pypto_serving import SamplingParams
from pypto_serving.request import KVState, OutputState, Request, SchedState
from pypto_serving.worker import WorkerClient

pytest.importorskip("pypto_serving_sync_sched")

_RECORD = (Request, SchedState, KVState, OutputState)  # the record itself holds dicts keyed by group
# The worker's state is the worker process's (here in-process, reached through the client).
_NOT_ENGINE = (*_RECORD, WorkerClient)


def _containers(root: object) -> Iterator[tuple[str, object]]:
    """Every dict, set and list reachable from ``root`` through attributes of the core's objects
    (``__dict__`` and slots), not descending into the per-request record or the worker, with its path."""
    seen: set[int] = set()
    todo: list[tuple[str, object]] = [(type(root).__name__, root)]
    while todo:
        path, obj = todo.pop()
        if id(obj) in seen or isinstance(obj, _NOT_ENGINE):
            continue
        seen.add(id(obj))
        if isinstance(obj, dict | set | frozenset | list | tuple):
            yield path, obj
            items = obj.values() if isinstance(obj, dict) else obj
            todo += [(f"{path}[]", v) for v in items if not isinstance(v, str | int | float | bytes)]
            continue
        if not type(obj).__module__.startswith("pypto_serving"):
            continue
        names = list(getattr(obj, "__dict__", {})) + [
            n for cls in type(obj).__mro__ for n in getattr(cls, "__slots__", ())
        ]
        for name in names:
            value = getattr(obj, name, None)
            if (value is not None and not callable(value)) or isinstance(value, dict | list | set):
                todo.append((f"{path}.{name}", value))


def _keyed_by_request_ids(engine: Any, ids: set[str]) -> list[str]:
    found = []
    for path, c in _containers(engine):
        keys = c.keys() if isinstance(c, dict) else c if isinstance(c, set | frozenset) else ()
        if any(isinstance(k, str) and k in ids for k in keys):
            found.append(path)
    return sorted(found)


@pytest.mark.parametrize("options", [{}, {"window": 8}], ids=["full", "window"])
@pytest.mark.parametrize("scheduler", ["sync", "async"])
def test_a_running_engine_has_at_most_two_maps_keyed_by_request_id(
    make_llm: Callable[..., Any], options: dict[str, Any], scheduler: str
) -> None:
    """Mid-run (requests waiting, running, preempted, aborted, one of n = 2 choices), the maps
    keyed by request ids are the engine's user requests and the scheduler's live requests."""
    if scheduler == "async":
        pytest.importorskip("pypto_serving_async_sched")
    llm = make_llm(block_size=4, num_kv_blocks=24, max_num_seqs=3, scheduler=scheduler, executor_options=options)
    engine = llm.engine
    prompts = [[(7 * i + j) % 90 + 1 for j in range(5 + 3 * i)] for i in range(6)]
    for i, p in enumerate(prompts):
        engine.add_request(f"u{i}", p, SamplingParams(max_tokens=12, n=2 if i == 0 else 1, ignore_eos=True))
    engine.abort("u5")
    seen: set[str] = set()
    for _ in range(6):
        engine.step()
        live = {r.request_id for r in engine.scheduler.live_requests()}
        ids = live | {r.out.user_request_id for r in engine.scheduler.live_requests()}
        seen |= set(_keyed_by_request_ids(engine, ids))
    assert engine.scheduler.running and engine.scheduler.waiting  # the check saw both queues
    assert seen == {"EngineCore._users", "EngineCore.scheduler.requests"}, seen


def test_the_walk_finds_a_map_keyed_by_request_ids(make_llm: Callable[..., Any]) -> None:
    """The check can fail: a map added beside the record is found."""
    engine = make_llm(block_size=4, num_kv_blocks=24).engine
    engine.add_request("x", [1, 2, 3], SamplingParams(max_tokens=4))
    engine.kv.extra = {"x": 1}
    assert any(p.endswith("kv.extra") for p in _keyed_by_request_ids(engine, {"x"}))
