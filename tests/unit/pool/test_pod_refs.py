"""The pool's pods as kube.deletion_cost ranks them: from an InferencePool's pods (with their annotation
and deletion state) and from EndpointSlices' targetRefs; the live requests as streams."""

from __future__ import annotations

from typing import Any

from picker.pool import Lease, Pool
from picker.pool.deletion_cost import ANNOTATION, PodRef, Stream
from picker.pool.pods import PodStore
from picker.pool.slices import SliceStore, TargetPort
from picker.request.live_work import live_streams
from picker.streams import RequestRecord, ResponseTracker


def a_pod(name: str, ip: str | None, cost: str | None = None, deleting: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": "ns", "uid": f"uid-{name}"}
    if cost is not None:
        meta["annotations"] = {ANNOTATION: cost, "other": "x"}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    status: dict[str, Any] = {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}
    if ip:
        status["podIP"] = ip
    return {"metadata": meta, "status": status}


def test_pool_pods_carry_their_endpoints_annotation_and_deletion() -> None:
    store = PodStore((8000, 8001))
    store.replace(
        [
            a_pod("a", "10.0.0.1", cost="-7"),
            a_pod("b", "10.0.0.2", cost="not-a-number", deleting=True),
            a_pod("pending", None),  # no IP: no endpoint, nothing to rank
        ]
    )
    assert store.pod_refs() == [
        PodRef("ns", "a", ("10.0.0.1:8000", "10.0.0.1:8001"), "uid-a", -7),
        PodRef("ns", "b", ("10.0.0.2:8000", "10.0.0.2:8001"), "uid-b", None, deleting=True),
    ]


def test_slice_endpoints_name_their_pods_through_target_ref() -> None:
    def entry(ip: str, pod: str | None, terminating: bool = False, kind: str = "Pod") -> dict[str, Any]:
        found: dict[str, Any] = {
            "addresses": [ip],
            "conditions": {"ready": not terminating, "terminating": terminating},
        }
        if pod is not None:
            found["targetRef"] = {"kind": kind, "name": pod, "namespace": "ns"}
        return found

    store = SliceStore(TargetPort.parse(None))
    store.replace(
        [
            {
                "metadata": {"name": f"s-{port}", "namespace": "ns"},
                "addressType": "IPv4",
                "ports": [{"port": port}],
                "endpoints": endpoints,
            }
            for port, endpoints in (
                (8000, [entry("10.0.0.1", "a"), entry("10.0.0.2", "b", terminating=True)]),
                (
                    8001,
                    [entry("10.0.0.1", "a"), entry("10.0.0.3", None), entry("10.0.0.4", "x", kind="Node")],
                ),
            )
        ]
    )
    assert store.pod_refs() == [
        PodRef("ns", "a", ("10.0.0.1:8000", "10.0.0.1:8001")),
        PodRef("ns", "b", ("10.0.0.2:8000",), deleting=True),
    ]


def test_live_requests_are_streams_where_they_are_attributed() -> None:
    pool = Pool(lambda: 0.0, wall=lambda: 0.0)
    pool.apply(ready=["a:1"])
    sending = RequestRecord("r1", 0.0, max_tokens=300, lease=Lease(pool, "a:1", 0.0))
    sending.tracker = ResponseTracker(streaming=True, first_byte_at=5.0, token_chunks=40)
    waiting = RequestRecord("r2", 0.0, lease=Lease(pool, "a:1", 0.0))
    unplaced = RequestRecord("r3", 0.0)
    assert live_streams([sending, waiting, unplaced]) == [
        Stream("a:1", 300, 40, 5.0),
        Stream("a:1", None, 0, None),
    ]
