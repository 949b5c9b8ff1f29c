"""Broken variants of the autoscaling overlay (config/k8s/autoscaling), for tests/drain/test_check.py's
catalogue: each adds the overlay's ScaledObject or HPA to the Manifests it takes, then breaks it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

OVERLAY = Path(__file__).resolve().parents[2] / "config" / "k8s" / "autoscaling"


def overlay_doc(name: str) -> dict[str, Any]:
    (doc,) = [d for d in yaml.safe_load_all((OVERLAY / name).read_text()) if d]
    return doc  # type: ignore[no-any-return]


def with_scaled_object(m: Any) -> dict[str, Any]:
    doc = overlay_doc("scaledobject.yaml")
    m.files["autoscaling-scaledobject.yaml"] = [doc]
    return doc


def with_hpa(m: Any) -> dict[str, Any]:
    doc = overlay_doc("hpa.yaml")
    m.files["autoscaling-hpa.yaml"] = [doc]
    return doc


def unquoted_threshold(m: Any) -> None:
    """KEDA reads trigger metadata as strings: `threshold: 0.8` is refused."""
    with_scaled_object(m)["spec"]["triggers"][0]["metadata"]["threshold"] = 0.8


def scales_the_pickers(m: Any) -> None:
    with_hpa(m)["spec"]["scaleTargetRef"]["name"] = "vllm-llama-picker"


def reads_a_renamed_metric(m: Any) -> None:
    """The metric as it was called before it had its pool label."""
    trigger = with_scaled_object(m)["spec"]["triggers"][0]
    trigger["metadata"]["query"] = "max(picker_ready_capacity)"


AUTOSCALE_VARIANTS = [
    ("AUTOSCALE-001", "ScaledObject threshold not a string", unquoted_threshold),
    ("AUTOSCALE-002", "HPA scales the pickers", scales_the_pickers),
    ("AUTOSCALE-003", "KEDA query names a metric the picker does not export", reads_a_renamed_metric),
]
