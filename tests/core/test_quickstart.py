"""quickstart.sh parses, documents its options and refuses unknown ones before touching anything.

The install itself (a venv, torch and six distributions) is not run here: it needs minutes and, on a
machine without a local torch wheel, a multi-GB download; the README's snippets it leads to run
against a real server in tests/core/test_docs_snippets.py.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

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
