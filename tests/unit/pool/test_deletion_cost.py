"""A pod's deletion cost from the work on it: streams by their time left, waiting work, peers' requests
and the cache it holds (picker/pool/deletion_cost.py)."""

from __future__ import annotations

import pytest

from picker.pool import Endpoint, EndpointState
from picker.pool.cache import PrefixIndex
from picker.pool.deletion_cost import (
    CostPolicy,
    PodRef,
    Stream,
    pod_work,
    read_value,
    times_per_token,
    tokens_left,
)

POLICY = CostPolicy(unknown_tokens=100, time_per_token_s=0.05, work_weight=0.1, cache_s=0.0)
NOW = 1000.0


def pod(name: str, *addresses: str, **fields: object) -> PodRef:
    return PodRef("default", name, addresses or (f"{name}:8000",), **fields)  # type: ignore[arg-type]


def running(endpoint: str, asked: int | None, sent: int, tpt_s: float = 0.05) -> Stream:
    """A stream that has sent `sent` tokens at `tpt_s` each since its first."""
    return Stream(endpoint, asked, sent, NOW - (sent - 1) * tpt_s)


def endpoints(*addresses: str) -> dict[str, Endpoint]:
    return {a: Endpoint(a, EndpointState.READY, 0.0) for a in addresses}


def test_time_left_is_tokens_asked_less_sent_and_a_default_where_max_tokens_is_unknown() -> None:
    assert tokens_left(Stream("a", 500, 120, NOW), 100) == 380
    assert tokens_left(Stream("a", 50, 80, NOW), 100) == 0  # usage past max_tokens (a stop string, a bug)
    assert tokens_left(Stream("a", None, 30, NOW), 100) == 70
    assert tokens_left(Stream("a", None, 300, NOW), 100) == 300  # past the default: as long again


def test_time_per_token_is_measured_per_replica_else_the_pool_else_the_default() -> None:
    per, pool = times_per_token([running("a", 500, 101, 0.02), running("b", 500, 11, 0.1)], NOW)
    assert per == {"a": pytest.approx(0.02), "b": pytest.approx(0.1)}
    assert pool == pytest.approx((100 * 0.02 + 10 * 0.1) / 110)
    assert times_per_token([Stream("a", 10, 0, None), running("b", 10, 1)], NOW) == ({}, None)
    work = pod_work([pod("a")], [Stream("a:8000", 10, 0, None)], endpoints("a:8000"), POLICY, NOW)
    assert work["default/a"].longest_s == pytest.approx(10 * 0.05)  # nobody measured: the default


def test_the_longest_stream_sets_the_cost_and_the_sum_breaks_near_ties() -> None:
    streams = [
        running("long:8000", 2400, 100),  # 2300 tokens left: 115 s at 0.05
        *(running("short:8000", 200, 100) for _ in range(8)),  # 100 left each: 5 s
        running("fewer:8000", 200, 100),
        running("more:8000", 200, 100),
        running("more:8000", 200, 100),
    ]
    pods = [pod("long"), pod("short"), pod("fewer"), pod("more")]
    work = pod_work(pods, streams, endpoints(*(p.addresses[0] for p in pods)), POLICY, NOW)
    assert work["default/long"].longest_s == pytest.approx(115.0)
    assert work["default/short"].longest_s == pytest.approx(5.0)
    assert work["default/short"].streams == 8
    assert work["default/short"].cost < work["default/long"].cost  # eight short drains beat one long
    assert work["default/fewer"].cost < work["default/more"].cost  # same drain, fewer streams


def test_waiting_requests_count_whole_and_a_replica_is_measured_by_its_own_streams() -> None:
    slow = [running("slow:8000", 100, 11, 0.2), Stream("slow:8000", 100, 0, None)]
    fast = [running("fast:8000", 100, 11, 0.01)]
    work = pod_work([pod("slow"), pod("fast")], slow + fast, endpoints("slow:8000", "fast:8000"), POLICY, NOW)
    assert work["default/slow"].waiting == 1
    assert work["default/slow"].longest_s == pytest.approx(100 * 0.2)  # the waiting one, whole
    assert work["default/fast"].longest_s == pytest.approx(89 * 0.01)


def test_a_pod_sums_its_endpoints_and_peers_requests_count_as_unknown_streams() -> None:
    ranks = pod("dp", "10.0.0.1:8000", "10.0.0.1:8001")
    table = endpoints(*ranks.addresses)
    table["10.0.0.1:8001"].peer_in_flight = 2
    work = pod_work([ranks], [running("10.0.0.1:8000", 30, 11)], table, POLICY, NOW)["default/dp"]
    assert work.streams == 3
    assert work.longest_s == pytest.approx(100 * 0.05)  # a peer's request: unknown_tokens at the pool's pace


def test_pods_being_deleted_are_not_ranked() -> None:
    work = pod_work([pod("a"), pod("b", deleting=True)], [], endpoints("a:8000", "b:8000"), POLICY, NOW)
    assert list(work) == ["default/a"]
    assert work["default/a"].cost == 0.0


def test_the_cache_a_replica_holds_weighs_as_its_share_of_the_largest() -> None:
    table = endpoints("warm:8000", "cold:8000", "half:8000")
    for address, blocks in (("warm:8000", 400), ("half:8000", 200)):
        table[address].prefix = PrefixIndex()
        table[address].prefix.add(list(range(blocks)))  # type: ignore[union-attr]
    policy = CostPolicy(unknown_tokens=100, time_per_token_s=0.05, work_weight=0.1, cache_s=3.0)
    work = pod_work([pod("warm"), pod("cold"), pod("half")], [], table, policy, NOW)
    assert [work[f"default/{n}"].cost for n in ("warm", "half", "cold")] == pytest.approx([3.0, 1.5, 0.0])


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("0", 0),
        ("-5", -5),
        ("2147483647", 2**31 - 1),
        ("2147483648", None),
        ("1.5", None),
        ("", None),
        (7, None),
    ],
)
def test_annotation_values_are_int32_as_the_api_server_validates_them(
    text: object, value: int | None
) -> None:
    assert read_value(text) == value
