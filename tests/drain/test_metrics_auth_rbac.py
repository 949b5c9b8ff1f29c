"""config/k8s/metrics-auth (issue 53, item 6): the overlay turns on --metrics-endpoint-auth and ships
the RBAC it needs, and `picker check` reports a picker with the flag whose service account cannot
create TokenReviews and SubjectAccessReviews cluster-wide (ADMIN-002)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.drain.overlays import serve_config, with_overlay
from tests.drain.test_check import check, ids

OVERLAY = "metrics-auth"


def test_the_overlay_passes_and_the_picker_reads_the_flag(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    m = with_overlay(OVERLAY)
    assert ids(check(m.write(tmp_path))) == set()
    config = serve_config(m, monkeypatch)
    assert config.admin.metrics_auth and config.admin.read_auth == "metrics"


def test_the_reviews_need_a_cluster_role_bound_cluster_wide(tmp_path: Path) -> None:
    m = with_overlay(OVERLAY)
    m.remove("ClusterRoleBinding", "vllm-llama-picker-metrics-auth")
    findings = [f for f in check(m.write(tmp_path / "unbound")).findings if f.rule.id == "ADMIN-002"]
    assert [f.message.split(" may not ")[1].split(",")[0] for f in findings] == [
        "create tokenreviews (authentication.k8s.io)",
        "create subjectaccessreviews (authorization.k8s.io)",
    ]
    assert "ClusterRoleBinding" in findings[0].message
    # bound by a RoleBinding, the ClusterRole grants nothing cluster-scoped
    m.files["picker.yaml"].append(
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": {"name": "metrics-auth-in-one-namespace"},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": "vllm-llama-picker-metrics-auth",
            },
            "subjects": [{"kind": "ServiceAccount", "name": "vllm-llama-picker"}],
        }
    )
    assert "ADMIN-002" in ids(check(m.write(tmp_path / "namespaced")))
    m.set_arg(m.picker, "--metrics-endpoint-auth", "false")
    assert ids(check(m.write(tmp_path / "off"))) == set()  # no reviews, no grants needed
    m.set_arg(m.picker, "--metrics-endpoint-auth", None)
    m.picker["env"].append({"name": "PICKER_ADMIN__METRICS_AUTH", "value": "true"})
    assert "ADMIN-002" in ids(check(m.write(tmp_path / "env")))
