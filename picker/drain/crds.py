"""Structural checks of the custom objects the picker's manifests use (no package ships their CRDs).

Each object is held to the required fields and types of its CRD: InferencePool
(inference.networking.k8s.io/v1), Gateway and HTTPRoute (gateway.networking.k8s.io/v1), KEDA's
ScaledObject (keda.sh/v1alpha1). Not the full
OpenAPI schema (patterns, CEL rules): the fields a typo or a v1alpha2 leftover gets wrong.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from picker.drain.manifests import FieldPath

Problem = tuple[FieldPath, str]
_DURATION = re.compile(r"^([0-9]{1,5}(h|m|s|ms)){1,4}$")
_UNITS = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}
INFERENCE_GROUP = "inference.networking.k8s.io"
GATEWAY_GROUP = "gateway.networking.k8s.io"


def gateway_duration(text: str) -> float | None:
    """Seconds of a Gateway API duration (GEP-2257: 1h, 30s, 1m30s, 500ms), else None."""
    if not isinstance(text, str) or not _DURATION.match(text):
        return None
    return sum(float(n) * _UNITS[u] for n, u in re.findall(r"([0-9]+)(ms|h|m|s)", text))


class _Checker:
    def __init__(self) -> None:
        self.problems: list[Problem] = []

    def need(self, node: Any, key: str, kind: type | tuple[type, ...], path: FieldPath) -> Any:
        if not isinstance(node, dict) or key not in node:
            self.problems.append(((*path, key), f"{key} is required"))
            return None
        return self.typed(node[key], kind, (*path, key))

    def may(self, node: Any, key: str, kind: type | tuple[type, ...], path: FieldPath) -> Any:
        if not isinstance(node, dict) or key not in node:
            return None
        return self.typed(node[key], kind, (*path, key))

    def typed(self, value: Any, kind: type | tuple[type, ...], path: FieldPath) -> Any:
        wrong_bool = isinstance(value, bool) and kind in (int, (int,))
        if not isinstance(value, kind) or wrong_bool:
            names = "/".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
            self.problems.append(
                (path, f"must be {_TYPE_WORDS.get(names, names)}, not {type(value).__name__}")
            )
            return None
        return value

    def port(self, node: Any, key: str, path: FieldPath, required: bool = True) -> None:
        value = (self.need if required else self.may)(node, key, int, path)
        if value is not None and not 1 <= value <= 65535:
            self.problems.append(((*path, key), f"{value} is not a port (1-65535)"))

    def items(self, node: Any, key: str, path: FieldPath, low: int, high: int, required: bool) -> list[Any]:
        value = (self.need if required else self.may)(node, key, list, path)
        if value is None:
            return []
        if not low <= len(value) <= high:
            self.problems.append(((*path, key), f"needs {low} to {high} items, has {len(value)}"))
        return value

    def enum(self, node: Any, key: str, allowed: tuple[str, ...], path: FieldPath) -> None:
        value = self.may(node, key, str, path)
        if value is not None and value not in allowed:
            self.problems.append(((*path, key), f"{value!r} is not one of {', '.join(allowed)}"))


_TYPE_WORDS = {"dict": "a mapping", "list": "a list", "str": "a string", "int": "an integer"}


def _inference_pool(obj: dict[str, Any], c: _Checker) -> None:
    spec = c.need(obj, "spec", dict, ())
    if spec is None:
        return
    path: FieldPath = ("spec",)
    if "extensionRef" in spec or "targetPortNumber" in spec:
        c.problems.append(
            (
                path,
                "extensionRef / targetPortNumber are v1alpha2 fields: v1 has "
                "endpointPickerRef and targetPorts",
            )
        )
    selector = c.need(spec, "selector", dict, path)
    if selector is not None:
        labels = c.need(selector, "matchLabels", dict, (*path, "selector"))
        if labels is not None and not labels:
            c.problems.append(((*path, "selector", "matchLabels"), "empty: it would select every pod"))
        for key, value in (labels or {}).items():
            c.typed(value, str, (*path, "selector", "matchLabels", str(key)))
    for i, port in enumerate(c.items(spec, "targetPorts", path, 1, 8, True)):
        if c.typed(port, dict, (*path, "targetPorts", i)) is not None:
            c.port(port, "number", (*path, "targetPorts", i))
    ref = c.need(spec, "endpointPickerRef", dict, path)
    if ref is not None:
        ref_path = (*path, "endpointPickerRef")
        c.need(ref, "name", str, ref_path)
        c.may(ref, "group", str, ref_path)
        kind = c.may(ref, "kind", str, ref_path) or "Service"
        port = (c.need if kind == "Service" else c.may)(ref, "port", dict, ref_path)
        if port is not None:
            c.port(port, "number", (*ref_path, "port"))
        c.enum(ref, "failureMode", ("FailOpen", "FailClose"), ref_path)


def _gateway(obj: dict[str, Any], c: _Checker) -> None:
    spec = c.need(obj, "spec", dict, ())
    if spec is None:
        return
    c.need(spec, "gatewayClassName", str, ("spec",))
    names: set[str] = set()
    for i, listener in enumerate(c.items(spec, "listeners", ("spec",), 1, 64, True)):
        path = ("spec", "listeners", i)
        if c.typed(listener, dict, path) is None:
            continue
        name = c.need(listener, "name", str, path)
        if name in names:
            c.problems.append(((*path, "name"), f"listener name {name!r} is used twice"))
        names.add(name or "")
        c.port(listener, "port", path)
        c.need(listener, "protocol", str, path)
        c.may(listener, "hostname", str, path)


def _http_route(obj: dict[str, Any], c: _Checker) -> None:
    spec = c.need(obj, "spec", dict, ())
    if spec is None:
        return
    for i, parent in enumerate(c.items(spec, "parentRefs", ("spec",), 0, 32, False)):
        if c.typed(parent, dict, ("spec", "parentRefs", i)) is not None:
            c.need(parent, "name", str, ("spec", "parentRefs", i))
    for i, rule in enumerate(c.items(spec, "rules", ("spec",), 0, 16, False)):
        path = ("spec", "rules", i)
        if c.typed(rule, dict, path) is None:
            continue
        timeouts = c.may(rule, "timeouts", dict, path) or {}
        for key in ("request", "backendRequest"):
            value = c.may(timeouts, key, str, (*path, "timeouts"))
            if value is not None and gateway_duration(value) is None:
                c.problems.append(((*path, "timeouts", key), f"{value!r} is not a duration like 30s or 1m"))
        for j, ref in enumerate(c.items(rule, "backendRefs", path, 0, 16, False)):
            ref_path = (*path, "backendRefs", j)
            if c.typed(ref, dict, ref_path) is None:
                continue
            c.need(ref, "name", str, ref_path)
            kind = c.may(ref, "kind", str, ref_path) or "Service"
            group = c.may(ref, "group", str, ref_path) or ""
            if kind == "InferencePool" and group != INFERENCE_GROUP:
                c.problems.append(
                    ((*ref_path, "group"), f"an InferencePool backendRef needs group {INFERENCE_GROUP}")
                )
            if kind == "Service" and group == "":
                c.port(ref, "port", ref_path)
            weight = c.may(ref, "weight", int, ref_path)
            if weight is not None and not 0 <= weight <= 1_000_000:
                c.problems.append(((*ref_path, "weight"), f"{weight} is not in 0-1000000"))


KEDA_GROUP = "keda.sh"


def _scaled_object(obj: dict[str, Any], c: _Checker) -> None:
    """KEDA's ScaledObject: a target, and triggers whose metadata are strings (KEDA reads a map of
    strings: `threshold: 0.8` unquoted is refused by the API server)."""
    spec = c.need(obj, "spec", dict, ())
    if spec is None:
        return
    target = c.need(spec, "scaleTargetRef", dict, ("spec",))
    if target is not None:
        c.need(target, "name", str, ("spec", "scaleTargetRef"))
        c.may(target, "kind", str, ("spec", "scaleTargetRef"))
    for key in ("minReplicaCount", "maxReplicaCount", "pollingInterval", "cooldownPeriod"):
        value = c.may(spec, key, int, ("spec",))
        if value is not None and value < 0:
            c.problems.append((("spec", key), f"{value} is negative"))
    for i, trigger in enumerate(c.items(spec, "triggers", ("spec",), 1, 64, True)):
        path = ("spec", "triggers", i)
        if c.typed(trigger, dict, path) is None:
            continue
        kind = c.need(trigger, "type", str, path)
        c.enum(trigger, "metricType", ("AverageValue", "Value", "Utilization"), path)
        metadata = c.need(trigger, "metadata", dict, path) or {}
        for key, value in metadata.items():
            c.typed(value, str, (*path, "metadata", str(key)))
        if kind == "prometheus":
            for key in ("serverAddress", "query", "threshold"):
                c.need(metadata, key, str, (*path, "metadata"))


_CHECKS: dict[tuple[str, str], Callable[[dict[str, Any], _Checker], None]] = {
    (f"{KEDA_GROUP}/v1alpha1", "ScaledObject"): _scaled_object,
    (f"{INFERENCE_GROUP}/v1", "InferencePool"): _inference_pool,
    (f"{GATEWAY_GROUP}/v1", "Gateway"): _gateway,
    (f"{GATEWAY_GROUP}/v1", "HTTPRoute"): _http_route,
}
CHECKED_KINDS = frozenset(kind for _, kind in _CHECKS)


def structural_problems(obj: dict[str, Any]) -> list[Problem]:
    """Problems of one InferencePool / Gateway / HTTPRoute / ScaledObject; [] for other kinds."""
    kind, api_version = obj.get("kind"), obj.get("apiVersion")
    check = _CHECKS.get((str(api_version), str(kind)))
    if check is None:
        if kind in CHECKED_KINDS:
            versions = sorted(v for v, k in _CHECKS if k == kind)
            return [(("apiVersion",), f"{kind} is checked as {', '.join(versions)}, not {api_version}")]
        return []
    checker = _Checker()
    metadata = checker.need(obj, "metadata", dict, ())
    if metadata is not None:
        checker.need(metadata, "name", str, ("metadata",))
    check(obj, checker)
    return checker.problems
