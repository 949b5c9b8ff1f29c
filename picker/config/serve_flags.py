"""The flags of `picker serve` (and `picker config`, `picker proxy`): each one's help and the config
setting it overrides, in one table (`SERVE_FLAGS`: flag dest -> config path). Standard library only
at import, like cli.py, so `picker drain-wait` starts no slower for it.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

# flag dest -> (config group, field)
SERVE_FLAGS: dict[str, tuple[str, ...]] = {
    "endpoints": ("pool", "endpoints"),
    "endpoints_file": ("pool", "endpoints_file"),
    "endpoints_file_poll": ("pool", "endpoints_file_poll_s"),
    "drains_configmap": ("kube", "drains_configmap"),
    "pod_deletion_cost": ("kube", "deletion_cost"),
    "pod_deletion_cost_interval": ("kube", "deletion_cost_interval_s"),
    "pool_status": ("kube", "pool_status"),
    "kube_service": ("kube", "service"),
    "kube_namespace": ("kube", "namespace"),
    "kube_label_selector": ("kube", "label_selector"),
    "kube_target_port": ("kube", "target_port"),
    "pool_name": ("kube", "pool_name"),
    "pool_namespace": ("kube", "namespace"),
    "objectives": ("kube", "objectives"),
    "kubeconfig": ("kube", "kubeconfig"),
    "admin_token": ("admin", "token"),
    "bind_address": ("server", "bind_address"),
    "grpc_port": ("server", "grpc_port"),
    "health_port": ("server", "health_port"),
    "metrics_port": ("server", "metrics_port"),
    "secure_serving": ("server", "secure_serving"),
    "cert_path": ("server", "cert_path"),
    "workers": ("server", "workers"),
    "fallback_count": ("scheduling", "fallback_count"),
    "fallbacks": ("scheduling", "fallbacks"),
    "route_by_model": ("scheduling", "by_model"),
    "max_body_bytes": ("requests", "max_body_bytes"),
    "enable_test_hooks": ("requests", "enable_test_hooks"),
    "response_end": ("streams", "response_end"),
    "drain_timeout": ("shutdown", "drain_timeout_s"),
    "propagation": ("shutdown", "propagation_s"),
    "quiet_interval": ("shutdown", "quiet_interval_s"),
    "scrape": ("load", "scrape"),
    "scrape_interval": ("load", "scrape_interval_s"),
    "model_server_engine": ("load", "engine"),
    "model_server_metrics_port": ("load", "metrics_port"),
    "model_server_metrics_path": ("load", "metrics_path"),
    "model_server_metrics_scheme": ("load", "metrics_scheme"),
    "total_running_requests_metric": ("load", "running_gauge"),
    "total_queued_requests_metric": ("load", "waiting_gauge"),
    "kv_cache_usage_percentage_metric": ("load", "kv_gauge"),
    "engine_slots": ("load", "engine_slots"),
    "waiting_threshold": ("load", "waiting_threshold"),
    "stall_after": ("streams", "stall_after_s"),
    "queue_ttl": ("flow", "ttl_s"),
    "max_queued": ("flow", "max_queued"),
    "reject_without_endpoints": ("flow", "reject_without_endpoints"),
    "peers": ("peers", "members"),
    "peer_port": ("peers", "port"),
    "peers_service": ("peers", "service"),
    "peer_advertise": ("peers", "advertise"),
    "peer_secret_file": ("peers", "secret"),
    "peers_allow_unauthenticated": ("peers", "allow_unauthenticated"),
    "prefix_affinity": ("affinity", "prefix"),
    "session_header": ("affinity", "session_header"),
    "kv_events_port": ("affinity", "kv_events_port"),
    "kv_events_port_offset": ("affinity", "kv_events_port_offset"),
    "config_file": ("scheduling", "config_file"),
    "config_text": ("scheduling", "config_text"),
    "rollout_candidate": ("rollout", "candidate"),
    "rollout_stable": ("rollout", "stable"),
    "rollout_group_label": ("rollout", "group_label"),
    "rollout_steps": ("rollout", "steps"),
    "rollout_step_interval": ("rollout", "step_interval_s"),
    "log_level": ("log_level",),
    "log_format": ("log_format",),
}


def overrides(args: argparse.Namespace, flags: dict[str, tuple[str, ...]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for dest, path in flags.items():
        value = getattr(args, dest, None)
        if value is None:
            continue
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return out


def flag_bool(value: str) -> bool:
    """`--secure-serving=false` as the reference picker spells it (true/false, 1/0, yes/no)."""
    lowered = value.strip().lower()
    if lowered in ("true", "1", "yes", "on"):
        return True
    if lowered in ("false", "0", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, not {value!r}")


def add_serve_flags(parser: argparse.ArgumentParser) -> None:
    from picker.config.reference_flags import add_reference_flags

    parser.add_argument("--config", type=Path, help="YAML file (same shape as `picker config`)")
    parser.add_argument(
        "--config-file", type=Path, help="the reference picker's EndpointPickerConfig (plugins, weights)"
    )
    parser.add_argument("--config-text", help="the same, as text")
    parser.add_argument("--endpoints", help="static endpoints, host:port,host:port")
    parser.add_argument(
        "--endpoints-file", type=Path, help="YAML endpoints list (draining: true allowed), reloaded on change"
    )
    parser.add_argument(
        "--endpoints-file-poll",
        type=float,
        help="seconds between checks of --endpoints-file (default 1): when other replicas' drains apply",
    )
    parser.add_argument("--kube-service", help="endpoints from this Service's EndpointSlices")
    parser.add_argument(
        "--drains-configmap", help="share admin drains with the other picker replicas through this ConfigMap"
    )
    parser.add_argument(
        "--pod-deletion-cost",
        action="store_const",
        const=True,
        help="rank the pool's pods for scale-downs through controller.kubernetes.io/pod-deletion-cost "
        "(RBAC: patch pods)",
    )
    parser.add_argument(
        "--pod-deletion-cost-interval",
        type=float,
        help="with --pod-deletion-cost: a pod's annotation changes at most once per this (default 10 s)",
    )
    parser.add_argument(
        "--pool-status",
        action="store_const",
        const=True,
        help="report the pool's health on the InferencePool (a Ready condition) and in events "
        "(RBAC: patch inferencepools/status, create events)",
    )
    parser.add_argument("--kube-namespace", help="its namespace (default: the service account's)")
    parser.add_argument("--kube-label-selector", help="or: EndpointSlices matching this label selector")
    parser.add_argument("--kube-target-port", help="model-server port, name or number")
    parser.add_argument("--kubeconfig", type=Path, help="default: in-cluster, else $KUBECONFIG")
    parser.add_argument("--pool-name", help="or: endpoints from this InferencePool's pods and targetPorts")
    parser.add_argument("--pool-namespace", help="its namespace (the same setting as --kube-namespace)")
    parser.add_argument(
        "--no-objectives",
        dest="objectives",
        action="store_const",
        const=False,
        help="with --pool-name: do not watch InferenceObjectives (priorities from the header only)",
    )
    parser.add_argument(
        "--admin-token", help="bearer token allowing admin drain/undrain from non-loopback peers"
    )
    parser.add_argument("--bind-address")
    parser.add_argument("--grpc-port", type=int, help="ext_proc gRPC port (default 9002)")
    parser.add_argument("--health-port", type=int, help="gRPC health port (default 9003)")
    parser.add_argument("--metrics-port", type=int, help="Prometheus /metrics and admin port (default 9090)")
    parser.add_argument(
        "--secure-serving",
        type=flag_bool,
        nargs="?",
        const=True,
        metavar="true|false",
        help="TLS on the ext_proc port (default true; the health port is always plaintext)",
    )
    parser.add_argument(
        "--cert-path", type=Path, help="dir with tls.crt + tls.key, reloaded on change (default: self-signed)"
    )
    parser.add_argument(
        "--workers",
        type=int,
        help="picker processes sharing the ext_proc port and one set of books (default 1; docs)",
    )
    parser.add_argument("--fallback-count", type=int, help="endpoints listed after the primary (default 2)")
    parser.add_argument(
        "--fallbacks",
        choices=["auto", "always", "never"],
        help="list fallbacks after the primary: auto (override_host data planes, default), always, never",
    )
    parser.add_argument(
        "--route-by-model",
        action="store_const",
        const=True,
        help="only to endpoints whose /v1/models serves the request's model with a window it fits",
    )
    parser.add_argument("--max-body-bytes", type=int, help="request body limit (default 8 MiB)")
    parser.add_argument(
        "--enable-test-hooks",
        action="store_const",
        const=True,
        help="GIE conformance hooks (test-epp-endpoint-selection, x-conformance-test-served-endpoint)",
    )
    parser.add_argument(
        "--response-end",
        choices=["auto", "observer", "access-log", "engine"],
        help="who reports a response's end without response bodies: observer filter, Envoy's access "
        "log (the lean shape), engine gauges, auto (default)",
    )
    parser.add_argument(
        "--drain-timeout", type=_seconds, help="the shutdown budget, SIGTERM to exit (default 30; or 30s)"
    )
    parser.add_argument(
        "--propagation", type=float, help="longest wait for load balancers on SIGTERM (default 5)"
    )
    parser.add_argument(
        "--quiet-interval", type=float, help="arrival-free interval ending propagation (default 1)"
    )
    parser.add_argument(
        "--no-scrape",
        dest="scrape",
        action="store_const",
        const=False,
        help="schedule by in-flight count alone; never scrape /metrics",
    )
    parser.add_argument(
        "--scrape-interval", type=float, help="seconds between /metrics scrapes (default 0.1)"
    )
    parser.add_argument(
        "--model-server-engine", choices=["vllm", "sglang"], help="whose /metrics gauge names to read (vllm)"
    )
    parser.add_argument(
        "--model-server-metrics-port", type=int, help="scrape this port of each endpoint (default: its own)"
    )
    parser.add_argument("--model-server-metrics-path", help="path of the model servers' metrics (/metrics)")
    parser.add_argument(
        "--model-server-metrics-scheme", choices=["http", "https"], help="https: certificate not verified"
    )
    parser.add_argument("--total-running-requests-metric", help="running-requests gauge (engine's name)")
    parser.add_argument("--total-queued-requests-metric", help="queued-requests gauge (engine's name)")
    parser.add_argument("--kv-cache-usage-percentage-metric", help="KV-cache usage gauge, 0-1 (engine's)")
    parser.add_argument("--engine-slots", type=int, help="the model servers' --max-num-seqs, if known")
    parser.add_argument("--waiting-threshold", type=float, help="engine queue depth counted as saturated (1)")
    parser.add_argument(
        "--stall-after", type=float, help="seconds of silence that make a stream stalled (30)"
    )
    parser.add_argument("--queue-ttl", type=float, help="longest wait in the picker's queue (default 30)")
    parser.add_argument("--max-queued", type=int, help="admission queue bound (default 1000)")
    parser.add_argument(
        "--reject-without-endpoints",
        action="store_const",
        const=True,
        help="answer 503 at once when no endpoint is ready, instead of queueing",
    )
    parser.add_argument("--log-level", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    parser.add_argument("--log-format", choices=["text", "json"], help="json: one JSON object per line")
    parser.add_argument(
        "--prefix-affinity",
        choices=["off", "approximate", "precise"],
        help="cache-aware routing: approximate (default), precise (KV events + /tokenize), off",
    )
    parser.add_argument("--session-header", help="header naming a session (e.g. x-session-id): sticky")
    parser.add_argument(
        "--peers", help="every picker's peer address, host:port,host:port: one set of books (docs)"
    )
    parser.add_argument(
        "--peers-service", help="or the pickers by DNS: a headless Service's host:port, re-resolved (docs)"
    )
    parser.add_argument("--peer-port", type=int, help="where this picker serves its peers (9004)")
    parser.add_argument("--peer-advertise", help="this picker's own peer address (default $POD_IP:port)")
    parser.add_argument(
        "--peer-secret-file", type=_secret_file, help="the pickers' peer credential, from a mounted Secret"
    )
    parser.add_argument(
        "--peers-allow-unauthenticated",
        action="store_const",
        const=True,
        help="peers without a credential (loopback-only test setups; said in the log)",
    )
    parser.add_argument("--kv-events-port", type=int, help="precise: each engine's KV-event port (5557)")
    parser.add_argument(
        "--kv-events-port-offset", type=int, help="precise: or each endpoint's port plus this (one host)"
    )
    parser.add_argument("--rollout-candidate", help="canary: the candidate group's label value (docs)")
    parser.add_argument("--rollout-stable", help="canary: the stable group's label value")
    parser.add_argument(
        "--rollout-group-label", help="canary: the label naming a group (app.kubernetes.io/version)"
    )
    parser.add_argument("--rollout-steps", help="canary: candidate weights in %%, e.g. 5,25,50,100")
    parser.add_argument(
        "--rollout-step-interval", type=float, help="canary: seconds a step lasts at least (60)"
    )
    add_reference_flags(parser)


def _secret_file(value: str) -> str:
    """The credential in a file (a mounted Secret's key), without its trailing newline."""
    from pathlib import Path

    try:
        return Path(value).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise argparse.ArgumentTypeError(f"cannot read the peer secret file {value}: {exc}") from None


def _seconds(value: str) -> float:
    from picker.config.reference_flags import seconds

    return seconds(value)
