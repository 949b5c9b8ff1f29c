"""Several pickers that pick at the same moment spread as one would (issue 23): a stream's end reaches
every picker from the one that saw it, a burst's picks are staggered, and a peer's pick is never
counted twice against a scrape. In process, no transport (tests/unit/peers/test_peering.py's helpers)."""

from __future__ import annotations

import random

from picker.config.model import AffinityConfig
from picker.peers.books import Peering
from picker.peers.outbox import CLAIM_WITHIN_S, REPORT_WITHIN_S
from picker.pool import Pool
from picker.pool.scrapes import record_sample
from picker.scheduling import LoadPolicy, Stagger, estimated_load, pick
from picker.scheduling.affinity import Affinity, AffinityPolicy, pick_with_affinity
from tests.unit.peers.test_peering import E1, LAST, REQUEST, TOKEN, Picker, deliver

A, B, C = "10.1.0.1:9004", "10.1.0.2:9004", "10.1.0.3:9004"
REPLICAS = [f"10.0.0.{i}:8000" for i in range(1, 5)]
AFFINITY = AffinityPolicy.of(AffinityConfig())


def test_the_picker_that_sees_an_end_tells_every_picker_and_the_owner_tells_the_rest_again() -> None:
    a, b, c = (Picker(name, (A, B, C)) for name in (A, B, C))
    record = a.path.admit(REQUEST).payload
    deliver(a, b, c)
    endpoint = record.picked[0]
    shadow = b.path.attach_observer(record.request_id)
    assert shadow is not None
    b.path.response_started(shadow, 200, endpoint, True)
    b.path.body_chunk(shadow, TOKEN)
    deliver(a, b, c)
    b.path.body_chunk(shadow, LAST)  # its `data: [DONE]` ends it; the end of stream adds nothing
    b.path.observer_ended(shadow, True)
    # before any delivery: B's own books drop it; what is queued is one `ended` to A, one `end` to C
    assert b.pool.get(endpoint).peer_in_flight == 0  # type: ignore[union-attr]
    assert [e[0] for e in b.peering.outbox.pending[A]] == ["ended"]
    assert [e[0] for e in b.peering.outbox.pending[C]] == ["end"]
    for event in b.peering.outbox.take(C):  # C hears it from B, not a hop later from A
        c.peering.book(B, event)
    assert c.pool.get(endpoint).peer_in_flight == 0  # type: ignore[union-attr]
    for event in b.peering.outbox.take(A):  # the owner hears how it ended
        a.path.peer_event(event, B)
    assert record.end_reason is not None and record.peers_told
    # nothing back to B, which told it; C again, should it not have heard B (harmless if it did)
    assert not a.peering.outbox.pending.get(B)
    assert [e[0] for e in a.peering.outbox.pending.get(C, [])] == ["end"]
    deliver(a, b, c)
    for picker in (a, b, c):
        assert picker.pool.in_flight() == 0
        assert sum(e.peer_in_flight for e in picker.pool.endpoints()) == 0


def test_an_end_heard_before_its_pick_leaves_nothing_counted() -> None:
    """The end comes from the observer's picker, the pick from its owner: two channels, any order."""
    a, c = Picker(A, (A, B, C)), Picker(C, (A, B, C))
    record = a.path.admit(REQUEST).payload
    endpoint = record.picked[0]
    c.peering.book(B, ["end", record.request_id])  # B saw it end before A's pick reached C
    for event in a.peering.outbox.take(C):
        c.peering.book(A, event)
    assert c.pool.get(endpoint).peer_in_flight == 0  # type: ignore[union-attr]


def test_an_end_is_urgent_a_report_may_wait_and_a_claim_waits_for_the_next_report() -> None:
    """Each write costs a system call: a claim rides with its request's next report (a short
    request's claim, start, first token and end go as one message), yet reaches the owner well
    inside the owner's grace for an observer; the books go at once."""
    a = Picker(A, (A, B))
    woken: list[float] = []
    a.peering.outbox.wake = lambda peer, within_s: woken.append(within_s)
    a.peering.outbox.to(B, ["claim", "x"])
    a.peering.outbox.to(B, ["started", "x", 200, E1, True])
    a.peering.outbox.to(B, ["ended", "x", True, None])
    a.peering.outbox.to(B, ["end", "x"])
    assert woken == [CLAIM_WITHIN_S, REPORT_WITHIN_S, 0.0, 0.0]
    assert REPORT_WITHIN_S < CLAIM_WITHIN_S <= 2.0 / 4
    hasty = Peering(A, (A, B), Pool(), observer_grace_s=0.2)
    assert hasty.outbox.claim_within_s == 0.05


