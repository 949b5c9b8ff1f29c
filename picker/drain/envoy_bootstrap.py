"""Walking an Envoy bootstrap's static_resources to its HTTP connection managers, each with the field
path it sits at (so a finding names the line). Shared by the Envoy rules; imports no rule."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from picker.drain.manifests import Document, FieldPath, get


def type_of(typed_config: Any) -> str:
    return str(get(typed_config, ("@type",), "")).rsplit(".", 1)[-1]


@dataclass(frozen=True)
class Located:
    path: FieldPath
    data: dict[str, Any]


def connection_managers(doc: Document) -> Iterator[Located]:
    for li, listener in enumerate(get(doc.data, ("static_resources", "listeners"), []) or []):
        for ci, chain in enumerate(get(listener, ("filter_chains",), []) or []):
            for fi, item in enumerate(get(chain, ("filters",), []) or []):
                config = get(item, ("typed_config",))
                if isinstance(config, dict) and type_of(config) == "HttpConnectionManager":
                    path = (
                        "static_resources",
                        "listeners",
                        li,
                        "filter_chains",
                        ci,
                        "filters",
                        fi,
                        "typed_config",
                    )
                    yield Located(path, config)
