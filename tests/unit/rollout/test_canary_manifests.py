"""config/k8s/canary: the overlay's patches apply to the base, the two Deployments never select each
other's pods while the InferencePool selects both, and the pickers' arguments give the canary."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from picker.cli.main import _load, build_parser

K8S = Path(__file__).resolve().parents[3] / "config" / "k8s"


def documents() -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = []
    for path in [*sorted(K8S.glob("*.yaml")), K8S / "canary" / "model-server-canary.yaml"]:
        found.extend(
            d for d in yaml.safe_load_all(path.read_text()) if d and d.get("kind") != "Kustomization"
        )
    overlay = yaml.safe_load((K8S / "canary" / "kustomization.yaml").read_text())
    for patch in overlay["patches"]:
        target = next(
            d
            for d in found
            if d["kind"] == patch["target"]["kind"] and d["metadata"]["name"] == patch["target"]["name"]
        )
        for op in yaml.safe_load(patch["patch"]):
            assert op["op"] == "add"
            *parents, last = [p.replace("~1", "/") for p in op["path"].strip("/").split("/")]
            node: Any = target
            for key in parents:
                node = node[int(key)] if isinstance(node, list) else node[key]
            if last == "-":
                node.append(op["value"])
            else:
                assert last not in node, op
                node[last] = op["value"]
    return found


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def test_two_deployments_in_one_pool_never_claim_each_others_pods() -> None:
    docs = documents()
    stable, canary = (
        next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == name)
        for name in ("vllm-llama", "vllm-llama-canary")
    )
    pool = next(d for d in docs if d["kind"] == "InferencePool")["spec"]["selector"]["matchLabels"]
    for own, other in ((stable, canary), (canary, stable)):
        pods = own["spec"]["template"]["metadata"]["labels"]
        assert selects(own["spec"]["selector"]["matchLabels"], pods)
        assert not selects(other["spec"]["selector"]["matchLabels"], pods)
        assert selects(pool, pods)
    versions = {
        d["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/version"] for d in (stable, canary)
    }
    assert versions == {"v1", "v2"}


def test_the_pickers_run_the_canary_on_the_pod_label(monkeypatch: pytest.MonkeyPatch) -> None:
    docs = documents()
    picker = next(
        d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "vllm-llama-picker"
    )
    container = picker["spec"]["template"]["spec"]["containers"][0]
    args = [a.replace("$(POD_NAMESPACE)", "default") for a in container["args"]]
    for env in container["env"]:  # what the kubelet sets from the Secrets it names
        if "secretKeyRef" in env.get("valueFrom", {}):
            monkeypatch.setenv(env["name"], "a-secret-value-the-kubelet-sets-0123")
    config = _load(build_parser().parse_args(["serve", *args]))
    assert config.peers.secret is not None
    assert config.rollout.candidate == "v2" and config.rollout.stable == "v1"
    assert config.rollout.group_label == "app.kubernetes.io/version"
