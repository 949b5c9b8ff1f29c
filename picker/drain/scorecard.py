"""`picker scorecard`: how recent drains went, as a table for people and JSON for pipelines.

Reads the drain records of a running picker (`GET /admin/drains` on its metrics port) and adds the
one figure the picker cannot know alone: how much of the model server's termination grace period
each drain left unused (grace minus time to zero in flight). A drain that needed more than the
grace was cut by the kubelet's SIGKILL; its `cut` requests are the forced cuts, with the streams its
engine stopped sending before the client left (vLLM abandons them at its --shutdown-timeout).

`failed_before` counts what clients may have seen before the picker learned of the drain: answers
that failed on the endpoint (before their first byte) in the seconds before the record opened, e.g.
vLLM's `500 cannot schedule new futures after shutdown` while the endpoint update was on its way.
Envoy retries those on the next endpoint of the picker's list, so a client sees one only when the
list ran out.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any

_COLUMNS = (
    "endpoint",
    "started",
    "cause",
    "failed_before",
    "in_flight",
    "completed",
    "client_gone",
    "upstream_err",
    "cut",
    "picks_after",
    "to_zero_s",
    "unused_grace_s",
    "exit",
)


def score(drains: Sequence[Mapping[str, Any]], grace_s: float | None) -> list[dict[str, Any]]:
    """One row per drain record (the shape `DrainRecord.summary` gives), newest first."""
    rows = []
    for drain in drains:
        ended = drain.get("ended") or {}
        to_zero = drain.get("time_to_zero_s")
        unused = None if grace_s is None or to_zero is None else round(grace_s - float(to_zero), 3)
        rows.append(
            {
                "endpoint": drain.get("address"),
                "started": drain.get("started_wall"),
                "cause": drain.get("cause"),
                "failed_before_start": drain.get("failed_before_start", 0),
                "open": drain.get("open"),
                "in_flight_at_start": drain.get("in_flight_at_start"),
                "completed": ended.get("completed", 0),
                "ended": dict(ended),
                "moved_away": drain.get("moved_away", 0),
                "picks_after_start": drain.get("picks_after_start", 0),
                "time_to_zero_s": to_zero,
                "unused_grace_s": unused,
                "forced_cuts": ended.get("cut", 0),
                "exit": drain.get("exit"),
            }
        )
    return rows


def _when(wall: object) -> str:
    if not isinstance(wall, int | float):
        return "-"
    return time.strftime("%H:%M:%S", time.localtime(wall))


def table(rows: Sequence[Mapping[str, Any]]) -> str:
    if not rows:
        return "no drains recorded yet"
    lines = [" | ".join(_COLUMNS)]
    for row in rows:
        ended = row["ended"]
        values = (
            row["endpoint"],
            _when(row["started"]),
            row["cause"],
            row["failed_before_start"],
            row["in_flight_at_start"],
            row["completed"],
            ended.get("client-disconnect", 0),
            ended.get("upstream-error", 0),
            row["forced_cuts"],
            row["picks_after_start"],
            "-" if row["time_to_zero_s"] is None else row["time_to_zero_s"],
            "-" if row["unused_grace_s"] is None else row["unused_grace_s"],
            row["exit"] or ("open" if row["open"] else "-"),
        )
        lines.append(" | ".join(str(v) for v in values))
    widths = [max(len(line.split(" | ")[i]) for line in lines) for i in range(len(_COLUMNS))]
    return "\n".join(
        " | ".join(cell.ljust(w) for cell, w in zip(line.split(" | "), widths, strict=True)) for line in lines
    )


def fetch(url: str, timeout_s: float = 5.0) -> list[dict[str, Any]]:
    # every picker's records, merged, when the picker has peers (scope=pool); its own otherwise
    with urllib.request.urlopen(url.rstrip("/") + "/admin/drains?scope=pool", timeout=timeout_s) as response:
        data = json.loads(response.read(4 * 1024 * 1024))
    drains = data.get("drains") if isinstance(data, dict) else None
    if not isinstance(drains, list):
        raise ValueError("the picker's answer has no 'drains' list")
    return drains


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default="http://127.0.0.1:9090", help="the picker's metrics/admin address")
    parser.add_argument("--grace", type=float, help="the model servers' terminationGracePeriodSeconds")
    parser.add_argument("--json", action="store_true", help="JSON instead of a table")


def main(args: argparse.Namespace) -> int:
    try:
        rows = score(fetch(args.url), args.grace)
    except (OSError, urllib.error.URLError, ValueError) as exc:
        print(f"picker scorecard: cannot read drains from {args.url}: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(rows, indent=2) if args.json else table(rows))
    return 0
