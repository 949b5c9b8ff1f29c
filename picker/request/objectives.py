"""InferenceObjectives (inference.networking.x-k8s.io/v1alpha2) -> request priorities for flow control.

Pure: no I/O. A request naming an objective (header x-gateway-inference-objective, the objective's
metadata.name, as GIE v1 defines it) is queued at that objective's `spec.priority`; an unset priority
is 0, as the API documents, and an unknown objective gets the default priority. Only the objectives
whose `spec.poolRef` names the picker's InferencePool count. The pool source
(picker/sources/kube_pool.py) keeps an `Objectives` in step with the API server; the request path
only reads it, through `priority()`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

POOL_GROUP = "inference.networking.k8s.io"


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _for_pool(spec: Mapping[str, Any], pool_name: str) -> bool:
    refs = [_mapping(spec.get("poolRef"))]
    listed = spec.get("poolRefs")  # the plural form of later API versions
    refs += [_mapping(r) for r in listed] if isinstance(listed, list) else []
    return any(
        ref.get("name") == pool_name and ref.get("group", POOL_GROUP) in (POOL_GROUP, None) for ref in refs
    )


class Objectives:
    """Objective name -> priority, for the objectives of one InferencePool."""

    def __init__(self, pool_name: str, default: int = 0) -> None:
        self.pool_name = pool_name
        self.default = default
        self._priorities: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._priorities)

    def priority(self, name: str | None) -> int:
        """The priority of a request naming this objective; the default for none or an unknown one."""
        if not name:
            return self.default
        return self._priorities.get(name, self.default)

    def known(self) -> dict[str, int]:
        return dict(self._priorities)

    def replace(self, objects: Iterable[Mapping[str, Any]]) -> list[str]:
        """A full list: exactly these objectives exist now. Problems, for the log."""
        self._priorities = {}
        problems: list[str] = []
        for obj in objects:
            problems.extend(self.apply("ADDED", obj))
        return problems

    def apply(self, event_type: str, obj: Mapping[str, Any]) -> list[str]:
        """One watch event (ADDED / MODIFIED / DELETED). Problems, for the log."""
        name = _mapping(obj.get("metadata")).get("name")
        if not isinstance(name, str) or not name:
            return [f"{event_type} event for an InferenceObjective without metadata.name; ignored"]
        spec = _mapping(obj.get("spec"))
        if event_type == "DELETED" or not _for_pool(spec, self.pool_name):
            self._priorities.pop(name, None)  # deleted, or moved to another pool
            return []
        priority = spec.get("priority", 0)
        if priority is None:
            priority = 0
        if not isinstance(priority, int) or isinstance(priority, bool):
            self._priorities.pop(name, None)
            return [f"InferenceObjective {name}: spec.priority {priority!r} is not an integer; default used"]
        self._priorities[name] = priority
        return []


def request_priority(
    priority_header: str | None, objective_header: str | None, objectives: Objectives | None
) -> int | None:
    """A request's flow-control priority: the priority header when set (an override, for users
    without Kubernetes), else its InferenceObjective's, else 0. None: the priority header is not an
    integer (the frontend answers 400)."""
    if priority_header is not None and priority_header.strip():
        try:
            return int(priority_header)
        except ValueError:
            return None
    if objectives is None:
        return 0
    return objectives.priority(objective_header)
