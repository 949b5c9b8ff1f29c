"""picker/pool/pods.py on its own: an InferencePool's spec, a pod's state, the pod store's view."""

from __future__ import annotations

from typing import Any

import pytest

from picker.pool import EndpointState
from picker.pool.pods import PodStore, PoolSpec, PoolSpecStore, pod_state, read_pool
from tests.kube.kube_objects import inference_pool, pod

READY, DRAINING, NOT_READY = EndpointState.READY, EndpointState.DRAINING, EndpointState.NOT_READY


def pod_obj(name: str, ip: str | None, **fields: Any) -> dict[str, Any]:
    labels, metadata, body = pod(ip, **fields)
    return {"metadata": {"name": name, "namespace": "default", "labels": labels, **metadata}, **body}


def test_a_pool_spec() -> None:
    spec = read_pool(inference_pool(selector={"app": "vllm", "tier": "gpu"}, ports=(8000, 8001)))
    assert spec == PoolSpec((("app", "vllm"), ("tier", "gpu")), (8000, 8001), "inference-picker")
    assert isinstance(spec, PoolSpec) and spec.label_selector == "app=vllm,tier=gpu"


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        ({}, "spec.selector is missing"),
        ({"selector": {"matchLabels": {}}, "targetPorts": [{"number": 1}]}, "would select every pod"),
        ({"selector": {"matchLabels": {"a": "b,c=d"}}, "targetPorts": [{"number": 1}]}, "not a label value"),
        ({"selector": {"matchLabels": {"a": "b"}}, "targetPorts": []}, "1 to 8 ports"),
        ({"selector": {"matchLabels": {"a": "b"}}, "targetPorts": [{"number": 8000}] * 9}, "1 to 8 ports"),
        ({"selector": {"matchLabels": {"a": "b"}}, "targetPorts": [{"number": 0}]}, "not a port number"),
        ({"selector": {"matchLabels": {"a": "b"}}, "targetPorts": [{"number": 1}, {"number": 1}]}, "twice"),
        (
            {"selector": {"matchExpressions": [{"key": "a"}]}, "targetPorts": [{"number": 1}]},
            "matchExpressions is not supported",
        ),
    ],
)
def test_invalid_pool_specs_name_the_field(spec: dict[str, Any], words: str) -> None:
    problem = read_pool({"spec": spec})
    assert isinstance(problem, str) and words in problem


def test_the_spec_store_follows_only_its_pool() -> None:
    store = PoolSpecStore("models", "vllm")
    assert store.current() == "InferencePool models/vllm not found"
    obj = {"metadata": {"name": "vllm", "namespace": "models"}, **inference_pool()}
    store.replace([{"metadata": {"name": "other", "namespace": "models"}, **inference_pool()}, obj])
    assert isinstance(store.current(), PoolSpec)
    store.apply("MODIFIED", {"metadata": {"name": "other", "namespace": "models"}})
    assert isinstance(store.current(), PoolSpec)
    store.apply("DELETED", obj)
    assert store.current() == "InferencePool models/vllm not found"


@pytest.mark.parametrize(
    ("fields", "state"),
    [
        ({}, READY),
        ({"ready": False}, NOT_READY),
        ({"deleting": True}, DRAINING),
        ({"deleting": True, "ready": False}, DRAINING),
        ({"phase": "Pending"}, NOT_READY),
        ({"phase": "Failed"}, None),
        ({"phase": "Succeeded", "deleting": True}, None),
    ],
)
def test_pod_states(fields: dict[str, Any], state: EndpointState | None) -> None:
    assert pod_state(pod_obj("p", "10.0.0.1", **fields)) is state


def test_a_pod_without_a_ready_condition_is_not_ready() -> None:
    obj = pod_obj("p", "10.0.0.1")
    obj["status"]["conditions"] = [{"type": "PodScheduled", "status": "True"}]
    assert pod_state(obj) is NOT_READY


def test_the_pod_store_view_and_its_problems() -> None:
    store = PodStore((8000, 8001))
    problems = store.replace(
        [
            pod_obj("a", "10.0.0.1"),
            pod_obj("b", None, phase="Pending"),
            pod_obj("c", "fd00::3", ready=False),
            pod_obj("d", "not-an-ip"),
            {"metadata": {}},
        ]
    )
    assert problems == [
        "a listed pod has no metadata.name; ignored",
        "pod default/d: status.podIP 'not-an-ip' is not an IP",
    ]
    assert store.desired() == {
        "10.0.0.1:8000": READY,
        "10.0.0.1:8001": READY,
        "[fd00::3]:8000": NOT_READY,
        "[fd00::3]:8001": NOT_READY,
    }
    store.set_ports((9000,))
    store.apply("DELETED", pod_obj("c", "fd00::3"))
    store.apply("MODIFIED", pod_obj("a", "10.0.0.1", deleting=True))
    assert store.desired() == {"10.0.0.1:9000": DRAINING}


def test_each_endpoint_carries_its_pods_labels() -> None:
    store = PodStore((8000, 8001))
    store.replace([pod_obj("a", "10.0.0.1"), pod_obj("b", None)])
    labels = store.labels()
    assert set(labels) == {"10.0.0.1:8000", "10.0.0.1:8001"}  # a pod with no IP has no endpoint
    assert labels["10.0.0.1:8000"] == pod_obj("a", "10.0.0.1")["metadata"]["labels"]
