"""The access log: the ASGI guard writes one info line per HTTP request on ``pypto_serving.access``
(method, path, status, duration, request id), never a key, header or prompt; the same id reaches the
app as ``request.state.request_id`` and the client as ``x-request-id``; a client that goes away
yields that one line and nothing else."""

from __future__ import annotations

import asyncio
import logging
import re
import time
from typing import Any

import pytest
from fastapi import Request  # module level: FastAPI resolves the handler's string annotation here

from pypto_serving.config import ServingSettings
from pypto_serving.server.guard import _Guard

ACCESS = "pypto_serving.access"
LINE = re.compile(
    r"^(?P<method>[A-Z]+) (?P<path>\S+) (?P<status>\d{3}) (?P<ms>\d+\.\d)ms (?P<id>req-[0-9a-f]{32})(?P<note>.*)$"
)


def access_lines(caplog: pytest.LogCaptureFixture) -> list[re.Match[str]]:
    records = [r for r in caplog.records if r.name == ACCESS]
    assert all(r.levelno == logging.INFO for r in records)
    matches = [LINE.match(r.getMessage()) for r in records]
    assert all(matches), [r.getMessage() for r in records]
    return [m for m in matches if m is not None]


def test_a_request_logs_one_line_with_its_id(make_client: Any, caplog: pytest.LogCaptureFixture) -> None:
    client, _ = make_client(api_key=["sekrit-key"])
    caplog.set_level(logging.INFO, logger=ACCESS)
    prompt = "the quick brown fox"
    r = client.post(
        "/v1/completions",
        json={"prompt": prompt, "max_tokens": 3, "temperature": 0},
        headers={"authorization": "Bearer sekrit-key"},
    )
    assert r.status_code == 200, r.text
    (line,) = access_lines(caplog)
    assert (line["method"], line["path"], line["status"], line["note"]) == ("POST", "/v1/completions", "200", "")
    assert line["id"] == r.headers["x-request-id"]
    assert "sekrit" not in caplog.text and prompt not in caplog.text and "authorization" not in caplog.text.lower()


def test_rejected_requests_are_logged_with_their_status(make_client: Any, caplog: pytest.LogCaptureFixture) -> None:
    """The guard's own answers (401, 413) go through the same accounting as the app's."""
    client, _ = make_client(api_key=["k"], max_request_body_bytes=64)
    caplog.set_level(logging.INFO, logger=ACCESS)
    unauthorized = client.get("/v1/models")
    too_large = client.post("/v1/completions", content=b"x" * 100, headers={"authorization": "Bearer k"})
    assert (unauthorized.status_code, too_large.status_code) == (401, 413)
    lines = access_lines(caplog)
    assert [(m["path"], m["status"]) for m in lines] == [("/v1/models", "401"), ("/v1/completions", "413")]
    assert [m["id"] for m in lines] == [unauthorized.headers["x-request-id"], too_large.headers["x-request-id"]]


def test_the_app_sees_the_request_id(make_client: Any, caplog: pytest.LogCaptureFixture) -> None:
    client, _ = make_client()

    async def echo_id(request: Request) -> dict[str, str]:
        return {"id": request.state.request_id}

    client.app.add_api_route("/test/request-id", echo_id)
    caplog.set_level(logging.INFO, logger=ACCESS)
    first, second = client.get("/test/request-id"), client.get("/test/request-id")
    assert first.json()["id"] == first.headers["x-request-id"] == access_lines(caplog)[0]["id"]
    assert first.json()["id"] != second.json()["id"]  # a fresh id per HTTP request


def test_control_characters_in_the_path_cannot_forge_lines(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=ACCESS)
    sent = _run_guard(_respond(404), path="/a\nGET /forged 200")
    assert sent[0]["status"] == 404
    (record,) = [r for r in caplog.records if r.name == ACCESS]
    assert "\n" not in record.getMessage() and "/a\\nGET" in record.getMessage()


# -- client disconnects, on the guard directly: the ASGI messages a server sends when a client leaves


def _respond(status: int) -> Any:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    return app


