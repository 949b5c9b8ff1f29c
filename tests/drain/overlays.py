"""The optional overlays in config/k8s (metrics-auth, deletion-cost), applied to the shipped
manifests as kustomize would, and the configuration `picker serve` reads from them."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from picker.cli.main import _load, build_parser
from picker.config.model import PickerConfig
from tests.drain.test_check import K8S, Manifests


def overlay_rbac(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((K8S / name / "rbac.yaml").read_text()) if d]


def with_overlay(name: str) -> Manifests:
    """The base with the overlay applied: its resources added, its patch (flags appended) made."""
    m = Manifests()
    m.files[f"{name}-rbac.yaml"] = overlay_rbac(name)
    kustomization = yaml.safe_load((K8S / name / "kustomization.yaml").read_text())
    assert kustomization["resources"] == ["..", "rbac.yaml"]
    (patch,) = kustomization["patches"]
    assert patch["target"] == {"kind": "Deployment", "name": "vllm-llama-picker"}
    for op in yaml.safe_load(patch["patch"]):
        assert op["op"] == "add" and op["path"] == "/spec/template/spec/containers/0/args/-"
        m.picker["args"].append(op["value"])
    return m


def serve_config(m: Manifests, monkeypatch: pytest.MonkeyPatch) -> PickerConfig:
    """What `picker serve` reads from the picker container's args and environment."""
    args = [a.replace("$(POD_NAMESPACE)", "default") for a in m.picker["args"]]
    for env in m.picker["env"]:  # what the kubelet sets from the Secrets it names
        if "secretKeyRef" in env.get("valueFrom", {}):
            monkeypatch.setenv(env["name"], "a-secret-value-the-kubelet-sets-0123")
    return _load(build_parser().parse_args(["serve", *args]))
