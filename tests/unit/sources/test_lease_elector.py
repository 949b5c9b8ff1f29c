"""The leader decision without I/O (picker/sources/lease.py): a standby takes the Lease only after
seeing it unchanged for its duration on its own clock, a leader stands down at its renew deadline
(before any standby may take over), and a released Lease goes at once."""

from __future__ import annotations

from datetime import UTC, datetime

from picker.sources.lease import Elector, LeaseRecord


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


WALL = datetime(2026, 12, 2, tzinfo=UTC)


def elector(identity: str, clock: Clock) -> Elector:
    return Elector(identity, lease_duration_s=15.0, renew_deadline_s=10.0, clock=clock, wall=lambda: WALL)


def test_no_lease_is_acquired_and_then_renewed() -> None:
    clock = Clock()
    a = elector("a", clock)
    a.observe(None)
    first = a.proposal()
    assert first is not None and first.holder == "a" and first.transitions == 0
    assert a.wrote(first) and a.leading
    a.observe(first)
    renewal = a.proposal()
    assert renewal is not None and renewal.holder == "a" and renewal.acquired == first.acquired
    assert not a.wrote(renewal)  # still the leader: not a new transition
    assert a.transitions == 1


def test_a_live_lease_of_another_is_left_alone_until_unchanged_for_its_duration() -> None:
    clock = Clock()
    b = elector("b", clock)
    held = LeaseRecord("a", 15.0, renewed=WALL)
    b.observe(held)
    clock.now += 14.9
    b.observe(held)  # the same record: the holder stopped renewing
    assert b.proposal() is None
    clock.now += 0.2
    taken = b.proposal()
    assert taken is not None and taken.holder == "b" and taken.transitions == 1


def test_a_renewed_lease_restarts_the_standbys_count() -> None:
    clock = Clock()
    b = elector("b", clock)
    b.observe(LeaseRecord("a", 15.0, renewed=WALL))
    clock.now += 14.0
    b.observe(LeaseRecord("a", 15.0, renewed=datetime(2026, 12, 2, 0, 0, 14, tzinfo=UTC)))
    clock.now += 14.0
    assert b.proposal() is None  # 28 s since the first sight, 14 s since the last change


def test_the_leader_stands_down_at_its_renew_deadline_before_a_standby_may_take_over() -> None:
    clock = Clock()
    a, b = elector("a", clock), elector("b", clock)
    a.observe(None)
    record = a.proposal()
    assert record is not None
    a.wrote(record)
    b.observe(record)  # b sees it at the same instant (the earliest it could)
    clock.now += 9.9
    a.failed()
    assert a.leading
    assert a.attempt_timeout() < 0.2  # a hanging request cannot carry it past the deadline
    clock.now += 0.1
    a.failed()
    assert not a.leading
    assert b.proposal() is None  # 10 s: a has stood down, b still waits out the 15 s
    clock.now += 5.0
    assert b.proposal() is not None


def test_a_released_lease_is_taken_at_once() -> None:
    clock = Clock()
    a, b = elector("a", clock), elector("b", clock)
    a.observe(None)
    record = a.proposal()
    assert record is not None
    a.wrote(record)
    released = a.release()
    assert released is not None and released.holder == "" and released.duration_s == 1.0
    b.observe(released)
    taken = b.proposal()
    assert taken is not None and taken.holder == "b"
    assert elector("c", clock).release() is None  # not holding it: nothing to hand back
