"""The `picker` command. The only module that exits the process.

`picker drain-wait` runs as a preStop hook against its own deadline, so its clock starts when this
module is imported and it is dispatched before anything but the standard library is imported (grpc,
pydantic, aiohttp and uvloop cost a preStop hook hundreds of milliseconds to seconds). Every other
command imports what it needs when it runs.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from picker.drain import wait as drain_wait  # standard library only

if TYPE_CHECKING:
    from picker.config import PickerConfig

_STARTED = time.monotonic()  # drain-wait's deadline counts from here: only the stdlib came before

# flag dest -> (config group, field)
_SERVE_FLAGS: dict[str, tuple[str, ...]] = {
    "endpoints": ("pool", "endpoints"),
    "endpoints_file": ("pool", "endpoints_file"),
    "endpoints_file_poll": ("pool", "endpoints_file_poll_s"),
    "drains_configmap": ("kube", "drains_configmap"),
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
    "fallback_count": ("scheduling", "fallback_count"),
    "fallbacks": ("scheduling", "fallbacks"),
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
    "prefix_affinity": ("affinity", "prefix"),
    "session_header": ("affinity", "session_header"),
    "kv_events_port": ("affinity", "kv_events_port"),
    "kv_events_port_offset": ("affinity", "kv_events_port_offset"),
    "config_file": ("scheduling", "config_file"),
    "config_text": ("scheduling", "config_text"),
    "log_level": ("log_level",),
    "log_format": ("log_format",),
}


def _overrides(args: argparse.Namespace, flags: dict[str, tuple[str, ...]]) -> dict[str, Any]:
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


def _flag_bool(value: str) -> bool:
    """`--secure-serving=false` as the reference picker spells it (true/false, 1/0, yes/no)."""
    lowered = value.strip().lower()
    if lowered in ("true", "1", "yes", "on"):
        return True
    if lowered in ("false", "0", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, not {value!r}")


def _add_serve_flags(parser: argparse.ArgumentParser) -> None:
    from picker.reference_flags import add_reference_flags

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
        type=_flag_bool,
        nargs="?",
        const=True,
        metavar="true|false",
        help="TLS on the ext_proc port (default true; the health port is always plaintext)",
    )
    parser.add_argument(
        "--cert-path", type=Path, help="dir with tls.crt + tls.key, reloaded on change (default: self-signed)"
    )
    parser.add_argument("--fallback-count", type=int, help="endpoints listed after the primary (default 2)")
    parser.add_argument(
        "--fallbacks",
        choices=["auto", "always", "never"],
        help="list fallbacks after the primary: auto (override_host data planes, default), always, never",
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
    parser.add_argument("--kv-events-port", type=int, help="precise: each engine's KV-event port (5557)")
    parser.add_argument(
        "--kv-events-port-offset", type=int, help="precise: or each endpoint's port plus this (one host)"
    )
    add_reference_flags(parser)


def _seconds(value: str) -> float:
    from picker.reference_flags import seconds

    return seconds(value)


_NOTES: list[str] = []  # what the reference picker's flags that change nothing here were told


def _load(args: argparse.Namespace, flags: dict[str, tuple[str, ...]] = _SERVE_FLAGS) -> PickerConfig:
    """The effective config from file, environment and flags (ours over the reference picker's)."""
    from picker.config import ConfigError
    from picker.config_sources import load_config, merge
    from picker.reference_flags import ReferenceFlagError, reference_overrides

    try:
        reference, notes = reference_overrides(args)
        config = load_config(args.config, merge(reference, _overrides(args, flags)))
    except (ConfigError, ReferenceFlagError) as exc:
        print(f"picker: {exc}", file=sys.stderr)
        raise SystemExit(2) from exc
    _NOTES[:] = notes
    return config


def _configure_logging(config: PickerConfig) -> None:
    """Logging as configured, then one line per reference flag accepted without effect."""
    import logging

    from picker.telemetry import configure_logging

    configure_logging(config.log_level, config.log_format)
    for note in _NOTES:
        logging.getLogger("picker.cli").info("%s", note)


def _run_serve(config: PickerConfig) -> None:
    import asyncio

    import uvloop

    from picker.config import ConfigError
    from picker.startup import cannot_listen, serve_or_reason

    problem = cannot_listen(config)
    if problem is None:
        try:
            if os.environ.get("PICKER_EVENT_LOOP") == "asyncio":  # for comparisons in benchmarks
                problem = asyncio.run(serve_or_reason(config))
            else:
                problem = uvloop.run(serve_or_reason(config))
        except ConfigError as exc:  # a source that cannot start (unreadable file, kubeconfig)
            problem = str(exc)
    if problem is not None:
        print(f"picker: {problem}", file=sys.stderr)
        raise SystemExit(2)


def _add_envoy_config_flags(parser: argparse.ArgumentParser) -> None:
    from picker.config import ServerConfig

    parser.add_argument("--endpoints", required=True, help="the model servers, host:port,host:port")
    parser.add_argument("--listen-address", default="0.0.0.0", help="Envoy's listener (default %(default)s)")
    parser.add_argument("--listen-port", type=int, default=8080, help="(default %(default)s)")
    parser.add_argument("--admin-address", default="127.0.0.1", help="Envoy's admin (default %(default)s)")
    parser.add_argument("--admin-port", type=int, default=9901, help="(default %(default)s)")
    parser.add_argument("--picker-address", default="127.0.0.1", help="the picker (default %(default)s)")
    parser.add_argument(
        "--picker-port",
        type=int,
        default=ServerConfig.model_fields["grpc_port"].default,
        help="its ext_proc port (default %(default)s)",
    )
    parser.add_argument(
        "--picker-tls",
        type=_flag_bool,
        default=True,
        metavar="true|false",
        help="TLS to the picker, as `picker serve --secure-serving` (default true)",
    )
    parser.add_argument(
        "--failure-mode-allow",
        type=_flag_bool,
        default=False,
        metavar="true|false",
        help="when the picker is unreachable: true routes round robin (fail open), false 5xx (default)",
    )
    parser.add_argument(
        "--static-pool",
        action="store_true",
        help="a STATIC pool cluster of --endpoints instead of EDS served by the picker (the default)",
    )
    parser.add_argument(
        "--lean",
        action="store_true",
        help="no observer filter: Envoy's access log (flushed every 10 ms) ends each request, so chunks "
        "cost the picker nothing; loses token counts, TTFT/ITL and silent-abort detection (docs). "
        "Run the picker with --response-end access-log",
    )


def _envoy_config(args: argparse.Namespace) -> int:
    from picker.config import canonical_address
    from picker.envoyconf import EnvoyParams, render

    try:
        endpoints = [canonical_address(part) for part in args.endpoints.split(",") if part.strip()]
        for name in ("listen_port", "admin_port", "picker_port"):
            if not 0 < getattr(args, name) < 65536:
                raise ValueError(f"--{name.replace('_', '-')} {getattr(args, name)} is not a port")
        text = render(
            EnvoyParams(
                listen_address=args.listen_address,
                listen_port=args.listen_port,
                admin_address=args.admin_address,
                admin_port=args.admin_port,
                picker_address=args.picker_address,
                picker_port=args.picker_port,
                picker_tls=args.picker_tls,
                failure_mode_allow=args.failure_mode_allow,
                endpoints=endpoints,
                eds=not args.static_pool,
                observer=not args.lean,
                **({"access_log_flush_interval": "0.01s"} if args.lean else {}),
            )
        )
    except ValueError as exc:
        print(f"picker envoy-config: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(text)
    return 0


# `picker proxy`: the serve flags (sources, admin, shutdown, ...) plus the proxy group's.
_PROXY_FLAGS: dict[str, tuple[str, ...]] = {
    **_SERVE_FLAGS,
    "port": ("proxy", "port"),
    "connect_timeout": ("proxy", "connect_timeout_s"),
    "max_attempts": ("proxy", "max_attempts"),
}


def _add_proxy_flags(parser: argparse.ArgumentParser) -> None:
    _add_serve_flags(parser)
    parser.add_argument("--port", type=int, help="where clients send OpenAI requests (default 8080)")
    parser.add_argument(
        "--connect-timeout", type=float, help="per upstream attempt, then the next pick (default 1)"
    )
    parser.add_argument("--max-attempts", type=int, help="upstream attempts before the first byte (3)")


def _run_proxy(args: argparse.Namespace) -> None:
    from picker.config import ConfigError

    config = _load(args, _PROXY_FLAGS)
    _configure_logging(config)
    import asyncio

    import uvloop

    from picker.proxy.app import serve_proxy

    try:
        if os.environ.get("PICKER_EVENT_LOOP") == "asyncio":  # for comparisons in benchmarks
            asyncio.run(serve_proxy(config))
        else:
            uvloop.run(serve_proxy(config))
    except ConfigError as exc:  # a source that cannot start (unreadable file, kubeconfig)
        print(f"picker: {exc}", file=sys.stderr)
        raise SystemExit(2) from exc
    except OSError as exc:  # a port that cannot be bound
        print(f"picker: cannot listen: {exc.strerror or exc}", file=sys.stderr)
        raise SystemExit(2) from exc


def build_parser() -> argparse.ArgumentParser:
    """Every subcommand and flag (the documentation's CLI page is generated from it)."""
    from picker.drain import check as drain_check
    from picker.drain import scorecard as drain_scorecard

    parser = argparse.ArgumentParser(prog="picker", description="Drain-aware endpoint picker for LLM pools")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="run the Envoy ext_proc endpoint picker")
    _add_serve_flags(serve)
    _add_proxy_flags(commands.add_parser("proxy", help="the standalone streaming reverse proxy (no Envoy)"))
    show = commands.add_parser("config", help="print the effective configuration as YAML and exit")
    _add_serve_flags(show)
    demo = commands.add_parser("demo", help="Envoy + picker + simulated vLLM replicas, with live traffic")
    demo.add_argument("--seconds", type=float, default=8.0, help="how long to send traffic")
    demo.add_argument("--proxy", action="store_true", help="the same drain through `picker proxy`, no Envoy")
    demo.add_argument(
        "--picture", type=Path, help="where the rollout picture (PNG) goes (default: in the temp directory)"
    )
    drain_wait.add_arguments(
        commands.add_parser("drain-wait", help="preStop hook: wait until the local vLLM is idle")
    )
    drain_scorecard.add_arguments(
        commands.add_parser("scorecard", help="how recent drains went (from a running picker's admin API)")
    )
    drain_check.add_arguments(
        commands.add_parser("check", help="check drain timing budgets of manifests + Envoy")
    )
    _add_envoy_config_flags(
        commands.add_parser("envoy-config", help="print config/envoy.yaml filled in for these ports")
    )
    return parser


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["drain-wait"]:  # before argparse: a preStop hook exits 0 even on bad flags
        raise SystemExit(drain_wait.main(argv[1:], prog="picker drain-wait", started=_STARTED))
    from picker.drain import check as drain_check
    from picker.drain import scorecard as drain_scorecard

    args = build_parser().parse_args(argv)

    match args.command:
        case "serve":
            config = _load(args)
            _configure_logging(config)
            _run_serve(config)
        case "proxy":
            _run_proxy(args)
        case "config":
            import yaml

            print(yaml.safe_dump(_load(args).model_dump(mode="json"), sort_keys=False), end="")
        case "demo":
            import uvloop

            from picker.demo import run_demo
            from picker.telemetry import configure_logging

            configure_logging("WARNING")

            if args.proxy:
                from picker.demo_proxy import run_demo_proxy

                raise SystemExit(uvloop.run(run_demo_proxy(seconds=args.seconds)))
            if args.picture is not None:
                raise SystemExit(uvloop.run(run_demo(seconds=args.seconds, picture=args.picture)))
            raise SystemExit(uvloop.run(run_demo(seconds=args.seconds)))
        case "check":
            raise SystemExit(drain_check.run(args))
        case "scorecard":
            raise SystemExit(drain_scorecard.main(args))
        case "envoy-config":
            raise SystemExit(_envoy_config(args))


if __name__ == "__main__":
    main()
