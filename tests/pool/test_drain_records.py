"""Endpoint state rules and drain records: every state, every transition, every way a request ends."""

from __future__ import annotations

import logging

import pytest

from picker.pool import (
    DrainCause,
    DrainEnd,
    DrainExit,
    DrainRecord,
    EndpointConflict,
    EndpointState,
    Pool,
    UnknownEndpoint,
)

READY, DRAINING, NOT_READY, GONE = (
    EndpointState.READY,
    EndpointState.DRAINING,
    EndpointState.NOT_READY,
    EndpointState.GONE,
)


class FakeClock:
    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def pool(clock: FakeClock) -> Pool:
    return Pool(clock, wall=lambda: clock.now + 1_700_000_000)


@pytest.mark.parametrize("state", list(EndpointState))
def test_every_state_has_a_pickability_and_a_source_can_state_it(pool: Pool, state: EndpointState) -> None:
    pool.reconcile({"a:1": state, "b:1": READY}, source="test")
    endpoint = pool.get("a:1")
    if state is GONE:
        assert endpoint is None  # a source that lists an address as GONE does not list it
        return
    assert endpoint is not None and endpoint.state is state
    assert endpoint.pickable is (state is READY)
    assert (endpoint in pool.ready()) is (state is READY)
    assert (endpoint.drain is not None) is (state is DRAINING)


@pytest.mark.parametrize("start", [READY, NOT_READY])
@pytest.mark.parametrize("then", [READY, DRAINING, NOT_READY, GONE])
def test_every_transition_opens_or_closes_records_as_the_rules_say(
    pool: Pool, start: EndpointState, then: EndpointState
) -> None:
    pool.reconcile({"a:1": start}, source="test")
    lease = pool.lease("a:1")
    pool.reconcile({} if then is GONE else {"a:1": then}, source="test")
    endpoint = pool.get("a:1")
    assert endpoint is not None and endpoint.state is then and endpoint.in_flight == 1
    if then is DRAINING:
        assert endpoint.drain is not None and endpoint.drain.cause is DrainCause.SOURCE
    elif then is GONE:  # removed with a request in flight, without a drain first
        assert endpoint.drain is not None and endpoint.drain.cause is DrainCause.REMOVED
    else:
        assert endpoint.drain is None
    lease.release(DrainEnd.COMPLETED)
    assert (pool.get("a:1") is None) is (then is GONE)


def test_rolling_drain_record(pool: Pool, clock: FakeClock, caplog: pytest.LogCaptureFixture) -> None:
    pool.reconcile({"a:1": READY, "b:1": READY}, source="kube")
    leases = [pool.lease("a:1") for _ in range(4)]
    clock.now = 110.0
    pool.reconcile({"a:1": DRAINING, "b:1": READY}, source="kube")
    assert [e.address for e in pool.ready()] == ["b:1"]
    record = pool.get("a:1").drain  # type: ignore[union-attr]
    assert record is not None and record.in_flight_at_start == 4 and record.started_at == 110.0
    assert record.started_wall == 110.0 + 1_700_000_000 and record.source == "kube"
    ends = [DrainEnd.COMPLETED, DrainEnd.COMPLETED, DrainEnd.CLIENT_DISCONNECT, DrainEnd.UPSTREAM_ERROR]
    for at, (lease, end) in enumerate(zip(leases, ends, strict=True)):
        clock.now = 111.0 + at
        lease.release(end)
        lease.release(DrainEnd.CUT)  # idempotent: the second call counts nothing
    assert record.time_to_zero_s == 4.0 and record.open
    clock.now = 120.0
    with caplog.at_level(logging.INFO, logger="picker.pool.view"):
        pool.reconcile({"b:1": READY}, source="kube")
    assert pool.get("a:1") is None
    assert not record.open and record.exit is DrainExit.GONE and record.duration_s(999) == 10.0
    assert dict(record.ends) == {
        DrainEnd.COMPLETED: 2,
        DrainEnd.CLIENT_DISCONNECT: 1,
        DrainEnd.UPSTREAM_ERROR: 1,
    }
    assert record.picks_after_start == 0
    assert pool.recent_drains() == [record]
    closed_lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("drain closed")]
    assert closed_lines == [
        "drain closed address=a:1 cause=source source=kube exit=gone duration_s=10.000 in_flight_at_start=4 "
        "failed_before_start=0 completed=2 client_disconnect=1 upstream_error=1 cut=0 unknown=0 "
        "moved_away=0 moved_in=0 picks_after_start=0 time_to_zero_s=4.000"
    ]
    assert pool.totals.opened == 1 and pool.totals.closed[DrainExit.GONE] == 1
    assert pool.totals.ends[DrainEnd.COMPLETED] == 2


