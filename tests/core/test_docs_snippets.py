"""Every ```python block of README.md and docs/*.md runs as written, as a script in its own process.

The placeholder model paths (``/path/to/Qwen3-0.6B``, ``/models/DeepSeek-V4``) become tiny random
checkpoints of the same architecture built here; nothing else in a block changes, and no setting is
injected through the environment (``PYPTO_SERVING_*`` is cleared), so a block runs as a user's copy
would. A block that creates an ``LLM`` spawns the worker process, which is what makes the
``if __name__ == "__main__":`` guard necessary; :func:`test_blocks_that_load_a_model_have_a_main_guard`
checks that statically as well.

Blocks that talk to the quick start's server (``http://127.0.0.1:8000``: Python blocks and ``curl``
lines) run against a real ``pypto-serving serve`` started as the quick start does (no ``--model``: the
default embedded model) on a free port, which replaces 8000. Blocks that name an embedded model
(``tiny-deepseek-v4``, ``tiny-qwen3``) need the plugin that ships it.

Every block is either run or skipped with its reason: a missing plugin, a missing device, or an entry
of :data:`SKIPS`. The plugin-writing example of docs/plugins.md is a package, not a script: it is
installed (as a dist-info on ``PYTHONPATH``, from the doc's own ``pyproject.toml`` block) and driven
by the doc's own ``python -c`` usage line, whose printed result must match the doc's comment.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import tomllib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TIMEOUT = 300

# Blocks known not to run yet: a text the block contains (its marker) -> the reason.
SKIPS: dict[str, str] = {}

# A placeholder model path in a block, e.g. /path/to/Qwen3-0.6B or /models/DeepSeek-V4.
PLACEHOLDER = re.compile(r"(?:/path/to|/models)/([A-Za-z][\w.-]*)")


@dataclass(frozen=True)
class Block:
    doc: Path
    line: int  # of the opening fence
    lang: str
    code: str

    @property
    def name(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line}"


def fenced_blocks(doc: Path) -> list[Block]:
    blocks: list[Block] = []
    lines = doc.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        fence = re.match(r"^```(\w*)\s*$", lines[i])
        if fence is None:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
        blocks.append(Block(doc, i + 1, fence.group(1), "\n".join(lines[i + 1 : end]) + "\n"))
        i = end + 1
    return blocks


PYTHON_BLOCKS = [b for doc in DOCS for b in fenced_blocks(doc) if b.lang == "python"]

# The quick start's server address, and the plugin shipping each embedded model.
QUICKSTART_URL = "http://127.0.0.1:8000"
EMBEDDED = {"tiny-deepseek-v4": "pypto_serving_deepseek_mtp", "tiny-qwen3": "pypto_serving_qwen"}
CURL_BLOCKS = [
    b for doc in DOCS for b in fenced_blocks(doc) if b.lang == "bash" and b.code.startswith(f"curl -s {QUICKSTART_URL}")
]


def test_the_docs_have_python_blocks() -> None:
    """Guards the extraction itself: an empty parametrization would pass vacuously."""
    names = [b.name for b in PYTHON_BLOCKS]
    assert any(n.startswith("README.md:") for n in names), names
    assert len(names) >= 3, names


@pytest.mark.parametrize("block", [b for b in PYTHON_BLOCKS if "LLM(" in b.code], ids=lambda b: b.name)
def test_blocks_that_load_a_model_have_a_main_guard(block: Block) -> None:
    """Without the guard the spawned worker re-runs the script's top level and dies while loading."""
    assert 'if __name__ == "__main__":' in block.code, f"{block.name}: LLM(...) outside a __main__ guard"


# -- checkpoints standing in for the placeholders


def _qwen_checkpoint(path: Path) -> None:
    pytest.importorskip("pypto_serving_qwen", reason="plugin qwen (pypto-serving-qwen) not installed")
    pytest.importorskip("transformers", reason="building the stand-in checkpoint needs transformers")
    from tests.core.server.server_helpers import write_tokenizer
    from tests.plugins.qwen.qwen_fixtures import make_qwen_checkpoint

    make_qwen_checkpoint(path, "qwen3")
    write_tokenizer(path, 320)


def _deepseek_checkpoint(path: Path) -> None:
    pytest.importorskip("pypto_serving_deepseek_mtp", reason="plugin deepseek_mtp not installed")
    pytest.importorskip("transformers.models.deepseek_v4", reason="transformers without DeepSeek-V4")
    from tests.core.server.server_helpers import write_tokenizer
    from tests.plugins.deepseek_mtp.helpers import build_checkpoint

    build_checkpoint(path, n_mtp=2, vocab_size=320)  # two MTP layers: the doc asks for 2 speculative tokens
    write_tokenizer(path, 320)


BUILDERS: dict[str, Callable[[Path], None]] = {"Qwen": _qwen_checkpoint, "DeepSeek": _deepseek_checkpoint}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``get(placeholder name) -> directory`` of a tiny checkpoint of that family, built once."""
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        family = next((f for f in BUILDERS if name.startswith(f)), None)
        assert family is not None, f"no stand-in checkpoint for the placeholder model {name!r}: add one to BUILDERS"
        if family not in built:
            path = tmp_path_factory.mktemp("doc_models") / name
            BUILDERS[family](path)
            built[family] = path
        return built[family]

    return get


# -- running


def _skip_unrunnable(block: Block) -> None:
    for marker, reason in SKIPS.items():
        if marker in block.code:
            pytest.skip(reason)
    for name, module in EMBEDDED.items():
        if name in block.code and importlib.util.find_spec(module) is None:
            pytest.skip(f"the embedded model {name} ships with {module}, which is not installed")
    for module in sorted(set(re.findall(r"^\s*(?:from|import)\s+(pypto_serving_\w+)", block.code, re.M))):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"the block imports {module}, which is not installed")
    _skip_without_strategy(block.code)
    device = re.search(r"""device\s*=\s*["'](npu|cuda)""", block.code)
    if device is not None:
        import torch

        if not (hasattr(torch, device.group(1)) and getattr(torch, device.group(1)).is_available()):
            pytest.skip(f"needs a {device.group(1)} device")


