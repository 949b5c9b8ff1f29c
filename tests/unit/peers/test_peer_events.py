"""Events from a peer are checked whole before any of them changes state (issue 40, item 2): before,
`["end", 7]` raised out of the request path (catch_up runs before every admission), a pick naming a
list as its endpoint was half applied, and one bad event dropped the rest of its message."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from picker.peers.books import owner_of
from picker.peers.events import problem
from picker.peers.inbox import PeerInbox
from tests.unit.peers.test_peering import E1, REQUEST, A, B, Picker

GOOD: list[list[Any]] = [
    ["pick", f"{B}~a1", E1],
    ["pick", f"{B}~a2", E1, "10.9.0.1:5555>10.9.0.2:80"],
    ["move", f"{B}~a1", E1],
    ["end", f"{B}~a2"],
    ["claim", f"{A}~x"],
    ["started", f"{A}~x", 200, E1, True],
    ["first", f"{A}~x", 0.25],
    ["alive", f"{A}~x"],
    ["ended", f"{A}~x", True, {"first": True, "done": True, "chunks": 3}, 0.5],
    ["log", f"{A}~x", 1, ["UR"], 200, E1],
]
BAD: list[tuple[Any, str]] = [
    (["end", 7], "bad-request-id"),
    (["pick", f"{B}~x", ["z"]], "bad-field"),
    (["pick", f"{B}~x"], "bad-arity"),
    (["pick", f"{B}~x", E1, "c", "extra"], "bad-arity"),
    (["started", f"{A}~x", "200", E1, True], "bad-field"),
    (["ended", f"{A}~x", True, {"first": [1]}, 0.1], "bad-field"),
    (["first", f"{A}~x", float("nan")], "bad-field"),
    (["log", f"{A}~x", 1, "UR", 200, E1], "bad-field"),
    (["explode", f"{A}~x"], "unknown-kind"),
    ({"pick": 1}, "not-an-event"),
    (["pick"], "not-an-event"),
]


def test_every_event_a_picker_sends_is_well_formed() -> None:
    assert [problem(e) for e in GOOD] == [None] * len(GOOD)


@pytest.mark.parametrize(("event", "reason"), BAD)
def test_malformed_events_are_named(event: Any, reason: str) -> None:
    assert problem(event) == reason


def inbox(picker: Picker) -> PeerInbox:
    return PeerInbox(picker.peering, picker.path, None, lambda: [])


def books(picker: Picker) -> tuple[int, ...]:
    return tuple(e.peer_in_flight for e in picker.pool.endpoints())


def test_a_message_with_bad_events_applies_its_good_ones_and_nothing_else() -> None:
    a = Picker(A)
    box = inbox(a)
    box.apply(B, [["end", 7], ["pick", f"{B}~x", ["z"]], ["pick", f"{B}~ok", E1]])
    assert a.pool.get(E1).peer_in_flight == 1  # type: ignore[union-attr]  # the good pick, once
    assert box.rejected == {"bad-request-id": 1, "bad-field": 1}
    a.path.admit(REQUEST)  # the request path reads peers' events first: nothing raises there
    a.peering.peer_gone(B)  # its requests become orphans; settling them must not raise either
    a.path.capacity_changed()


def test_a_stranger_cannot_write_in_another_pickers_books() -> None:
    a = Picker(A)
    box = inbox(a)
    box.apply("10.66.6.6:1", [["pick", f"{B}~forged", E1]])  # named as B's, sent by someone else
    assert books(a) == (0, 0) and box.rejected == {"not-its-own": 1}


def test_the_rejections_are_a_metric_by_reason() -> None:
    a = Picker(A)
    box = inbox(a)
    a.metrics.register_rejections("peer_events", lambda: box.rejected)
    box.apply(B, [["end", 7], "nonsense"])
    assert (
        a.metrics.registry.get_sample_value("picker_peer_events_rejected_total", {"reason": "bad-request-id"})
        == 1
    )
    assert (
        a.metrics.registry.get_sample_value("picker_peer_events_rejected_total", {"reason": "not-an-event"})
        == 1
    )


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_mutated_events_never_raise_and_never_half_apply(data: st.DataObject) -> None:
    """Any event, or a valid one with one field replaced by anything msgpack can carry: applied
    whole or not at all, and never an exception out of the inbox."""
    a = Picker(A)
    box = inbox(a)
    anything = st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
        max_leaves=6,
    )
    event = copy.deepcopy(data.draw(st.sampled_from(GOOD)))
    if data.draw(st.booleans()):
        event[data.draw(st.integers(0, len(event) - 1))] = data.draw(anything)
    before = books(a)
    box.apply(B, [event])
    foreign = event[0] in ("pick", "move") and owner_of(str(event[1])) not in (None, B)
    if problem(event) is not None or foreign:  # rejected: the books as they were
        assert books(a) == before


def test_an_event_naming_a_picker_nobody_configured_opens_no_book() -> None:
    a = Picker(A)
    box = inbox(a)
    box.apply(B, [["end", f"10.9.9.{i}:1~x"] for i in range(50)])  # before: a book per invented owner
    assert set(a.peering._books) <= {B} and box.rejected == {"unknown-owner": 50}


async def test_a_peers_request_ending_dispatches_a_request_queued_here_at_once() -> None:
    """Both engines' one slot held by the peer's requests: a request queues here; the peer's end
    frees a slot, and the queued request takes it then (before, only at this picker's next scrape,
    arrival or own end)."""
    from picker.pool.scrapes import record_sample
    from picker.scheduling import LoadPolicy
    from tests.unit.peers.test_peering import E2

    a = Picker(A, clock=lambda: 1.0, load_policy=LoadPolicy(engine_slots=1, engine_queue=0))
    for endpoint in a.pool.endpoints():
        record_sample(endpoint, running=0.0, waiting=0.0, kv_usage=0.1, now=1.0)
    box = inbox(a)
    box.apply(B, [["pick", f"{B}~1", E1], ["pick", f"{B}~2", E2]])
    ticket = a.path.admit(REQUEST)
    assert not ticket.done  # every slot held by the peer's requests
    box.apply(B, [["end", f"{B}~1"]])
    assert ticket.done and ticket.payload.picked == (E1,)
