"""EndpointSlice JSON -> desired endpoint states: conditions, ports, address types, merging, garbage."""

from __future__ import annotations

from typing import Any

import pytest

from picker.pool import EndpointState
from picker.pool.slices import SliceStore, TargetPort, merge, read_slice, state_of

READY, DRAINING, NOT_READY = EndpointState.READY, EndpointState.DRAINING, EndpointState.NOT_READY


def endpoint(ip: str, **conditions: bool | None) -> dict[str, Any]:
    entry: dict[str, Any] = {"addresses": [ip]}
    if conditions:
        entry["conditions"] = {k: v for k, v in conditions.items() if v is not None}
    return entry


def a_slice(
    name: str,
    endpoints: list[dict[str, Any]],
    ports: list[dict[str, Any]] | None = None,
    address_type: str = "IPv4",
) -> dict[str, Any]:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {"name": name, "namespace": "ns", "resourceVersion": "1"},
        "addressType": address_type,
        "endpoints": endpoints,
        "ports": [{"name": "http", "port": 8000, "protocol": "TCP"}] if ports is None else ports,
    }


# (ready, serving, terminating) -> state; None = condition missing (ready/serving nil = true,
# terminating nil = false, as the v1 API documents).
CONDITIONS = [
    ((None, None, None), READY),
    ((True, True, False), READY),
    ((False, True, True), DRAINING),  # the pod is terminating, still finishing work
    ((False, False, True), DRAINING),  # terminating and no longer serving: still no new work
    ((True, True, True), DRAINING),  # publishNotReadyAddresses keeps ready=true while terminating
    ((False, True, False), DRAINING),  # the documented rule: not ready but serving
    ((False, None, None), DRAINING),  # serving nil means true
    ((False, False, False), NOT_READY),  # starting up / failing readiness probes
    ((False, False, None), NOT_READY),
    ((None, None, True), DRAINING),
]


@pytest.mark.parametrize(("flags", "expected"), CONDITIONS, ids=[str(c[0]) for c in CONDITIONS])
def test_conditions_to_state(flags: tuple[bool | None, ...], expected: EndpointState) -> None:
    ready, serving, terminating = flags
    conditions = {
        k: v
        for k, v in {"ready": ready, "serving": serving, "terminating": terminating}.items()
        if v is not None
    }
    assert state_of(conditions) is expected


def test_conditions_that_are_not_booleans_count_as_false_and_garbage_as_missing() -> None:
    assert state_of({"ready": "yes"}) is DRAINING  # not True -> not ready; serving nil -> true
    assert state_of("garbage") is READY
    assert state_of(None) is READY


def test_ipv4_and_ipv6_slices_give_canonical_addresses() -> None:
    v4 = read_slice(a_slice("a", [endpoint("10.0.0.1")]), TargetPort())
    v6 = read_slice(a_slice("b", [endpoint("fd00:0:0::1")], address_type="IPv6"), TargetPort())
    assert v4 is not None and v4.endpoints == {"10.0.0.1:8000": READY}
    assert v6 is not None and v6.endpoints == {"[fd00::1]:8000": READY}


def test_address_that_does_not_match_the_address_type_is_a_problem() -> None:
    view = read_slice(a_slice("a", [endpoint("fd00::1"), endpoint("10.0.0.2")]), TargetPort())
    assert view is not None and view.endpoints == {"10.0.0.2:8000": READY}
    assert "is not IPv4" in view.problems[0]


def test_fqdn_slices_are_ignored_with_a_problem() -> None:
    view = read_slice(a_slice("a", [endpoint("10.0.0.1")], address_type="FQDN"), TargetPort())
    assert view is not None and view.endpoints == {} and "FQDN" in view.problems[0]


PORTS = [
    {"name": "metrics", "port": 9100},
    {"name": "http", "port": 8000},
    {"name": "dns", "port": 53, "protocol": "UDP"},
]


@pytest.mark.parametrize(
    ("target", "ports", "expected", "problem"),
    [
        ("http", PORTS, 8000, None),
        ("8000", PORTS, 8000, None),
        (9100, PORTS, 9100, None),
        ("grpc", PORTS, None, "no TCP port named 'grpc'"),
        ("dns", PORTS, None, "no TCP port named 'dns'"),  # UDP
        ("53", PORTS, None, "no TCP port 53"),
        ("7000", PORTS, None, "no TCP port 7000"),
        (None, PORTS, None, "several ports"),
        (None, [{"port": 8000}], 8000, None),
        (None, [], None, "no port listed"),
        ("8000", [], 8000, None),  # a slice without ports: the number is the port
        ("http", [{"name": "http"}], None, "no valid number"),
        ("http", [{"name": "http", "port": "8000"}], None, "no valid number"),
    ],
)
def test_target_port_by_name_or_number(
    target: str | int | None, ports: list[dict[str, Any]], expected: int | None, problem: str | None
) -> None:
    view = read_slice(a_slice("a", [endpoint("10.0.0.1")], ports=ports), TargetPort.parse(target))
    assert view is not None
    if expected is None:
        assert view.endpoints == {} and problem is not None and problem in view.problems[0]
    else:
        assert view.endpoints == {f"10.0.0.1:{expected}": READY} and view.problems == ()


