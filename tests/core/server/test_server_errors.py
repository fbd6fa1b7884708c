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
