"""Fault injection: one spec format for the `x-sim-fault` header, the --fault option and POST /sim/faults.

Keys (hyphen or underscore):
- `status=N`: answer HTTP N (400-599) with a vLLM-style JSON error body before any token.
- `slow-headers=MS`: wait MS before admission and the response headers (holding no slot meanwhile).
- `reset-after=N`: after N tokens, close the TCP connection with RST (SO_LINGER 0 + abort).
- `error-after=N`: after N tokens, send vLLM's in-stream error event then `data: [DONE]`
  (non-streaming: HTTP 500 with the same error).
- `stall-after=N`: after N tokens, send nothing more and keep the connection (and the slot) until the
  client goes away.
At most one of reset-after / error-after / stall-after per spec.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


class MidStreamFault(enum.Enum):
    RESET = "reset-after"
    ERROR = "error-after"
    STALL = "stall-after"


@dataclass(frozen=True, slots=True)
class FaultSpec:
    status: int | None = None
    slow_headers_ms: float | None = None
    mid_stream: MidStreamFault | None = None
    after_tokens: int = 0  # when mid_stream is set: tokens sent before it strikes

    def describe(self) -> dict[str, Any]:
        """The spec in the same key=value vocabulary it is written in (for GET /sim/faults and logs)."""
        out: dict[str, Any] = {}
        if self.status is not None:
            out["status"] = self.status
        if self.slow_headers_ms is not None:
            out["slow-headers"] = self.slow_headers_ms
        if self.mid_stream is not None:
            out[self.mid_stream.value] = self.after_tokens
        return out


_SPLIT = re.compile(r"[,;\s]+")


def parse_fault_header(text: str) -> FaultSpec:
    """Parse `status=503`, `reset-after=5,slow-headers=100`, ... (separators: comma, semicolon, space)."""
    pairs: dict[str, str] = {}
    for item in _SPLIT.split(text.strip()):
        if not item:
            continue
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"fault item {item!r} is not key=value")
        pairs[key] = value
    return parse_fault_mapping(pairs)


def parse_fault_mapping(values: Mapping[str, Any]) -> FaultSpec:
    """Build a spec from a mapping (header pairs or admin JSON); `count` must be removed by the caller."""
    status: int | None = None
    slow_headers_ms: float | None = None
    mid: list[tuple[MidStreamFault, int]] = []
    for raw_key, raw_value in values.items():
        key = str(raw_key).replace("_", "-").lower()
        if key == "status":
            status = _as_int(key, raw_value, 400, 599)
        elif key == "slow-headers":
            slow_headers_ms = _as_float(key, raw_value)
        elif key in {fault.value for fault in MidStreamFault}:
            mid.append((MidStreamFault(key), _as_int(key, raw_value, 0, 10**9)))
        else:
            raise ValueError(f"unknown fault key {raw_key!r}")
    if len(mid) > 1:
        raise ValueError("only one of reset-after, error-after, stall-after per fault")
    if not (status is not None or slow_headers_ms is not None or mid):
        raise ValueError("empty fault spec")
    mid_fault, after = mid[0] if mid else (None, 0)
    return FaultSpec(status=status, slow_headers_ms=slow_headers_ms, mid_stream=mid_fault, after_tokens=after)


def _as_int(key: str, value: Any, low: int, high: int) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{key} must be an integer")
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{key} must be an integer, got {value!r}") from None
    if not low <= number <= high:
        raise ValueError(f"{key} must be within [{low}, {high}], got {number}")
    return number


def _as_float(key: str, value: Any) -> float:
    if isinstance(value, bool):
        raise ValueError(f"{key} must be a number")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{key} must be a number, got {value!r}") from None
    if not 0 <= number <= 3_600_000:
        raise ValueError(f"{key} must be within [0, 3600000] ms, got {number}")
    return number


class FaultBoard:
    """The server-wide fault of one replica; with a count it applies to the next K completion requests."""

    def __init__(self, spec: FaultSpec | None = None, count: int | None = None) -> None:
        self._spec = spec
        self._remaining = count if spec is not None else None

    def set(self, spec: FaultSpec, count: int | None = None) -> None:
        self._spec = spec
        self._remaining = count

    def clear(self) -> None:
        self._spec = None
        self._remaining = None

    def take(self) -> FaultSpec | None:
        """The fault for the request arriving now, consuming one use when counted."""
        spec = self._spec
        if spec is None:
            return None
        if self._remaining is not None:
            self._remaining -= 1
            if self._remaining <= 0:
                self.clear()
        return spec

    def describe(self) -> dict[str, Any]:
        if self._spec is None:
            return {"fault": None}
        return {"fault": self._spec.describe(), "count": self._remaining}
