"""Kubernetes objects parsed whole or refused with a named problem (issue 40, item 3 of what to build):
pods, EndpointSlices, InferencePools, InferenceObjectives, the leader Lease and the drains ConfigMap.
Arbitrary JSON and valid objects with parts replaced by arbitrary JSON never raise out of the stores
the list/watch loop feeds, and what they publish is well formed. Hypothesis, bounded in examples."""

from __future__ import annotations

import copy
import ipaddress
import json
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lightkube.resources.coordination_v1 import Lease

from picker.config.model import canonical_address
from picker.pool import EndpointState
from picker.pool.pods import PodStore, PoolSpec, read_pool
from picker.pool.slices import SliceStore, TargetPort
from picker.request.objectives import Objectives
from picker.sources.kube_drains import DATA_KEY, DrainRecord, Record, parse_record, render_record
from picker.sources.lease import Elector, LeaseInvalid, LeaseRecord, lease_record
from picker.sources.lease_api import spec_fields
from tests.kube.kube_objects import endpoint, inference_objective, inference_pool, pod

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
    max_leaves=20,
)


def full_pod(ip: str = "10.0.0.1") -> dict[str, Any]:
    labels, metadata, body = pod(ip)
    return {
        "metadata": {"name": "vllm-0", "namespace": "default", "uid": "u-1", "labels": labels, **metadata},
        **body,
    }


def full_slice() -> dict[str, Any]:
    return {
        "metadata": {"name": "vllm-abc", "namespace": "default"},
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": 8000, "protocol": "TCP"}],
        "endpoints": [endpoint("10.0.0.1"), endpoint("10.0.0.2", ready=False, terminating=True)],
    }


def full_pool() -> dict[str, Any]:
    return {"metadata": {"name": "vllm", "namespace": "default"}, **inference_pool()}


def full_objective() -> dict[str, Any]:
    return {"metadata": {"name": "chat", "namespace": "default"}, **inference_objective(priority=2)}


def paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every path to a value inside `value` (dict keys and list indexes)."""
    found = [prefix]
    if isinstance(value, dict):
        for key, inner in value.items():
            found += paths(inner, (*prefix, key))
    elif isinstance(value, list):
        for index, inner in enumerate(value):
            found += paths(inner, (*prefix, index))
    return found


@st.composite
def mutated(draw: st.DrawFn, valid: dict[str, Any]) -> dict[str, Any]:
    """`valid` with one to three of its parts (any depth) replaced by arbitrary JSON."""
    obj = copy.deepcopy(valid)
    for _ in range(draw(st.integers(1, 3))):
        choices = [p for p in paths(obj) if p]
        if not choices:
            break
        path = draw(st.sampled_from(choices))
        parent = obj
        for step in path[:-1]:
            parent = parent[step]
        parent[path[-1]] = draw(JSON)
    return obj


def well_formed(desired: dict[str, EndpointState]) -> None:
    for address, state in desired.items():
        assert canonical_address(address) == address and isinstance(state, EndpointState)
        host = address.rsplit(":", 1)[0].strip("[]")
        ipaddress.ip_address(host)


def feed(store: Any, objects: list[Any]) -> None:
    """What the list/watch loop does with a list and events: problems are strings, nothing raises."""
    problems = store.replace([o for o in objects if isinstance(o, dict)])
    for obj in objects:
        if isinstance(obj, dict):
            for event in ("ADDED", "MODIFIED", "DELETED"):
                problems += store.apply(event, obj)
    assert all(isinstance(p, str) for p in problems)


@SETTINGS
@given(st.lists(mutated(full_pod()) | st.dictionaries(st.text(max_size=8), JSON, max_size=4), max_size=4))
def test_any_pods_give_a_well_formed_view(objects: list[Any]) -> None:
    store = PodStore((8000, 8001))
    problems = store.replace(objects)
    for obj in objects:
        problems += store.apply("MODIFIED", obj)
    assert all(isinstance(p, str) for p in problems)
    well_formed(store.desired())
    assert all(isinstance(v, str) for labels in store.labels().values() for v in labels.values())
    assert all(isinstance(uid, str) and uid for uid in store.instances().values())


@SETTINGS
@given(st.lists(mutated(full_slice()) | st.dictionaries(st.text(max_size=8), JSON, max_size=4), max_size=4))
def test_any_slices_give_a_well_formed_view(objects: list[Any]) -> None:
    for target in (TargetPort.parse(8000), TargetPort.parse("http"), TargetPort.parse(None)):
        store = SliceStore(target)
        feed(store, objects)
        well_formed(store.desired())


@SETTINGS
@given(mutated(full_pool()) | JSON)
def test_any_inference_pool_is_a_spec_or_a_named_problem(obj: Any) -> None:
    spec = read_pool(obj) if isinstance(obj, dict) else read_pool({"spec": obj})
    assert isinstance(spec, PoolSpec | str)
    if isinstance(spec, PoolSpec):
        assert spec.selector and all(0 < port < 65536 for port in spec.ports)


@SETTINGS
@given(st.lists(mutated(full_objective()), max_size=4))
def test_any_objectives_give_integer_priorities(objects: list[Any]) -> None:
    objectives = Objectives("vllm")
    feed(objectives, objects)
    assert all(isinstance(p, int) and not isinstance(p, bool) for p in objectives.known().values())


VALID_LEASE = {
    "metadata": {"name": "vllm-picker-leader", "namespace": "default", "resourceVersion": "7"},
    "spec": {
        "holderIdentity": "picker-a",
        "leaseDurationSeconds": 15,
        "leaseTransitions": 2,
        "acquireTime": "2026-12-04T10:00:00.000000Z",
        "renewTime": "2026-12-04T10:00:10.000000Z",
    },
}


@SETTINGS
@given(mutated(VALID_LEASE))
def test_any_lease_is_a_record_or_refused_and_the_elector_takes_any_record(obj: dict[str, Any]) -> None:
    try:
        decoded = Lease.from_dict(obj)  # what the client library does first (its ValueError: refused)
        record = lease_record(spec_fields(decoded.spec))
    except (ValueError, LeaseInvalid):
        return
    assert isinstance(record, LeaseRecord) and 0 <= record.duration_s < 2**31
    elector = Elector("picker-b", 15.0, 10.0)
    elector.observe(record)
    proposal = elector.proposal()
    assert proposal is None or proposal.holder == "picker-b"
    elector.failed()


@SETTINGS
@given(
    st.dictionaries(st.text(max_size=8), JSON, max_size=5).map(lambda spec: {"spec": spec})
    | st.builds(lambda v: {"spec": {"leaseDurationSeconds": v}}, st.integers() | st.floats())
)
def test_lease_fields_of_any_type_are_refused_by_name(obj: dict[str, Any]) -> None:
    try:
        lease_record(obj["spec"])
    except LeaseInvalid as exc:
        assert exc.reason in ("malformed", "out-of-range")


VALID_RECORD = [
    "10.0.0.1:8000",
    {"address": "10.0.0.2:8000", "pod": "uid-2"},
    {"address": "10.0.0.3:8000", "cause": "prestop"},
    {"address": "10.0.0.3:8000", "cause": "rollback", "rollout": "app.kubernetes.io/version=v2", "pod": "u"},
]


@SETTINGS
@given(st.lists(JSON, max_size=4) | st.builds(lambda v: [*VALID_RECORD, v], JSON) | JSON)
def test_any_drain_record_is_drains_and_problems_and_round_trips(listed: Any) -> None:
    obj = {"data": {DATA_KEY: json.dumps(listed)}}
    record, problems = parse_record(obj)
    assert isinstance(record, Record) and all(isinstance(p, str) for p in problems)
    for address in record.drained:
        assert canonical_address(address) == address
    again, same = parse_record({"data": {DATA_KEY: render_record(record)}})
    assert again == record and len(same) == len(record.unread)  # what it could not read, kept as it was
    store = DrainRecord()
    assert store.apply("MODIFIED", obj) == problems and store.current == record


@SETTINGS
@given(st.text(max_size=40))
def test_any_text_in_the_drain_record_is_refused_or_read(text: str) -> None:
    record, problems = parse_record({"data": {DATA_KEY: text}})
    assert isinstance(record, Record) and all(isinstance(p, str) for p in problems)


def test_a_pod_ip_that_is_not_a_string_is_a_problem_not_an_address() -> None:
    """`ipaddress.ip_address(5)` is 0.0.0.5: a number in status.podIP made an endpoint of it."""
    obj = full_pod()
    obj["status"]["podIP"] = 5
    store = PodStore((8000,))
    assert store.replace([obj]) and store.desired() == {}
