"""The size rules of the project's style (COMMON.md, docs/architecture.md): no module under
toolkit/, model_adapters/ or scripts/ over 500 lines, no function (or method) there over 80
lines, no family file in model_adapters/ over 80 lines. Every offender is listed, not only
the first."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80
MAX_FAMILY_LINES = 80


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def _functions(path: Path) -> list[tuple[str, int, int]]:
    """(qualified name, first line, lines) of every function and method, def line to last."""
    out = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{child.name}"
                out.append((name, child.lineno, child.end_lineno - child.lineno + 1))
                visit(child, name + ".")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(path.read_text(), filename=str(path)), "")
    return out


def _sources(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


def test_no_module_over_500_lines():
    long = [f"{p.relative_to(ROOT)}: {n} lines"
            for p in _sources("toolkit") + _sources("model_adapters") + _sources("scripts")
            if (n := _lines(p)) > MAX_MODULE_LINES]
    assert not long, (f"modules over {MAX_MODULE_LINES} lines (split them by job):\n"
                      + "\n".join(long))


def test_no_function_over_80_lines():
    long = [f"{p.relative_to(ROOT)}:{line} {name}: {n} lines"
            for p in _sources("toolkit") + _sources("model_adapters") + _sources("scripts")
            for name, line, n in _functions(p) if n > MAX_FUNCTION_LINES]
    assert not long, (f"functions over {MAX_FUNCTION_LINES} lines (split them into named "
                      "steps):\n" + "\n".join(long))


def test_family_files_stay_declarations():
    long = [f"{p.relative_to(ROOT)}: {n} lines" for p in _sources("model_adapters")
            if p.name != "__init__.py" and (n := _lines(p)) > MAX_FAMILY_LINES]
    assert not long, f"family files over {MAX_FAMILY_LINES} lines:\n" + "\n".join(long)
