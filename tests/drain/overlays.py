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


def apply_json6902(obj: dict[str, Any], ops: list[dict[str, Any]]) -> None:
    """The JSON6902 operations the overlays use, as kustomize makes them: `add` (a value, or `-` to
    append to a list) and `remove` (the path must exist: kustomize fails otherwise)."""
    for op in ops:
        *parents, last = op["path"].lstrip("/").split("/")
        target: Any = obj
        for key in parents:
            target = target[int(key)] if isinstance(target, list) else target[key]
        if op["op"] == "add":
            if isinstance(target, list):
                target.append(op["value"]) if last == "-" else target.insert(int(last), op["value"])
            else:
                target[last] = op["value"]
        elif op["op"] == "remove":
            assert last in target, f"remove {op['path']}: no such path (kustomize fails)"
            del target[int(last) if isinstance(target, list) else last]
        else:
            raise AssertionError(f"an operation the overlays do not use: {op['op']}")


def serve_config(m: Manifests, monkeypatch: pytest.MonkeyPatch) -> PickerConfig:
    """What `picker serve` reads from the picker container's args and environment."""
    args = [a.replace("$(POD_NAMESPACE)", "default") for a in m.picker["args"]]
    for env in m.picker["env"]:  # what the kubelet sets from the Secrets it names
        if "secretKeyRef" in env.get("valueFrom", {}):
            monkeypatch.setenv(env["name"], "a-secret-value-the-kubelet-sets-0123")
    return _load(build_parser().parse_args(["serve", *args]))
