"""Rules over autoscalers (an HPA, a KEDA ScaledObject): sound objects, aimed at the model servers,
reading metrics the picker exports.

An autoscaler that scales the pickers on the pool's demand, or reads a metric the picker does not
export (a typo, a family renamed since), scales nothing or the wrong thing, silently: an absent
series is "no data" to KEDA, and to an HPA a metric it cannot read.
"""

from __future__ import annotations

import re
from typing import Any

from picker.drain import crds
from picker.drain.k8s_rules import Inputs
from picker.drain.manifests import Document, FieldPath, get
from picker.drain.rules import Report

_PICKER_METRIC = re.compile(r"\bpicker_[a-z0-9_]+")
AUTOSCALER_KINDS = ("HorizontalPodAutoscaler", "ScaledObject")


def _exported() -> frozenset[str]:
    from picker.observability.families import exported_names  # prometheus-client: only when needed

    return exported_names()


def metric_reads(doc: Document) -> list[tuple[FieldPath, str]]:
    """Where the autoscaler names a metric, and the text there (a PromQL query or a metric name)."""
    reads: list[tuple[FieldPath, str]] = []
    if doc.kind == "ScaledObject":
        for i, trigger in enumerate(get(doc.data, ("spec", "triggers"), []) or []):
            query = get(trigger, ("metadata", "query"))
            if isinstance(query, str):
                reads.append((("spec", "triggers", i, "metadata", "query"), query))
    else:
        for i, metric in enumerate(get(doc.data, ("spec", "metrics"), []) or []):
            kind = {"External": "external", "Pods": "pods", "Object": "object"}.get(
                str(get(metric, ("type",)))
            )
            name = get(metric, (kind, "metric", "name")) if kind else None
            if isinstance(name, str):
                reads.append((("spec", "metrics", i, kind or "", "metric", "name"), name))
    return reads


def _target(doc: Document) -> dict[str, Any]:
    target = get(doc.data, ("spec", "scaleTargetRef"), {})
    return target if isinstance(target, dict) else {}


def check(inputs: Inputs, report: Report) -> None:
    """AUTOSCALE-001 malformed, -002 aimed at a picker or at no model server, -003 unknown metric."""
    autoscalers = [d for kind in AUTOSCALER_KINDS for d in inputs.of_kind(kind)]
    exported: frozenset[str] | None = None
    for doc in autoscalers:
        if doc.kind == "ScaledObject":
            for path, problem in crds.structural_problems(doc.data):
                report.add("AUTOSCALE-001", doc, path, problem)
        target = _target(doc)
        kind, name = str(target.get("kind", "Deployment")), str(target.get("name", ""))
        path: FieldPath = ("spec", "scaleTargetRef", "name")
        same = [
            w
            for w in [*inputs.pickers, *inputs.model_servers]
            if w.doc.kind == kind and w.doc.name == name and w.doc.namespace == doc.namespace
        ]
        if any(w in inputs.pickers for w in same):
            report.add("AUTOSCALE-002", doc, path, f"scales the picker {kind}/{name}, not the model servers")
        elif not same:
            named = [d for d in inputs.of_kind(kind) if d.name == name and d.namespace == doc.namespace]
            if named:
                report.add("AUTOSCALE-002", doc, path, f"{kind}/{name} runs no model server of a pool")
            else:
                report.skip("AUTOSCALE-002", doc, f"{kind}/{name} is not in the inputs")
        for where, text in metric_reads(doc):
            exported = _exported() if exported is None else exported
            for metric in _PICKER_METRIC.findall(text):
                if metric not in exported:
                    report.add("AUTOSCALE-003", doc, where, f"{metric}: no such metric on the picker's page")
