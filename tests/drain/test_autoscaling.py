"""config/k8s/autoscaling (issue 55, item 2): the KEDA ScaledObject, the HPA and prometheus-adapter's
rule are sound, aim at the model-server Deployment, and read a metric the picker exports with the
query the metrics reference documents; the overlay's slot counts agree, and `picker check` passes it
and reports what breaks it (AUTOSCALE-001..003, tests/drain/autoscale_variants.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate.utils as kubernetes_validate
import pytest
import yaml

from picker.drain.crds import structural_problems
from picker.drain.manifests import format_path
from picker.observability.families import exported_names
from picker.observability.metrics import AUTOSCALING_QUERIES
from tests.drain.autoscale_variants import OVERLAY, overlay_doc, with_hpa, with_scaled_object
from tests.drain.overlays import apply_json6902, serve_config
from tests.drain.test_check import Manifests, check, ids
from tests.drain.test_manifests import KUBERNETES_VERSION

POOL = "vllm-llama"


def test_the_overlay_is_the_base_plus_keda_with_matching_slot_counts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    kustomization = yaml.safe_load((OVERLAY / "kustomization.yaml").read_text())
    assert kustomization["resources"] == ["..", "scaledobject.yaml"]  # never the HPA beside it
    m = Manifests()
    assert m.model_server["spec"]["replicas"] == 4  # the base's count
    for patch in kustomization["patches"]:
        target = m.obj(patch["target"]["kind"], patch["target"]["name"])
        apply_json6902(target, yaml.safe_load(patch["patch"]))
    # the autoscaler owns the count: an `apply -k` that set it would undo every scaling
    assert "replicas" not in m.model_server["spec"]
    with_scaled_object(m)
    assert ids(check(m.write(tmp_path))) == set()
    max_num_seqs = next(a for a in m.vllm["args"] if a.startswith("--max-num-seqs="))
    assert serve_config(m, monkeypatch).load.engine_slots == int(max_num_seqs.split("=")[1])
    assert serve_config(m, monkeypatch).pool_label() == POOL  # the label the queries select


def test_the_hpa_matches_the_kubernetes_schema() -> None:
    kubernetes_validate.validate(overlay_doc("hpa.yaml"), KUBERNETES_VERSION, strict=True)


def test_the_adapter_rule_is_a_values_fragment_not_a_configmap_that_would_replace_the_adapters() -> None:
    """Applied, a ConfigMap named as the adapter's would replace every rule it has: the rule ships
    as a Helm values fragment (prometheus-community/prometheus-adapter: rules.external), to merge."""
    assert not (OVERLAY / "prometheus-adapter.yaml").exists()
    values = overlay_doc("prometheus-adapter-values.yaml")
    assert "kind" not in values and "apiVersion" not in values
    assert set(values) == {"rules"} and set(values["rules"]) == {"external"}
    kustomization = yaml.safe_load((OVERLAY / "kustomization.yaml").read_text())
    assert "prometheus-adapter-values.yaml" not in kustomization["resources"]


def test_the_hpa_schema_check_can_fail() -> None:
    hpa = overlay_doc("hpa.yaml")
    hpa["spec"]["metrics"][0]["external"]["target"]["averageValu"] = "1"  # typo: unknown field
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(hpa, KUBERNETES_VERSION, strict=True)


def test_the_scaled_object_is_structurally_sound_and_the_check_can_fail() -> None:
    scaled = overlay_doc("scaledobject.yaml")
    assert structural_problems(scaled) == []
    trigger = scaled["spec"]["triggers"][0]
    trigger["metadata"].pop("query")
    trigger["metadata"]["threshold"] = 0.8
    scaled["spec"].pop("scaleTargetRef")
    problems = {format_path(p): message for p, message in structural_problems(scaled)}
    assert set(problems) == {
        "spec.scaleTargetRef",
        "spec.triggers[0].metadata.query",
        "spec.triggers[0].metadata.threshold",
    }
    assert "must be a string" in problems["spec.triggers[0].metadata.threshold"]


def test_every_autoscaler_aims_at_the_model_servers_and_keeps_scale_downs_gradual() -> None:
    m = Manifests()
    for doc in (with_scaled_object(m), with_hpa(m)):
        target = doc["spec"]["scaleTargetRef"]
        assert (target["kind"], target["name"]) == ("Deployment", m.model_server["metadata"]["name"])
        behavior = (
            doc["spec"].get("behavior")
            or doc["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
        )
        assert behavior["scaleDown"]["policies"] == [{"type": "Pods", "value": 1, "periodSeconds": 120}]


def test_the_queries_are_the_documented_ones_and_name_exported_metrics() -> None:
    """Renaming picker_pool_saturation (or its pool label) fails here before it fails a cluster."""
    query = overlay_doc("scaledobject.yaml")["spec"]["triggers"][0]["metadata"]["query"]
    assert query == AUTOSCALING_QUERIES["picker_pool_saturation"][1].replace("$POOL", POOL)
    external = overlay_doc("hpa.yaml")["spec"]["metrics"][0]["external"]["metric"]
    assert external == {"name": "picker_pool_saturation", "selector": {"matchLabels": {"pool": POOL}}}
    adapter: dict[str, Any] = overlay_doc("prometheus-adapter-values.yaml")
    (rule,) = adapter["rules"]["external"]
    assert rule["name"]["as"] == external["name"]
    assert rule["seriesQuery"].startswith(external["name"] + "{")
    assert "by (pool)" in rule["metricsQuery"] and "<<.LabelMatchers>>" in rule["metricsQuery"]
    assert external["name"] in exported_names()


def test_a_renamed_metric_is_reported_where_the_query_is(tmp_path: Path) -> None:
    m = Manifests()
    with_hpa(m)["spec"]["metrics"][0]["external"]["metric"]["name"] = "picker_saturation"
    (finding,) = [f for f in check(m.write(tmp_path)).findings if f.rule.id == "AUTOSCALE-003"]
    assert finding.field == "spec.metrics[0].external.metric.name"
    assert "picker_saturation: no such metric" in finding.message


def test_an_autoscaler_whose_target_is_elsewhere_is_skipped_not_failed(tmp_path: Path) -> None:
    m = Manifests()
    with_scaled_object(m)["spec"]["scaleTargetRef"]["name"] = "another-team"
    report = check(m.write(tmp_path))
    assert ids(report) == set()
    assert any(s.rule_id == "AUTOSCALE-002" and "not in the inputs" in s.reason for s in report.skipped)
