"""The capacity guard's rule (picker/scheduling/capacity.py), over hand-built endpoints."""

from __future__ import annotations

from picker.pool.endpoint import Endpoint, EndpointState
from picker.scheduling.capacity import drain_verdict, ready_capacity

READY, DRAINING = EndpointState.READY, EndpointState.DRAINING


def endpoints(*in_flight: int, learned: int = 0) -> list[Endpoint]:
    return [
        Endpoint(f"10.0.0.{i}:8000", READY, 0.0, in_flight=n, learned_slots=learned)
        for i, n in enumerate(in_flight, 1)
    ]


def test_a_drain_that_leaves_enough_slots_goes_ahead() -> None:
    verdict = drain_verdict(endpoints(2, 2, 2), "10.0.0.1:8000", queued=0, engine_slots=4, headroom=0.1)
    assert verdict.allowed and verdict.capacity_left == 8 and verdict.demand == 6


def test_a_drain_that_would_starve_the_pool_is_refused_with_its_figures() -> None:
    pool = endpoints(2, 2, 2)
    pool[1].state = DRAINING  # already draining: no capacity, but its streams' traffic goes on
    pool[1].in_flight = 1
    verdict = drain_verdict(pool, "10.0.0.1:8000", queued=1, engine_slots=4, headroom=0.1)
    assert not verdict.allowed
    assert (verdict.capacity_left, verdict.demand) == (4, 6.0)  # 2 + 1 + 2 + 1 queued
    assert "would leave 4 ready slots" in verdict.reason


def test_the_headroom_counts_and_peers_requests_are_demand() -> None:
    pool = endpoints(1, 1)
    pool[1].peer_in_flight = 2  # another picker's streams on the same replica
    assert drain_verdict(pool, "10.0.0.1:8000", queued=0, engine_slots=4, headroom=0.0).allowed
    assert not drain_verdict(pool, "10.0.0.1:8000", queued=0, engine_slots=4, headroom=0.5).allowed


def test_the_last_ready_replica_is_never_drained_without_force_even_idle() -> None:
    """Issue 40, item 9: at a momentary demand of 0 the guard let the last ready endpoint go."""
    assert not drain_verdict(endpoints(1), "10.0.0.1:8000", queued=0, engine_slots=4, headroom=0).allowed
    idle = drain_verdict(endpoints(0), "10.0.0.1:8000", queued=0, engine_slots=4, headroom=0.1)
    assert not idle.allowed and "last ready endpoint" in idle.reason
    unknown = drain_verdict(endpoints(0), "10.0.0.1:8000", queued=0, engine_slots=None, headroom=0.1)
    assert not unknown.allowed  # slots unknown or not: nothing would be left to route to
    assert drain_verdict(endpoints(0, 0), "10.0.0.1:8000", queued=0, engine_slots=4, headroom=0.1).allowed


def test_unknown_slots_are_not_judged() -> None:
    verdict = drain_verdict(endpoints(9, 9), "10.0.0.1:8000", queued=0, engine_slots=None, headroom=0.1)
    assert verdict.allowed and verdict.capacity_left is None
    assert ready_capacity(endpoints(1, 1), None) is None
    assert ready_capacity(endpoints(1, 1, learned=3), None) == 6  # learned from a queue


def test_a_draining_or_unknown_endpoint_takes_nothing_away() -> None:
    pool = endpoints(4, 4)
    pool[0].state = DRAINING
    assert drain_verdict(pool, "10.0.0.1:8000", queued=9, engine_slots=4, headroom=0).allowed
    assert drain_verdict(pool, "10.9.9.9:1", queued=9, engine_slots=4, headroom=0).allowed
