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
from typing import TYPE_CHECKING

from picker.config.serve_flags import SERVE_FLAGS, add_serve_flags, flag_bool, overrides
from picker.drain import wait as drain_wait  # standard library only

if TYPE_CHECKING:
    from picker.config.model import PickerConfig

_STARTED = time.monotonic()  # drain-wait's deadline counts from here: only the stdlib came before

_NOTES: list[str] = []  # what the reference picker's flags that change nothing here were told


def _load(args: argparse.Namespace, flags: dict[str, tuple[str, ...]] = SERVE_FLAGS) -> PickerConfig:
    """The effective config from file, environment and flags (ours over the reference picker's)."""
    from picker.config.model import ConfigError
    from picker.config.reference_flags import ReferenceFlagError, reference_overrides
    from picker.config.sources import load_config, merge

    try:
        reference, notes = reference_overrides(args)
        config = load_config(args.config, merge(reference, overrides(args, flags)))
    except (ConfigError, ReferenceFlagError) as exc:
        print(f"picker: {exc}", file=sys.stderr)
        raise SystemExit(2) from exc
    _NOTES[:] = notes
    return config


def _configure_logging(config: PickerConfig) -> None:
    """Logging as configured, then one line per reference flag accepted without effect."""
    import logging

    from picker.observability.metrics import configure_logging

    configure_logging(config.log_level, config.log_format)
    for note in _NOTES:
        logging.getLogger("picker.cli.main").info("%s", note)


def _run_serve(config: PickerConfig) -> None:
    if config.server.workers > 1:
        raise SystemExit(_run_workers(config))
    from picker.lifecycle.startup import cannot_listen

    run_serve(config, cannot_listen(config))


def _run_workers(config: PickerConfig) -> int:
    """`picker serve --workers N`: the parent's exit code (picker/lifecycle/workers.py)."""
    import secrets
    import shutil
    import tempfile

    from picker.config.model import ConfigError
    from picker.lifecycle.workers import (
        Workers,
        claim_port,
        ports_problem,
        worker_configs,
        write_endpoints_file,
    )

    directory: str | None = None
    try:
        try:
            if config.pool.endpoints:  # shared through a file (a Kubernetes source needs none)
                directory = tempfile.mkdtemp(prefix="picker-workers-")
                shared = write_endpoints_file(Path(directory), config.pool.endpoints)
            else:
                shared = None
            configs = worker_configs(config, secrets.token_hex(32), shared)  # this pod's peer credential
        except ConfigError as exc:
            print(f"picker: {exc}", file=sys.stderr)
            return 2
        except OSError as exc:
            print(
                "picker: pool.endpoints: with server.workers > 1 static endpoints are shared through a "
                f"file, which could not be written ({exc}); give the container a writable temporary "
                "directory (an emptyDir on /tmp) or a Kubernetes source",
                file=sys.stderr,
            )
            return 2
        problem = ports_problem(config, configs)
        if problem is not None:
            print(f"picker: {problem}", file=sys.stderr)
            return 2
        claimed = claim_port(config)
        if isinstance(claimed, str):
            print(f"picker: {claimed}", file=sys.stderr)
            return 2
        with claimed:
            return Workers(configs).run()
    finally:
        if directory is not None:
            shutil.rmtree(directory, ignore_errors=True)


def run_serve(config: PickerConfig, problem: str | None = None) -> None:
    """Serve until signalled, or exit 2 with `problem` (found before starting) or a start-up one."""
    import asyncio

    import uvloop

    from picker.config.model import ConfigError
    from picker.lifecycle.startup import serve_or_reason

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
    from picker.config.model import ServerConfig

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
        type=flag_bool,
        default=True,
        metavar="true|false",
        help="TLS to the picker, as `picker serve --secure-serving` (default true)",
    )
    parser.add_argument(
        "--failure-mode-allow",
        type=flag_bool,
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
    from picker.cli.envoyconf import EnvoyParams, render
    from picker.config.model import canonical_address

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
    **SERVE_FLAGS,
    "port": ("proxy", "port"),
    "connect_timeout": ("proxy", "connect_timeout_s"),
    "max_attempts": ("proxy", "max_attempts"),
}


