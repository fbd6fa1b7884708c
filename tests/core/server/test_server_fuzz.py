"""Generated attacks the OpenAPI fuzzing (``test_server_schema.py``) cannot reach: grammars and deep
JSON. Schemathesis draws bodies from the schema's types, so a ``guided_regex`` is any string and a
nested object is a few levels deep; the grammars and depths that broke the server (issue 25) come
from the generators here.

- Regular expressions built from a small regex grammar (literals, classes, alternation, groups and
  quantifiers up to ``{1000000}``) and JSON schemas (strings, bounded integers, enums of up to 3,000
  values, arrays, objects, ``anyOf`` of up to 2,500 branches, ``$ref``, patterns), plus the issue's
  own grammars as explicit examples: every answer is a
  200 or a 400 naming the field; a 200 that ended on EOS is checked against an independent
  reference (the ``regex`` package's ``fullmatch``, ``re``'s semantics with a time limit, for a regex;
  ``jsonschema`` for a schema).
- JSON nested 1..3x ``max_json_depth`` deep, placed where clients put JSON (a schema as JSON or as
  text, a tool call's arguments, a ``logit_bias``, an unknown field, ``/tokenize``): a 400 past the
  limit, never a 5xx.

The engine runs the fake executor (its logits are finite everywhere, so the grammar alone decides
what is valid) with EOS = ``<|im_end|>``, in-process behind FastAPI's TestClient."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import regex  # transformers' dependency, in every test env: re's matching with a timeout
from hypothesis import HealthCheck, example, given, reject, settings
from hypothesis import strategies as st

from tests.core.server.conftest import start_llm

pytestmark = pytest.mark.requires_plugin("sync_sched")

IM_END = 2  # the fake tokenizer's <|im_end|>
MAX_TOKENS = 24
FUZZ = settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), database=None)


@pytest.fixture(scope="module")
def client(fake_model_dir: Path) -> Iterator[Any]:
    pytest.importorskip("pypto_serving_sync_sched")
    from fastapi.testclient import TestClient

    from pypto_serving.server import build_app

    llm = start_llm(fake_model_dir, executor_options={"eos": IM_END, "max_model_len": 256})
    with TestClient(build_app(llm, manage_engine=False), raise_server_exceptions=False) as c:
        c.max_json_depth = llm.settings.max_json_depth
        yield c
    llm.shutdown(10)


# --------------------------------------------------------------------------- regexes

_ATOMS = st.sampled_from(["a", "b", "c", "0", "1", " ", "x", r"\.", "[a-c]", "[0-9]", "[xyz]", r"\d"])
_COUNTS = st.sampled_from([0, 1, 2, 3, 5, 100, 1000, 100000, 1000000])


def _quantified(inner: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    def quantify(draw_args: tuple[str, str, int, int]) -> str:
        body, kind, m, n = draw_args
        group = f"(?:{body})"
        if kind == "exact":
            return f"{group}{{{m}}}"
        if kind == "range":
            return f"{group}{{{min(m, n)},{max(m, n)}}}"
        return group + kind

    return st.tuples(inner, st.sampled_from(["?", "*", "+", "exact", "range"]), _COUNTS, _COUNTS).map(quantify)


# The grammars of issue 25 that answered 500 (or froze the server): always among the examples.
ISSUE_REGEXES = [r"[^\x00-\x{10FFFF}]", "a{1000000}", "(?:a{1000}){1000}", "(?:(?:a{100}){100}){100}"]
ISSUE_SCHEMAS: list[dict[str, Any]] = [
    {"$ref": "#"},
    {"anyOf": [{"const": f"v{i}"} for i in range(5000)]},
    {"anyOf": [{"type": "object", "properties": {f"k{i}": {"type": "integer"}}} for i in range(5000)]},
    {"enum": [f"value-{i}" for i in range(20000)]},
]


def _regexes() -> st.SearchStrategy[str]:
    def extend(inner: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
        return st.one_of(
            st.lists(inner, min_size=2, max_size=4).map("".join),
            st.lists(inner, min_size=2, max_size=4).map(lambda xs: "(?:" + "|".join(xs) + ")"),
            _quantified(inner),
        )

    return st.recursive(_ATOMS, extend, max_leaves=12)


# --------------------------------------------------------------------------- JSON schemas

_LEAF_SCHEMAS = st.one_of(
    st.integers(1, 8).map(lambda n: {"type": "string", "maxLength": n}),
    st.tuples(st.integers(-50, 50), st.integers(0, 50)).map(
        lambda t: {"type": "integer", "minimum": t[0], "maximum": t[0] + t[1]}
    ),
    st.just({"type": "boolean"}),
    st.sampled_from([1, 3, 50, 3000]).map(lambda n: {"enum": [f"value-{i}" for i in range(n)]}),
    st.just({"$ref": "#"}),
    st.just({"type": "string", "pattern": "^[a-c]{2,4}$"}),
)


def _schemas() -> st.SearchStrategy[dict[str, Any]]:
    def extend(inner: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
        props = st.dictionaries(st.sampled_from(["a", "b", "name", "n"]), inner, min_size=1, max_size=3)
        return st.one_of(
            inner.map(lambda s: {"type": "array", "items": s, "maxItems": 2}),
            props.map(
                lambda p: {"type": "object", "properties": p, "required": sorted(p), "additionalProperties": False}
            ),
            st.lists(inner, min_size=2, max_size=3).map(lambda xs: {"anyOf": xs}),
        )

    wide = st.sampled_from([10, 2500]).map(lambda n: {"anyOf": [{"const": f"v{i}"} for i in range(n)]})
    return st.one_of(st.recursive(_LEAF_SCHEMAS, extend, max_leaves=6), wide, st.sampled_from(ISSUE_SCHEMAS))


def _check_answer(r: Any, param: str) -> dict[str, Any] | None:
    """The 200 body, or None after checking that a non-200 is a 400 naming ``param``."""
    assert r.status_code in (200, 400), f"{r.status_code}: {r.text[:500]}"
    body = r.json()
    if r.status_code == 400:
        error = body["error"]
        assert error["param"] == param and error["message"], body
        return None
    return dict(body)


@FUZZ
@given(pattern=st.one_of(_regexes(), st.sampled_from(ISSUE_REGEXES)))
@example(pattern=ISSUE_REGEXES[0])
@example(pattern=ISSUE_REGEXES[1])
@example(pattern=ISSUE_REGEXES[2])
@example(pattern=ISSUE_REGEXES[3])
@example(pattern=r"(?:(?:(?: )?|\.|(?:\d){0}|(?:0|c|0|0))){1000}")  # drawn once: re.fullmatch never returned
def test_generated_regexes_are_answered_or_refused(client: Any, pattern: str) -> None:
    body = {"prompt": "hello", "max_tokens": MAX_TOKENS, "temperature": 0, "guided_regex": pattern}
    out = _check_answer(client.post("/v1/completions", json=body), "guided_regex")
    if out is not None and out["choices"][0]["finish_reason"] == "stop":
        text = out["choices"][0]["text"]
        assert _fullmatch(pattern, text), (pattern, text)


def _fullmatch(pattern: str, text: str) -> bool:
    """Whether ``text`` matches ``pattern`` whole. A backtracking matcher (``re``, ``regex``) takes
    exponential time on some generated patterns, e.g. ``(?:(?: )?|\\.|0){1000}`` over `` c c c``, which
    the server answers at once (its grammar engine is linear): such an example is rejected after 5 s
    rather than hanging the suite."""
    try:
        return regex.fullmatch(pattern, text, timeout=5.0) is not None
    except TimeoutError:
        reject()


@FUZZ
@given(schema=_schemas(), temperature=st.sampled_from([0.0, 1.0]))
@example(schema=ISSUE_SCHEMAS[0], temperature=0.0)
@example(schema=ISSUE_SCHEMAS[1], temperature=0.0)
@example(schema=ISSUE_SCHEMAS[2], temperature=0.0)
@example(schema=ISSUE_SCHEMAS[3], temperature=1.0)
def test_generated_json_schemas_are_answered_or_refused(
    client: Any, schema: dict[str, Any], temperature: float
) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    body = {"prompt": "hello", "max_tokens": MAX_TOKENS, "temperature": temperature, "seed": 7, "guided_json": schema}
    out = _check_answer(client.post("/v1/completions", json=body), "guided_json")
    # jsonschema recurses forever on a "$ref": "#" reached without consuming input (anyOf of itself),
    # which llguidance resolves; such schemas are checked for their answer's status only.
    if out is not None and out["choices"][0]["finish_reason"] == "stop" and "$ref" not in json.dumps(schema):
        jsonschema.validate(json.loads(out["choices"][0]["text"]), schema)


# --------------------------------------------------------------------------- deep JSON


def _nested(depth: int, kind: str) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value] if kind == "list" else {"k": value}
    return value


def _deep_request(where: str, value: Any) -> tuple[str, dict[str, Any]]:
    msgs = [{"role": "user", "content": "hi"}]
    if where == "guided_json":
        return "/v1/completions", {"prompt": "hi", "max_tokens": 2, "guided_json": value}
    if where == "guided_json_text":
        return "/v1/completions", {"prompt": "hi", "max_tokens": 2, "guided_json": json.dumps(value)}
    if where == "tool_arguments":
        call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": json.dumps(value)}}
        history = [*msgs, {"role": "assistant", "content": None, "tool_calls": [call]}]
        return "/v1/chat/completions", {"messages": history, "max_tokens": 2}
    if where == "tokenize_arguments":
        call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": json.dumps(value)}}
        return "/tokenize", {"messages": [*msgs, {"role": "assistant", "content": None, "tool_calls": [call]}]}
    if where == "unknown_field":
        return "/v1/completions", {"prompt": "hi", "max_tokens": 2, "x_extra": value}
    return "/v1/chat/completions", {"messages": msgs, "max_tokens": 2, "logit_bias": {"5": value}}


@FUZZ
@given(
    where=st.sampled_from(
        ["guided_json", "guided_json_text", "tool_arguments", "tokenize_arguments", "unknown_field", "logit_bias"]
    ),
    kind=st.sampled_from(["list", "dict"]),
    scale=st.floats(0.0, 3.0),
)
def test_deep_json_anywhere_is_a_400_past_the_limit(client: Any, where: str, kind: str, scale: float) -> None:
    depth = max(1, int(scale * client.max_json_depth))
    path, body = _deep_request(where, _nested(depth, kind))
    r = client.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
    assert r.status_code < 500, f"{where} depth {depth}: {r.status_code} {r.text[:300]}"
    if depth > client.max_json_depth + 4:
        assert r.status_code == 400, f"{where} depth {depth}: {r.status_code} {r.text[:300]}"
        assert r.json()["error"]["message"], r.text