def burst(
    stagger_of: list[Stagger | None], rounds: int, with_affinity: bool, busy: tuple[int, ...] = (0, 0, 0, 0)
) -> list[int]:
    """`len(stagger_of)` pickers each pick `rounds` times over four replicas already running `busy`
    requests, each picker seeing only its own picks (the others' are on their way); the scrape's KV
    usage differs a little per replica, the same on every picker. Returns the requests each replica
    got."""
    policy = LoadPolicy()
    got = dict.fromkeys(REPLICAS, 0)
    for index, stagger in enumerate(stagger_of):
        pool = Pool(clock=lambda: 0.0)
        pool.apply(ready=REPLICAS)
        for n, endpoint in enumerate(pool.endpoints()):
            record_sample(endpoint, running=busy[n], waiting=0, kv_usage=0.001 * n, now=0.0)
            for _ in range(busy[n]):
                pool.lease(endpoint.address)
        rng = random.Random(index)
        for _ in range(rounds):
            candidates = pool.ready()
            if with_affinity:
                affinities = [Affinity(0.0, 0.0, False, 0.0, 1.0, 0.0) for _ in candidates]
                choice = pick_with_affinity(
                    candidates, affinities, 1, rng, 0.0, policy, AFFINITY, stagger=stagger
                )
                primary = choice.destinations[0]
            else:
                primary = pick(candidates, 1, rng, 0.0, policy, stagger=stagger)[0]
            pool.lease(primary)
            got[primary] += 1
    return list(got.values())


def test_staggered_pickers_spread_a_burst_that_load_alone_sends_to_one_replica() -> None:
    for with_affinity in (False, True):
        # by load alone every picker's first pick is the replica with the least KV in use
        assert max(burst([None] * 4, 1, with_affinity)) == 4
        staggered = burst([Stagger(place, 4) for place in range(4)], 6, with_affinity)
        assert staggered == [6, 6, 6, 6], with_affinity
        assert burst([Stagger(place, 2) for place in range(2)], 2, with_affinity) == [1, 1, 1, 1]


def test_pickers_picking_at_once_share_out_the_least_loaded_replicas() -> None:
    """Some replicas tie for least loaded: pickers picking before they hear each other take different
    ones (picker i the i-th of k tied, modulo k), not the same one as a ring of all replicas would
    send most of them to (a replica two streams above the rest, while another had room)."""
    for with_affinity in (False, True):
        for busy, want2, want4 in (
            ((1, 1, 0, 0), [0, 0, 1, 1], [0, 0, 2, 2]),
            ((0, 1, 1, 0), [1, 0, 0, 1], [2, 0, 0, 2]),
            ((1, 0, 1, 1), [0, 2, 0, 0], [0, 4, 0, 0]),  # one least loaded: every picker's choice
        ):
            two = burst([Stagger(place, 2) for place in range(2)], 1, with_affinity, busy)
            assert two == want2, (with_affinity, busy)
            four = burst([Stagger(place, 4) for place in range(4)], 1, with_affinity, busy)
            assert four == want4, (with_affinity, busy)


def test_each_picker_takes_its_place_in_the_same_order() -> None:
    places = {Picker(name, (C, A, B)).peering.stagger for name in (A, B, C)}
    assert places == {Stagger(0, 3), Stagger(1, 3), Stagger(2, 3)}


def test_a_peers_pick_after_the_scrape_began_is_not_counted_twice() -> None:
    """Its message trails the request, which the engine (and so the scrape) may already count."""
    a = Picker(A, (A, B))
    endpoint = a.pool.get(REPLICAS[0]) or a.pool.endpoints()[0]
    before_own, before_peer = endpoint.arrivals, endpoint.peer_arrivals
    a.peering.book(B, ["pick", f"{B}~1", endpoint.address])  # arrives while the scrape is out
    record_sample(
        endpoint,
        running=1,  # the engine runs B's request already
        waiting=0,
        kv_usage=0.0,
        now=0.0,
        arrivals_before=before_own,
        peer_arrivals_before=before_peer,
    )
    assert estimated_load(endpoint) == 1  # not 2
