"""The picker's configuration: one typed, frozen model, from a YAML file, then PICKER_* env, then flags.

Every default lives here. Invalid values are errors that name the field (e.g. `server.grpc_port`);
nothing falls back silently, and nothing here exits the process (only `cli.py` does).
"""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
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
    return format_address(*parse_address(value))


class _Group(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ServerConfig(_Group):
    """Where the picker listens. 0.0.0.0 by default because Envoy reaches it over the pod network."""

    bind_address: str = "0.0.0.0"
    grpc_port: int = Field(9002, ge=0, le=65535, description="Envoy ext_proc (gRPC)")
    health_port: int = Field(9003, ge=0, le=65535, description="gRPC health: '', liveness, readiness")
    metrics_port: int = Field(9090, ge=0, le=65535, description="Prometheus /metrics and the admin API")


class PoolConfig(_Group):
    """Static endpoints, for machines without Kubernetes."""

    endpoints: tuple[str, ...] = ()

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


class SchedulingConfig(_Group):
    fallback_count: int = Field(2, ge=0, le=8, description="endpoints listed after the primary")


class RequestsConfig(_Group):
    max_body_bytes: int = Field(8 * _MIB, ge=1024, description="larger bodies get 413 too-large")


class StreamsConfig(_Group):
    # Envoy sends the observer stream's request headers before the upstream request starts, so a
    # dispatched request whose observer has not shown up by the time routing ends within this grace
    # was never going to be observed (observer filter missing): release its slot instead of leaking it.
    observer_attach_grace_s: float = Field(2.0, gt=0)


class ShutdownConfig(_Group):
    drain_timeout_s: float = Field(30.0, ge=0, description="budget for in-flight ext_proc streams on SIGTERM")


class PickerConfig(BaseSettings):
    """All of the picker's settings, grouped by plane."""

    model_config = SettingsConfigDict(
        env_prefix="PICKER_", env_nested_delimiter="__", frozen=True, extra="forbid"
    )

    server: ServerConfig = ServerConfig()
    pool: PoolConfig = PoolConfig()
    scheduling: SchedulingConfig = SchedulingConfig()
    requests: RequestsConfig = RequestsConfig()
    streams: StreamsConfig = StreamsConfig()
    shutdown: ShutdownConfig = ShutdownConfig()
    log_level: str = Field("INFO", pattern="^(DEBUG|INFO|WARNING|ERROR)$")


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
