"""The reference picker's command line, as its Helm chart starts it, on `picker serve` and `picker proxy`.

Users of the reference chart (the GIE `inferencepool` chart, the llm-d Router's) should change only
the image. Its container arguments mix three kinds of flags, each handled here in one table:
- flags that mean what a setting of this picker means: mapped onto it (`--grpc-health-port` is
  `server.health_port`; Go durations such as `50ms` are read as seconds);
- flags whose effect this picker has anyway, or that change nothing here: accepted, and each one
  named in one log line at start saying so (`--enable-pprof`);
- values this picker cannot honour (`--pool-group` of the v1alpha2 API): a start-up error naming
  the flag. A flag in neither table is argparse's error, naming it. None is silently misread.
Flags this picker already has under the same name (`--pool-name`, `--grpc-port`, `--secure-serving`,
`--cert-path`, `--total-queued-requests-metric`, ...) stay in cli.py.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

REFERENCE_POOL_GROUP = "inference.networking.k8s.io"

_GO_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def seconds(value: str) -> float:
    """A Go duration (`50ms`, `1m30s`) or plain seconds (`0.05`), as seconds."""
    text = value.strip()
    try:
        return float(text)
    except ValueError:
        pass
    position, total = 0, 0.0
    for match in _GO_DURATION.finditer(text):
        if match.start() != position:
            break
        total += float(match.group(1)) * _UNITS[match.group(2)]
        position = match.end()
    if position != len(text) or not text:
        raise argparse.ArgumentTypeError(f"{value!r} is not a duration (e.g. 50ms, 5s, 1m30s)")
    return total


def go_bool(value: str) -> bool:
    """A boolean as Go's flag package reads one (`--flag=false`, `--flag=0`, `--flag=T`)."""
    lowered = value.strip().lower()
    if lowered in ("true", "t", "1", "yes", "on"):
        return True
    if lowered in ("false", "f", "0", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, not {value!r}")


def _ports(value: str) -> tuple[int, ...]:
    try:
        ports = tuple(int(part) for part in value.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a comma-separated list of ports") from None
    if not ports or any(not 0 < port < 65536 for port in ports):
        raise argparse.ArgumentTypeError(f"{value!r}: ports must be 1-65535")
    return ports


_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")  # most verbose first


def _verbosity(value: str) -> str:
    """The reference's `-v` (logr verbosity: 1-3 info, 4 and up debug) as a log level."""
    try:
        level = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"-v takes a number, not {value!r}") from None
    return "DEBUG" if level >= 4 else "INFO"


def _encoder(value: str) -> str:
    """`--zap-encoder`: json, or console (text lines)."""
    lowered = value.strip().lower()
    if lowered not in ("json", "console"):
        raise argparse.ArgumentTypeError(f"--zap-encoder takes json or console, not {value!r}")
    return "json" if lowered == "json" else "text"


def _zap_level(value: str) -> str:
    """`--zap-log-level` (debug, info, error, or a number: zap's -1 is debug) as a log level."""
    lowered = value.strip().lower()
    named = {"debug": "DEBUG", "info": "INFO", "warn": "WARNING", "error": "ERROR", "panic": "ERROR"}
    if lowered in named:
        return named[lowered]
    try:
        return "DEBUG" if int(lowered) < 0 else "INFO"
    except ValueError:
        raise argparse.ArgumentTypeError(f"--zap-log-level: unknown level {value!r}") from None


@dataclass(frozen=True, slots=True)
class Mapped:
    """A reference flag that sets one of this picker's settings."""

    flag: str
    path: tuple[str, ...]
    parse: Callable[[str], Any]
    metavar: str
    help: str
    boolean: bool = False  # may be given without a value (Go: `--tracing` alone is true)


@dataclass(frozen=True, slots=True)
class Accepted:
    """A reference flag accepted without a setting of its own; `why(value)` is its start-up log line."""

    flag: str
    parse: Callable[[str], Any]
    why: Callable[[Any], str]
    boolean: bool = False


MAPPED: tuple[Mapped, ...] = (
    Mapped("--grpc-health-port", ("server", "health_port"), int, "PORT", "gRPC health port (9003)"),
    Mapped(
        "--refresh-metrics-interval",
        ("load", "scrape_interval_s"),
        seconds,
        "DURATION",
        "how often each model server's /metrics is scraped (100ms)",
    ),
    Mapped(
        "--metrics-staleness-threshold",
        ("load", "staleness_s"),
        seconds,
        "DURATION",
        "metrics older than this count as saturated (2s)",
    ),
    Mapped(
        "--metrics-endpoint-auth",
        ("admin", "metrics_auth"),
        go_bool,
        "true|false",
        "/metrics only for bearer tokens the API server vouches for (TokenReview)",
        True,
    ),
    Mapped("--zap-encoder", ("log_format",), _encoder, "json|console", "log lines as JSON or text"),
    Mapped("--zap-log-level", ("log_level",), _zap_level, "LEVEL", "debug, info, error"),
    Mapped("--v", ("log_level",), _verbosity, "N", "reference verbosity: 4 and above is debug"),
    Mapped("--tracing", ("tracing", "enabled"), go_bool, "true|false", "OpenTelemetry traces", boolean=True),
    Mapped(
        "--ha-enable-leader-election",
        ("leader", "enabled"),
        go_bool,
        "true|false",
        "active-passive: ready only while holding the leader Lease",
        boolean=True,
    ),
    Mapped("--leader-lease-duration", ("leader", "lease_duration_s"), seconds, "DURATION", "15s"),
    Mapped("--leader-renew-deadline", ("leader", "renew_deadline_s"), seconds, "DURATION", "10s"),
    Mapped("--leader-retry-period", ("leader", "retry_period_s"), seconds, "DURATION", "2s"),
    Mapped(
        "--lora-info-metric",
        ("load", "lora_info_metric"),
        str,
        "NAME",
        "the LoRA adapters' info series (vllm:lora_requests_info)",
    ),
    Mapped(
        "--endpoint-selector",
        ("kube", "endpoint_selector"),
        str,
        "SELECTOR",
        "model-server pods by label selector, without an InferencePool",
    ),
    Mapped(
        "--endpoint-target-ports",
        ("kube", "endpoint_target_ports"),
        _ports,
        "PORTS",
        "with --endpoint-selector: the model-server ports, comma-separated",
    ),
)

ACCEPTED: tuple[Accepted, ...] = (
    Accepted(
        "--enable-pprof", go_bool, lambda _: "--enable-pprof: a Go profiler; nothing to enable here", True
    ),
    Accepted(
        "--health-checking",
        go_bool,
        lambda _: "--health-checking: gRPC health is always served, on the health port",
        True,
    ),
    Accepted(
        "--enable-cert-reload",
        go_bool,
        lambda _: "--enable-cert-reload: --cert-path is always reloaded when it changes",
        True,
    ),
    Accepted(
        "--refresh-prometheus-metrics-interval",
        seconds,
        lambda _: "--refresh-prometheus-metrics-interval: the picker's /metrics is computed at each scrape",
    ),
    Accepted("--zap-devel", go_bool, lambda _: "--zap-devel: log lines keep the one format", True),
    Accepted("--zap-stacktrace-level", str, lambda _: "--zap-stacktrace-level: tracebacks on errors only"),
    Accepted("--zap-time-encoding", str, lambda _: "--zap-time-encoding: log times are ISO 8601"),
    Accepted(
        "--cache-info-metric",
        str,
        lambda name: f"--cache-info-metric {name}: the cache size is read from vllm:cache_config_info",
    ),
)


def _dest(flag: str) -> str:
    return "ref_" + flag.lstrip("-").replace("-", "_")


def add_reference_flags(parser: argparse.ArgumentParser) -> None:
    """The reference picker's flags this picker maps or accepts (see the module docstring)."""
    group = parser.add_argument_group("reference picker flags (its Helm chart's arguments)")
    for mapped in MAPPED:
        names = [mapped.flag, "-v"] if mapped.flag == "--v" else [mapped.flag]
        extra: dict[str, Any] = {"nargs": "?", "const": "true"} if mapped.boolean else {}
        group.add_argument(*names, dest=_dest(mapped.flag), metavar=mapped.metavar, help=mapped.help, **extra)
    for accepted in ACCEPTED:
        extra = {"nargs": "?", "const": "true"} if accepted.boolean else {}
        group.add_argument(accepted.flag, dest=_dest(accepted.flag), help=argparse.SUPPRESS, **extra)
    group.add_argument(
        "--pool-group",
        dest="ref_pool_group",
        metavar="GROUP",
        help=f"the InferencePool API group; only {REFERENCE_POOL_GROUP} (v1) is served",
    )
    group.add_argument(
        "--model-server-metrics-https-insecure-skip-verify",
        dest="ref_skip_verify",
        nargs="?",
        const="true",
        help=argparse.SUPPRESS,
    )


class ReferenceFlagError(ValueError):
    """A reference flag's value this picker cannot honour (the message names the flag)."""


def reference_overrides(args: argparse.Namespace) -> tuple[dict[str, Any], list[str]]:
    """(setting overrides as nested dicts, one log line per accepted flag). ReferenceFlagError when a
    value cannot be honoured; argparse.ArgumentTypeError for a value that is not of its type."""
    out: dict[str, Any] = {}
    notes: list[str] = []
    for mapped in MAPPED:
        raw = getattr(args, _dest(mapped.flag), None)
        if raw is None:
            continue
        try:
            value = mapped.parse(raw)
        except argparse.ArgumentTypeError as exc:
            raise ReferenceFlagError(f"{mapped.flag}: {exc}") from None
        node = out
        for key in mapped.path[:-1]:
            node = node.setdefault(key, {})
        key = mapped.path[-1]
        if key == "log_level" and key in node:  # --zap-log-level and -v both given: the more verbose
            value = min(node[key], value, key=_LEVELS.index)
        node[key] = value
    for accepted in ACCEPTED:
        raw = getattr(args, _dest(accepted.flag), None)
        if raw is None:
            continue
        try:
            notes.append(accepted.why(accepted.parse(raw)))
        except argparse.ArgumentTypeError as exc:
            raise ReferenceFlagError(f"{accepted.flag}: {exc}") from None
    group = getattr(args, "ref_pool_group", None)
    if group is not None and group != REFERENCE_POOL_GROUP:
        raise ReferenceFlagError(
            f"--pool-group {group}: this picker reads InferencePools of {REFERENCE_POOL_GROUP} (v1) only"
        )
    skip = getattr(args, "ref_skip_verify", None)
    if skip is not None and not go_bool(skip):
        raise ReferenceFlagError(
            "--model-server-metrics-https-insecure-skip-verify=false: this picker does not verify "
            "model servers' certificates when it scrapes over https"
        )
    return out, notes
