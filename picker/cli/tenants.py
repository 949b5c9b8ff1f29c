"""`picker tenants`: a running picker's tenants (GET /admin/tenants on its metrics port), as a table
for people or JSON for pipelines: each tenant's weight and share of the pool now, queued, in flight,
tokens and their share, times held back, and its token budget (left of its burst, refusals). Bounded
by the picker: the configured tenants and the busiest others, the rest summed as `other`. Standard
library only."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from picker.cli.admin_call import admin_call

_COLUMNS = (
    "tenant", "weight", "share", "queued", "in_flight", "tokens", "token_share", "held_back",
    "budget_left", "over_budget",
)  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default="http://127.0.0.1:9090", help="the picker's metrics/admin address")
    parser.add_argument(
        "--token", help="a reader's bearer token (admin.read_auth; default: $PICKER_ADMIN_TOKEN)"
    )
    parser.add_argument("--json", action="store_true", help="the picker's answer as JSON")


def fetch(url: str, token: str | None, timeout_s: float = 10.0) -> tuple[int, dict[str, Any]]:
    """The admin API's answer (status code, JSON body)."""
    return admin_call(url, "/admin/tenants", token, timeout_s=timeout_s)


def _cell(row: Mapping[str, Any], column: str) -> str:
    if column == "budget_left":
        budget = row.get("budget")
        return "-" if not budget else f"{budget['level']:g}/{budget['burst']:g}"
    value = row.get(column)
    if value is None:
        return "-"
    if column in ("share", "token_share"):
        return f"{100 * float(value):.1f}%"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def table(rows: Sequence[Mapping[str, Any]]) -> str:
    """The rows as aligned columns (`-`: not counted, e.g. a budgeted tenant with fair share off)."""
    cells = [list(_COLUMNS)] + [[_cell(row, c) for c in _COLUMNS] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(_COLUMNS))]
    lines = ("  ".join(v.ljust(w) for v, w in zip(line, widths, strict=True)).rstrip() for line in cells)
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    token = args.token or os.environ.get("PICKER_ADMIN_TOKEN")
    try:
        code, body = fetch(args.url, token)
    except (OSError, ValueError) as exc:
        print(f"picker tenants: cannot reach {args.url}: {exc}", file=sys.stderr)
        return 2
    if code != 200:
        message = body.get("error", {}).get("message", body) if isinstance(body, dict) else body
        print(f"picker tenants: {code} {message}", file=sys.stderr)
        return 1
    view = body.get("tenants")
    if args.json:
        print(json.dumps(view, indent=2))
        return 0
    if view is None:
        print("nothing is counted by tenant (tenants.fair_share off and no tenants.budgets)")
        return 0
    if not view.get("fair_share"):
        print("fair share off: only the budgets are counted")
    print(table(view.get("rows", [])) if view.get("rows") else "no tenant seen yet")
    return 0
