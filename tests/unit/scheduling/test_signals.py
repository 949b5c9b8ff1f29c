"""The pool's autoscaling signals (picker/scheduling/signals.py, issue 55 item 2) over hand-built
endpoints: ready capacity and saturation leave draining endpoints out, the replicas a scale-down
could take are the capacity guard's answer, and the predicted wait reads the pool's recent rate."""

from __future__ import annotations

import math

import pytest

from picker.admin.capacity_guard import CapacityGuard
from picker.config.model import PickerConfig
from picker.pool import EndpointState, Pool
from picker.pool.endpoint import Endpoint
from picker.scheduling.capacity import drain_verdict, removable_replicas
from picker.scheduling.signals import Completions, predicted_wait_s, saturation

WINDOW_S = PickerConfig().autoscaling.rate_window_s  # the shipped default

READY, DRAINING, NOT_READY = EndpointState.READY, EndpointState.DRAINING, EndpointState.NOT_READY


def pool_of(*in_flight: int, instance: list[str] | None = None) -> list[Endpoint]:
    return [
        Endpoint(f"10.0.0.{i}:8000", READY, 0.0, in_flight=n, instance=(instance or [None] * 99)[i - 1])
        for i, n in enumerate(in_flight, 1)
    ]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_saturation_leaves_draining_and_starting_endpoints_out_of_the_capacity() -> None:
    endpoints = pool_of(4, 4, 4, 3)
    endpoints[3].state = DRAINING  # its 3 streams are demand (their traffic goes on), not capacity
    endpoints[2].state = NOT_READY
    guard_pool = Pool()
    guard_pool.reconcile({e.address: e.state for e in endpoints}, source="static")
    for endpoint in endpoints:
        guard_pool.get(endpoint.address).in_flight = endpoint.in_flight  # type: ignore[union-attr]
    figures = CapacityGuard(guard_pool, lambda: 2, 4, 0.1, 0.0, WINDOW_S).figures()
    assert figures.ready_capacity == 8  # two READY endpoints of 4 slots
    assert figures.demand == 4 + 4 + 4 + 3 + 2  # every endpoint's streams and the queue
    assert figures.saturation == pytest.approx(17 / 8)


def test_saturation_without_capacity_is_the_demand_and_unknown_slots_say_nothing() -> None:
    assert saturation(6.0, 12) == 0.5
    assert saturation(3.0, 0) == 3.0  # nothing ready: above 0 from the first request
    assert saturation(0.0, 0) == 0.0
    assert saturation(5.0, None) is None


def test_removable_replicas_is_what_the_guard_allows_one_drain_after_another() -> None:
    endpoints = pool_of(3, 3, 3, 3)  # demand 12 on 4 x 4 slots
    count = removable_replicas(endpoints, queued=0, engine_slots=4, headroom=0.0)
    assert count == 1  # 12 slots carry 12; 8 would not
    gone = frozenset({endpoints[0].address})
    assert drain_verdict(endpoints, endpoints[0].address, queued=0, engine_slots=4, headroom=0.0).allowed
    refused = drain_verdict(
        endpoints, endpoints[1].address, queued=0, engine_slots=4, headroom=0.0, drained_elsewhere=gone
    )
    assert not refused.allowed  # the next one is the one the guard would refuse
    # the headroom and the queue are the guard's too
    assert removable_replicas(endpoints, queued=0, engine_slots=4, headroom=0.5) == 0
    assert removable_replicas(pool_of(1, 1, 1, 1), queued=0, engine_slots=4, headroom=0.1) == 2
    assert removable_replicas(pool_of(1, 1, 1, 1), queued=5, engine_slots=4, headroom=0.1) == 1


def test_an_idle_pool_may_shrink_to_one_and_unknown_slots_are_not_judged() -> None:
    assert removable_replicas(pool_of(0, 0, 0), queued=0, engine_slots=4, headroom=0.1) == 2
    assert removable_replicas(pool_of(0), queued=0, engine_slots=4, headroom=0.1) == 0  # the last stays
    assert removable_replicas([], queued=0, engine_slots=4, headroom=0.1) == 0
    assert removable_replicas(pool_of(0, 0), queued=0, engine_slots=None, headroom=0.1) is None
    learned = pool_of(0, 0)
    for endpoint in learned:
        endpoint.learned_slots = 2  # learned from a scrape that showed a queue
    assert removable_replicas(learned, queued=0, engine_slots=None, headroom=0.1) == 1


