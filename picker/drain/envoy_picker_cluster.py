"""ENVOY-016: the circuit breakers of the cluster the ext_proc filters call (the picker's).

Every ext_proc filter holds one gRPC stream on its cluster per request: the observer's for the whole
response, the routing filter's until the response headers (a queued request's for its whole wait).
Envoy's DEFAULT-priority max_requests (1024 unless set) caps them: past it a fail-closed routing
filter answers 503 picker-unavailable and an observer lets its stream pass untracked. The
rule asks for room for every filter's stream of every expected stream at once (a burst of queued
requests holds both), the bound the shipped config meets.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from picker.drain.envoy_bootstrap import Located
from picker.drain.manifests import Document, get, is_placeholder, placeholder_name
from picker.drain.rules import Budget, Report

RULE = "ENVOY-016"


def _filter_clusters(hcm: Located) -> Counter[str]:
    """How many ext_proc filters of one connection manager name each gRPC cluster."""
    counts: Counter[str] = Counter()
    for item in hcm.data.get("http_filters") or []:
        config = get(item, ("typed_config",))
        if not isinstance(config, dict):
            continue
        if not str(config.get("@type", "")).endswith(".ExternalProcessor"):
            continue
        name = get(config, ("grpc_service", "envoy_grpc", "cluster_name"))
        if isinstance(name, str):
            counts[name] += 1
    return counts


def _default_max_requests(cluster: dict[str, Any], envoy_default: int) -> tuple[Any, bool]:
    """(DEFAULT-priority max_requests, whether it is set) of a cluster."""
    thresholds = get(cluster, ("circuit_breakers", "thresholds"), []) or []
    default = next(
        (t for t in thresholds if isinstance(t, dict) and t.get("priority", "DEFAULT") == "DEFAULT"), {}
    )
    return default.get("max_requests", envoy_default), "max_requests" in default


def check(doc: Document, managers: list[Located], report: Report, budget: Budget, envoy_default: int) -> None:
    """ENVOY-016 on one bootstrap: the picker cluster's max_requests against the streams it must hold.

    `envoy_default`: Envoy's max_requests when the cluster sets none (envoy_rules.ENVOY_DEFAULTS).
    """
    needed: dict[str, int] = {}  # cluster -> most filters of one connection manager that call it
    for hcm in managers:
        for name, filters in _filter_clusters(hcm).items():
            needed[name] = max(needed.get(name, 0), filters)
    clusters = get(doc.data, ("static_resources", "clusters"), []) or []
    for name, filters in sorted(needed.items()):
        if is_placeholder(name):
            report.skip(RULE, doc, f"ext_proc cluster_name is placeholder {placeholder_name(name)}")
            continue
        found = next(
            ((i, c) for i, c in enumerate(clusters) if isinstance(c, dict) and c.get("name") == name), None
        )
        if found is None:
            report.skip(RULE, doc, f"ext_proc cluster {name!r} is not a static cluster of this file")
            continue
        index, cluster = found
        value, is_set = _default_max_requests(cluster, envoy_default)
        if is_placeholder(value):
            report.skip(
                RULE, doc, f"max_requests of cluster {name!r} is placeholder {placeholder_name(value)}"
            )
            continue
        want = budget.expected_concurrent_streams * filters
        if isinstance(value, int) and value < want:
            report.add(
                RULE,
                doc,
                ("static_resources", "clusters", index, "circuit_breakers"),
                f"cluster {name!r} max_requests {value}{'' if is_set else ' (default)'} < "
                f"--expected-concurrent-streams {budget.expected_concurrent_streams} x {filters} ext_proc "
                f"filter{'s' if filters != 1 else ''} (one gRPC stream each per request) = {want}",
            )
