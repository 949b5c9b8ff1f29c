"""The `picker` command. The only module that exits the process."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path
from typing import Any

import uvloop

from picker.config import ConfigError, PickerConfig, load_config
from picker.drain import check as drain_check
from picker.drain import scorecard as drain_scorecard
from picker.drain import wait as drain_wait
from picker.telemetry import configure_logging

# flag dest -> (config group, field)
_SERVE_FLAGS: dict[str, tuple[str, ...]] = {
    "endpoints": ("pool", "endpoints"),
    "endpoints_file": ("pool", "endpoints_file"),
    "kube_service": ("kube", "service"),
    "kube_namespace": ("kube", "namespace"),
    "kube_label_selector": ("kube", "label_selector"),
    "kube_target_port": ("kube", "target_port"),
    "kubeconfig": ("kube", "kubeconfig"),
    "admin_token": ("admin", "token"),
    "bind_address": ("server", "bind_address"),
    "grpc_port": ("server", "grpc_port"),
    "health_port": ("server", "health_port"),
    "metrics_port": ("server", "metrics_port"),
    "fallback_count": ("scheduling", "fallback_count"),
    "max_body_bytes": ("requests", "max_body_bytes"),
    "drain_timeout": ("shutdown", "drain_timeout_s"),
    "propagation": ("shutdown", "propagation_s"),
    "quiet_interval": ("shutdown", "quiet_interval_s"),
    "scrape": ("load", "scrape"),
    "scrape_interval": ("load", "scrape_interval_s"),
    "engine_slots": ("load", "engine_slots"),
    "waiting_threshold": ("load", "waiting_threshold"),
    "stall_after": ("streams", "stall_after_s"),
    "queue_ttl": ("flow", "ttl_s"),
    "max_queued": ("flow", "max_queued"),
    "reject_without_endpoints": ("flow", "reject_without_endpoints"),
    "log_level": ("log_level",),
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


def _add_serve_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, help="YAML file (same shape as `picker config`)")
    parser.add_argument("--endpoints", help="static endpoints, host:port,host:port")
    parser.add_argument(
        "--endpoints-file", type=Path, help="YAML endpoints list (draining: true allowed), reloaded on change"
    )
    parser.add_argument("--kube-service", help="endpoints from this Service's EndpointSlices")
    parser.add_argument("--kube-namespace", help="its namespace (default: the service account's)")
    parser.add_argument("--kube-label-selector", help="or: EndpointSlices matching this label selector")
    parser.add_argument("--kube-target-port", help="model-server port, name or number")
    parser.add_argument("--kubeconfig", type=Path, help="default: in-cluster, else $KUBECONFIG")
    parser.add_argument(
        "--admin-token", help="bearer token allowing admin drain/undrain from non-loopback peers"
    )
    parser.add_argument("--bind-address")
    parser.add_argument("--grpc-port", type=int, help="ext_proc gRPC port (default 9002)")
    parser.add_argument("--health-port", type=int, help="gRPC health port (default 9003)")
    parser.add_argument("--metrics-port", type=int, help="Prometheus /metrics and admin port (default 9090)")
    parser.add_argument("--fallback-count", type=int, help="endpoints listed after the primary (default 2)")
    parser.add_argument("--max-body-bytes", type=int, help="request body limit (default 8 MiB)")
    parser.add_argument(
        "--drain-timeout", type=float, help="the shutdown budget, SIGTERM to exit (default 30)"
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


def _load(args: argparse.Namespace) -> PickerConfig:
    try:
        return load_config(args.config, _overrides(args, _SERVE_FLAGS))
    except ConfigError as exc:
        print(f"picker: {exc}", file=sys.stderr)
        raise SystemExit(2) from exc


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["drain-wait"]:  # before argparse: a preStop hook exits 0 even on bad flags
        raise SystemExit(drain_wait.main(argv[1:], prog="picker drain-wait"))
    parser = argparse.ArgumentParser(prog="picker", description="Drain-aware endpoint picker for LLM pools")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="run the Envoy ext_proc endpoint picker")
    _add_serve_flags(serve)
    show = commands.add_parser("config", help="print the effective configuration as YAML and exit")
    _add_serve_flags(show)
    demo = commands.add_parser("demo", help="Envoy + picker + simulated vLLM replicas, with live traffic")
    demo.add_argument("--seconds", type=float, default=8.0, help="how long to send traffic")
    drain_wait.add_arguments(
        commands.add_parser("drain-wait", help="preStop hook: wait until the local vLLM is idle")
    )
    drain_scorecard.add_arguments(
        commands.add_parser("scorecard", help="how recent drains went (from a running picker's admin API)")
    )
    drain_check.add_arguments(
        commands.add_parser("check", help="check drain timing budgets of manifests + Envoy")
    )
    args = parser.parse_args(argv)

    match args.command:
        case "serve":
            config = _load(args)
            configure_logging(config.log_level)
            from picker.app import serve as run

            try:
                if os.environ.get("PICKER_EVENT_LOOP") == "asyncio":  # for comparisons in benchmarks
                    asyncio.run(run(config))
                else:
                    uvloop.run(run(config))
            except ConfigError as exc:  # a source that cannot start (unreadable file, kubeconfig)
                print(f"picker: {exc}", file=sys.stderr)
                raise SystemExit(2) from exc
        case "config":
            import yaml

            print(yaml.safe_dump(_load(args).model_dump(mode="json"), sort_keys=False), end="")
        case "demo":
            configure_logging("WARNING")
            from picker.demo import run_demo

            raise SystemExit(uvloop.run(run_demo(seconds=args.seconds)))
        case "check":
            raise SystemExit(drain_check.run(args))
        case "scorecard":
            raise SystemExit(drain_scorecard.main(args))


if __name__ == "__main__":
    main()
