"""Rules over an Envoy bootstrap (rendered, or the template with `${...}` placeholders).

Only static_resources are read: listeners -> HTTP connection managers -> routes and ext_proc filters,
and the clusters the routes send to. A placeholder makes the rules that need its value skip.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from picker.drain.manifests import Document, FieldPath, Unknown, get, is_placeholder, placeholder_name
from picker.drain.rules import Budget, Report

ROUTING_HEADER = "x-gateway-destination-endpoint"
ENVOY_DEFAULTS = {"route_timeout_s": 15.0, "stream_idle_timeout_s": 300.0, "circuit_breaker": 1024}
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)s$")
_HOLDING_BODY_MODES = ("FULL_DUPLEX_STREAMED", "BUFFERED", "BUFFERED_PARTIAL")


def duration_s(value: Any) -> float | Unknown | None:
    """A protobuf Duration as seconds ("15s", "0.25s", {seconds, nanos}); None when absent."""
    if value is None:
        return None
    if is_placeholder(value):
        return Unknown(f"placeholder {placeholder_name(value)}")
    if isinstance(value, dict):
        return float(value.get("seconds", 0) or 0) + float(value.get("nanos", 0) or 0) / 1e9
    match = _DURATION.match(str(value).strip())
    return float(match.group(1)) if match else Unknown(f"duration {value!r} not understood")


def _type_of(typed_config: Any) -> str:
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
                if isinstance(config, dict) and _type_of(config) == "HttpConnectionManager":
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


def _routes(hcm: Located) -> Iterator[tuple[FieldPath, dict[str, Any]]]:
    """(path, route action) of every forwarding route."""
    for vi, vhost in enumerate(get(hcm.data, ("route_config", "virtual_hosts"), []) or []):
        for ri, route in enumerate(get(vhost, ("routes",), []) or []):
            action = get(route, ("route",))
            if isinstance(action, dict):
                yield (*hcm.path, "route_config", "virtual_hosts", vi, "routes", ri, "route"), action


def _check_timeouts(doc: Document, hcm: Located, report: Report, budget: Budget) -> None:
    idle = duration_s(hcm.data.get("stream_idle_timeout"))
    if isinstance(idle, Unknown):
        report.skip("ENVOY-002", doc, f"stream_idle_timeout is a {idle.why}")
    else:
        value = ENVOY_DEFAULTS["stream_idle_timeout_s"] if idle is None else idle
        if 0 < value < budget.longest_silence_s:
            report.add(
                "ENVOY-002",
                doc,
                (*hcm.path, "stream_idle_timeout"),
                f"stream_idle_timeout {value:g} s{' (default)' if idle is None else ''} "
                f"< longest silence {budget.longest_silence_s:g} s (--longest-silence-s)",
            )
    hcm_max = duration_s(get(hcm.data, ("common_http_protocol_options", "max_stream_duration")))
    if isinstance(hcm_max, float) and 0 < hcm_max < budget.longest_stream_s:
        report.add(
            "ENVOY-001",
            doc,
            (*hcm.path, "common_http_protocol_options", "max_stream_duration"),
            f"max_stream_duration {hcm_max:g} s < longest stream {budget.longest_stream_s:g} s",
        )
    if "route_config" not in hcm.data:
        report.skip("ENVOY-001", doc, "routes come from RDS, not from this file")
    for path, action in _routes(hcm):
        timeout = duration_s(action.get("timeout"))
        if isinstance(timeout, Unknown):
            report.skip("ENVOY-001", doc, f"route timeout is a {timeout.why}")
        else:
            value = ENVOY_DEFAULTS["route_timeout_s"] if timeout is None else timeout
            if 0 < value < budget.longest_stream_s:
                report.add(
                    "ENVOY-001",
                    doc,
                    (*path, "timeout"),
                    f"route timeout {value:g} s{' (default)' if timeout is None else ''} "
                    f"< longest stream {budget.longest_stream_s:g} s (--longest-stream-s)",
                )
        longest = duration_s(get(action, ("max_stream_duration", "max_stream_duration")))
        if isinstance(longest, float) and 0 < longest < budget.longest_stream_s:
            report.add("ENVOY-001", doc, (*path, "max_stream_duration"), f"max_stream_duration {longest:g} s")
        route_idle = duration_s(action.get("idle_timeout"))
        if isinstance(route_idle, float) and 0 < route_idle < budget.longest_silence_s:
            report.add("ENVOY-002", doc, (*path, "idle_timeout"), f"route idle_timeout {route_idle:g} s")
        _check_retries(doc, path, action.get("retry_policy"), report)
    for vi, vhost in enumerate(get(hcm.data, ("route_config", "virtual_hosts"), []) or []):
        _check_retries(
            doc, (*hcm.path, "route_config", "virtual_hosts", vi), get(vhost, ("retry_policy",)), report
        )


def _check_retries(doc: Document, path: FieldPath, policy: Any, report: Report) -> None:
    if not isinstance(policy, dict):
        return
    retry_on = {part.strip() for part in str(policy.get("retry_on", "")).split(",")}
    codes = policy.get("retriable_status_codes") or []
    risky = []
    if "5xx" in retry_on:
        risky.append("5xx")
    if "retriable-status-codes" in retry_on and 500 in codes:
        risky.append("retriable_status_codes 500")
    if risky:
        report.add("ENVOY-004", doc, (*path, "retry_policy", "retry_on"), f"retries on {' and '.join(risky)}")


def _check_header_removal(doc: Document, hcm: Located, report: Report) -> None:
    for extension in hcm.data.get("early_header_mutation_extensions") or []:
        for mutation in get(extension, ("typed_config", "mutations"), []) or []:
            if isinstance(mutation, dict) and str(mutation.get("remove", "")).lower() == ROUTING_HEADER:
                return
    report.add(
        "ENVOY-006",
        doc,
        (*hcm.path, "early_header_mutation_extensions"),
        f"no early header mutation removes {ROUTING_HEADER}",
    )


def _routing_filters(hcm: Located) -> Iterator[Located]:
    for index, item in enumerate(hcm.data.get("http_filters") or []):
        config = get(item, ("typed_config",))
        if isinstance(config, dict) and _type_of(config) == "ExternalProcessor":
            if config.get("observability_mode") is not True:  # an observer cannot route
                yield Located((*hcm.path, "http_filters", index, "typed_config"), config)


def _check_routing_filter(doc: Document, ext: Located, pool_modes: set[str], report: Report) -> None:
    namespaces = get(ext.data, ("metadata_options", "receiving_namespaces", "untyped"), []) or []
    if "envoy.lb" not in namespaces:
        report.add(
            "ENVOY-005",
            doc,
            (*ext.path, "metadata_options", "receiving_namespaces"),
            "receiving_namespaces.untyped lacks envoy.lb",
        )
    mode = ext.data.get("processing_mode") or {}
    response_body = str(mode.get("response_body_mode", "NONE"))
    if response_body in _HOLDING_BODY_MODES:
        report.add(
            "ENVOY-007",
            doc,
            (*ext.path, "processing_mode", "response_body_mode"),
            f"response_body_mode {response_body}",
        )
    elif response_body == "STREAMED":
        report.add(
            "ENVOY-008",
            doc,
            (*ext.path, "processing_mode", "response_body_mode"),
            "response_body_mode STREAMED",
        )
    request_body = str(mode.get("request_body_mode", "NONE"))
    if request_body != "BUFFERED":
        report.add(
            "ENVOY-011",
            doc,
            (*ext.path, "processing_mode", "request_body_mode"),
            f"request_body_mode {request_body}",
        )
    allow = ext.data.get("failure_mode_allow", False)
    if not pool_modes:
        return  # no InferencePool among the inputs to compare with
    if is_placeholder(allow):
        report.skip("ENVOY-010", doc, f"failure_mode_allow is placeholder {placeholder_name(allow)}")
    elif len(pool_modes) == 1 and isinstance(allow, bool):
        (pool_mode,) = pool_modes
        if allow != (pool_mode == "FailOpen"):
            report.add(
                "ENVOY-010",
                doc,
                (*ext.path, "failure_mode_allow"),
                f"failure_mode_allow {str(allow).lower()} but the InferencePool says {pool_mode}",
            )


def _routed_clusters(doc: Document) -> set[str]:
    names: set[str] = set()
    for hcm in connection_managers(doc):
        for _, action in _routes(hcm):
            if isinstance(action.get("cluster"), str):
                names.add(action["cluster"])
            for weighted in get(action, ("weighted_clusters", "clusters"), []) or []:
                if isinstance(weighted, dict) and isinstance(weighted.get("name"), str):
                    names.add(weighted["name"])
    return names


def _check_clusters(doc: Document, report: Report, budget: Budget) -> None:
    routed = _routed_clusters(doc)
    for index, cluster in enumerate(get(doc.data, ("static_resources", "clusters"), []) or []):
        if not isinstance(cluster, dict) or cluster.get("name") not in routed:
            continue
        path = ("static_resources", "clusters", index)
        thresholds = get(cluster, ("circuit_breakers", "thresholds"), []) or []
        default = next(
            (t for t in thresholds if isinstance(t, dict) and t.get("priority", "DEFAULT") == "DEFAULT"), {}
        )
        h2 = get(
            cluster, ("typed_extension_protocol_options",)
        ) is not None and "http2_protocol_options" in str(cluster.get("typed_extension_protocol_options"))
        for key in ("max_requests",) if h2 else ("max_requests", "max_connections"):
            value = default.get(key, ENVOY_DEFAULTS["circuit_breaker"])
            if is_placeholder(value):
                report.skip("ENVOY-003", doc, f"{key} is placeholder {placeholder_name(value)}")
            elif isinstance(value, int) and value < budget.expected_concurrent_streams:
                report.add(
                    "ENVOY-003",
                    doc,
                    (*path, "circuit_breakers"),
                    f"cluster {cluster.get('name')!r} {key} {value}{'' if key in default else ' (default)'} "
                    f"< --expected-concurrent-streams {budget.expected_concurrent_streams}",
                )
        is_eds = cluster.get("type") == "EDS" or "eds_cluster_config" in cluster
        if (
            is_eds
            and cluster.get("health_checks")
            and cluster.get("ignore_health_on_host_removal") is not True
        ):
            report.add(
                "ENVOY-009", doc, (*path, "ignore_health_on_host_removal"), f"cluster {cluster.get('name')!r}"
            )


def check(doc: Document, report: Report, budget: Budget, pool_modes: set[str]) -> None:
    """Every Envoy rule on one bootstrap document. `pool_modes`: failureModes of the InferencePools."""
    managers = list(connection_managers(doc))
    if not managers:
        report.skip("ENVOY-001", doc, "no static listener with an HTTP connection manager")
    for hcm in managers:
        _check_timeouts(doc, hcm, report, budget)
        _check_header_removal(doc, hcm, report)
        routing = list(_routing_filters(hcm))
        if not routing:
            report.skip("ENVOY-005", doc, "no routing ext_proc filter in this connection manager")
        for ext in routing:
            _check_routing_filter(doc, ext, pool_modes, report)
    _check_clusters(doc, report, budget)
