"""The OpenAI bodies' ``priority`` (vLLM's field) through the server: accepted under
``scheduling_policy = "priority"`` with the tokens the same request gets without it, and under
``fcfs`` a 400 naming the field and the setting for any value but the default 0."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tests.core.server.test_server_validation import CHAT, COMPLETION, err, post

pytest.importorskip("pypto_serving_sync_sched")

BODIES = {
    COMPLETION: {"prompt": [5, 6, 7], "max_tokens": 5, "temperature": 0.8, "seed": 11},
    CHAT: {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "temperature": 0.8, "seed": 11},
}


def _tokens(r: Any) -> str:
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return str(choice["text"] if "text" in choice else choice["message"]["content"])


@pytest.mark.parametrize("path", [COMPLETION, CHAT])
def test_priority_is_accepted_under_the_priority_policy_and_refused_under_fcfs(
    make_client: Callable[..., tuple[Any, Any]], path: str
) -> None:
    fcfs, _ = make_client()
    prio, _ = make_client(scheduling_policy="priority")
    body = BODIES[path]
    plain = _tokens(post(fcfs, path, body))
    for priority in (-3, 0, 7):
        assert _tokens(post(prio, path, {**body, "priority": priority})) == plain  # order never changes tokens
    e = err(post(fcfs, path, {**body, "priority": 7}), "priority")
    assert "scheduling_policy" in e["message"] and "priority=7" in e["message"], e
    assert _tokens(post(fcfs, path, {**body, "priority": 0})) == plain  # the default, as vLLM accepts it
    err(post(prio, path, {**body, "priority": "high"}), "priority")  # strict integers
    err(post(prio, path, {**body, "priority": 1.5}), "priority")
