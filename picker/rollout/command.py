"""`picker rollout status | promote | abort | resume | pause`: the canary of a running picker, over
its admin API (GET /admin/rollout, POST /admin/rollout/<verb>). Standard library only."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from picker.cli.admin_call import admin_call

VERBS = ("status", "promote", "abort", "resume", "pause")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("verb", choices=VERBS, help="status, or a command (same auth as drains)")
    parser.add_argument("--url", default="http://127.0.0.1:9090", help="the picker's metrics/admin address")
    parser.add_argument("--token", help="admin bearer token (default: $PICKER_ADMIN_TOKEN)")
    parser.add_argument("--json", action="store_true", help="the whole status as JSON")


def call(url: str, verb: str, token: str | None, timeout_s: float = 10.0) -> tuple[int, dict[str, Any]]:
    """The admin API's answer (status code, JSON body): the rollout's status, or a command's."""
    post = verb != "status"
    return admin_call(url, "/admin/rollout" + (f"/{verb}" if post else ""), token, post, timeout_s)


def describe(status: dict[str, Any]) -> str:
    """A few lines for a person: phase, weight, step, each gate, the rollback's reason."""
    lines = [
        f"phase {status['phase']}  weight {status['weight']}%  step {status['step'] + 1} of "
        f"{len(status['steps'])} {status['steps']}  ({status['step_for_s']:.0f} s in it, routed "
        f"{status['routed_this_step']})"
    ]
    for gate in status.get("gates", []):
        if gate["verdict"] == "unobservable":
            lines.append(f"  {gate['gate']:<22} {gate.get('note', 'unobservable')}")
            continue
        lines.append(
            f"  {gate['gate']:<22} {gate['verdict']:<5} candidate {gate['candidate']}  stable "
            f"{gate['stable']}  limit {gate['limit']}  samples {gate['samples']}"
        )
        why = gate.get("why")
        if isinstance(why, dict):  # a waiting gate: what it waits for, and whether it can come
            stuck = "" if why.get("can_gather") else "  (this step cannot gather it)"
            lines.append(f"  {'':<22} waits: {why.get('text', '')}{stuck}")
    judges = [f"  {g['gate']}: {g['judges_from']}" for g in status.get("gates", []) if g.get("judges_from")]
    if judges:
        lines += ["what each gate judges from:", *judges]
    if status.get("rollback"):
        lines.append(f"rolled back: {status['rollback']['reason']}")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    token = args.token or os.environ.get("PICKER_ADMIN_TOKEN")
    try:
        code, body = call(args.url, args.verb, token)
    except (OSError, ValueError) as exc:
        print(f"picker rollout: cannot reach {args.url}: {exc}", file=sys.stderr)
        return 2
    if code != 200:
        message = body.get("error", {}).get("message", body)
        print(f"picker rollout {args.verb}: {code} {message}", file=sys.stderr)
        return 1
    status = body.get("rollout")
    if status is None:
        print("no rollout is configured (rollout.candidate)")
        return 0
    print(json.dumps(status, indent=2) if args.json else describe(status))
    return 0
