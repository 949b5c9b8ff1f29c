"""Kubernetes objects for the fake API server and its tests: label selectors, Status, slice entries."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from aiohttp import web

SERVICE_LABEL = "kubernetes.io/service-name"
GROUP_PATH = "/apis/discovery.k8s.io/v1"
# plural -> (path of its group version, kind, apiVersion)
RESOURCES = {
    "endpointslices": (GROUP_PATH, "EndpointSlice", "discovery.k8s.io/v1"),
    "pods": ("/api/v1", "Pod", "v1"),
    "configmaps": ("/api/v1", "ConfigMap", "v1"),  # the shared admin-drain record (written too)
    "leases": ("/apis/coordination.k8s.io/v1", "Lease", "coordination.k8s.io/v1"),  # leader election
    "inferencepools": (
        "/apis/inference.networking.k8s.io/v1",
        "InferencePool",
        "inference.networking.k8s.io/v1",
    ),
    "inferenceobjectives": (
        "/apis/inference.networking.x-k8s.io/v1alpha2",
        "InferenceObjective",
        "inference.networking.x-k8s.io/v1alpha2",
    ),
}


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


SERVICE_ACCOUNT_GROUPS = ("system:serviceaccounts", "system:serviceaccounts:default", "system:authenticated")


def status_response(code: int, reason: str, message: str) -> web.Response:
    """The API server's error answer: a `Status` object as application/json."""
    return web.Response(
        status=code, body=json.dumps(status(code, reason, message)), content_type="application/json"
    )


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


POOL_LABELS = {"app": "vllm"}


def pod(
    ip: str | None,
    *,
    labels: dict[str, str] | None = None,
    ready: bool = True,
    phase: str = "Running",
    deleting: bool = False,
    container_ports: tuple[int, ...] = (8000,),
) -> tuple[dict[str, str], dict[str, Any], dict[str, Any]]:
    """(labels, extra metadata, body) of a model-server pod; `deleting` sets what `kubectl delete` does."""
    body: dict[str, Any] = {
        "spec": {
            "containers": [
                {
                    "name": "vllm",
                    "image": "vllm/vllm-openai",
                    "ports": [{"containerPort": port, "protocol": "TCP"} for port in container_ports],
                }
            ]
        },
        "status": {
            "phase": phase,
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
            **({"podIP": ip, "podIPs": [{"ip": ip}]} if ip else {}),
        },
    }
    metadata: dict[str, Any] = (
        {"deletionTimestamp": "2026-01-01T00:00:00Z", "deletionGracePeriodSeconds": 30} if deleting else {}
    )
    return dict(POOL_LABELS if labels is None else labels), metadata, body


def inference_pool(
    *,
    selector: dict[str, str] | None = None,
    ports: tuple[int, ...] = (8000,),
    picker: str = "inference-picker",
) -> dict[str, Any]:
    """The body of an InferencePool (inference.networking.k8s.io/v1)."""
    return {
        "spec": {
            "selector": {"matchLabels": dict(POOL_LABELS if selector is None else selector)},
            "targetPorts": [{"number": port} for port in ports],
            "endpointPickerRef": {"name": picker, "port": {"number": 9002}},
        }
    }


def inference_objective(*, priority: int | None = None, pool: str = "vllm") -> dict[str, Any]:
    """The body of an InferenceObjective (inference.networking.x-k8s.io/v1alpha2)."""
    spec: dict[str, Any] = {"poolRef": {"group": "inference.networking.k8s.io", "name": pool}}
    if priority is not None:
        spec["priority"] = priority
    return {"spec": spec}


def field_name(text: str, namespace: str) -> str | None:
    """The name a fieldSelector asks for (metadata.name=, metadata.namespace=); ValueError otherwise."""
    name = None
    for part in (p.strip() for p in text.split(",") if p.strip()):
        field_name, _, value = part.partition("=")
        if field_name == "metadata.name" and value:
            name = value
        elif field_name == "metadata.namespace" and value == namespace:
            pass
        else:
            raise ValueError(f"field selector {part!r} is not supported")
    return name


def kubeconfig(server: str, token: str, namespace: str) -> dict[str, Any]:
    """A kubeconfig for one plain-http server and a bearer token."""
    context = {"cluster": "fake", "user": "fake", "namespace": namespace}
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "fake", "cluster": {"server": server}}],
        "users": [{"name": "fake", "user": {"token": token}}],
        "contexts": [{"name": "fake", "context": context}],
        "current-context": "fake",
    }
