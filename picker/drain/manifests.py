"""Reading the inputs of `picker check`: YAML documents that remember the line of every field.

Envoy templates carry `${NAME}` placeholders (filled by picker/cli/envoyconf.py). They are not YAML, so
before parsing each becomes a plain scalar `__placeholder_NAME__` (a placeholder alone on its line
becomes a comment), and rules treat any value holding one as unknown.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

FieldPath = tuple[str | int, ...]

_PLACEHOLDER = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
_PLACEHOLDER_LINE = re.compile(r"^(\s*)\$\{([A-Za-z_][A-Za-z0-9_]*)\}\s*$", re.MULTILINE)
_SENTINEL = "__placeholder_"
_SUFFIXES = (".yaml", ".yml", ".json")


class Unknown:
    """A value the inputs do not fix (a template placeholder, an unset flag read from a file)."""

    def __init__(self, why: str) -> None:
        self.why = why

    def __repr__(self) -> str:
        return f"Unknown({self.why})"


def is_placeholder(value: Any) -> bool:
    return isinstance(value, str) and _SENTINEL in value


def placeholder_name(value: str) -> str:
    match = re.search(r"__placeholder_([A-Za-z0-9_]+?)__", value)
    return "${" + (match.group(1) if match else "?") + "}"


def format_path(path: FieldPath) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


@dataclass
class Document:
    """One YAML document of one file, with the line (1-based) of each field path."""

    file: Path
    index: int
    data: Any
    lines: dict[FieldPath, int] = field(default_factory=dict)

    def line_of(self, path: FieldPath) -> int | None:
        """The line of `path`, or of its nearest ancestor that exists."""
        for end in range(len(path), -1, -1):
            line = self.lines.get(path[:end])
            if line is not None:
                return line
        return None

    @property
    def kind(self) -> str:
        return str(self.data.get("kind", "")) if isinstance(self.data, dict) else ""

    @property
    def name(self) -> str:
        meta = self.data.get("metadata") if isinstance(self.data, dict) else None
        return str(meta.get("name", "")) if isinstance(meta, dict) else ""

    @property
    def namespace(self) -> str:
        meta = self.data.get("metadata") if isinstance(self.data, dict) else None
        return str(meta.get("namespace") or "default") if isinstance(meta, dict) else "default"

    @property
    def label(self) -> str:
        """How findings name the object: `Deployment/vllm` or `envoy bootstrap`."""
        if self.is_kubernetes:
            return f"{self.kind}/{self.name}"
        return "envoy bootstrap" if self.is_envoy else f"document {self.index}"

    @property
    def is_kubernetes(self) -> bool:
        return isinstance(self.data, dict) and "apiVersion" in self.data and "kind" in self.data

    @property
    def is_envoy(self) -> bool:
        return isinstance(self.data, dict) and bool(
            {"static_resources", "dynamic_resources", "admin", "layered_runtime"} & set(self.data)
        )


@dataclass(frozen=True)
class LoadProblem:
    file: Path
    line: int | None
    message: str


def _fill_placeholders(text: str) -> str:
    text = _PLACEHOLDER_LINE.sub(lambda m: f"{m.group(1)}# placeholder {m.group(2)}", text)
    return _PLACEHOLDER.sub(lambda m: f"{_SENTINEL}{m.group(1)}__", text)


def _record_lines(node: yaml.Node, path: FieldPath, lines: dict[FieldPath, int]) -> None:
    lines.setdefault(path, node.start_mark.line + 1)
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            if isinstance(key_node, yaml.ScalarNode):
                child = (*path, str(key_node.value))
                lines[child] = key_node.start_mark.line + 1
                _record_lines(value_node, child, lines)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            _record_lines(item, (*path, index), lines)


def parse_documents(text: str, file: Path) -> list[Document]:
    """Every non-empty document of `text`; raises yaml.YAMLError on invalid YAML."""
    loader = yaml.SafeLoader(_fill_placeholders(text))
    documents: list[Document] = []
    try:
        while loader.check_node():
            node = loader.get_node()
            if node is None:
                continue
            data = loader.construct_document(node)
            if data is None:
                continue
            lines: dict[FieldPath, int] = {}
            _record_lines(node, (), lines)
            documents.extend(_expand_list(Document(file, len(documents), data, lines)))
    finally:
        loader.dispose()
    return documents


def _expand_list(document: Document) -> Iterator[Document]:
    """`kind: List` (what `kubectl get -o yaml` prints) holds its objects under `items`."""
    items = document.data.get("items") if document.kind == "List" else None
    if not isinstance(items, list):
        yield document
        return
    for index, item in enumerate(items):
        prefix: FieldPath = ("items", index)
        lines = {path[2:]: line for path, line in document.lines.items() if path[:2] == prefix}
        yield Document(document.file, document.index, item, lines)


def input_files(paths: list[Path]) -> tuple[list[Path], list[LoadProblem]]:
    """Files named, and the YAML/JSON files under directories named (sorted, recursive)."""
    files: list[Path] = []
    problems: list[LoadProblem] = []
    for path in paths:
        if path.is_dir():
            files.extend(sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in _SUFFIXES))
        elif path.is_file():
            files.append(path)
        else:
            problems.append(LoadProblem(path, None, "no such file or directory"))
    return list(dict.fromkeys(files)), problems


def load(paths: list[Path]) -> tuple[list[Document], list[LoadProblem]]:
    """All documents of all inputs; unreadable or invalid files become problems, never exceptions."""
    files, problems = input_files(paths)
    documents: list[Document] = []
    for file in files:
        try:
            text = file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            problems.append(LoadProblem(file, None, f"cannot read: {exc}"))
            continue
        try:
            documents.extend(parse_documents(text, file))
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            line = mark.line + 1 if mark is not None else None
            problems.append(LoadProblem(file, line, f"not valid YAML: {getattr(exc, 'problem', exc)}"))
    return documents, problems


def get(data: Any, path: FieldPath, default: Any = None) -> Any:
    """`data` followed along `path`; `default` where a step is missing or of the wrong type."""
    node = data
    for part in path:
        if isinstance(part, int):
            if not isinstance(node, list) or not -len(node) <= part < len(node):
                return default
        elif not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node
