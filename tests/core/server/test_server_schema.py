"""schemathesis fuzzes the app against its own OpenAPI schema: no input may cause a 5xx."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pypto_serving_sync_sched")
schemathesis = pytest.importorskip("schemathesis", reason="schemathesis is not installed (pip install schemathesis)")

from hypothesis import HealthCheck, settings  # noqa: E402

from tests.core.server.conftest import start_llm  # noqa: E402


@pytest.fixture(scope="module")
def api_schema(fake_model_dir: Path) -> Iterator[Any]:
    from pypto_serving.server import build_app

    # Small limits keep every fuzzed request cheap: short context, few tokens, modest n.
    llm = start_llm(fake_model_dir, executor_options={"max_model_len": 16})
    app = build_app(llm, manage_engine=False)
    yield schemathesis.openapi.from_asgi("/openapi.json", app)
    llm.shutdown(10)


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_server_errors(case: Any) -> None:
    response = case.call()
    assert response.status_code < 500, f"{case.method} {case.path} -> {response.status_code}: {response.text[:500]}"
