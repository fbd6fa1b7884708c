"""Third-party plugins installed for real with pip, as a user would, but never into the running
environment: an install left behind by an interrupted run would break every later engine start.

Each fixture distribution under tests/fixtures/ is pip-installed (``--target``) into a directory of
its own, and the CLI and engines run as subprocesses with those directories on ``PYTHONPATH``, so
they see the installed entry points while this interpreter and its environment stay untouched.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def _install(dist_dir: str, tmp: pytest.TempPathFactory) -> Path:
    """Install a fixture distribution into a fresh directory and return it. The source is copied
    first so the build leaves nothing in the repository."""
    work = tmp.mktemp(dist_dir)
    shutil.copytree(FIXTURES / dist_dir, work / "src", ignore=shutil.ignore_patterns("build", "*.egg-info"))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", "install", "--no-deps"]
    target = ["--no-build-isolation", "--target", str(work / "site"), str(work / "src")]
    subprocess.run([*pip, *target], check=True, timeout=300)
    return work / "site"


@pytest.fixture(scope="module")
def example_plugin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _install("thirdparty_executor", tmp_path_factory)


@pytest.fixture(scope="module")
def broken_plugin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _install("broken_plugin", tmp_path_factory)


def _env(*sites: Path, **extra: str) -> dict[str, str]:
    """This environment plus the given install directories on ``PYTHONPATH``."""
    path = [str(s) for s in sites] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path), **extra}


def _cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pypto_serving.cli", *args], capture_output=True, text=True, timeout=120, env=env
    )


def _python(code: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)


def test_installed_plugin_is_listed(example_plugin: Path) -> None:
    res = _cli("plugins", "--json", env=_env(example_plugin))
    assert res.returncode == 0, res.stderr
    rows = {r["name"]: r for r in json.loads(res.stdout)}
    assert rows["example"]["distribution"] == "pypto-serving-example-executor"
    assert rows["example"]["version"] == "0.3.1"
    assert rows["example"]["status"] == "ok"
    assert "executor example" in rows["example"]["provides"]


def test_installed_plugin_is_selected_by_name(example_plugin: Path) -> None:
    pytest.importorskip("pypto_serving_sync_sched")
    code = (
        "from pypto_serving import LLM, SamplingParams\n"
        "with LLM(executor='example', scheduler='sync', worker_mode='inproc', num_kv_blocks=8) as llm:\n"
        "    out = llm.generate([[3, 4]], SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)\n"
        "print(out[0].outputs[0].token_ids)\n"
    )
    res = _python(code, _env(example_plugin))
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "[5, 6, 7, 8, 9]"


def test_broken_plugin_is_listed_as_broken_and_others_still_load(broken_plugin: Path, example_plugin: Path) -> None:
    res = _cli("plugins", "--json", env=_env(broken_plugin, example_plugin))
    assert res.returncode == 0, res.stderr
    rows = {r["name"]: r for r in json.loads(res.stdout)}
    assert rows["broken"]["status"].startswith("broken: ImportError")
    assert "does_not_exist" in rows["broken"]["status"]
    assert rows["example"]["status"] == "ok"


def test_broken_plugin_fails_startup_with_its_name(broken_plugin: Path) -> None:
    code = "from pypto_serving import LLM\nLLM(executor='example', worker_mode='inproc')\n"
    res = _python(code, _env(broken_plugin))
    assert res.returncode != 0
    assert "plugin 'broken' (distribution pypto-serving-broken-plugin) failed to load" in res.stderr
    assert "does_not_exist" in res.stderr


def test_plugins_env_var_excludes_the_broken_plugin(broken_plugin: Path, example_plugin: Path) -> None:
    res = _cli("plugins", "--json", env=_env(broken_plugin, example_plugin, PYPTO_SERVING_PLUGINS="example"))
    assert res.returncode == 0, res.stderr
    names = {r["name"] for r in json.loads(res.stdout)}
    assert names == {"core", "example"}


def test_fixture_plugins_stay_out_of_the_running_environment(broken_plugin: Path, example_plugin: Path) -> None:
    """The installs live only in their own directories: neither this interpreter nor a fresh one
    without them on its path sees the broken plugin, so an interrupted run leaves nothing behind."""
    for name in ("pypto-serving-broken-plugin", "pypto-serving-example-executor"):
        with pytest.raises(metadata.PackageNotFoundError):
            metadata.distribution(name)
    res = _cli("plugins", "--json", env=dict(os.environ))
    assert res.returncode == 0, res.stderr
    assert {"broken", "example"}.isdisjoint(r["name"] for r in json.loads(res.stdout))
