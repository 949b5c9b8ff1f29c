"""`picker check` on the picker's own endpoint source: --pool-name / --pool-namespace vs the
InferencePool they name, targetPorts vs the pods' ports, and the --kube-service Service's selector vs
the pool's. Variants of the shipped config/k8s, as in test_check.py."""

from __future__ import annotations

from pathlib import Path

from tests.drain.pool_variants import (
    drain_record_rules,
    kube_service_with_another_selector,
    role_without_inferencepools,
    second_pool_through_the_picker,
    undeclared_target_port,
)
from tests.drain.test_check import Manifests, check, ids


def messages(tmp_path: Path, manifests: Manifests, rule_id: str) -> list[str]:
    report = check(manifests.write(tmp_path))
    return [f.message for f in report.findings if f.rule.id == rule_id]


def test_the_shipped_picker_reads_the_pool_it_serves(tmp_path: Path) -> None:
    m = Manifests()
    assert any(a == "--pool-name=vllm-llama" for a in m.picker["args"])
    assert ids(check(m.write(tmp_path))) == set()


def test_a_pool_name_naming_no_pool(tmp_path: Path) -> None:
    m = Manifests()
    m.set_arg(m.picker, "--pool-name", "vllm-lama")
    (message,) = messages(tmp_path, m, "POOL-003")
    assert message == "--pool-name vllm-lama: no InferencePool 'vllm-lama' in namespace default"


def test_a_pool_namespace_naming_another_namespace(tmp_path: Path) -> None:
    m = Manifests()
    m.set_arg(m.picker, "--pool-namespace", "models")
    (message,) = messages(tmp_path, m, "POOL-003")
    assert "no InferencePool 'vllm-llama' in namespace models" in message


def test_a_second_pool_routing_through_the_picker(tmp_path: Path) -> None:
    m = Manifests()
    second_pool_through_the_picker(m)
    (message,) = messages(tmp_path, m, "POOL-005")
    assert message == (
        "InferencePool/vllm-llama-canary routes through the picker Deployment/vllm-llama-picker, "
        "which serves --pool-name vllm-llama (namespace default)"
    )


def test_kube_service_with_the_pools_selector_passes_and_with_another_does_not(tmp_path: Path) -> None:
    m = Manifests()
    kube_service_with_another_selector(m)
    m.obj("Service", "vllm-llama")["spec"]["selector"] = {"app": "vllm-llama"}  # the pool's: fine
    assert ids(check(m.write(tmp_path / "same"))) == set()
    m.obj("Service", "vllm-llama")["spec"]["selector"] = {"app": "vllm-llama", "tier": "canary"}
    (message,) = messages(tmp_path / "other", m, "POOL-006")
    assert (
        "reads Service vllm-llama" in message
        and "InferencePool/vllm-llama selects {'app': 'vllm-llama'}" in message
    )


def test_kube_service_naming_no_service(tmp_path: Path) -> None:
    m = Manifests()
    kube_service_with_another_selector(m)
    m.set_arg(m.picker, "--kube-service", "vllm")
    (message,) = messages(tmp_path, m, "POOL-003")
    assert message == "--kube-service vllm: no Service 'vllm' in namespace default"


def test_target_ports_against_the_declared_container_ports(tmp_path: Path) -> None:
    m = Manifests()
    undeclared_target_port(m)
    (message,) = messages(tmp_path / "undeclared", m, "POOL-007")
    assert message == "targetPorts 8001, but Deployment/vllm-llama declares only 5557, 8000"
    m.vllm["ports"].append({"name": "rank1", "containerPort": 8001})  # a second rank's port: fine
    assert ids(check(m.write(tmp_path / "declared"))) == set()
    for container in m.model_server["spec"]["template"]["spec"]["containers"]:
        container.pop("ports", None)  # nothing declared: nothing to compare
    assert "POOL-007" not in ids(check(m.write(tmp_path / "none")))


def test_rbac_follows_the_source(tmp_path: Path) -> None:
    m = Manifests()
    role_without_inferencepools(m)
    (message,) = messages(tmp_path / "pool", m, "POOL-008")
    assert message == (
        "service account vllm-llama-picker (Role/vllm-llama-picker) may not list/watch inferencepools "
        "(inference.networking.k8s.io), which picker reads"
    )
    role = m.obj("Role", "vllm-llama-picker")
    drains = drain_record_rules(m)
    role["rules"] = [
        {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["*"]},
        *drains,
    ]
    kube_service_with_another_selector(m)
    m.obj("Service", "vllm-llama")["spec"]["selector"] = {"app": "vllm-llama"}
    assert ids(check(m.write(tmp_path / "slices"))) == set()  # --kube-service needs only endpointslices
    m.set_arg(m.picker, "--kube-service", None)
    m.set_arg(m.picker, "--pool-name", "vllm-llama")
    m.set_arg(m.picker, "--no-objectives", None)
    m.picker["args"].append("--no-objectives")
    role["rules"] = [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
        {"apiGroups": ["inference.networking.k8s.io"], "resources": ["*"], "verbs": ["list", "watch"]},
        *drains,
    ]
    assert ids(check(m.write(tmp_path / "no-objectives"))) == set()  # no inferenceobjectives needed
    m.remove("RoleBinding", "vllm-llama-picker")
    role["rules"] = []
    assert "POOL-008" not in ids(check(m.write(tmp_path / "unbound")))  # RBAC kept elsewhere: not judged


def test_the_drains_configmap_needs_its_verbs_on_that_name(tmp_path: Path) -> None:
    m = Manifests()
    assert any(a == "--drains-configmap=vllm-llama-picker-drains" for a in m.picker["args"])
    role = m.obj("Role", "vllm-llama-picker")
    named, create = drain_record_rules(m)
    named["resourceNames"] = ["some-other-configmap"]  # get/list/watch/update grant another object
    (message,) = messages(tmp_path / "other-name", m, "POOL-008")
    assert message == (
        "service account vllm-llama-picker (Role/vllm-llama-picker) may not get/list/watch/update "
        "configmaps vllm-llama-picker-drains (core), which picker shares admin drains through"
    )
    named["resourceNames"] = ["vllm-llama-picker-drains"]
    create["resourceNames"] = ["vllm-llama-picker-drains"]  # a create is never authorized by name
    (message,) = messages(tmp_path / "create-by-name", m, "POOL-008")
    assert "may not create configmaps vllm-llama-picker-drains" in message
    create.pop("resourceNames")
    assert ids(check(m.write(tmp_path / "shipped"))) == set()
    role["rules"] = [r for r in role["rules"] if r not in (named, create)]
    role["rules"].append({"apiGroups": [""], "resources": ["configmaps"], "verbs": ["*"]})
    assert ids(check(m.write(tmp_path / "any-configmap"))) == set()  # unrestricted grants do
    m.set_arg(m.picker, "--drains-configmap", None)
    role["rules"] = [r for r in role["rules"] if "configmaps" not in r["resources"]]
    assert ids(check(m.write(tmp_path / "no-shared-drains"))) == set()  # no flag: no ConfigMap needed
