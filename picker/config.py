"""The picker's configuration: one typed, frozen model, from a YAML file, then PICKER_* env, then flags.

Every default lives here. Invalid values are errors that name the field (e.g. `server.grpc_port`);
nothing falls back silently, and nothing here exits the process (only `cli.py` does).
"""

from __future__ import annotations

import ipaddress
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, InitSettingsSource, PydanticBaseSettingsSource, SettingsConfigDict

_MIB = 1024 * 1024


class ConfigError(ValueError):
    """A configuration problem, worded for the operator (names the field or the file)."""


def parse_address(value: str) -> tuple[str, int]:
    """Split "ip:port" / "[v6]:port" / "host:port" and check both halves."""
    text = value.strip()
    if text.startswith("["):
        host, sep, port = text[1:].partition("]:")
        if not sep:
            raise ValueError(f"{value!r} is not [ipv6]:port")
        ipaddress.IPv6Address(host)
    else:
        host, sep, port = text.rpartition(":")
        if not sep or not host:
            raise ValueError(f"{value!r} is not host:port")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{value!r} has no valid port")
    return host, int(port)


def format_address(host: str, port: int) -> str:
    """The canonical "ip:port" form used as an endpoint's identity (IPv6 in brackets)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def canonical_address(value: str) -> str:
    """One spelling per endpoint, whichever source names it (IP addresses in their compressed form)."""
    host, port = parse_address(value)
    try:
        host = ipaddress.ip_address(host).compressed
    except ValueError:
        pass  # a host name
    return format_address(host, port)


class _Group(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ServerConfig(_Group):
    """Where the picker listens. 0.0.0.0 by default because Envoy reaches it over the pod network."""

    bind_address: str = "0.0.0.0"
    grpc_port: int = Field(9002, ge=0, le=65535, description="Envoy ext_proc (gRPC)")
    health_port: int = Field(9003, ge=0, le=65535, description="gRPC health: '', liveness, readiness")
    metrics_port: int = Field(9090, ge=0, le=65535, description="Prometheus /metrics and the admin API")


class PoolConfig(_Group):
    """Endpoints without Kubernetes: a static list, or a file reloaded when it changes."""

    endpoints: tuple[str, ...] = ()
    endpoints_file: Path | None = Field(
        None, description="YAML list of endpoints (each may say draining: true); reloaded when it changes"
    )
    endpoints_file_poll_s: float = Field(1.0, gt=0, description="how often the file is checked")

    @field_validator("endpoints", mode="before")
    @classmethod
    def _split(cls, value: Any) -> Any:
        if isinstance(value, str):
            return tuple(part for part in (p.strip() for p in value.split(",")) if part)
        return value

    @field_validator("endpoints")
    @classmethod
    def _canonical(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(dict.fromkeys(canonical_address(v) for v in value))


_DNS_LABEL = r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$"


class KubeSourceConfig(_Group):
    """The EndpointSlice source: the slices of one Service (or a label selector) in one namespace.

    Needs RBAC get/list/watch on endpointslices (discovery.k8s.io) in that namespace, nothing more.
    """

    service: str | None = Field(
        None, pattern=_DNS_LABEL, description="watch this Service's slices (label kubernetes.io/service-name)"
    )
    label_selector: str | None = Field(None, min_length=1, description="or: slices matching this selector")
    namespace: str | None = Field(
        None, pattern=_DNS_LABEL, description="default: the service account's, else the kubeconfig context's"
    )
    target_port: str | None = Field(
        None, description="model-server port on each endpoint, a name or a number; default: the only port"
    )
    kubeconfig: Path | None = Field(
        None, description="default: in-cluster service account, else $KUBECONFIG, else ~/.kube/config"
    )
    watch_timeout_s: int = Field(
        60, ge=1, le=3600, description="the API server ends each watch after this; the picker resumes it"
    )
    inactivity_deadline_s: float = Field(90.0, gt=0, description="a watch silent this long is a dead one")
    request_timeout_s: float = Field(10.0, gt=0, description="connect and list timeout")
    backoff_initial_s: float = Field(0.5, gt=0, description="first pause after a failed list or watch")
    backoff_max_s: float = Field(30.0, gt=0, description="longest pause between retries")

    @property
    def enabled(self) -> bool:
        return self.service is not None or self.label_selector is not None

    @property
    def selector(self) -> str:
        if self.service is not None:
            return f"kubernetes.io/service-name={self.service}"
        return self.label_selector or ""

    @field_validator("target_port", mode="before")
    @classmethod
    def _port_text(cls, value: Any) -> Any:
        return str(value) if isinstance(value, int) and not isinstance(value, bool) else value

    @field_validator("target_port")
    @classmethod
    def _port_name_or_number(cls, value: str | None) -> str | None:
        if value is None:
            return None
        if value.isdigit():
            if not 0 < int(value) < 65536:
                raise ValueError(f"port {value} is outside 1-65535")
        elif not re.match(_DNS_LABEL, value):
            raise ValueError(f"{value!r} is neither a port number nor a port name")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> KubeSourceConfig:
        if self.service is not None and self.label_selector is not None:
            raise ValueError("kube.service and kube.label_selector: set one, not both")
        if self.inactivity_deadline_s <= self.watch_timeout_s:
            raise ValueError(
                f"kube.inactivity_deadline_s ({self.inactivity_deadline_s}) must exceed "
                f"kube.watch_timeout_s ({self.watch_timeout_s}), or every quiet watch would count as dead"
            )
        if self.backoff_initial_s > self.backoff_max_s:
            raise ValueError("kube.backoff_initial_s must not exceed kube.backoff_max_s")
        return self


class AdminConfig(_Group):
    """The admin API on the metrics port: GET /admin/endpoints; POST .../<addr>/drain and .../undrain.

    Changes are accepted from loopback peers, or from anyone presenting this bearer token.
    """

    token: SecretStr | None = Field(None, description="bearer token for non-loopback callers (16+ chars)")

    @field_validator("token")
    @classmethod
    def _long_enough(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and len(value.get_secret_value()) < 16:
            raise ValueError("must be at least 16 characters")
        return value


class SchedulingConfig(_Group):
    fallback_count: int = Field(2, ge=0, le=8, description="endpoints listed after the primary")


class LoadConfig(_Group):
    """Load signals scraped from each endpoint's own /metrics, and how they score."""

    scrape: bool = Field(True, description="false: no scraping, schedule by in-flight count alone")
    metrics_path: str = "/metrics"
    scrape_interval_s: float = Field(0.1, gt=0)
    scrape_timeout_s: float = Field(0.5, gt=0)
    max_backoff_s: float = Field(5.0, gt=0, description="longest pause after repeated scrape failures")
    max_page_bytes: int = Field(4 * _MIB, ge=1024, description="larger /metrics pages count as a failure")
    staleness_s: float = Field(2.0, gt=0, description="older metrics count as saturated")
    waiting_threshold: float = Field(1.0, gt=0, description="saturated at this many queued on the engine")
    kv_threshold: float = Field(0.9, gt=0, le=1, description="saturated at this KV-cache usage")
    engine_slots: int | None = Field(None, ge=1, description="vLLM --max-num-seqs, if known")
    weight_load: float = Field(1.0, ge=0)
    weight_waiting: float = Field(2.0, ge=0)
    weight_kv: float = Field(10.0, ge=0)


