"""The runtime reads as it is: every module, class and public function of `tiered/` says what it
does, and no comment or docstring there carries an issue number, a date or a formatter opt-out."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import tiered

ROOT = Path(tiered.__file__).parent
SOURCES = sorted(ROOT.rglob("*.py"))
HISTORY = re.compile(r"\b[Ii]ssue \d+|\b20\d\d-\d\d-\d\d\b|fmt:\s*(skip|off)")


def undocumented(tree: ast.Module) -> list[str]:
    """Names of the module (as "<module>"), classes and public functions without a docstring."""
    missing = [] if ast.get_docstring(tree) else ["<module>"]

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                if not child.name.startswith("_") and ast.get_docstring(child) is None:
                    missing.append(prefix + child.name)
                if isinstance(child, ast.ClassDef):
                    walk(child, f"{prefix}{child.name}.")

    walk(tree, "")
    return missing


def test_the_check_finds_what_lacks_a_docstring() -> None:
    source = '"""m."""\nclass A:\n    def f(self): pass\n    def _g(self): pass\ndef h():\n    """h."""\n'
    assert undocumented(ast.parse(source)) == ["A", "A.f"]
    assert undocumented(ast.parse("x = 1\n")) == ["<module>"]


def test_every_module_class_and_public_function_has_a_docstring() -> None:
    missing = [
        f"{p.relative_to(ROOT.parent)}: {name}" for p in SOURCES for name in undocumented(ast.parse(p.read_text()))
    ]
    assert missing == [], "without a docstring:\n" + "\n".join(missing)


def test_no_issue_numbers_dates_or_formatter_opt_outs_in_the_runtime() -> None:
    found = [
        f"{p.relative_to(ROOT.parent)}:{n}: {line.strip()}"
        for p in SOURCES
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if HISTORY.search(line)
    ]
    assert found == [], "\n".join(found)
