"""Broken variants of the shipped pool wiring (the picker's source vs its InferencePool), for
tests/drain/test_check.py's catalogue and tests/drain/test_pool_wiring.py. Each takes its Manifests."""

from __future__ import annotations

import copy
from typing import Any


def second_pool_through_the_picker(m: Any) -> None:
    """Another InferencePool names the same picker Service, but the picker serves --pool-name vllm-llama."""
    pool = copy.deepcopy(m.obj("InferencePool"))
    pool["metadata"]["name"] = "vllm-llama-canary"
    m.files["inferencepool.yaml"].append(pool)


def kube_service_with_another_selector(m: Any) -> None:
    """The picker reads the Service's slices (--kube-service), whose selector differs from the pool's."""
    m.set_arg(m.picker, "--pool-name", None)
    m.set_arg(m.picker, "--pool-namespace", None)
    m.set_arg(m.picker, "--kube-service", "vllm-llama")
    m.set_arg(m.picker, "--kube-namespace", "$(POD_NAMESPACE)")
    m.obj("Service", "vllm-llama")["spec"]["selector"] = {"app": "vllm-llama", "tier": "canary"}
    m.obj("Role", "vllm-llama-picker")["rules"] = [  # what the slice source reads
        {
            "apiGroups": ["discovery.k8s.io"],
            "resources": ["endpointslices"],
            "verbs": ["get", "list", "watch"],
        },
        *drain_record_rules(m),
    ]


def drain_record_rules(m: Any) -> list[dict[str, Any]]:
    """The shipped Role's rules for the --drains-configmap ConfigMap (kept when a test swaps the rest)."""
    return [r for r in m.obj("Role", "vllm-llama-picker")["rules"] if "configmaps" in r["resources"]]


def undeclared_target_port(m: Any) -> None:
    """A second data-parallel port the pods do not declare."""
    m.obj("InferencePool")["spec"]["targetPorts"].append({"number": 8001})


def role_without_inferencepools(m: Any) -> None:
    """The picker's Role still grants only what the EndpointSlice source read."""
    role = m.obj("Role", "vllm-llama-picker")
    role["rules"] = [r for r in role["rules"] if "inferencepools" not in r["resources"]]


def role_that_cannot_update_the_drain_record(m: Any) -> None:
    """--drains-configmap, but the Role lets the picker only read ConfigMaps (drains are not shared)."""
    for rule in drain_record_rules(m):
        rule["verbs"] = [v for v in rule["verbs"] if v != "update"]


def pickers_with_separate_books(m: Any) -> None:
    """Two picker replicas, neither peers nor leader election: each sees some of its requests end."""
    m.set_arg(m.picker, "--peers-service", None)


def ranks_pods_without_patch(m: Any) -> None:
    """--pod-deletion-cost on the base, whose Role reads pods but may not patch them."""
    m.picker["args"].append("--pod-deletion-cost")


POOL_VARIANTS = [
    ("POOL-005", "picker serves another pool", second_pool_through_the_picker),
    ("POOL-006", "picker's Service selects other pods", kube_service_with_another_selector),
    ("POOL-007", "pool targets an undeclared port", undeclared_target_port),
    ("POOL-008", "picker RBAC without inferencepools", role_without_inferencepools),
    ("POOL-008", "picker RBAC cannot update the drains ConfigMap", role_that_cannot_update_the_drain_record),
    ("POOL-009", "two pickers with separate books", pickers_with_separate_books),
    ("POOL-010", "pod deletion cost without patch on pods", ranks_pods_without_patch),
]
