"""Peer content rules everywhere (issue 53, item 4). Before: a peer's `sync` could book the receiver's
own requests, or a third picker's, in the sender's book (the per-event rule "only the sender's own
books" did not reach a sync's entries); a peer's answer to the drains query was used unvalidated (one
malformed answer made `GET /admin/drains?scope=pool` a 500); and the close of a superseded connection
from a peer orphaned the books its newer session had just brought."""

from __future__ import annotations

import copy
import json
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import given, settings
from hypothesis import strategies as st

from loadtest.procs import async_wait_until
from picker.admin.api import admin_app
from picker.observability.metrics import Metrics
from picker.peers.asks import PoolDrains, peer_drains
from picker.peers.auth import EVENTS
from picker.peers.books import Peering
from picker.peers.events import drains_problem
from picker.peers.inbox import PeerInbox
from picker.pool import Pool
from picker.pool.drain import merge_summaries
from tests.unit.peers.peer_client import Client, FakePeer
from tests.unit.peers.test_peer_links import drain_summaries
from tests.unit.peers.test_peer_listener import A, B, Listening, listening
from tests.unit.peers.test_peering import E1, E2, REQUEST, Picker

C = "10.1.0.3:9004"
SECRET = "s3cret"
PA, PB = "10.1.0.1:9004", "10.1.0.2:9004"


def books(picker: Picker) -> tuple[int, ...]:
    return tuple(e.peer_in_flight for e in picker.pool.endpoints())


# --- a sync books only the sender's own requests --------------------------------------------------------


def test_a_sync_cannot_book_the_receivers_or_a_third_pickers_requests() -> None:
    a = Picker(PA, (PA, PB, C))
    box = PeerInbox(a.peering, a.path, None, lambda: [])
    a.path.admit(REQUEST)  # one of A's own, counted in its record, not in a peer's book
    before = books(a)
    box.apply(PB, [["sync", f"{PB}~", [[f"{PA}~0", E1], [f"{PB}~ok", E2]]]])  # A's own request
    box.apply(PB, [["sync", f"{PB}~", [[f"{C}~x", E1]]]])  # a third picker's
    assert books(a) == before and box.rejected == {"not-its-own": 2}  # each refused whole
    box.apply(PB, [["sync", f"{PB}~", [[f"{PB}~ok", E2]]]])
    assert a.pool.get(E2).peer_in_flight == 1  # type: ignore[union-attr]


def test_the_books_themselves_take_no_foreign_entry_from_a_sync() -> None:
    """The same rule in the core: whoever calls `book`, a sync fills the sender's book only."""
    a = Picker(PA, (PA, PB, C))
    a.peering.book(PB, ["sync", f"{PB}~", [[f"{PA}~0", E1], [f"{C}~x", E1], [f"{PB}~ok", E2]]])
    assert books(a) == (0, 1) and a.peering.held()["books"] == {PB: 1, C: 0}


# --- a drains answer is judged whole ------------------------------------------------------------------


def a_summary() -> dict[str, Any]:
    [summary] = drain_summaries()
    return summary


BAD_DRAINS: list[tuple[Any, str]] = [
    (None, "not-a-list"),
    ({"address": E1}, "not-a-list"),
    (["error"], "not-a-record"),
    ([[E1]], "not-a-record"),
    ([{"address": 1}], "bad-field"),
    ([{**a_summary(), "started_wall": "yesterday"}], "bad-field"),
    ([{**a_summary(), "started_wall": float("nan")}], "bad-field"),
    ([{**a_summary(), "ended": {"completed": "3"}}], "bad-field"),
    ([{**a_summary(), "ended": []}], "bad-field"),
    ([{**a_summary(), "in_flight_at_start": -1}], "bad-field"),
    ([{**a_summary(), "pulls_at_start": "one"}], "bad-field"),  # optional, but a count when sent
    ([{**a_summary(), "open": 1}], "bad-field"),
    ([{k: v for k, v in a_summary().items() if k != "address"}], "bad-field"),
    ([{**a_summary(), "extra": [1, 2]}], "bad-field"),
]


def test_a_well_formed_drains_answer_passes() -> None:
    assert drains_problem([]) is None
    assert drains_problem([a_summary(), {**a_summary(), "open": False, "exit": "ready"}]) is None


