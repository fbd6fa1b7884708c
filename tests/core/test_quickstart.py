"""quickstart.sh parses, documents its options and refuses unknown ones before touching anything,
and runs the installs it should: torch's CPU build from PyTorch's CPU index, with progress.

The installs themselves (torch and six distributions) are not run here: they need minutes and a
download; the pip commands are checked against a stand-in for the venv's python instead. The
README's snippets the script leads to run against a real server in tests/core/test_docs_snippets.py.
"""

from __future__ import annotations

import functools
import http.server
import os
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "quickstart.sh"


def _run(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=cwd, capture_output=True, text=True, timeout=60)


def test_the_script_parses_and_is_executable() -> None:
    assert subprocess.run(["bash", "-n", str(SCRIPT)], check=False).returncode == 0
    assert SCRIPT.stat().st_mode & 0o111


def test_help_lists_the_device_options(tmp_path: Path) -> None:
    proc = _run("--help", cwd=tmp_path)
    assert proc.returncode == 0
    for option in ("--cuda", "--npu", "--no-serve", "--port"):
        assert option in proc.stdout


def test_an_unknown_option_fails_before_creating_anything(tmp_path: Path) -> None:
    proc = _run("--venv", str(tmp_path / "venv"), "--gpu", cwd=tmp_path)
    assert proc.returncode == 2 and "unknown option --gpu" in proc.stderr
    assert not (tmp_path / "venv").exists()


# ---------------------------------------------------------------- the installs it runs
# A stand-in for the venv's python: it records each call, answers the "is torch 2.13.0 installed"
# probe with $TORCH_PROBE_RC, and installs nothing.
STUB_PYTHON = """#!/usr/bin/env bash
echo "$*" >> "$STUB_LOG"
if [ "$1" = "-c" ]; then exit "${TORCH_PROBE_RC:-1}"; fi
exit 0
"""


@pytest.fixture
def stub_venv(tmp_path: Path) -> Path:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(STUB_PYTHON)
    python.chmod(0o755)
    return venv


@pytest.fixture(scope="module")
def cpu_index(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A reachable stand-in for PyTorch's CPU wheel index (a local HTTP server with a torch/ page)."""
    root = tmp_path_factory.mktemp("index")
    (root / "torch").mkdir()
    (root / "torch" / "index.html").write_text("<html></html>")
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def _install(venv: Path, index: str, probe_rc: int, *args: str) -> tuple[list[str], str]:
    """Run the script's install steps (``--no-serve``) against the stub; its pip calls and stderr."""
    log = venv.parent / "calls.log"
    env = {**os.environ, "STUB_LOG": str(log), "TORCH_PROBE_RC": str(probe_rc), "QUICKSTART_TORCH_CPU_INDEX": index}
    proc = subprocess.run(
        ["bash", str(SCRIPT), "--venv", str(venv), "--no-serve", *args],
        cwd=venv.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    calls = [line for line in log.read_text().splitlines() if line.startswith("-m pip install")]
    return calls, proc.stderr


def test_cpu_installs_torch_from_the_cpu_wheel_index_with_progress(stub_venv: Path, cpu_index: str) -> None:
    calls, err = _install(stub_venv, cpu_index, 1, "--cpu")
    torch_call, dists_call = calls
    assert torch_call.split() == [
        "-m", "pip", "install", "--disable-pip-version-check", "--extra-index-url", cpu_index, "torch==2.13.0"
    ]  # fmt: skip
    assert dists_call.endswith(
        "./ ./kernels ./plugins/qwen ./plugins/deepseek_mtp ./plugins/sync_sched ./plugins/async_sched"
    )
    assert all(" -q" not in c for c in calls)  # pip's progress shows
    steps = [line for line in err.splitlines() if line.startswith("quickstart: [")]
    assert [s[:15] for s in steps] == ["quickstart: [1/", "quickstart: [2/", "quickstart: [3/"]
    assert f"CPU build from {cpu_index}" in steps[1]


def test_an_unreachable_cpu_index_leaves_torch_to_pips_own_indexes(stub_venv: Path, tmp_path: Path) -> None:
    calls, err = _install(stub_venv, f"file://{tmp_path}/no-such-index", 1, "--cpu")
    assert calls[0].split()[-1] == "torch==2.13.0" and "--extra-index-url" not in calls[0]
    assert "is unreachable" in err


def test_torch_already_installed_is_not_installed_again(stub_venv: Path, cpu_index: str) -> None:
    calls, err = _install(stub_venv, cpu_index, 0)
    assert len(calls) == 1 and "torch" not in calls[0]
    assert "torch 2.13.0 is already installed" in err


def test_it_says_how_to_put_pypto_serving_on_path(stub_venv: Path, cpu_index: str) -> None:
    _, err = _install(stub_venv, cpu_index, 0)
    assert f"source {stub_venv}/bin/activate" in err and f"{stub_venv}/bin/pypto-serving" in err