class FlowConfig(_Group):
    """The admission queue in front of saturated engines."""

    max_queued: int = Field(1000, ge=0)
    max_queued_bytes: int = Field(256 * _MIB, ge=0)
    ttl_s: float = Field(30.0, gt=0, description="longest wait in the queue before a 429/503")
    envoy_max_message_timeout_s: float = Field(
        60.0,
        gt=0,
        description="Envoy ext_proc max_message_timeout: how long Envoy lets a queued request wait",
    )
    reject_without_endpoints: bool = Field(False, description="503 at once instead of waiting for endpoints")

    @model_validator(mode="after")
    def _ttl_fits_envoy(self) -> FlowConfig:
        if self.ttl_s >= self.envoy_max_message_timeout_s:
            raise ValueError(
                f"ttl_s ({self.ttl_s}) must be below envoy_max_message_timeout_s "
                f"({self.envoy_max_message_timeout_s}), or Envoy gives up on queued requests first"
            )
        return self


class RequestsConfig(_Group):
    max_body_bytes: int = Field(8 * _MIB, ge=1024, description="larger bodies get 413 too-large")


class StreamsConfig(_Group):
    # Envoy sends the observer stream's request headers before the upstream request starts, so a
    # dispatched request whose observer has not shown up by the time routing ends within this grace
    # was never going to be observed (observer filter missing): release its slot instead of leaking it.
    observer_attach_grace_s: float = Field(2.0, gt=0)
    # When a stream ends short of its response, Envoy's access log (sent a moment later) says who
    # cut it; this is how long to wait for it before calling the ending unobserved.
    access_log_grace_s: float = Field(1.0, gt=0)
    stall_after_s: float = Field(30.0, gt=0, description="silence after which a stream counts as stalled")


