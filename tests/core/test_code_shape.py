"""Shape rules of the core that review alone does not keep: no function over 50 lines (declaration
lists such as a metrics registry excepted, by name)."""

from __future__ import annotations

import ast
from pathlib import Path

CORE = Path(__file__).resolve().parents[2] / "core" / "pypto_serving"
MAX_LINES = 50
# Declaration lists: one statement per metric, nothing to split.
DECLARATIONS = {("metrics.py", "ServerMetrics.__init__")}


def _functions(path: Path) -> list[tuple[str, int]]:
    out: list[tuple[str, int]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                name = f"{prefix}{child.name}"
                out.append((name, (child.end_lineno or child.lineno) - child.lineno + 1))
                visit(child, f"{name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")

    visit(ast.parse(path.read_text()), "")
    return out


def test_no_function_in_core_is_over_50_lines() -> None:
    long = [
        f"{path.relative_to(CORE)}:{name} ({n} lines)"
        for path in sorted(CORE.rglob("*.py"))
        for name, n in _functions(path)
        if n > MAX_LINES and (str(path.relative_to(CORE)), name) not in DECLARATIONS
    ]
    assert not long, "split these functions: " + ", ".join(long)


def test_the_rule_sees_nested_and_async_functions(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    body = "\n".join(f"            x{i} = {i}" for i in range(60))
    src.write_text(f"class A:\n    async def f(self):\n        def g():\n{body}\n        return 1\n")
    assert dict(_functions(src))["A.f.g"] == 61