def test_removal_before_the_last_request_ends_closes_the_record_at_the_last_end(
    pool: Pool, clock: FakeClock
) -> None:
    pool.reconcile({"a:1": READY}, source="kube")
    lease = pool.lease("a:1")
    pool.reconcile({"a:1": DRAINING}, source="kube")
    record = pool.get("a:1").drain  # type: ignore[union-attr]
    clock.now = 105.0
    pool.reconcile({}, source="kube")
    gone = pool.get("a:1")
    assert gone is not None and gone.state is GONE and gone.drain is record and record is not None
    clock.now = 107.0
    lease.release(DrainEnd.CUT)
    assert pool.get("a:1") is None and record.exit is DrainExit.GONE and record.time_to_zero_s == 7.0
    assert record.ends[DrainEnd.CUT] == 1


def test_back_to_ready_closes_the_record_and_a_new_drain_opens_a_new_one(pool: Pool) -> None:
    pool.reconcile({"a:1": READY}, source="kube")
    pool.reconcile({"a:1": DRAINING}, source="kube")
    first = pool.get("a:1").drain  # type: ignore[union-attr]
    pool.reconcile({"a:1": READY}, source="kube")
    assert first is not None and first.exit is DrainExit.READY and pool.get("a:1").drain is None  # type: ignore[union-attr]
    pool.reconcile({"a:1": DRAINING}, source="kube")
    second = pool.get("a:1").drain  # type: ignore[union-attr]
    assert second is not None and second is not first
    pool.reconcile({"a:1": NOT_READY}, source="kube")
    assert second.exit is DrainExit.NOT_READY
    assert [r.exit for r in pool.recent_drains()] == [DrainExit.NOT_READY, DrainExit.READY]


def test_readded_while_gone_closes_the_removal_record_as_ready(pool: Pool) -> None:
    pool.reconcile({"a:1": READY}, source="kube")
    lease = pool.lease("a:1")
    pool.reconcile({}, source="kube")  # slice deleted ...
    pool.reconcile({"a:1": READY}, source="kube")  # ... and recreated
    endpoint = pool.get("a:1")
    assert endpoint is not None and endpoint.state is READY and endpoint.in_flight == 1
    assert pool.recent_drains()[0].cause is DrainCause.REMOVED
    assert pool.recent_drains()[0].exit is DrainExit.READY
    lease.release(DrainEnd.COMPLETED)
    assert endpoint.in_flight == 0


def test_picks_after_drain_start_are_counted(pool: Pool) -> None:
    pool.reconcile({"a:1": READY, "b:1": READY}, source="kube")
    pool.reconcile({"a:1": DRAINING, "b:1": READY}, source="kube")
    record = pool.get("a:1").drain  # type: ignore[union-attr]
    assert record is not None and record.time_to_zero_s == 0.0  # nothing in flight at the start
    late = pool.lease("a:1")  # only a bug (or a race) can do this: it must show
    assert record.picks_after_start == 1 and record.zero_at is None
    lease = pool.lease("b:1")
    lease.move("a:1")  # Envoy's fallback served it from the draining endpoint
    assert record.picks_after_start == 2
    assert pool.totals.picks_after_start == 2 and pool.totals.picks_not_ready == 2
    late.release(DrainEnd.COMPLETED)
    lease.release(DrainEnd.COMPLETED)
    assert record.time_to_zero_s == 0.0 and record.ends[DrainEnd.COMPLETED] == 2


def test_a_request_moved_away_from_a_draining_endpoint_is_not_an_end(pool: Pool) -> None:
    pool.reconcile({"a:1": READY, "b:1": READY}, source="kube")
    lease = pool.lease("a:1")
    pool.reconcile({"a:1": DRAINING, "b:1": READY}, source="kube")
    lease.move("b:1")  # the primary refused the connection: served by the fallback
    record = pool.get("a:1").drain  # type: ignore[union-attr]
    assert record is not None and record.moved_away == 1 and sum(record.ends.values()) == 0
    assert record.time_to_zero_s is not None
    lease.release(DrainEnd.COMPLETED)
    assert record.ends[DrainEnd.COMPLETED] == 0  # ended on b:1, which is not draining


def test_admin_drain_overrides_a_ready_source_until_undrain(pool: Pool) -> None:
    pool.reconcile({"a:1": READY, "b:1": READY}, source="kube")
    lease = pool.lease("a:1")
    pool.drain("a:1")
    endpoint = pool.get("a:1")
    assert endpoint is not None and endpoint.state is DRAINING and pool.admin_drained("a:1")
    assert endpoint.drain is not None and endpoint.drain.cause is DrainCause.ADMIN
    pool.reconcile({"a:1": READY, "b:1": READY}, source="kube")  # the source still says ready
    assert endpoint.state is DRAINING
    pool.drain("a:1")  # idempotent
    assert pool.totals.opened == 1
    lease.release(DrainEnd.COMPLETED)
    pool.undrain("a:1")
    assert endpoint.state is READY and pool.recent_drains()[0].exit is DrainExit.READY
    assert pool.recent_drains()[0].ends[DrainEnd.COMPLETED] == 1


