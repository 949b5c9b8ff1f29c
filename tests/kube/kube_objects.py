"""Kubernetes objects for the fake API server and its tests: label selectors, Status, slice entries."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

SERVICE_LABEL = "kubernetes.io/service-name"


@dataclass(frozen=True)
class Requirement:
    key: str
    op: str  # "=", "!=", "exists", "!exists"
    value: str = ""

    def matches(self, labels: Mapping[str, str]) -> bool:
        match self.op:
            case "=":
                return labels.get(self.key) == self.value
            case "!=":
                return labels.get(self.key) != self.value
            case "exists":
                return self.key in labels
            case _:
                return self.key not in labels


def parse_selector(text: str) -> list[Requirement]:
    """Equality-based label selectors (what a Service's slices are found by); ValueError otherwise."""
    requirements = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        if m := re.fullmatch(r"([\w./-]+)\s*(==|=|!=)\s*([\w.-]*)", part):
            op = "!=" if m.group(2) == "!=" else "="
            requirements.append(Requirement(m.group(1), op, m.group(3)))
        elif m := re.fullmatch(r"(!?)([\w./-]+)", part):
            requirements.append(Requirement(m.group(2), "!exists" if m.group(1) else "exists"))
        else:
            raise ValueError(f"unable to parse requirement: {part!r}")
    return requirements


def matches(selector: list[Requirement], obj: Mapping[str, Any] | None) -> bool:
    if obj is None:
        return False
    labels = obj.get("metadata", {}).get("labels") or {}
    return all(r.matches(labels) for r in selector)


def status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


def endpoint(
    ip: str,
    *,
    ready: bool | None = True,
    serving: bool | None = True,
    terminating: bool | None = False,
) -> dict[str, Any]:
    """One endpoint entry of a slice (None leaves the condition out)."""
    conditions = {
        k: v
        for k, v in {"ready": ready, "serving": serving, "terminating": terminating}.items()
        if v is not None
    }
    return {"addresses": [ip], "conditions": conditions, "targetRef": {"kind": "Pod", "name": f"pod-{ip}"}}


def terminating(ip: str) -> dict[str, Any]:
    """What the EndpointSlice controller writes for a pod that has started to terminate."""
    return endpoint(ip, ready=False, serving=True, terminating=True)