def _skip_without_strategy(code: str) -> None:
    strategies = ("pypto_serving_sync_sched", "pypto_serving_async_sched")
    if "LLM(" in code and not any(importlib.util.find_spec(m) for m in strategies):
        pytest.skip("no scheduling strategy plugin (pypto-serving-sync-sched or -async-sched) installed")


def _run(args: list[str], cwd: Path, pythonpath: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYPTO_SERVING_")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONIOENCODING="utf-8")
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(pythonpath), env.get("PYTHONPATH")]))
    return subprocess.run(
        args, cwd=cwd, env=env, capture_output=True, text=True, encoding="utf-8", timeout=TIMEOUT, check=False
    )


def _assert_ran(proc: subprocess.CompletedProcess[str], what: str) -> None:
    assert proc.returncode == 0, f"{what} exited {proc.returncode}:\n{proc.stderr[-3000:]}"
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]


@pytest.fixture(scope="module")
def quickstart_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``pypto-serving serve`` with no model (the default embedded one), as ``quickstart.sh`` runs it."""
    _skip_without_strategy("LLM(")
    from tests.core.server.server_helpers import free_port, wait_for

    port = free_port()
    log = tmp_path_factory.mktemp("quickstart") / "serve.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYPTO_SERVING_")}
    cmd = [sys.executable, "-m", "pypto_serving.cli", "serve", "--port", str(port), "--device", "cpu"]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: proc.poll() is not None or _healthy(url), 120, "the quick start server")
        assert proc.poll() is None, log.read_text()
        yield url
    finally:
        proc.terminate()
        proc.wait(30)


def _healthy(url: str) -> bool:
    import httpx

    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.mark.parametrize("block", CURL_BLOCKS, ids=lambda b: b.name)
def test_curl_block_answers(block: Block, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    _skip_unrunnable(block)
    url = request.getfixturevalue("quickstart_server")
    proc = _run(["bash", "-c", block.code.replace(QUICKSTART_URL, url)], cwd=tmp_path)
    _assert_ran(proc, block.name)
    body = json.loads(proc.stdout)
    assert body["choices"][0]["message"]["content"], body


@pytest.mark.parametrize("block", [b for b in PYTHON_BLOCKS if "@hookimpl" not in b.code], ids=lambda b: b.name)
def test_script_block_runs(
    block: Block, checkpoint: Callable[[str], Path], tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    _skip_unrunnable(block)
    code = PLACEHOLDER.sub(lambda m: str(checkpoint(m.group(1))), block.code)
    if QUICKSTART_URL in code:
        code = code.replace(QUICKSTART_URL, request.getfixturevalue("quickstart_server"))
    script = tmp_path / "snippet.py"
    script.write_text(code, encoding="utf-8")
    proc = _run([sys.executable, str(script)], cwd=tmp_path)
    _assert_ran(proc, block.name)
    if "print(" in code:
        assert proc.stdout.strip(), f"{block.name} printed nothing"


@pytest.mark.parametrize("block", [b for b in PYTHON_BLOCKS if "@hookimpl" in b.code], ids=lambda b: b.name)
def test_plugin_block_installs_and_runs(block: Block, tmp_path: Path) -> None:
    """The block is a plugin package: install it the way its doc says, then run the doc's usage line."""
    siblings = fenced_blocks(block.doc)
    (project,) = [tomllib.loads(b.code)["project"] for b in siblings if b.lang == "toml"]
    (shell,) = [b.code for b in siblings if b.lang == "bash" and "python -c" in b.code]
    _install_as_distribution(project, block.code, tmp_path / "site")

    listing = _run([sys.executable, "-m", "pypto_serving.cli", "plugins"], tmp_path, tmp_path / "site")
    _assert_ran(listing, "pypto-serving plugins")
    listed = re.search(r'pypto-serving plugins\s+# lists "([^"]+)"', shell)
    assert listed is not None, shell
    rows = [" ".join(line.split()) for line in listing.stdout.splitlines()]
    assert " ".join(listed.group(1).split()) in rows, listing.stdout

    usage = re.search(r'python -c "(.*?)"\n# (.+)', shell, re.S)
    assert usage is not None, f"{block.doc.name}: no python -c usage line followed by '# <expected output>'"
    _skip_unrunnable(block)  # only here: installing and listing the plugin work regardless
    _skip_without_strategy(usage.group(1))
    proc = _run([sys.executable, "-c", usage.group(1)], tmp_path, tmp_path / "site")
    _assert_ran(proc, f"{block.name} usage")
    assert proc.stdout.strip() == usage.group(2).strip()


def _install_as_distribution(project: dict[str, object], code: str, site: Path) -> None:
    """What ``pip install`` leaves behind that matters here: the package and its entry points."""
    entry_points = project["entry-points"]
    assert isinstance(entry_points, dict)
    ((name, module),) = entry_points["pypto_serving"].items()
    (site / module).mkdir(parents=True)
    (site / module / "__init__.py").write_text(code, encoding="utf-8")
    dist_info = site / f"{str(project['name']).replace('-', '_')}-{project['version']}.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n", encoding="utf-8"
    )
    (dist_info / "entry_points.txt").write_text(f"[pypto_serving]\n{name} = {module}\n", encoding="utf-8")
