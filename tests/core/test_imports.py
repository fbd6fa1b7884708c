"""The core's import structure: no cycle among its modules, and a light KV-cache planner.

The module graph is read from the source with ``ast``, every import included: those inside functions
(a deferred import only hides a cycle) and those under ``if TYPE_CHECKING:`` (a cycle there is still a
loop in the design, and one ``from __future__`` change or a runtime use away from a real one), so a
cycle fails here even where Python happens to resolve it.
"""

from __future__ import annotations

import ast
import graphlib
import importlib
import importlib.util
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pypto_serving

CORE = Path(pypto_serving.__file__).parent
PACKAGE = "pypto_serving"


def _module_name(path: Path) -> str:
    parts = [PACKAGE, *path.relative_to(CORE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_package: bool, modules: set[str]) -> set[str]:
    """The core modules an import statement runs, as dotted names."""
    if isinstance(node, ast.Import):
        return {a.name for a in node.names if a.name in modules}
    if node.level:
        package = module if is_package else module.rpartition(".")[0]
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        base = f"{package}.{node.module}" if node.module else package
    else:
        base = node.module or ""
    # ``from . import x`` runs the submodule x when there is one, else the package itself.
    found = {f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules}
    if len(found) < len(node.names) and base in modules:
        found.add(base)
    return found


def core_import_graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in sorted(CORE.rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        tree = ast.parse(path.read_text(), str(path))
        edges: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import | ast.ImportFrom):
                edges |= _targets(node, module, path.name == "__init__.py", set(files))
        graph[module] = edges - {module}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as e:
        return list(e.args[1])
    return None


def test_the_graph_sees_every_kind_of_import() -> None:
    """Guards the cycle test against passing on an empty graph."""
    graph = core_import_graph()
    assert "pypto_serving.request" in graph["pypto_serving.kv_cache"]  # a plain ``from .x import``
    assert "pypto_serving.server.app" in graph["pypto_serving.server"]  # from a package's __init__
    assert "pypto_serving.engine" in graph["pypto_serving.cli"]  # inside a function
    assert "pypto_serving.config" in graph["pypto_serving.server.app"]  # ``from ..x import``
    assert "pypto_serving.config" in graph["pypto_serving.hookspecs"]  # under ``if TYPE_CHECKING:``


def test_the_cycle_finder_names_a_cycle() -> None:
    cycle = find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}})
    assert cycle is not None and set(cycle) == {"a", "b", "c"} and cycle[0] == cycle[-1]


def test_no_import_cycle_in_core() -> None:
    cycle = find_cycle(core_import_graph())
    assert cycle is None, "import cycle among core modules: " + " -> ".join(cycle or [])


HEAVY = ("torch", "msgspec", "multiprocessing")

# Imports kv_cache.py and what it imports, without running the package's __init__ (which loads the
# whole engine), and prints the heavy top-level modules that this added to sys.modules.
_PROBE = """
import importlib, json, sys, types
package = types.ModuleType({package!r})
package.__path__ = [{core!r}]
sys.modules[{package!r}] = package
before = set(sys.modules)
importlib.import_module({package!r} + ".kv_cache")
added = {{name.split(".")[0] for name in set(sys.modules) - before}}
print(json.dumps(sorted(added & set({heavy!r}))))
"""


def test_kv_cache_imports_no_torch_msgspec_or_multiprocessing() -> None:
    code = _PROBE.format(package=PACKAGE, core=str(CORE), heavy=HEAVY)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    loaded = json.loads(r.stdout.strip().splitlines()[-1])
    assert loaded == [], f"importing kv_cache.py loads {loaded}"


# ------------------------------------------------------------------ the surface plugins import

REPO = Path(__file__).resolve().parents[2]
# Plugin sources: the built-in plugins and the third-party example the docs print.
PLUGIN_SOURCES = (REPO / "plugins", REPO / "tests" / "fixtures" / "thirdparty_executor")
# The submodules docs/plugins.md declares public: a plugin imports the names of their ``__all__``.
PUBLIC_MODULES = frozenset(
    {
        f"{PACKAGE}.parallel",
        f"{PACKAGE}.parsers",
        f"{PACKAGE}.quantization",
        f"{PACKAGE}.kv_transfer",
        f"{PACKAGE}.lora_weights",
    }
)


def _public_names(module: str) -> set[str]:
    return set(importlib.import_module(module).__all__)