class ShutdownConfig(_Group):
    """The picker's own shutdown: one budget, spent in phases (see picker/shutdown.py)."""

    drain_timeout_s: float = Field(30.0, ge=0, description="the whole budget, from SIGTERM to exit")
    propagation_s: float = Field(5.0, ge=0, description="longest wait for load balancers to notice")
    quiet_interval_s: float = Field(1.0, gt=0, description="two of these without arrivals end phase 1")

    @model_validator(mode="after")
    def _fits(self) -> ShutdownConfig:
        if self.propagation_s > self.drain_timeout_s:
            raise ValueError(
                f"propagation_s ({self.propagation_s}) must not exceed drain_timeout_s "
                f"({self.drain_timeout_s})"
            )
        return self


class PickerConfig(BaseSettings):
    """All of the picker's settings, grouped by plane."""

    model_config = SettingsConfigDict(
        env_prefix="PICKER_", env_nested_delimiter="__", frozen=True, extra="forbid"
    )

    server: ServerConfig = ServerConfig()
    pool: PoolConfig = PoolConfig()
    kube: KubeSourceConfig = KubeSourceConfig()
    admin: AdminConfig = AdminConfig()
    scheduling: SchedulingConfig = SchedulingConfig()
    load: LoadConfig = LoadConfig()
    flow: FlowConfig = FlowConfig()
    requests: RequestsConfig = RequestsConfig()
    streams: StreamsConfig = StreamsConfig()
    shutdown: ShutdownConfig = ShutdownConfig()
    log_level: str = Field("INFO", pattern="^(DEBUG|INFO|WARNING|ERROR)$")

    @model_validator(mode="after")
    def _one_endpoint_source(self) -> PickerConfig:
        chosen = [
            name
            for name, on in (
                ("pool.endpoints", bool(self.pool.endpoints)),
                ("pool.endpoints_file", self.pool.endpoints_file is not None),
                ("kube.service", self.kube.service is not None),
                ("kube.label_selector", self.kube.label_selector is not None),
            )
            if on
        ]
        if len(chosen) > 1:
            raise ValueError(f"choose one endpoint source: {', '.join(chosen)} are all set")
        return self


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except OSError as exc:
        raise ConfigError(f"config file {path}: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path}: not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: top level must be a mapping")
    return data


def _describe(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        field = ".".join(str(p) for p in err["loc"]) or "(top level)"
        lines.append(f"{field}: {err['msg']}")
    return "invalid configuration: " + "; ".join(lines)


def load_config(path: Path | None = None, overrides: dict[str, Any] | None = None) -> PickerConfig:
    """Merge defaults < file < PICKER_* environment < flags (``overrides``, nested dicts)."""
    file_data = _read_yaml(path) if path is not None else {}

    class _WithFile(PickerConfig):
        @classmethod
        def settings_customise_sources(
            cls,
            settings_cls: type[BaseSettings],
            init_settings: PydanticBaseSettingsSource,
            env_settings: PydanticBaseSettingsSource,
            dotenv_settings: PydanticBaseSettingsSource,
            file_secret_settings: PydanticBaseSettingsSource,
        ) -> tuple[PydanticBaseSettingsSource, ...]:
            return init_settings, env_settings, InitSettingsSource(settings_cls, file_data)

    try:
        merged = _WithFile(**(overrides or {}))
        return PickerConfig.model_validate(merged.model_dump())
    except ValidationError as exc:
        raise ConfigError(_describe(exc)) from exc
