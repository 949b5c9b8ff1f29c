"""Two pickers, one set of books (issue 23), in process: each request's end reaches the picker that
routed it, whichever saw its response, and each picker counts the other's requests on every endpoint."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from picker.observability.metrics import Metrics
from picker.peers.books import Peering, owner_of
from picker.pool import EndpointState, Pool
from picker.pool.load import LoadSample
from picker.request.inference import InferenceRequest
from picker.request.pipeline import RequestPath
from picker.scheduling import LoadPolicy
from picker.streams import Attempts, EndReason

E1, E2 = "10.0.0.1:8000", "10.0.0.2:8000"
A, B = "10.1.0.1:9004", "10.1.0.2:9004"
REQUEST = InferenceRequest(method="POST", path="/v1/completions", model="m", stream=True)
TOKEN = b'data: {"choices":[{"text":" t","finish_reason":null}]}\n\n'
LAST = b'data: {"choices":[{"text":"","finish_reason":"length"}]}\n\ndata: [DONE]\n\n'


class Picker:
    def __init__(
        self,
        name: str,
        members: tuple[str, ...] = (A, B),
        clock: Callable[[], float] = time.monotonic,
        load_policy: LoadPolicy | None = None,
    ) -> None:
        self.pool = Pool(clock=clock)
        self.pool.apply(ready=[E1, E2])
        self.metrics = Metrics(pool="default")
        self.metrics.register_pool(self.pool)
        self.peering = Peering(name, members, self.pool, clock=clock)
        self.path = RequestPath(
            self.pool,
            self.metrics,
            fallback_count=0,
            schedule=lambda d, f: lambda: None,
            peering=self.peering,
            clock=clock,
            load_policy=load_policy,
        )


def deliver(*pickers: Picker) -> None:
    """Carry every queued event to its peer, until nothing is left (the transport's job)."""
    by_name = {p.peering.name: p for p in pickers}
    moved = True
    while moved:
        moved = False
        for sender in pickers:
            for name, receiver in by_name.items():
                for event in sender.peering.outbox.take(name):
                    moved = True
                    if not receiver.peering.book(sender.peering.name, event):
                        receiver.path.peer_event(event, sender.peering.name)


def test_a_response_seen_by_the_other_picker_ends_on_the_router() -> None:
    a, b = Picker(A), Picker(B)
    record = a.path.admit(REQUEST).payload
    assert owner_of(record.request_id) == A
    deliver(a, b)
    endpoint = record.picked[0]
    assert b.pool.get(endpoint).peer_in_flight == 1  # type: ignore[union-attr]
    shadow = b.path.attach_observer(record.request_id)  # Envoy sent the observer stream to B
    assert shadow is not None and shadow.owner == A
    b.path.response_started(shadow, 200, endpoint, True)
    b.path.body_chunk(shadow, TOKEN)
    deliver(a, b)
    assert record.observed and record.response_started_at is not None
    assert record.tracker is not None and record.tracker.first_byte_at is not None
    b.path.body_chunk(shadow, TOKEN)
    b.path.body_chunk(shadow, LAST)
    b.path.observer_ended(shadow, True)
    deliver(a, b)
    assert record.end_reason is EndReason.COMPLETED
    assert a.pool.in_flight() == 0 and b.pool.get(endpoint).peer_in_flight == 0  # type: ignore[union-attr]
    assert a.metrics.registry.get_sample_value("picker_request_ends_total", {"reason": "completed"}) == 1
    assert b.metrics.registry.get_sample_value("picker_observer_unmatched_total") in (None, 0.0)


def test_a_cut_stream_is_settled_by_the_access_log_forwarded_to_the_router() -> None:
    a, b = Picker(A), Picker(B)
    record = a.path.admit(REQUEST).payload
    deliver(a, b)
    shadow = b.path.attach_observer(record.request_id)
    assert shadow is not None
    b.path.response_started(shadow, 200, record.picked[0], True)
    b.path.body_chunk(shadow, TOKEN)
    b.path.observer_ended(shadow, False)  # cut short: the body cannot say who cut it
    b.path.access_logged(
        record.request_id, Attempts(flags=frozenset({"downstream_remote_reset"}), status=200)
    )
    deliver(a, b)
    assert record.end_reason is EndReason.CLIENT_DISCONNECT


def test_each_picker_counts_the_others_requests_so_load_spreads() -> None:
    a, b = Picker(A), Picker(B)
    placed = []
    for turn in range(8):  # the two pickers take turns, as Envoy spreads streams over them
        picker = a if turn % 2 == 0 else b
        placed.append(picker.path.admit(REQUEST).payload.picked[0])
        deliver(a, b)
    assert placed.count(E1) == placed.count(E2) == 4  # with only its own counts each would pile up
    assert a.pool.get(E1).in_flight + a.pool.get(E1).peer_in_flight == 4  # type: ignore[union-attr]


def peer_counts(picker: Picker) -> int:
    return sum(e.peer_in_flight for e in picker.pool.endpoints())


def test_a_dead_peers_requests_count_until_their_engine_no_longer_runs_them() -> None:
    """A picker SIGKILLed leaves its streams running: the survivor keeps them on the books (orphans)
    until the engine's gauges show them gone; never dropped early, never counted for ever."""
    a, b = Picker(A), Picker(B)
    first, second = (a.path.admit(REQUEST).payload for _ in range(2))
    deliver(a, b)
    assert peer_counts(b) == 2
    b.peering.peer_gone(A)
    assert peer_counts(b) == 2 and b.peering.orphans == 2  # still streaming on the replicas
    endpoint = b.pool.get(first.picked[0])
    assert endpoint is not None
    b.path.capacity_changed()  # no scrape yet: nothing to settle against
    assert b.peering.orphans == 2
    running = 1 if first.picked[0] == second.picked[0] else 0  # one of them ended
    endpoint.load = LoadSample(running, 0, 0.0, at=0.0, arrivals_before=endpoint.arrivals, departures_after=0)
    b.path.capacity_changed()
    assert endpoint.peer_in_flight == running and b.peering.orphans == 1
    other = b.pool.get(second.picked[0])
    assert other is not None
    other.load = LoadSample(0, 0, 0.0, at=0.0, arrivals_before=other.arrivals, departures_after=0)
    b.path.capacity_changed()
    assert peer_counts(b) == 0 and b.peering.orphans == 0  # not leaked


def test_an_orphan_goes_when_its_end_is_seen_or_its_owner_resends_its_books() -> None:
    a, b = Picker(A), Picker(B)
    seen, resent = (a.path.admit(REQUEST).payload for _ in range(2))
    deliver(a, b)
    shadow = b.path.attach_observer(seen.request_id)
    assert shadow is not None
    b.peering.peer_gone(A)
    b.path.response_started(shadow, 200, seen.picked[0], True)
    b.path.body_chunk(shadow, LAST)
    b.path.observer_ended(shadow, True)
    assert b.peering.orphans == 1 and peer_counts(b) == 1
    b.peering.book(A, ["pick", resent.request_id, resent.picked[0]])  # A's link back: its books first
    assert b.peering.orphans == 0 and peer_counts(b) == 1


def test_an_end_heard_first_outlives_every_pick_that_comes_after_it() -> None:
    """Found by the chaos test (tests/envoy/test_chaos.py): a request picked by A while its link to B
    was cut, observed and ended on B. On the reconnect B hears A's pick twice (the resent books,
    then the pick queued during the cut): the first used up the tombstone of its end, the second
    was booked and stayed, since A, told of the end by B, sends B no `end`. B over-counted for ever."""
    a, b = Picker(A), Picker(B)
    cut = a.path.admit(REQUEST).payload
    queued = a.peering.outbox.take(B)  # A's pick, held while the link is down
    shadow = b.path.attach_observer(cut.request_id)
    assert shadow is not None
    b.path.response_started(shadow, 200, cut.picked[0], True)
    b.path.body_chunk(shadow, LAST)
    b.path.observer_ended(shadow, True)
    assert peer_counts(b) == 0
    b.peering.book(A, ["pick", cut.request_id, cut.picked[0]])  # the link back: A's books first
    for event in queued:  # then what was queued during the cut
        b.peering.book(A, event)
    deliver(a, b)  # B's reports reach A: its record ends there, told by B
    assert a.path.live == 0 and peer_counts(b) == 0


def test_requests_of_no_known_peer_are_unmatched_as_before() -> None:
    b = Picker(B)
    assert b.path.attach_observer("10.9.9.9:9004~deadbeef") is None
    assert b.path.attach_observer("plainid") is None
    assert b.metrics.registry.get_sample_value("picker_observer_unmatched_total") == 2


def test_drain_records_of_the_router_count_what_it_routed_wherever_it_was_observed() -> None:
    a, b = Picker(A), Picker(B)
    record = a.path.admit(REQUEST).payload
    endpoint = record.picked[0]
    deliver(a, b)
    a.pool.set_state(endpoint, EndpointState.DRAINING)
    shadow = b.path.attach_observer(record.request_id)
    assert shadow is not None
    b.path.response_started(shadow, 200, endpoint, True)
    b.path.body_chunk(shadow, LAST)
    b.path.observer_ended(shadow, True)
    deliver(a, b)
    drain = a.pool.get(endpoint).drain  # type: ignore[union-attr]
    assert drain is not None and drain.in_flight_at_start == 1 and drain.ends
    assert sum(drain.ends.values()) == 1 and drain.picks_after_start == 0


def test_a_request_whose_observer_was_on_a_dead_peer_is_settled_by_its_engine() -> None:
    a, b = Picker(A), Picker(B)
    record = a.path.admit(REQUEST).payload
    deliver(a, b)
    assert b.path.attach_observer(record.request_id) is not None
    deliver(a, b)
    assert record.observed_by == B
    a.path.peer_gone(B)  # B SIGKILLed: nobody will report this stream's end
    assert not record.ended and record.engine_tracked
    endpoint = a.pool.get(record.picked[0])
    assert endpoint is not None
    endpoint.load = LoadSample(0, 0, 0.0, at=1e9, arrivals_before=endpoint.arrivals, departures_after=0)
    a.path.capacity_changed()  # the engine runs nothing: it ended
    assert record.end_reason is EndReason.UNOBSERVED and a.pool.in_flight() == 0


def test_a_streams_done_ends_it_before_the_end_of_stream() -> None:
    """`data: [DONE]` is the stream's end (what follows is framing): the endpoint's slot is free for
    the next pick at once, here and on the peers, and the end of stream after it settles nothing twice."""
    a, b = Picker(A), Picker(B)
    own = a.path.admit(REQUEST).payload
    deliver(a, b)
    observed = a.path.attach_observer(own.request_id)
    assert observed is own
    a.path.response_started(own, 200, own.picked[0], True)
    a.path.body_chunk(own, TOKEN)
    assert own.end_reason is None and a.pool.in_flight() == 1
    a.path.body_chunk(own, LAST)
    assert own.end_reason is EndReason.COMPLETED and a.pool.in_flight() == 0
    deliver(a, b)
    assert sum(e.peer_in_flight for e in b.pool.endpoints()) == 0
    ends = a.metrics.registry.get_sample_value("picker_request_ends_total", {"reason": "completed"})
    a.path.body_chunk(own, b"")  # what Envoy sends with end_of_stream
    a.path.observer_ended(own, True)
    again = a.metrics.registry.get_sample_value("picker_request_ends_total", {"reason": "completed"})
    assert ends == again == 1.0 and not a.peering.outbox.pending


def test_the_first_token_and_the_end_are_dated_as_the_observer_saw_them() -> None:
    """Reports wait a few milliseconds to share a message, and pickers' clocks need not agree: the
    router dates a request's first token (TTFT) and its end (drain records) by the age each report
    carries, not by when the message reached it."""
    now = {A: 100.0, B: 5000.0}  # two nodes' monotonic clocks: unrelated
    a, b = Picker(A, clock=lambda: now[A]), Picker(B, clock=lambda: now[B])

    def advance(seconds: float) -> None:
        for name in now:
            now[name] += seconds

    record = a.path.admit(REQUEST).payload
    endpoint = record.picked[0]
    deliver(a, b)
    a.pool.set_state(endpoint, EndpointState.DRAINING)
    shadow = b.path.attach_observer(record.request_id)
    assert shadow is not None
    advance(0.2)
    b.path.response_started(shadow, 200, endpoint, True)
    b.path.body_chunk(shadow, TOKEN)  # the first token, 0.2 s after admission
    advance(0.004)  # the report's flush window
    deliver(a, b)
    assert record.tracker is not None and record.tracker.first_byte_at == pytest.approx(100.2)
    ttft = a.metrics.registry.get_sample_value("picker_time_to_first_token_seconds_sum", {"model": "m"})
    assert ttft == pytest.approx(0.2)
    advance(1.0)
    b.path.body_chunk(shadow, LAST)  # its end: 1.204 s after admission
    advance(0.003)  # a late message
    deliver(a, b)
    assert record.end_reason is EndReason.COMPLETED and record.ended_at == pytest.approx(101.204)
    drain = a.pool.get(endpoint).drain  # type: ignore[union-attr]
    assert drain is not None and drain.time_to_zero_s == pytest.approx(1.204)


def test_a_report_without_an_age_or_with_a_bad_one_is_dated_on_arrival() -> None:
    """A picker of a version before ages (a rolling upgrade), or a bad value: the time it arrived."""
    now = [10.0]
    a = Picker(A, clock=lambda: now[0])
    record = a.path.admit(REQUEST).payload
    a.path.peer_event(["claim", record.request_id], B)
    a.path.peer_event(["started", record.request_id, 200, record.picked[0], True], B)
    now[0] = 10.5
    a.path.peer_event(["first", record.request_id, "soon"], B)
    assert record.tracker is not None and record.tracker.first_byte_at == 10.5
    now[0] = 11.0
    a.path.peer_event(["ended", record.request_id, True, None], B)
    assert record.ended_at == 11.0


def test_an_observer_that_sees_no_body_hands_the_end_to_the_owners_engine_gauges() -> None:
    """Issue 40, item 3: with an observer that sees response headers only, the observing picker's
    shadow record was never removed (one more per peer request) and the owner's record waited for
    an end that never came, holding its slot until the endpoint went away."""
    a, b = Picker(A), Picker(B)
    record = a.path.admit(REQUEST).payload
    deliver(a, b)
    shadow = b.path.attach_observer(record.request_id)
    assert shadow is not None
    b.path.response_started(shadow, 200, record.picked[0], True)
    b.path.observer_blind(shadow)  # the observer's stream ends at the headers: no body will come
    deliver(a, b)
    assert not b.peering._shadows  # nothing left behind on the observing picker
    assert record.engine_tracked  # the owner's engine gauges end it
    endpoint = a.pool.get(record.picked[0])
    assert endpoint is not None
    endpoint.load = LoadSample(0, 0, 0.0, a.pool.now() + 1, endpoint.arrivals, endpoint.departures)
    a.path.capacity_changed()
    assert record.ended and a.pool.in_flight() == 0


def test_an_orphan_ended_by_its_observer_is_not_booked_again_by_the_owners_resent_books() -> None:
    """Found by the chaos test: the link broke (A's books on B became orphans); B's observer saw one
    of them end; A, not yet told (B's report waits behind the link), resent it with its books on
    the reconnect. B booked it again, and A, told by B, never sent B an `end`: B over-counted."""
    a, b = Picker(A), Picker(B)
    request = a.path.admit(REQUEST).payload
    deliver(a, b)
    shadow = b.path.attach_observer(request.request_id)
    assert shadow is not None
    deliver(a, b)
    b.path.peer_gone(A)  # the link breaks: A's request is an orphan on B
    b.path.response_started(shadow, 200, request.picked[0], True)
    b.path.body_chunk(shadow, LAST)
    b.path.observer_ended(shadow, True)  # the orphan goes with it
    b.peering.book(A, ["pick", request.request_id, request.picked[0]])  # A's books, resent
    deliver(a, b)
    assert a.path.live == 0 and peer_counts(b) == 0


def test_a_pick_read_after_its_owners_end_is_stale() -> None:
    """Found by the chaos test (a picker restarted under load): the owner's link flapped, and the
    receiver read a pick left on the old connection after the owner's `end` on the new one. The end
    left no tombstone (it came from the owner), so the late pick was booked for ever."""
    a, b = Picker(A), Picker(B)
    request = a.path.admit(REQUEST).payload
    stale = a.peering.outbox.take(B)  # the pick, still in the old connection's buffer
    b.peering.book(A, ["pick", request.request_id, request.picked[0]])  # the resent books
    b.peering.book(A, ["end", request.request_id])  # it ended; the owner says so
    for event in stale:  # the old connection's bytes, read last
        b.peering.book(A, event)
    assert peer_counts(b) == 0


def test_the_owners_periodic_sync_drops_what_it_no_longer_runs() -> None:
    """A book entry whose end never arrived (however it was lost) is counted until the owner's next
    sync of its books, never for ever; the sync re-books what is missing, but never an ended one."""
    a, b = Picker(A), Picker(B)
    kept, lost = (a.path.admit(REQUEST).payload for _ in range(2))
    deliver(a, b)
    ghost = f"{A}~feedbeef"
    b.peering.book(A, ["pick", ghost, E1])  # an entry whose end was lost
    b.peering.book(A, ["end", lost.request_id])
    b.peering.book(A, ["pick", lost.request_id, lost.picked[0]])  # a stale pick: tombstoned
    assert peer_counts(b) == 2
    a.path.finish(lost, EndReason.CLIENT_DISCONNECT)
    a.peering.sync(a.path.live_records())  # what its transport does every few seconds
    deliver(a, b)
    assert peer_counts(b) == 1 and b.peering.held()["books"] == {A: 1}
    a.path.finish(kept, EndReason.CLIENT_DISCONNECT)
    deliver(a, b)
    assert peer_counts(b) == 0


def test_a_peers_claim_takes_a_request_back_from_the_engines_gauges() -> None:
    """A clean-clone CI run: with two pickers, a routing stream closed before the other picker's
    claim came, on a connection whose observer streams had all gone to that picker; the request was
    handed to the engine's gauges, which ended it `unobserved` before its observer's report came.
    A claim now takes it back, as a local observer stream does."""
    a, b = Picker(A), Picker(B)
    record = a.path.admit(REQUEST).payload
    a.path.hand_to_engine(record)
    assert record.engine_tracked
    deliver(a, b)
    assert b.path.attach_observer(record.request_id) is not None
    deliver(a, b)
    assert record.observed and not record.engine_tracked
