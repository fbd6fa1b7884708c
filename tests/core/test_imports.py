"""The core's import structure: no cycle among its modules, and a light KV-cache planner.

The module graph is read from the source with ``ast`` (imports inside functions included, since a
deferred import only hides a cycle), so a cycle fails here even where Python happens to resolve it.
"""

from __future__ import annotations

import ast
import graphlib
import json
import subprocess
import sys
from pathlib import Path

import pypto_serving

CORE = Path(pypto_serving.__file__).parent
PACKAGE = "pypto_serving"


def _module_name(path: Path) -> str:
    parts = [PACKAGE, *path.relative_to(CORE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_only(tree: ast.Module) -> set[int]:
    """Ids of import nodes under ``if TYPE_CHECKING:``: they never run, so they cannot form a cycle."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skipped


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
        skipped = _type_checking_only(tree)
        edges: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import | ast.ImportFrom) and id(node) not in skipped:
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
