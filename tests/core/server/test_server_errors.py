"""A failed request tells the client why: the 500 body and the stream's error event carry the
request's own error (its first line; the traceback tail stays in the server log)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pypto_serving_sync_sched")

from tests.core.server.server_helpers import parse_sse

_CAUSE = "RuntimeError: fake executor asked to fail"


def test_failed_request_reports_its_error(make_client: Any) -> None:
    client, _ = make_client(executor_options={"fail_on_token": 7})
    r = client.post("/v1/completions", json={"prompt": [7, 8], "max_tokens": 3})
    assert r.status_code == 500, r.text
    error = r.json()["error"]
    assert error["code"] == "generation_failed" and _CAUSE in error["message"]
    assert "\n" not in error["message"] and "File " not in error["message"]

    r = client.post("/v1/completions", json={"prompt": [7, 8], "max_tokens": 3, "stream": True})
    events, done = parse_sse(r.text)
    assert done and _CAUSE in events[-1]["error"]["message"]
    assert "\n" not in events[-1]["error"]["message"]


def test_failed_chat_stream_reports_its_error(make_client: Any, fake_model_dir: Path) -> None:
    from pypto_serving.tokenizer import load_tokenizer

    messages = [{"role": "user", "content": "hi"}]
    tok = load_tokenizer(str(fake_model_dir))
    assert tok is not None
    first = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True))[0]
    client, _ = make_client(executor_options={"fail_on_token": first})
    r = client.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 3, "stream": True})
    events, done = parse_sse(r.text)
    assert done and _CAUSE in events[-1]["error"]["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_prepared_while_the_drain_begins_is_told_shutting_down(
    make_client: Any, monkeypatch: pytest.MonkeyPatch, stream: bool
) -> None:
    """SIGTERM arriving while a request is tokenized: it never ran and another server can take it,
    so it is a 503 ``shutting_down`` with Retry-After (it was a 503 ``engine_dead``, "down for good")."""
    client, llm = make_client()
    encode = llm.tokenizer.encode

    def encode_as_sigterm_arrives(text: str, add_special_tokens: bool = False) -> list[int]:
        llm.drain()
        return list(encode(text, add_special_tokens))

    monkeypatch.setattr(llm.tokenizer, "encode", encode_as_sigterm_arrives)
    r = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2, "stream": stream})
    assert r.status_code == 503, r.text
    assert r.json()["error"]["code"] == "shutting_down" and r.headers["retry-after"] == "5"
