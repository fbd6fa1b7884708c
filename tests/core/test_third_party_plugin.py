"""Third-party plugins installed for real with pip into the running environment (tox env or venv).

Each fixture distribution under tests/fixtures/ is pip-installed for the module and uninstalled
afterwards; the CLI runs as a subprocess so it sees the installed entry points as a user would.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def _pip(*args: str) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", *args],
        check=True,
        timeout=300,
    )


def _installed(dist_dir: str, dist_name: str) -> Iterator[None]:
    _pip("install", "--no-deps", "--no-build-isolation", str(FIXTURES / dist_dir))
    try:
        yield
    finally:
        _pip("uninstall", "-y", dist_name)


@pytest.fixture(scope="module")
def example_plugin() -> Iterator[None]:
    yield from _installed("thirdparty_executor", "pypto-serving-example-executor")


@pytest.fixture(scope="module")
def broken_plugin() -> Iterator[None]:
    yield from _installed("broken_plugin", "pypto-serving-broken-plugin")


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "pypto_serving.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=full_env,
    )


def test_installed_plugin_is_listed(example_plugin: None) -> None:
    res = _cli("plugins", "--json")
    assert res.returncode == 0, res.stderr
    rows = {r["name"]: r for r in json.loads(res.stdout)}
    assert rows["example"]["distribution"] == "pypto-serving-example-executor"
    assert rows["example"]["version"] == "0.3.1"
    assert rows["example"]["status"] == "ok"
    assert "executor example" in rows["example"]["provides"]


def test_installed_plugin_is_selected_by_name(example_plugin: None) -> None:
    pytest.importorskip("pypto_serving_sync_sched")
    code = (
        "from pypto_serving import LLM, SamplingParams\n"
        "with LLM(executor='example', scheduler='sync', worker_mode='inproc', num_kv_blocks=8) as llm:\n"
        "    out = llm.generate([[3, 4]], SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)\n"
        "print(out[0].outputs[0].token_ids)\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[5, 6, 7, 8, 9]"


def test_broken_plugin_is_listed_as_broken_and_others_still_load(broken_plugin: None, example_plugin: None) -> None:
    res = _cli("plugins", "--json")
    assert res.returncode == 0, res.stderr
    rows = {r["name"]: r for r in json.loads(res.stdout)}
    assert rows["broken"]["status"].startswith("broken: ImportError")
    assert "does_not_exist" in rows["broken"]["status"]
    assert rows["example"]["status"] == "ok"


def test_broken_plugin_fails_startup_with_its_name(broken_plugin: None) -> None:
    code = "from pypto_serving import LLM\nLLM(executor='example', worker_mode='inproc')\n"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode != 0
    assert "plugin 'broken' (distribution pypto-serving-broken-plugin) failed to load" in res.stderr
    assert "does_not_exist" in res.stderr


def test_plugins_env_var_excludes_the_broken_plugin(broken_plugin: None, example_plugin: None) -> None:
    res = _cli("plugins", "--json", env={"PYPTO_SERVING_PLUGINS": "example"})
    assert res.returncode == 0, res.stderr
    names = {r["name"] for r in json.loads(res.stdout)}
    assert names == {"core", "example"}
