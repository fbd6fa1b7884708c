"""Grammar limits (issue 25 items 1 and 2): every grammar llguidance refuses, at build or on its first
tokens, is a 400 with the library's reason before the request is queued (the SDK retries 500s); a
grammar over ``grammar_max_bytes`` or ``grammar_compile_timeout`` is a 400 naming the setting; a
request's grammar is compiled once, whatever its prompts and ``n``; and while such a request is
checked, ``/health`` answers at once."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest

pytestmark = pytest.mark.requires_plugin("sync_sched")

# The issue's 5,000 branches compile past grammar_max_bytes; 2,500 are under it and still past the
# parser's 2,000 items in a row.
ANY_OF = {"anyOf": [{"type": "object", "properties": {f"k{i}": {"type": "integer"}}} for i in range(2500)]}


@pytest.fixture(scope="module")
def client(fake_model_dir: Any) -> Any:
    pytest.importorskip("pypto_serving_sync_sched")
    from fastapi.testclient import TestClient

    from pypto_serving.server import build_app
    from tests.core.server.conftest import start_llm

    # These tests are about the library's own refusals: a compile budget no loaded 2-core runner
    # reaches keeps them from becoming "did not compile within 5 s" (seen once with 4 jobs on 2 cores).
    llm = start_llm(fake_model_dir, grammar_compile_timeout=120.0)
    with TestClient(build_app(llm, manage_engine=False), raise_server_exceptions=False) as c:
        yield c
    llm.shutdown(10)


@pytest.mark.parametrize(
    ("field", "value", "reason"),
    [
        ("guided_json", {"$ref": "#"}, "NoExtensionBias"),
        ("guided_regex", "[^\\x00-\\x{10FFFF}]", "NoExtensionBias"),
        ("guided_json", ANY_OF, "max is 2000"),
        ("guided_regex", "a{1000000}", "too many expressions constructed"),
        ("guided_regex", "(?:a{1000}){1000}", "too many expressions constructed"),
    ],
)
def test_grammars_the_library_refuses_are_400s(client: Any, field: str, value: Any, reason: str) -> None:
    """Each of these passed the old check and failed in the worker: ``500 generation_failed``."""
    r = client.post("/v1/completions", json={"prompt": "a", "n": 4, field: value, "max_tokens": 2})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert reason in error["message"] and error["param"] == field and error["code"] == "invalid_grammar"
    assert "<state>" not in error["message"]  # the parser's internals stay out of the answer


def test_forced_tool_call_grammar_errors_are_400s_on_tool_choice(client: Any) -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"$ref": "#"}}}]
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": tools, "tool_choice": "required"}
    r = client.post("/v1/chat/completions", json=body)
    # The fake model serves no tool parser by default: either way the answer is a 400, never a 500.
    assert r.status_code == 400, r.text


def test_grammar_over_max_bytes_names_the_setting(client: Any) -> None:
    """The issue's 300 KB request: a 20,000-value enum for 1,000 prompts."""
    enum = {"enum": [f"value-{i}" for i in range(20000)]}
    r = client.post("/v1/completions", json={"prompt": ["a"] * 1000, "guided_json": enum, "max_tokens": 1})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert "grammar_max_bytes=262144" in error["message"]
    assert error["code"] == "grammar_too_complex" and error["param"] == "guided_json"


def test_grammar_over_the_time_budget_names_the_setting(make_client: Any) -> None:
    client, _ = make_client(grammar_compile_timeout=0.05)
    t0 = time.monotonic()
    r = client.post("/v1/completions", json={"prompt": "a", "guided_regex": "(?:a{1000}){1000}", "max_tokens": 2})
    assert time.monotonic() - t0 < 0.6  # answered at the deadline, not when the compile ends
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert "grammar_compile_timeout=0.05" in error["message"] and error["code"] == "grammar_too_complex"