async def _stream_until_disconnect(scope: Any, receive: Any, send: Any) -> None:
    """What a streaming response does: start, send a chunk, stop when the client is gone."""
    await receive()  # the (replayed) request body
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"data: 1\n\n", "more_body": True})
    while (await receive())["type"] != "http.disconnect":
        pass


def _run_guard(app: Any, messages: list[dict[str, Any]] | None = None, path: str = "/v1/completions") -> list[Any]:
    """Run the guard over ``app`` with the client sending ``messages``; returns what went to the client."""
    inbox = list(messages or [{"type": "http.request", "body": b"{}", "more_body": False}])
    sent: list[Any] = []

    async def receive() -> dict[str, Any]:
        return inbox.pop(0) if inbox else {"type": "http.disconnect"}

    async def send(msg: Any) -> None:
        sent.append(msg)

    scope = {"type": "http", "method": "POST", "path": path, "headers": []}
    asyncio.run(_Guard(app, ServingSettings())(scope, receive, send))
    return sent


def test_client_gone_before_its_body_is_one_499_line(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    sent = _run_guard(_respond(200), [{"type": "http.request", "body": b"{", "more_body": True}])
    assert sent == []
    (line,) = access_lines(caplog)
    assert (line["status"], line["note"]) == ("499", " (client closed)")
    assert [r for r in caplog.records if r.name.startswith("pypto_serving") and r.name != ACCESS] == []


def test_client_gone_mid_stream_is_one_line(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    sent = _run_guard(_stream_until_disconnect)
    assert dict(sent[0]["headers"])[b"x-request-id"].startswith(b"req-")
    (line,) = access_lines(caplog)
    assert (line["status"], line["note"]) == ("200", " (client closed)")
    assert [r for r in caplog.records if r.name.startswith("pypto_serving") and r.name != ACCESS] == []


def test_real_disconnect_mid_stream_is_one_line(live_server: Any, caplog: pytest.LogCaptureFixture) -> None:
    """The real app over real sockets: a client dropping a stream yields its one access line and no
    other pypto_serving log line (the engine's abort is silent)."""
    import httpx

    server, _ = live_server(executor_options={"step_sleep": 0.02})
    caplog.set_level(logging.INFO)
    body = {"prompt": [5, 6, 7], "max_tokens": 100, "ignore_eos": True, "stream": True}

    async def leave_after_first_event() -> str:
        async with (
            httpx.AsyncClient(base_url=server.url, timeout=30) as client,
            client.stream("POST", "/v1/completions", json=body) as r,
        ):
            async for _ in r.aiter_text():
                return r.headers["x-request-id"]  # leaving the block closes the socket mid-stream
        raise AssertionError("no event arrived")

    request_id = asyncio.run(leave_after_first_event())
    deadline = time.monotonic() + 10
    while not [r for r in caplog.records if r.name == ACCESS] and time.monotonic() < deadline:
        time.sleep(0.02)
    time.sleep(0.2)  # anything else the disconnect would log arrives by now
    (line,) = access_lines(caplog)
    assert (line["status"], line["id"], line["note"]) == ("200", request_id, " (client closed)")
    assert [r.getMessage() for r in caplog.records if r.name.startswith("pypto_serving") and r.name != ACCESS] == []


def _fail_before(started: bool) -> Any:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        if started:
            await send({"type": "http.response.start", "status": 200, "headers": []})
        raise RuntimeError("boom")

    return app


@pytest.mark.parametrize(("started", "note"), [(False, ""), (True, " (failed mid-response)")])
def test_only_a_response_cut_short_is_failed_mid_response(
    caplog: pytest.LogCaptureFixture, started: bool, note: str
) -> None:
    """The guard's own complete 500 (the app raised before answering) is an ordinary line; only a
    response already started, then cut by an exception, is noted as failed mid-response."""
    caplog.set_level(logging.INFO, logger=ACCESS)
    sent = _run_guard(_fail_before(started))
    assert sent[0]["status"] == (200 if started else 500)
    (line,) = access_lines(caplog)
    assert (line["status"], line["note"]) == (str(sent[0]["status"]), note)
