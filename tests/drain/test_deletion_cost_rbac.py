"""config/k8s/deletion-cost (issue 55, item 1): the overlay turns on --pod-deletion-cost and ships the
Role it needs, and `picker check` reports a picker with the flag whose service account cannot patch
pods (POOL-010)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.drain.overlays import overlay_rbac, serve_config, with_overlay
from tests.drain.test_check import check, ids

OVERLAY = "deletion-cost"


def rbac() -> list[dict[str, Any]]:
    return overlay_rbac(OVERLAY)


def test_the_overlay_grants_only_patch_on_pods() -> None:
    (role,) = [d for d in rbac() if d["kind"] == "Role"]
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["patch"]}]


def test_the_overlay_passes_and_the_picker_reads_the_flag(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    m = with_overlay(OVERLAY)
    assert ids(check(m.write(tmp_path))) == set()
    config = serve_config(m, monkeypatch)
    assert config.kube.deletion_cost and config.kube.pool_name == "vllm-llama"
    assert config.kube.deletion_cost_interval_s == 10.0


def test_the_flag_without_the_grant_is_reported(tmp_path: Path) -> None:
    m = with_overlay(OVERLAY)
    m.remove("RoleBinding", "vllm-llama-picker-deletion-cost")
    (finding,) = [f for f in check(m.write(tmp_path / "unbound")).findings if f.rule.id == "POOL-010"]
    assert "may not patch pods (core)" in finding.message and "--pod-deletion-cost" in finding.message
    m.picker["args"].remove("--pod-deletion-cost")
    assert ids(check(m.write(tmp_path / "off"))) == set()  # no annotation written, no grant needed
    m.picker["env"].append({"name": "PICKER_KUBE__DELETION_COST", "value": "true"})
    assert "POOL-010" in ids(check(m.write(tmp_path / "env")))
