"""Rules over an Envoy bootstrap (rendered, or the template with `${...}` placeholders).

Only static_resources are read: listeners -> HTTP connection managers -> routes and ext_proc filters,
and the clusters the routes send to. A placeholder makes the rules that need its value skip.
Just over 400 lines: the rules walk one parsed bootstrap together; picker/drain/envoy_bootstrap.py
finds its connection managers, picker/drain/envoy_picker_cluster.py holds the picker cluster's rule.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

from picker.contract import Outcome, headers
from picker.drain import envoy_picker_cluster
from picker.drain.envoy_bootstrap import Located, connection_managers, type_of
from picker.drain.manifests import Document, FieldPath, Unknown, get, is_placeholder, placeholder_name
from picker.drain.rules import Budget, Report

ROUTING_HEADER = "x-gateway-destination-endpoint"
ENVOY_DEFAULTS = {"route_timeout_s": 15.0, "stream_idle_timeout_s": 300.0, "circuit_breaker": 1024}
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)s$")
_HOLDING_BODY_MODES = ("FULL_DUPLEX_STREAMED", "BUFFERED", "BUFFERED_PARTIAL")
_UNAVAILABLE = Outcome.PICKER_UNAVAILABLE.value


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
        retries = policy.get("num_retries", 1)
        if isinstance(retries, str):  # a template placeholder: the bound is not known here
            report.skip("ENVOY-004", doc, f"num_retries is the placeholder {retries}")
        elif not _bounded(policy):
            risky.append("retriable_status_codes 500 without previous_hosts and num_retries <= 2")
    if risky:
        report.add("ENVOY-004", doc, (*path, "retry_policy", "retry_on"), f"retries on {' and '.join(risky)}")


def _bounded(policy: dict[str, Any]) -> bool:
    """A 500 retry each replica sees at most once, on at most 3 replicas: a query of death that
    crashes engines cannot walk a whole pool (the drain 500 comes before any token)."""
    predicates = {
        str(p.get("name", "")) for p in policy.get("retry_host_predicate") or [] if isinstance(p, dict)
    }
    retries = policy.get("num_retries", 1)
    return (
        "envoy.retry_host_predicates.previous_hosts" in predicates
        and isinstance(retries, int)
        and retries <= 2
    )


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
        if isinstance(config, dict) and type_of(config) == "ExternalProcessor":
            if config.get("observability_mode") is not True:  # an observer cannot route
                yield Located((*hcm.path, "http_filters", index, "typed_config"), config)


def _check_routing_filter(
    doc: Document, ext: Located, pool_modes: set[str], reads_metadata: bool, report: Report
) -> None:
    namespaces = get(ext.data, ("metadata_options", "receiving_namespaces", "untyped"), []) or []
    if reads_metadata and "envoy.lb" not in namespaces:
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
    # The picker decides on the body in BUFFERED and BUFFERED_PARTIAL (the body comes before the
    # headers answer is due) and FULL_DUPLEX_STREAMED (it holds that answer until the body's end);
    # NONE and STREAMED are decided on the headers alone (docs, "Routing in every ext_proc shape").
    sees_body = request_body in _HOLDING_BODY_MODES
    if not sees_body:
        report.add(
            "ENVOY-011",
            doc,
            (*ext.path, "processing_mode", "request_body_mode"),
            f"request_body_mode {request_body}",
        )
    for side in ("request", "response"):
        body, trailer = mode.get(f"{side}_body_mode"), mode.get(f"{side}_trailer_mode", "SKIP")
        if body == "FULL_DUPLEX_STREAMED" and trailer != "SEND":
            report.add(
                "ENVOY-013",
                doc,
                (*ext.path, "processing_mode", f"{side}_trailer_mode"),
                f"{side}_body_mode FULL_DUPLEX_STREAMED with {side}_trailer_mode {trailer}",
            )
    allow = ext.data.get("failure_mode_allow", False)
    _check_failclose_reply(doc, hcm_of(ext), ext, report)
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


def hcm_of(ext: Located) -> FieldPath:
    """The path of the connection manager a filter sits in."""
    return ext.path[: ext.path.index("http_filters")]


def _check_failclose_reply(doc: Document, hcm_path: FieldPath, ext: Located, report: Report) -> None:
    """ENVOY-015: failClose whose error status no local_reply_config mapper restates as the contract."""
    if ext.data.get("failure_mode_allow", False) is True:
        return  # failOpen: no error reply (a placeholder may render either way: checked as failClose)
    code = get(ext.data, ("status_on_error", "code"), 500)
    if is_placeholder(code):
        report.skip("ENVOY-015", doc, f"status_on_error is placeholder {placeholder_name(code)}")
        return
    hcm = get(doc.data, hcm_path, {}) or {}
    for mapper in get(hcm, ("local_reply_config", "mappers"), []) or []:
        value = get(mapper, ("filter", "status_code_filter", "comparison", "value", "default_value"))
        op = get(mapper, ("filter", "status_code_filter", "comparison", "op"), "EQ")
        if op != "EQ" or str(value) != str(code):
            continue
        added = {
            str(get(item, ("header", "key"), "")).lower(): str(get(item, ("header", "value"), ""))
            for item in mapper.get("headers_to_add") or []
        }
        if added.get(headers.DROPPED_REASON) == _UNAVAILABLE and headers.RETRY_AFTER in added:
            return
    report.add(
        "ENVOY-015",
        doc,
        (*ext.path, "status_on_error"),
        f"failure_mode_allow false, status_on_error {code}, and no local_reply_config mapper restates it "
        f"as 503 {headers.DROPPED_REASON}: {_UNAVAILABLE} with {headers.RETRY_AFTER}",
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


def _pool_clusters(doc: Document) -> Iterator[tuple[FieldPath, dict[str, Any]]]:
    """(path, cluster) of every static cluster a route sends to."""
    routed = _routed_clusters(doc)
    for index, cluster in enumerate(get(doc.data, ("static_resources", "clusters"), []) or []):
        if isinstance(cluster, dict) and cluster.get("name") in routed:
            yield ("static_resources", "clusters", index), cluster


def _reads_lb_metadata(cluster: dict[str, Any]) -> bool:
    """Does the cluster pick its host from the picker's envoy.lb dynamic metadata?"""
    if cluster.get("type") == "ORIGINAL_DST":
        return get(cluster, ("original_dst_lb_config", "metadata_key", "key")) == "envoy.lb"
    for policy in get(cluster, ("load_balancing_policy", "policies"), []) or []:
        for source in (
            get(policy, ("typed_extension_config", "typed_config", "override_host_sources"), []) or []
        ):
            if get(source, ("metadata", "key")) == "envoy.lb":
                return True
    return False


