"""The house rules a newcomer walks by: no module of the package over 400 lines unless its docstring
says why at its top, and the frontends share the core's rules rather than copying them (the import
contracts in pyproject.toml say which imports; this says how long)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "picker"
LIMIT = 400


def test_a_long_module_says_why_at_its_top() -> None:
    unexplained = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        if len(text.splitlines()) <= LIMIT:
            continue
        docstring = ast.get_docstring(ast.parse(text)) or ""
        if f"{LIMIT} lines" not in docstring:
            unexplained.append(f"{path.relative_to(PACKAGE.parent)} ({len(text.splitlines())} lines)")
    assert unexplained == [], "split these, or say at their top why not: " + ", ".join(unexplained)