def test_one_compile_per_request_whatever_its_prompts_and_n(client: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The old server checked the grammar once per prompt on the event loop and the worker built one
    matcher per sequence: here 20 prompts x n=4 build one matcher in the server, one in the worker."""
    from pypto_serving import structured

    built: list[str] = []
    real = structured.build_matcher

    def counting(tok: Any, text: str) -> Any:
        built.append(text)
        return real(tok, text)

    monkeypatch.setattr(structured, "build_matcher", counting)
    body = {"prompt": ["a"] * 20, "n": 4, "guided_regex": "(ab){1,3}c", "max_tokens": 8, "temperature": 1.0}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    texts = [c["text"] for c in r.json()["choices"]]
    assert len(texts) == 80 and all(t in ("abc", "ababc", "abababc") for t in texts), texts
    assert len(built) == 2, len(built)


def test_health_answers_while_a_slow_grammar_compiles(client: Any) -> None:
    """The compile runs on the checker's threads (llguidance drops the GIL), never the event loop."""
    body = {"prompt": "a", "n": 128, "guided_regex": "(?:(?:a{100}){100}){100}", "max_tokens": 2}
    answer: list[Any] = []
    attack = threading.Thread(target=lambda: answer.append(client.post("/v1/completions", json=body)))
    attack.start()
    worst = 0.0
    while attack.is_alive():
        t0 = time.monotonic()
        assert client.get("/health").status_code == 200
        worst = max(worst, time.monotonic() - t0)
        time.sleep(0.02)
    attack.join()
    assert answer[0].status_code == 400, answer[0].text
    assert "too many expressions constructed" in answer[0].json()["error"]["message"]
    assert worst < 1.0, worst


def test_serve_builds_the_checkers_tokenizer_before_the_first_grammar(
    make_client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The llguidance tokenizer holds the GIL while it is built (a few hundred ms over Qwen's
    vocabulary): ``serve`` builds the checker's at start-up, so no request's check builds one."""
    import llguidance

    from pypto_serving.server.openai_requests import warm_grammars

    client, _ = make_client()
    warm_grammars(client.app.state.ctx)
    built: list[str] = []
    make = llguidance.LLTokenizer

    def counting(*args: Any, **kwargs: Any) -> Any:
        built.append(threading.current_thread().name)
        return make(*args, **kwargs)

    monkeypatch.setattr(llguidance, "LLTokenizer", counting)
    r = client.post("/v1/completions", json={"prompt": "a", "guided_regex": "(ab)+", "max_tokens": 4})
    assert r.status_code == 200, r.text
    assert not [name for name in built if name.startswith("grammar-check")], built


def test_a_grammar_failing_past_the_check_is_the_clients_400(client: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """llguidance builds its lexer lazily, so a grammar can pass the server's probe of its first
    tokens and fail later in the worker (the fuzz test met such a regex). The server's check is
    switched off here to reach that path with a grammar known to fail: the answer is a 400 naming
    the field (it was ``500 generation_failed``), and a stream's error event says the same."""
    from pypto_serving.structured import GrammarChecker

    async def accept(self: GrammarChecker, spec: Any) -> None:
        return None

    monkeypatch.setattr(GrammarChecker, "check_async", accept)
    body = {"prompt": "a", "guided_regex": "a{1000000}", "max_tokens": 4}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "guided_regex" and error["code"] == "invalid_grammar"
    assert error["type"] == "invalid_request_error" and "too many expressions constructed" in error["message"]
    chat = {"messages": [{"role": "user", "content": "hi"}], "guided_regex": "a{1000000}", "max_tokens": 4}
    r = client.post("/v1/chat/completions", json=chat)
    assert r.status_code == 400 and r.json()["error"]["param"] == "guided_regex", r.text
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
        events = [line[6:] for line in s.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]
    failed = [e for e in events if '"error"' in e]
    assert failed and '"invalid_grammar"' in failed[-1] and '"invalid_request_error"' in failed[-1], events
    # /v1/responses names the field as it calls it (text.format), streamed or not.
    fmt = {"type": "json_schema", "name": "s", "schema": {"type": "string", "pattern": "^a{1000000}$"}}
    answer = {"input": "hi", "text": {"format": fmt}, "max_output_tokens": 4, "store": False}
    r = client.post("/v1/responses", json=answer)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "text.format" and r.json()["error"]["code"] == "invalid_grammar", r.text
    with client.stream("POST", "/v1/responses", json={**answer, "stream": True}) as s:
        typed = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: ")]
    error = next(e for e in typed if e["type"] == "error")
    assert error["code"] == "invalid_grammar" and error["param"] == "text.format", typed
    assert typed[-1]["type"] == "response.failed" and typed[-1]["response"]["error"]["code"] == "invalid_grammar"
