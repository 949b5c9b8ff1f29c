"""Random sequences of source updates, admin calls and request lifecycles keep the pool's invariants."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from picker.pool import DrainEnd, EndpointConflict, EndpointState, Lease, Pool

ADDRESSES = ["a:1", "b:1", "c:1"]
LISTED = st.sampled_from([EndpointState.READY, EndpointState.DRAINING, EndpointState.NOT_READY, None])


class PoolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.pool = Pool(lambda: self.now, wall=lambda: self.now)
        self.leases: list[Lease] = []
        self.served_unpickable = 0

    @rule(states=st.lists(LISTED, min_size=3, max_size=3), dt=st.floats(0, 5))
    def source_update(self, states: list[EndpointState | None], dt: float) -> None:
        self.now += dt
        desired = {a: s for a, s in zip(ADDRESSES, states, strict=True) if s is not None}
        self.pool.reconcile(desired, source="test")

    @rule(index=st.integers(0, 2))
    def pick(self, index: int) -> None:
        ready = self.pool.ready()
        if ready:
            self.leases.append(self.pool.lease(ready[index % len(ready)].address))

    @precondition(lambda self: self.leases)
    @rule(index=st.integers(0, 100), address=st.sampled_from(ADDRESSES))
    def envoy_serves_elsewhere(self, index: int, address: str) -> None:
        lease = self.leases[index % len(self.leases)]
        endpoint = self.pool.get(address)
        if address != lease.address and (endpoint is None or endpoint.state is not EndpointState.READY):
            self.served_unpickable += 1
        lease.move(address)

    @precondition(lambda self: self.leases)
    @rule(index=st.integers(0, 100), end=st.sampled_from(list(DrainEnd)), twice=st.booleans())
    def request_ends(self, index: int, end: DrainEnd, twice: bool) -> None:
        lease = self.leases.pop(index % len(self.leases))
        lease.release(end)
        if twice:
            lease.release(end)

    @rule(address=st.sampled_from(ADDRESSES), undrain=st.booleans())
    def admin(self, address: str, undrain: bool) -> None:
        try:
            self.pool.undrain(address) if undrain else self.pool.drain(address)
        except (LookupError, EndpointConflict):
            pass

    @invariant()
    def in_flight_matches_held_leases(self) -> None:
        assert self.pool.in_flight() == len(self.leases)
        for endpoint in self.pool.endpoints():
            assert endpoint.in_flight == sum(1 for lease in self.leases if lease.address == endpoint.address)

    @invariant()
    def gone_endpoints_only_while_work_remains(self) -> None:
        for endpoint in self.pool.endpoints():
            if endpoint.state is EndpointState.GONE:
                assert endpoint.in_flight > 0

    @invariant()
    def only_ready_and_never_admin_drained_endpoints_are_pickable(self) -> None:
        for endpoint in self.pool.ready():
            assert endpoint.state is EndpointState.READY
            assert not self.pool.admin_drained(endpoint.address)

    @invariant()
    def records_account_for_every_request(self) -> None:
        for endpoint in self.pool.endpoints():
            record = endpoint.drain
            if endpoint.state is EndpointState.DRAINING:
                assert record is not None
            elif endpoint.state is not EndpointState.GONE:
                assert record is None
            if record is not None:
                accounted = sum(record.ends.values()) + record.moved_away + endpoint.in_flight
                arrived = record.in_flight_at_start + record.picks_after_start + record.moved_in
                assert arrived == accounted
                assert (record.zero_at is not None) == (endpoint.in_flight == 0)
        for record in self.pool.recent_drains():
            assert not record.open and record.exit is not None

    @invariant()
    def unpickable_work_is_counted(self) -> None:
        assert self.pool.totals.picks_not_ready == self.served_unpickable


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