def _check_from(module: str, names: list[str]) -> list[str]:
    """Why ``from module import names`` leaves the public surface (empty: it keeps to it)."""
    if module == PACKAGE:
        exported = _public_names(PACKAGE)
        return [
            f"{PACKAGE}.{n} is not public" if importlib.util.find_spec(f"{PACKAGE}.{n}") else f"the root exports no {n}"
            for n in names
            if n not in exported and f"{PACKAGE}.{n}" not in PUBLIC_MODULES
        ]
    if module not in PUBLIC_MODULES:
        return [f"{module} is not public"]
    return [f"{module}.__all__ has no {n}" for n in names if n not in _public_names(module)]


def _check_attribute(node: ast.Attribute) -> list[str]:
    """Why ``pypto_serving.a.b`` (read through ``import pypto_serving``) leaves the public surface."""
    chain: list[str] = []
    current: ast.expr = node
    while isinstance(current, ast.Attribute):
        chain.insert(0, current.attr)
        current = current.value
    if not (isinstance(current, ast.Name) and current.id == PACKAGE):
        return []
    module = f"{PACKAGE}.{chain[0]}"
    if module in PUBLIC_MODULES:
        return _check_from(module, chain[1:2])
    return _check_from(PACKAGE, chain[:1])


def surface_violations(source: str, where: str) -> list[str]:
    """Each import (or ``pypto_serving.x`` attribute) in ``source`` that reaches past the public
    surface: every node of the tree, so imports under ``if TYPE_CHECKING:`` and in functions count."""
    found: list[str] = []
    tree = ast.parse(source, where)
    inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}  # read whole chains once
    for node in ast.walk(tree):
        problems: list[str] = []
        if isinstance(node, ast.Import):
            for alias in node.names:
                top, _, rest = alias.name.partition(".")
                if top == PACKAGE and rest:
                    problems += [] if alias.name in PUBLIC_MODULES else [f"{alias.name} is not public"]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            if node.module.partition(".")[0] == PACKAGE:
                problems += _check_from(node.module, [a.name for a in node.names])
        elif isinstance(node, ast.Attribute) and id(node) not in inner:
            problems += _check_attribute(node)
        found += [f"{where}:{getattr(node, 'lineno', '?')}: {p}" for p in problems]
    return found


def _plugin_files() -> list[Path]:
    return sorted(p for root in PLUGIN_SOURCES for p in root.rglob("*.py"))


def test_the_surface_check_sees_every_kind_of_import() -> None:
    """Guards the plugin scan against passing by not looking: each line below leaves the surface."""
    source = textwrap.dedent(
        """
        from typing import TYPE_CHECKING
        import pypto_serving
        from pypto_serving import Executor, hookimpl, parallel
        from pypto_serving.parallel import ParallelContext
        if TYPE_CHECKING:
            from pypto_serving.scheduler import Scheduler
        def later():
            import pypto_serving.engine
            from pypto_serving import engine, NotAName
            from pypto_serving.quantization import _FP8_DTYPES
            return pypto_serving.runner.ModelRunner, pypto_serving.parallel.NoSuchName, pypto_serving.LLM
        """
    )
    found = [v.partition(": ")[2] for v in surface_violations(source, "x.py")]
    assert sorted(found) == sorted(
        [
            f"{PACKAGE}.scheduler is not public",
            f"{PACKAGE}.engine is not public",
            f"{PACKAGE}.engine is not public",
            "the root exports no NotAName",
            f"{PACKAGE}.quantization.__all__ has no _FP8_DTYPES",
            f"{PACKAGE}.runner is not public",
            f"{PACKAGE}.parallel.__all__ has no NoSuchName",
        ]
    )


def test_plugins_import_only_the_public_surface() -> None:
    files = _plugin_files()
    plugin_dirs = {d for d in (REPO / "plugins").iterdir() if (d / "pyproject.toml").is_file()}
    assert len(plugin_dirs) >= 4 and all(any(d in f.parents for f in files) for d in plugin_dirs)
    sources = {p: p.read_text() for p in files}
    assert sum(f"from {PACKAGE}" in s for s in sources.values()) >= 10  # and they use the core
    found = [v for p, s in sources.items() for v in surface_violations(s, str(p.relative_to(REPO)))]
    assert not found, "plugins reach past the public surface (docs/plugins.md):\n" + "\n".join(found)


def test_public_modules_are_declared_and_documented() -> None:
    """Each public submodule lists its names in ``__all__``, each of them exists, and docs/plugins.md
    names exactly these submodules as public."""
    for module in sorted(PUBLIC_MODULES | {PACKAGE}):
        mod = importlib.import_module(module)
        missing = [n for n in mod.__all__ if not hasattr(mod, n)]
        assert not missing, f"{module}.__all__ names what it does not define: {missing}"
    doc = (REPO / "docs" / "plugins.md").read_text()
    section = doc.split("## The public surface", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(rf"`({PACKAGE}\.[a-z][a-z_]*)`", section))
    assert documented == PUBLIC_MODULES