def test_a_pod_with_several_ranks_leaves_whole_and_the_largest_go_first() -> None:
    # two pods of two data-parallel ranks each (4 slots a rank) and one single-rank pod
    endpoints = pool_of(2, 2, 2, 2, 1, instance=["a", "a", "b", "b", "c"])
    # demand 9: losing pod a (8 slots) leaves 12 >= 9.9; losing b as well leaves 4
    assert removable_replicas(endpoints, queued=0, engine_slots=4, headroom=0.1) == 1
    # counted by endpoints it would say 2 (any two single ranks leave 12 slots)
    assert removable_replicas(pool_of(2, 2, 2, 2, 1), queued=0, engine_slots=4, headroom=0.1) == 2


def test_the_predicted_wait_is_the_demand_beyond_the_slots_over_the_recent_rate() -> None:
    assert predicted_wait_s(6.0, 8, 0, None) == 0.0  # a free slot: no wait, rate or not
    assert predicted_wait_s(10.0, 8, 2, 3.0) == pytest.approx(1.0)  # 2 ahead, the newcomer third
    assert predicted_wait_s(8.0, 8, 0, 2.0) == pytest.approx(0.5)  # every slot busy: one must end
    assert predicted_wait_s(10.0, 8, 2, None) is None  # no window yet
    assert predicted_wait_s(50.0, None, 3, 2.0) == pytest.approx(2.0)  # slots unknown: the queue
    assert predicted_wait_s(50.0, None, 0, None) == 0.0


def test_a_wait_without_bound_is_no_figure_never_a_non_finite_one() -> None:
    """prometheus-adapter turns a value into int64(v * 1000) and KEDA may read +Inf as no value at
    all: a wait with nothing ending over the window is left out, as any unknown figure is."""
    assert predicted_wait_s(10.0, 8, 2, 0.0) is None  # waiting, and nothing ended
    assert predicted_wait_s(0.0, 0, 0, 0.0) is None  # nothing ready, nothing ended
    for busy, capacity, queued, rate in [(10.0, 8, 2, 1e-300), (1e308, 1, 0, 1e-10), (9.0, 8, 1, 0.0)]:
        wait = predicted_wait_s(busy, capacity, queued, rate)
        assert wait is None or math.isfinite(wait)


def test_a_draining_replicas_streams_are_not_ahead_of_a_newcomer() -> None:
    """Two replicas of 2 slots, one draining with 2 streams, the ready one with 1: a newcomer gets
    the free ready slot at once, though the demand (3) is above the ready capacity (2)."""
    pool = Pool()
    pool.reconcile({"10.0.0.1:8000": READY, "10.0.0.2:8000": DRAINING}, source="static")
    pool.get("10.0.0.1:8000").in_flight = 1  # type: ignore[union-attr]
    pool.get("10.0.0.2:8000").in_flight = 2  # type: ignore[union-attr]
    guard = CapacityGuard(pool, lambda: 0, 2, 0.1, 0.0, WINDOW_S)
    figures = guard.figures()
    assert figures.demand == 3 and figures.ready_capacity == 2 and figures.saturation == 1.5
    assert figures.predicted_wait_s == 0.0
    pool.get("10.0.0.1:8000").in_flight = 2  # type: ignore[union-attr]
    assert guard.figures().predicted_wait_s is None  # full, and nothing ended yet: no figure


def test_completions_per_second_over_the_window() -> None:
    clock = Clock()
    rate = Completions(window_s=10.0, clock=clock)
    endpoints = pool_of(0, 0)
    endpoints[0].departures = 500  # before the first reading: not this window's
    assert rate.per_s(endpoints) is None  # one reading: no span yet
    clock.now += 5
    endpoints[0].departures += 10
    endpoints[1].departures += 5
    assert rate.per_s(endpoints) == pytest.approx(3.0)
    clock.now += 5
    late = Endpoint("10.0.0.9:8000", READY, 0.0, departures=5)  # listed since the last reading
    endpoints[1].departures += 10
    assert rate.per_s([*endpoints, late]) == pytest.approx(30 / 10)
    clock.now += 10
    # 10.0.0.1 forgotten, 10.0.0.9 back as a new instance at the same address (its counter from 0)
    again = Endpoint("10.0.0.9:8000", READY, 0.0, departures=2)
    assert rate.per_s([endpoints[1], again]) == pytest.approx(2 / 10)  # the window slid on