# serve flags that mean nothing to `picker proxy` (its gRPC side, Envoy's data plane, leader
# election): left out of its --help, and refused when given
_SERVE_ONLY = (
    "--grpc-port", "--health-port", "--secure-serving", "--cert-path", "--fallbacks", "--response-end",
    "--grpc-health-port", "--ha-enable-leader-election", "--leader-lease-duration", "--leader-renew-deadline",
    "--leader-retry-period", "--workers",
)  # fmt: skip
_serve_only: dict[str, str] = {}  # their dests on the proxy's parser -> flag


def _add_proxy_flags(parser: argparse.ArgumentParser) -> None:
    add_serve_flags(parser)
    for action in parser._actions:  # argparse has no public way to drop an added argument
        if set(action.option_strings) & set(_SERVE_ONLY):
            action.help = argparse.SUPPRESS
            _serve_only[action.dest] = action.option_strings[0]
    parser.add_argument("--port", type=int, help="where clients send OpenAI requests (default 8080)")
    parser.add_argument(
        "--connect-timeout", type=float, help="per upstream attempt, then the next pick (default 1)"
    )
    parser.add_argument("--max-attempts", type=int, help="upstream attempts before the first byte (3)")


def _run_proxy(args: argparse.Namespace) -> None:
    from picker.config.model import ConfigError

    given = [flag for dest, flag in _serve_only.items() if getattr(args, dest, None) is not None]
    if given:
        print(f"picker proxy: {', '.join(given)}: picker serve's, not picker proxy's", file=sys.stderr)
        raise SystemExit(2)
    config = _load(args, _PROXY_FLAGS)
    if config.server.workers > 1:
        print("picker proxy: server.workers is picker serve's, not picker proxy's", file=sys.stderr)
        raise SystemExit(2)
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
    from picker.cli import tenants as tenants_cli
    from picker.drain import check as drain_check
    from picker.drain import scorecard as drain_scorecard
    from picker.rollout import command as rollout_cli

    parser = argparse.ArgumentParser(prog="picker", description="Drain-aware endpoint picker for LLM pools")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="run the Envoy ext_proc endpoint picker")
    add_serve_flags(serve)
    _add_proxy_flags(commands.add_parser("proxy", help="the standalone streaming reverse proxy (no Envoy)"))
    show = commands.add_parser("config", help="print the effective configuration as YAML and exit")
    add_serve_flags(show)
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
    rollout_cli.add_arguments(
        commands.add_parser(
            "rollout", help="a running picker's canary: status, promote, abort, resume, pause"
        )
    )
    tenants_cli.add_arguments(
        commands.add_parser("tenants", help="a running picker's tenants: share, queued, tokens, budgets")
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
    from picker.cli import tenants as tenants_cli
    from picker.drain import check as drain_check
    from picker.drain import scorecard as drain_scorecard
    from picker.rollout import command as rollout_cli

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

            try:
                from picker.cli.demo import run_demo
            except ImportError as exc:  # an installed picker: the demo's harness is a checkout's
                raise SystemExit(
                    f"picker demo needs the simulator and the test harness ({exc.name}), which run from "
                    "a checkout of the repository, not from the installed package: clone it and run "
                    "`make demo`"
                ) from None
            from picker.observability.metrics import configure_logging

            configure_logging("WARNING")

            if args.proxy:
                from picker.cli.demo_proxy import run_demo_proxy

                raise SystemExit(uvloop.run(run_demo_proxy(seconds=args.seconds)))
            if args.picture is not None:
                raise SystemExit(uvloop.run(run_demo(seconds=args.seconds, picture=args.picture)))
            raise SystemExit(uvloop.run(run_demo(seconds=args.seconds)))
        case "check":
            raise SystemExit(drain_check.run(args))
        case "scorecard":
            raise SystemExit(drain_scorecard.main(args))
        case "rollout":
            raise SystemExit(rollout_cli.main(args))
        case "tenants":
            raise SystemExit(tenants_cli.main(args))
        case "envoy-config":
            raise SystemExit(_envoy_config(args))


if __name__ == "__main__":
    main()