@pytest.mark.parametrize(("answer", "reason"), BAD_DRAINS)
def test_a_malformed_drains_answer_is_named(answer: Any, reason: str) -> None:
    assert drains_problem(answer) == reason


ANYTHING = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6,
)


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_a_drains_answer_that_passes_merges_and_encodes(data: st.DataObject) -> None:
    """A record with one field replaced, removed or added: judged, never raised; one that passes is
    one the pool's merge and the admin answer's JSON take."""
    record = copy.deepcopy(a_summary())
    keys = sorted(record)
    change = data.draw(st.sampled_from(["replace", "remove", "add", "none"]))
    if change == "replace":
        record[data.draw(st.sampled_from(keys))] = data.draw(ANYTHING)
    elif change == "remove":
        del record[data.draw(st.sampled_from(keys))]
    elif change == "add":
        record[data.draw(st.text(max_size=8))] = data.draw(ANYTHING)
    shape = data.draw(st.sampled_from(["one", "two", "bare", "anything"]))
    answer = {"one": [record], "two": [record, a_summary()], "bare": record}.get(shape) or data.draw(ANYTHING)
    if drains_problem(answer) is None:
        json.dumps(merge_summaries([[a_summary()], answer]), allow_nan=False)


@pytest.fixture
async def fakes() -> AsyncIterator[list[FakePeer]]:
    made: list[FakePeer] = []
    yield made
    for fake in made:
        await fake.close()


async def test_a_malformed_drains_answer_is_counted_and_the_pool_view_still_answers(
    fakes: list[FakePeer],
) -> None:
    good, garbled = FakePeer([a_summary()]), FakePeer([{"address": E1, "started_wall": "x"}])
    fakes += [good, garbled]
    members = ["127.0.0.1:1", await good.start(), await garbled.start()]
    rejected: Counter[str] = Counter()
    assert await peer_drains(members[2], members[0], SECRET, rejected=rejected) == []
    assert rejected == {"bad-field": 1}
    pool = Pool()
    pool.apply(ready=[E1, E2])
    drains = PoolDrains(Peering(members[0], members, pool), SECRET)
    app = admin_app(pool, Metrics(pool="default"), pool_drains=drains)
    client = TestClient(TestServer(app, host="127.0.0.1"))
    await client.start_server()
    try:
        response = await client.get("/admin/drains?scope=pool")
        body = await response.json()
    finally:
        await client.close()
    assert response.status == 200, body  # before: a 500
    assert [d["address"] for d in body["drains"]] == [E1] and drains.rejected == {"bad-field": 1}
    metrics = Metrics(pool="default")
    metrics.register_rejections("peer_drain_answers", lambda: drains.rejected)
    assert 'picker_peer_drain_answers_rejected_total{reason="bad-field"} 1.0' in metrics.exposition().decode()


# --- a superseded connection's close -----------------------------------------------------------------


@pytest.fixture
async def listener() -> AsyncIterator[Listening]:
    made = await listening()
    yield made
    await made.inbox.close()


async def test_a_superseded_connections_close_leaves_the_newer_sessions_books(listener: Listening) -> None:
    """B restarts: its new session's books arrive while A still holds the old connection, whose close
    A reads later. The old books become orphans when the new session opens (their streams may run
    on); the old close changes nothing."""
    peering, inbox = listener.peering, listener.inbox

    def books_read() -> dict[str, str]:
        inbox.catch_up()  # what the request path does before each admission
        return peering._books[B]

    old = await Client.connect(listener.port)
    await old.handshake_as(EVENTS, B, A, SECRET)
    old.send([["pick", f"{B}~old", E1]])
    await async_wait_until(lambda: books_read() == {f"{B}~old": E1}, 5, what="the old session's pick")
    new = await Client.connect(listener.port)
    await new.handshake_as(EVENTS, B, A, SECRET)
    new.send([["pick", f"{B}~new", E2]])
    await async_wait_until(lambda: f"{B}~new" in books_read(), 5, what="the new session's pick")
    old.close()
    await async_wait_until(
        lambda: books_read() is not None and len(inbox._connections) == 1, 5, what="the old one gone"
    )
    assert peering._books[B] == {f"{B}~new": E2}  # before: orphaned by the old connection's close
    assert peering._orphans == {f"{B}~old": E1} and B in peering.heard
    new.close()
