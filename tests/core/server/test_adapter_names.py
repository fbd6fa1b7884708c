"""Every API names the LoRA adapter a request selected (its ``model``), not the base model: completions
did, while the Messages and Responses bodies and streams said the base model's name."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.requires_plugin("sync_sched")


def _events(text: str) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


def test_messages_and_responses_name_the_selected_adapter(live_server: Any, tmp_path: Any) -> None:
    # The fake executor ignores adapter weights: this checks the names the server shows.
    server, _ = live_server(lora_modules=[f"style={tmp_path}"])
    chat = [{"role": "user", "content": "hi"}]
    with httpx.Client(base_url=server.url, timeout=60) as client:
        message = client.post("/v1/messages", json={"model": "style", "max_tokens": 2, "messages": chat})
        streamed = client.post(
            "/v1/messages", json={"model": "style", "max_tokens": 2, "messages": chat, "stream": True}
        )
        response = client.post("/v1/responses", json={"model": "style", "input": "hi", "max_output_tokens": 2})
        base = client.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2})
    assert message.status_code == 200 and message.json()["model"] == "style", message.text
    starts = [e for e in _events(streamed.text) if e.get("type") == "message_start"]
    assert [e["message"]["model"] for e in starts] == ["style"]
    assert response.status_code == 200 and response.json()["model"] == "style", response.text
    assert base.status_code == 200 and base.json()["model"] != "style"