@pytest.mark.parametrize("bad", ["0", "70000", "HTTP", "-x", "a" * 64])
def test_target_port_rejects_bad_values(bad: str) -> None:
    with pytest.raises(ValueError):
        TargetPort.parse(bad)


def test_only_the_first_address_of_an_endpoint_counts() -> None:
    view = read_slice(a_slice("a", [{"addresses": ["10.0.0.1", "10.0.0.9"]}]), TargetPort())
    assert view is not None and list(view.endpoints) == ["10.0.0.1:8000"]


def test_merge_takes_the_most_cautious_state_for_an_address_in_several_slices() -> None:
    target = TargetPort()
    one = read_slice(
        a_slice("a", [endpoint("10.0.0.1"), endpoint("10.0.0.2", ready=False, serving=False)]), target
    )
    two = read_slice(
        a_slice("b", [endpoint("10.0.0.1", ready=False, terminating=True), endpoint("10.0.0.2")]), target
    )
    three = read_slice(a_slice("c", [endpoint("10.0.0.3")]), target)
    assert one and two and three
    assert merge([one, two, three]) == {
        "10.0.0.1:8000": DRAINING,
        "10.0.0.2:8000": NOT_READY,
        "10.0.0.3:8000": READY,
    }
    assert merge([two, one, three]) == merge([one, two, three])


GARBAGE: list[Any] = [
    {},
    {"metadata": {"name": "x"}},
    {"metadata": {"name": "x"}, "addressType": "IPv4", "ports": "http"},
    {"metadata": {"name": "x"}, "addressType": "IPv4", "ports": [{"port": 8000}], "endpoints": "nope"},
    {"metadata": {"name": "x"}, "addressType": "IPv4", "ports": [{"port": 8000}], "endpoints": [None, 1, {}]},
    {
        "metadata": {"name": "x"},
        "addressType": "IPv4",
        "ports": [{"port": 8000}],
        "endpoints": [{"addresses": [7]}],
    },
    {
        "metadata": {"name": "x"},
        "addressType": "IPv4",
        "ports": [7],
        "endpoints": [{"addresses": ["10.0.0.1"]}],
    },
    {"metadata": {"name": "x"}, "addressType": 4, "endpoints": [{"addresses": ["999.0.0.1"]}]},
    {"metadata": "x"},
]


@pytest.mark.parametrize("obj", GARBAGE)
def test_garbage_never_raises_and_contributes_nothing(obj: Any) -> None:
    store = SliceStore(TargetPort())
    store.replace([obj])
    store.apply("MODIFIED", obj)
    assert store.desired() == {}


def test_store_follows_events_and_a_relist_drops_slices_not_listed() -> None:
    store = SliceStore(TargetPort("http"))
    assert store.replace([a_slice("a", [endpoint("10.0.0.1")]), a_slice("b", [endpoint("10.0.0.2")])]) == []
    assert store.desired() == {"10.0.0.1:8000": READY, "10.0.0.2:8000": READY}
    store.apply("MODIFIED", a_slice("a", [endpoint("10.0.0.1", ready=False, serving=True, terminating=True)]))
    assert store.desired()["10.0.0.1:8000"] is DRAINING
    store.apply("ADDED", a_slice("c", [endpoint("10.0.0.3", ready=False, serving=False)]))
    assert store.desired()["10.0.0.3:8000"] is NOT_READY
    store.apply("DELETED", a_slice("b", []))
    assert set(store.desired()) == {"10.0.0.1:8000", "10.0.0.3:8000"}
    # A relist is the whole truth: the DELETED event for "a" that was missed does not matter.
    store.replace([a_slice("c", [endpoint("10.0.0.3")])])
    assert store.desired() == {"10.0.0.3:8000": READY}
    assert store.keys() == ["ns/c"]


def test_store_reports_unexpected_events_and_nameless_objects() -> None:
    store = SliceStore(TargetPort())
    assert "unexpected event type" in store.apply("BOOKMARK", a_slice("a", []))[0]
    assert "without metadata.name" in store.apply("ADDED", {"metadata": {}})[0]
    assert "no metadata.name" in store.replace([{"kind": "EndpointSlice"}])[0]
