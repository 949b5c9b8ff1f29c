"""The pool is a core plane: no network, file or event-loop library, whatever a source needs."""

from __future__ import annotations

import ast
from pathlib import Path

import picker.pool

FORBIDDEN = {
    "aiohttp",
    "asyncio",
    "grpc",
    "httpx",
    "httpx2",
    "lightkube",
    "socket",
    "picker.sources",
    "picker.streams",
}


def test_pool_modules_import_no_io_library() -> None:
    offenders = []
    for module in sorted(Path(picker.pool.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(module.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            offenders += [
                f"{module.name}: {n}" for n in names if n.split(".")[0] in FORBIDDEN or n in FORBIDDEN
            ]
            offenders += [
                f"{module.name}: {n}" for n in names if any(n.startswith(f + ".") for f in FORBIDDEN)
            ]
    assert offenders == []