def test_admin_drain_ends_when_the_source_drops_the_address(pool: Pool) -> None:
    pool.reconcile({"a:1": READY}, source="file")
    pool.drain("a:1")
    pool.reconcile({}, source="file")
    assert pool.get("a:1") is None and pool.recent_drains()[0].exit is DrainExit.GONE
    pool.reconcile({"a:1": READY}, source="file")  # a new instance at the same address
    assert pool.get("a:1").state is READY  # type: ignore[union-attr]


def test_admin_drain_ends_when_another_instance_takes_the_address(pool: Pool) -> None:
    """The source lists the address without a gap (one list replaced another pod's): the drain was
    that pod's; the endpoint says which pod stands behind it."""
    pool.reconcile({"a:1": READY}, source="kube-pods", instances={"a:1": "uid-1"})
    pool.drain("a:1")
    pool.reconcile({"a:1": READY}, source="kube-pods", instances={"a:1": "uid-1"})
    assert pool.get("a:1").state is DRAINING  # type: ignore[union-attr]
    pool.reconcile({"a:1": READY}, source="kube-pods", instances={"a:1": "uid-2"})
    endpoint = pool.get("a:1")
    assert endpoint is not None and endpoint.state is READY and endpoint.instance == "uid-2"


def test_admin_errors_say_why(pool: Pool) -> None:
    pool.reconcile({"a:1": READY, "b:1": DRAINING}, source="kube")
    with pytest.raises(UnknownEndpoint):
        pool.drain("z:1")
    with pytest.raises(UnknownEndpoint):
        pool.undrain("z:1")
    with pytest.raises(EndpointConflict, match="source"):
        pool.undrain("b:1")
    with pytest.raises(EndpointConflict, match="not drained"):
        pool.undrain("a:1")
    lease = pool.lease("a:1")
    pool.reconcile({"b:1": DRAINING}, source="kube")
    with pytest.raises(EndpointConflict, match="gone"):
        pool.drain("a:1")
    lease.release()


def test_admin_drain_of_a_not_ready_endpoint_applies_once_it_is_ready(pool: Pool) -> None:
    pool.reconcile({"a:1": NOT_READY}, source="kube")
    pool.drain("a:1")
    assert pool.get("a:1").state is NOT_READY  # type: ignore[union-attr]
    pool.reconcile({"a:1": READY}, source="kube")
    assert pool.get("a:1").state is DRAINING  # type: ignore[union-attr]


def test_change_and_drain_listeners(pool: Pool) -> None:
    changes: list[int] = []
    closed: list[DrainRecord] = []
    pool.on_change(lambda: changes.append(1))
    pool.on_drain_closed(closed.append)
    pool.reconcile({"a:1": READY}, source="kube")
    pool.reconcile({"a:1": READY}, source="kube")  # no change, no call
    pool.set_state("a:1", DRAINING)
    pool.set_state("a:1", GONE)
    assert len(changes) == 3 and [r.exit for r in closed] == [DrainExit.GONE]


def test_summary_is_plain_json_values(pool: Pool, clock: FakeClock) -> None:
    pool.reconcile({"a:1": READY}, source="kube")
    lease = pool.lease("a:1")
    pool.drain("a:1")
    clock.now += 2.5
    summary = pool.get("a:1").drain.summary(clock.now)  # type: ignore[union-attr]
    assert summary == {
        "address": "a:1",
        "cause": "admin",
        "source": "kube",
        "started_wall": 1_700_000_100.0,
        "open": True,
        "duration_s": 2.5,
        "in_flight_at_start": 1,
        "pulls_at_start": 0,
        "failed_before_start": 0,
        "ended": {
            "completed": 0,
            "client-disconnect": 0,
            "upstream-error": 0,
            "cut": 0,
            "unknown": 0,
            "kv-pulled": 0,
            "kv-pull-abandoned": 0,
        },
        "moved_away": 0,
        "moved_in": 0,
        "picks_after_start": 0,
        "time_to_zero_s": None,
        "exit": None,
    }
    lease.release()
    assert pool.get("a:1").drain.ends[DrainEnd.UNKNOWN] == 1  # type: ignore[union-attr]


@pytest.mark.parametrize("end", list(DrainEnd))
def test_every_end_category_is_counted(pool: Pool, end: DrainEnd) -> None:
    pool.reconcile({"a:1": READY}, source="kube")
    lease = pool.lease("a:1")
    pool.reconcile({"a:1": DRAINING}, source="kube")
    lease.release(end)
    record = pool.get("a:1").drain  # type: ignore[union-attr]
    assert record is not None and record.ends == {end: 1} and pool.totals.ends == {end: 1}
