"""`picker check`: does the whole deployment's timing budget let a drain finish?

Reads Kubernetes manifests and an Envoy bootstrap (files or directories, multi-document YAML), runs
every rule of `k8s_rules` and `envoy_rules`, and prints each finding with its file, line and field
path, the numbers behind it, and why it matters. Exit status 1 when a finding reaches --fail-on.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from picker.drain import autoscale_rules, envoy_rules, k8s_rules, wiring_rules
from picker.drain.manifests import get, load
from picker.drain.rules import RULES, Budget, Finding, Report, Severity

_DEFAULTS = Budget()
_SEVERITY_ORDER = {Severity.ERROR: 0, Severity.WARNING: 1, Severity.INFO: 2}


def check_paths(paths: list[Path], budget: Budget) -> tuple[Report, int]:
    """Run every rule over the inputs; returns the report and the number of documents read."""
    documents, problems = load(paths)
    report = Report()
    for problem in problems:
        report.findings.append(
            Finding(RULES["INPUT-001"], str(problem.file), problem.line, "file", "", problem.message)
        )
    inputs = k8s_rules.check([d for d in documents if d.is_kubernetes], report, budget)
    wiring_rules.check(inputs, report, budget)
    autoscale_rules.check(inputs, report)
    pool_modes = {
        str(get(pool.data, ("spec", "endpointPickerRef", "failureMode"), "FailClose"))
        for pool in inputs.of_kind("InferencePool")
    }
    canaries = [
        (workload, container)
        for workload in inputs.pickers
        for container in workload.picker_containers()
        if any(word.startswith("--rollout-candidate") for word in container.argv)
    ]
    for doc in documents:
        if doc.is_envoy:
            envoy_rules.check(doc, report, budget, pool_modes)
            blind = envoy_rules.routes_with_picker(doc) and not envoy_rules.sees_response_bodies(doc)
            if canaries and blind:
                workload, container = canaries[0]
                report.add(
                    "ROLLOUT-004",
                    workload.doc,
                    container.args_path,
                    f"--rollout-candidate with {doc.label}: no ext_proc filter sees response bodies",
                )
    report.findings.sort(key=lambda f: (f.file, f.line or 0, _SEVERITY_ORDER[f.rule.severity], f.rule.id))
    return report, len(documents)


def as_json(report: Report, documents: int, budget: Budget) -> dict[str, Any]:
    return {
        "findings": [f.as_json() for f in report.findings],
        "skipped": [s.as_json() for s in report.skipped],
        "summary": {
            "errors": report.count(Severity.ERROR),
            "warnings": report.count(Severity.WARNING),
            "info": report.count(Severity.INFO),
            "documents": documents,
        },
        "budget": asdict(budget),
    }


def as_text(report: Report, documents: int) -> str:
    lines: list[str] = []
    for finding in report.findings:
        where = finding.file + (f":{finding.line}" if finding.line else "")
        lines.append(f"{where}: {finding.rule.severity} {finding.rule.id} {finding.rule.title}")
        lines.append(f"    {finding.obj} {finding.field}".rstrip())
        lines.append(f"    {finding.message}")
        lines.append(f"    why: {finding.rule.why}")
    for skipped in report.skipped:
        lines.append(f"{skipped.file}: skipped {skipped.rule_id} ({skipped.obj}): {skipped.reason}")
    lines.append(
        f"picker check: {report.count(Severity.ERROR)} errors, {report.count(Severity.WARNING)} warnings, "
        f"{report.count(Severity.INFO)} info in {documents} documents ({len(report.skipped)} checks skipped)"
    )
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("paths", nargs="+", type=Path, help="manifest / Envoy config files or directories")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument(
        "--fail-on", choices=["error", "warning"], default="error", help="lowest severity that fails (exit 1)"
    )
    budget = parser.add_argument_group("what the manifests do not say")
    budget.add_argument(
        "--longest-stream-s",
        type=float,
        default=_DEFAULTS.longest_stream_s,
        help="longest request, first byte to last (default %(default)s)",
    )
    budget.add_argument(
        "--longest-silence-s",
        type=float,
        default=_DEFAULTS.longest_silence_s,
        help="longest gap between two chunks of a stream, the first included (default %(default)s)",
    )
    budget.add_argument(
        "--expected-concurrent-streams",
        type=int,
        default=_DEFAULTS.expected_concurrent_streams,
        help="open streams through one Envoy at peak (default %(default)s)",
    )
    budget.add_argument(
        "--cleanup-margin-s",
        type=float,
        default=_DEFAULTS.cleanup_margin_s,
        help="time a process needs to exit after its drain (default %(default)s)",
    )
    budget.add_argument(
        "--model-load-s",
        type=float,
        default=_DEFAULTS.model_load_s,
        help="longest time a model server takes to load and become ready (default %(default)s)",
    )


def run(args: argparse.Namespace) -> int:
    """Print the report; the exit status for `picker check`."""
    budget = Budget(
        longest_stream_s=args.longest_stream_s,
        longest_silence_s=args.longest_silence_s,
        expected_concurrent_streams=args.expected_concurrent_streams,
        cleanup_margin_s=args.cleanup_margin_s,
        model_load_s=args.model_load_s,
    )
    report, documents = check_paths(list(args.paths), budget)
    print(
        json.dumps(as_json(report, documents, budget), indent=2) if args.json else as_text(report, documents)
    )
    failing = report.count(Severity.ERROR) + (
        report.count(Severity.WARNING) if args.fail_on == "warning" else 0
    )
    return 1 if failing else 0
