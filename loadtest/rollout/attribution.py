"""Which replica served a request, when the replica does not say so itself (real vLLM).

The simulator names itself in a response header; vLLM does not. Two other witnesses are used instead:
Envoy's access log (both setups' Envoy configs log each request's `x-request-id`, which the load
sends, beside `%UPSTREAM_HOST%`), and each replica's own `/metrics` sampled over time (requests
running + waiting in its engine), which draws the lanes the same way for every setup.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from loadtest.procs import wait_until

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
NO_HOST = ("", "-")  # Envoy's %UPSTREAM_HOST% when no upstream was reached (a local reply)


def request_id(tag: str, index: int) -> str:
    """The `x-request-id` the load sends with arrival `index` of the run `tag`."""
    return f"{tag}-{index}"


def upstreams_from_access_log(lines: Iterable[str]) -> dict[str, str]:
    """request id -> the upstream host that answered it, from JSON access-log lines.

    Lines that are not JSON objects, or lack either field, or name no upstream (Envoy's "-") are
    skipped: a partly written last line or a local reply must not break the report. With retries
    Envoy logs the last host tried, which is the one whose answer the client got."""
    found: dict[str, str] = {}
    for line in lines:
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if not isinstance(entry, dict):
            continue
        rid, host = str(entry.get("request_id") or ""), str(entry.get("upstream_host") or "")
        if rid and rid != "-" and host not in NO_HOST:
            found[rid] = host
    return found


def upstreams_from_file(path: Path, expected: int, within_s: float = 5.0) -> dict[str, str]:
    """`upstreams_from_access_log` of an access-log file, once it names `expected` requests (or after
    `within_s`: requests that never reached an upstream have no host, so the rest are attributed)."""

    def logged() -> dict[str, str]:
        try:
            return upstreams_from_access_log(path.read_text(errors="replace").splitlines())
        except OSError:
            return {}

    try:
        wait_until(lambda: len(logged()) >= expected, within_s, 0.1, "the access log")
    except TimeoutError:
        pass
    return logged()


def engine_requests(metrics_text: str) -> int | None:
    """Requests vLLM's engine holds (running + waiting, summed over engines) from its /metrics text.

    None when neither gauge is present (not a vLLM, or not up yet). A cheap line scan rather than a
    full Prometheus parse: it runs several times a second per replica on a 2-core machine."""
    total, seen = 0.0, False
    for line in metrics_text.splitlines():
        if not line.startswith((RUNNING, WAITING)):
            continue
        name, _, rest = line.partition("{") if "{" in line else line.partition(" ")
        if name not in (RUNNING, WAITING):  # e.g. vllm:num_requests_waiting_by_reason
            continue
        value = rest.rsplit("}", 1)[-1].split() if "{" in line else rest.split()
        try:
            total += float(value[0])
        except (IndexError, ValueError):
            continue
        seen = True
    return round(total) if seen else None
