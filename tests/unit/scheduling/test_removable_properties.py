"""removable_replicas (picker/scheduling/capacity.py) in one pass gives exactly the answer of the
capacity guard asked drain after drain (drain_verdict with the replicas already taken as drained
elsewhere, the largest replica first): over random pools of ready, draining and starting endpoints,
single- and multi-rank pods, learned and configured slot counts, queues and headrooms."""

from __future__ import annotations

from collections.abc import Iterable

from hypothesis import given, settings
from hypothesis import strategies as st

from picker.pool.endpoint import Endpoint, EndpointState
from picker.scheduling.capacity import drain_verdict, ready_capacity, removable_replicas, slots_of

STATES = [EndpointState.READY, EndpointState.READY, EndpointState.DRAINING, EndpointState.NOT_READY]


def by_the_guard(
    endpoints: Iterable[Endpoint], *, queued: int, engine_slots: int | None, headroom: float
) -> int | None:
    """The guard's successive verdicts, one drain after another (the rule the count must give)."""
    listed = list(endpoints)
    if ready_capacity(listed, engine_slots) is None:
        return None
    replicas: dict[str, list[Endpoint]] = {}
    for endpoint in listed:
        if endpoint.state is EndpointState.READY:
            replicas.setdefault(endpoint.instance or endpoint.address, []).append(endpoint)
    largest_first = sorted(
        replicas.values(), key=lambda group: -sum(slots_of(e, engine_slots) or 0 for e in group)
    )
    gone: frozenset[str] = frozenset()
    for count, replica in enumerate(largest_first):
        for endpoint in replica:
            verdict = drain_verdict(
                listed,
                endpoint.address,
                queued=queued,
                engine_slots=engine_slots,
                headroom=headroom,
                drained_elsewhere=gone,
            )
            if not verdict.allowed:
                return count
            gone |= {endpoint.address}
    return len(largest_first)


endpoint_specs = st.lists(
    st.tuples(
        st.sampled_from(STATES),
        st.integers(0, 12),  # in flight
        st.integers(0, 6),  # peers' in flight
        st.sampled_from([None, "a", "b", "c", "d"]),  # the pod (data-parallel ranks share it)
        st.sampled_from([None, 1, 2, 4, 8]),  # learned slots
    ),
    max_size=14,
)


@settings(max_examples=400, deadline=None)
@given(
    specs=endpoint_specs,
    queued=st.integers(0, 20),
    engine_slots=st.sampled_from([None, 1, 2, 4, 16]),
    headroom=st.sampled_from([0.0, 0.1, 0.5, 1.0]),
)
def test_one_pass_gives_the_guards_successive_verdicts(
    specs: list[tuple[EndpointState, int, int, str | None, int | None]],
    queued: int,
    engine_slots: int | None,
    headroom: float,
) -> None:
    endpoints = [
        Endpoint(
            f"10.0.0.{i}:8000",
            state,
            0.0,
            in_flight=in_flight,
            peer_in_flight=peers,
            instance=pod,
            learned_slots=learned or 0,
        )
        for i, (state, in_flight, peers, pod, learned) in enumerate(specs)
    ]
    options = {"queued": queued, "engine_slots": engine_slots, "headroom": headroom}
    assert removable_replicas(endpoints, **options) == by_the_guard(endpoints, **options)  # type: ignore[arg-type]


def test_a_large_pool_in_one_pass() -> None:
    """1,000 ready endpoints: the answer the guard's rule gives, from one look at each."""
    endpoints = [Endpoint(f"10.0.{i // 250}.{i % 250}:8000", EndpointState.READY, 0.0) for i in range(1000)]
    for endpoint in endpoints:
        endpoint.in_flight = 2
    # demand 2,000 x 1.1 = 2,200 slots must stay: of 4,000, 450 replicas of 4 may go
    assert removable_replicas(endpoints, queued=0, engine_slots=4, headroom=0.1) == 450
