"""The house rules a newcomer walks by: no module of the package over 400 lines unless its docstring
says why at its top; the top of the package holds only its parts and the assembly, each part saying
what it owns (the import contracts in pyproject.toml say which imports a part may make)."""

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


ASSEMBLY = {"__init__.py", "__main__.py", "app.py", "wiring.py"}


def test_the_top_holds_only_parts_and_the_assembly_and_each_part_says_what_it_owns() -> None:
    """A newcomer opening picker/ sees the parts (packages) and the two modules that put them
    together; each part's docstring says what it owns."""
    stray = sorted(p.name for p in PACKAGE.glob("*.py") if p.name not in ASSEMBLY)
    assert stray == [], "move these into the part that owns them: " + ", ".join(stray)
    silent = []
    for part in sorted(p for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()):
        docstring = ast.get_docstring(ast.parse((part / "__init__.py").read_text())) or ""
        if len(docstring) < 80:
            silent.append(part.name)
    assert silent == [], "say what these parts own: " + ", ".join(silent)
