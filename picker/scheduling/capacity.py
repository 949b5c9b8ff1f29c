"""The capacity guard: whether the ready endpoints left after a drain can carry the live demand.

"Count a draining replica's GPU, but never as capacity for new traffic": a drain moves every new
request its endpoint would have taken onto the others, so a drain is safe only while what stays
READY holds what the pool runs now (plus a headroom). An endpoint's capacity is its slot count:
vLLM's --max-num-seqs when configured (load.engine_slots), else what the picker learned from a
scrape that showed a queue. Demand is what the picker books (its own and its peers' requests)
plus its queue. Pure functions over the view; no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from picker.pool.endpoint import Endpoint, EndpointState


@dataclass(frozen=True, slots=True)
class Verdict:
    """The guard's answer for one drain: `allowed`, and the figures it judged by (None: unknown)."""

    allowed: bool
    capacity_left: int | None  # slots of the ready endpoints that would remain
    demand: float  # requests live on ready endpoints + queued
    needed: float  # demand x (1 + headroom)
    reason: str  # one line for the operator

    def as_dict(self) -> dict[str, object]:
        return {
            "allowed": self.allowed,
            "capacity_left": self.capacity_left,
            "demand": round(self.demand, 2),
            "needed": round(self.needed, 2),
            "reason": self.reason,
        }


def slots_of(endpoint: Endpoint, engine_slots: int | None) -> int | None:
    """How many requests the endpoint runs at once, when known."""
    return engine_slots or endpoint.learned_slots or None


def demand(endpoints: Iterable[Endpoint], queued: int) -> float:
    """The live demand on the pool: every request in flight (every picker's) and the queue.

    A draining endpoint's streams count too: they finish where they are, but the traffic they
    stand for keeps arriving, and only the ready endpoints can take it."""
    return float(queued + sum(e.in_flight + e.peer_in_flight for e in endpoints))


def ready_capacity(
    endpoints: Iterable[Endpoint], engine_slots: int | None, without: frozenset[str] = frozenset()
) -> int | None:
    """Slots of the READY endpoints not in `without`; None when any of them has no known slot count
    (the guard cannot judge, so it does not stand in the way)."""
    total = 0
    for endpoint in endpoints:
        if endpoint.state is not EndpointState.READY or endpoint.address in without:
            continue
        slots = slots_of(endpoint, engine_slots)
        if slots is None:
            return None
        total += slots
    return total


def drain_verdict(
    endpoints: Iterable[Endpoint],
    address: str,
    *,
    queued: int,
    engine_slots: int | None,
    headroom: float,
    drained_elsewhere: frozenset[str] = frozenset(),
) -> Verdict:
    """Whether draining `address` leaves enough READY capacity for the demand (x (1 + headroom)).

    Allowed when the endpoint is not READY (nothing changes), when nothing is asked of the pool, and
    when capacity cannot be known (an endpoint's slots unknown; say so); never for the last READY
    endpoint (only `force` drains it). `drained_elsewhere`: addresses a shared drain record drains
    that this view may not show yet (another picker's drain): they count as not ready."""
    listed = list(endpoints)
    target = next((e for e in listed if e.address == address), None)
    load = demand(listed, queued)
    needed = load * (1.0 + headroom)
    if target is None or target.state is not EndpointState.READY or address in drained_elsewhere:
        return Verdict(True, None, load, needed, "not ready: a drain takes no capacity away")
    others = [e for e in listed if e.address != address and e.address not in drained_elsewhere]
    if not any(e.state is EndpointState.READY for e in others):
        # whatever the demand this instant (0 between two requests): nothing would be left to route to
        left = 0
        return Verdict(False, left, load, needed, f"{address} is the last ready endpoint: force it if meant")
    if slots_of(target, engine_slots) is None:
        return Verdict(True, None, load, needed, "its slot count is unknown: not judged")
    left = ready_capacity(others, engine_slots)
    if left is None:
        return Verdict(True, None, load, needed, "a remaining endpoint's slot count is unknown: not judged")
    if load <= 0 or left >= needed:
        return Verdict(True, left, load, needed, f"{left} slots stay ready for a demand of {load:g}")
    return Verdict(
        False,
        left,
        load,
        needed,
        f"draining {address} would leave {left} ready slots for a demand of {load:g} "
        f"(needs {needed:.1f} with the headroom): wait for a replacement, or force it",
    )


def removable_replicas(
    endpoints: Iterable[Endpoint], *, queued: int, engine_slots: int | None, headroom: float
) -> int | None:
    """How many ready replicas a scale-down could take now with the guard still allowing each
    drain (drain_verdict, one after another): the guard's view before the scale-down happens.

    A replica is a pod (`instance`: its data-parallel ranks leave together) or, where the source
    names none, an endpoint. The largest go first, so the count holds whichever the ReplicaSet
    controller takes. None when a ready endpoint's slot count is unknown (the guard cannot judge).

    One pass (it runs at every scrape): the guard's rule drain after drain is "a READY endpoint is
    left, and what stays READY holds the demand x (1 + headroom), or nothing is asked", with a
    demand that a drain does not change; so the slots taken are summed as the replicas go, largest
    first, and the count stops at the first drain the guard would refuse."""
    listed = list(endpoints)
    capacity = ready_capacity(listed, engine_slots)
    if capacity is None:
        return None
    replicas: dict[str, list[int]] = {}
    for endpoint in listed:
        if endpoint.state is EndpointState.READY:
            slots = slots_of(endpoint, engine_slots) or 0  # known: ready_capacity said so
            replicas.setdefault(endpoint.instance or endpoint.address, []).append(slots)
    load = demand(listed, queued)
    needed = load * (1.0 + headroom)
    ready_left, left = sum(len(ranks) for ranks in replicas.values()), capacity
    for count, ranks in enumerate(sorted(replicas.values(), key=lambda ranks: -sum(ranks))):
        for slots in ranks:  # a pod's ranks one after another, as the guard is asked for each
            ready_left, left = ready_left - 1, left - slots
            if ready_left <= 0 or (load > 0 and left < needed):
                return count
    return len(replicas)