def _declares_lists(doc: Document) -> bool:
    """Does a routing filter tell the picker its data plane walks a fallback list (override_host)?"""
    for hcm in connection_managers(doc):
        for ext in _routing_filters(hcm):
            for item in get(ext.data, ("grpc_service", "initial_metadata"), []) or []:
                if isinstance(item, dict) and (item.get("key"), item.get("value")) == (
                    headers.DATA_PLANE,
                    headers.OVERRIDE_HOST,
                ):
                    return True
    return False


def _check_single_destination(
    doc: Document, path: FieldPath, cluster: dict[str, Any], report: Report
) -> None:
    if cluster.get("type") != "ORIGINAL_DST" or not _declares_lists(doc):
        return
    config = cluster.get("original_dst_lb_config") or {}
    if get(config, ("metadata_key", "key")) is not None:
        source = "the envoy.lb metadata"
    elif config.get("use_http_header") is True:
        source = f"header {config.get('http_header_name') or 'x-envoy-original-dst-host'}"
    else:
        source = "the connection's original destination"
    report.add(
        "ENVOY-012",
        doc,
        (*path, "type"),
        f"cluster {cluster.get('name')!r} is ORIGINAL_DST on {source} (one ip:port), but the routing "
        f"filter's initial_metadata says {headers.DATA_PLANE}: {headers.OVERRIDE_HOST}",
    )


def _check_clusters(doc: Document, report: Report, budget: Budget) -> None:
    for path, cluster in _pool_clusters(doc):
        _check_single_destination(doc, path, cluster, report)
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
    # ENVOY-005 matters only when a pool cluster takes the pick from metadata (not from the header).
    reads_metadata = any(_reads_lb_metadata(cluster) for _, cluster in _pool_clusters(doc))
    if not managers:
        report.skip("ENVOY-001", doc, "no static listener with an HTTP connection manager")
    for hcm in managers:
        _check_timeouts(doc, hcm, report, budget)
        _check_header_removal(doc, hcm, report)
        routing = list(_routing_filters(hcm))
        if not routing:
            report.skip("ENVOY-005", doc, "no routing ext_proc filter in this connection manager")
        for ext in routing:
            _check_routing_filter(doc, ext, pool_modes, reads_metadata, report)
        _check_response_view(doc, hcm, routing, report)
    _check_clusters(doc, report, budget)
    envoy_picker_cluster.check(doc, managers, report, budget, ENVOY_DEFAULTS["circuit_breaker"])


def routes_with_picker(doc: Document) -> bool:
    """Whether the config has a routing ext_proc filter (one that is not an observer)."""
    return any(any(True for _ in _routing_filters(hcm)) for hcm in connection_managers(doc))


def sees_response_bodies(doc: Document) -> bool:
    """Whether some ext_proc filter (routing or observer) of the config sees response bodies: what a
    canary's TTFT and ITL gates judge from."""
    for hcm in connection_managers(doc):
        for item in hcm.data.get("http_filters") or []:
            config = get(item, ("typed_config",))
            if isinstance(config, dict) and type_of(config) == "ExternalProcessor":
                if str(get(config, ("processing_mode", "response_body_mode"), "NONE")) != "NONE":
                    return True
    return False


def _check_response_view(doc: Document, hcm: Located, routing: list[Located], report: Report) -> None:
    """ENVOY-014: neither the routing filter nor an observer sees the response body (its end), nor
    does Envoy's gRPC access log tell the picker how each request ended (the lean shape)."""
    if not routing:
        return
    for item in hcm.data.get("access_log") or []:
        config = get(item, ("typed_config",))
        if isinstance(config, dict) and type_of(config) == "HttpGrpcAccessLogConfig":
            return  # each request's end reaches the picker from the log (--response-end access-log)
    for item in hcm.data.get("http_filters") or []:
        config = get(item, ("typed_config",))
        if isinstance(config, dict) and type_of(config) == "ExternalProcessor":
            if str(get(config, ("processing_mode", "response_body_mode"), "NONE")) != "NONE":
                return  # a routing filter or an observer streams the response past the picker
    first = routing[0]
    report.add(
        "ENVOY-014",
        doc,
        (*first.path, "processing_mode", "response_body_mode"),
        "response_body_mode NONE and no observer ext_proc filter",
    )
