"""Moves that reach every stream (issue 52, item 4): `?move_streams=true` on one picker asks every peer,
over the authenticated channel between pickers, to move its streams off the address too. Both sides
judge the message whole: a malformed ask or answer is counted and dropped (nothing moves, nothing
raises), only a member that proves the credential may ask, and a peer that does not answer costs
the asker at most `peers.move_timeout_s`."""

from __future__ import annotations

import asyncio
import logging
import socket
from functools import partial
from typing import Any

import msgpack
import pytest
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import given, settings
from hypothesis import strategies as st

from loadtest.procs import free_port
from picker.admin.api import admin_app
from picker.config.model import PickerConfig, RolloutConfig
from picker.observability.metrics import Metrics
from picker.peers.asks import peer_moves
from picker.peers.auth import EVENTS, MOVES, Handshake
from picker.peers.books import Peering
from picker.peers.events import MOVE_ASK, MOVED, answer_problem, ask_problem
from picker.peers.moves import PoolMoves, everywhere
from picker.pool import EndpointState, Pool
from picker.rollout import Canary, CanaryPlan
from picker.rollout.runner import RolloutRunner
from picker.sources.drain_store import LocalDrains
from picker.wiring import build_core, spawn_owned
from tests.unit.peers.peer_client import Client, FakePeer
from tests.unit.peers.test_peer_links import E1, E2, Side
from tests.unit.peers.test_peer_listener import B, listening

SECRET = "s3cret"  # Side's
SELF = "127.0.0.1:1"
PEERS_SECRET = "rollback-peers-secret-0123"  # a configured credential: 16 characters or more
LABEL = RolloutConfig().group_label

GOOD_ASKS: list[Any] = [[MOVE_ASK, E1], [MOVE_ASK, "[fd00::1]:8000"]]
BAD_ASKS: list[tuple[Any, str]] = [
    (None, "not-an-ask"),
    ([], "not-an-ask"),
    (MOVE_ASK, "not-an-ask"),
    ({"move-streams": E1}, "not-an-ask"),
    (["drain", E1], "unknown-ask"),
    ([[MOVE_ASK], E1], "unknown-ask"),
    ([MOVE_ASK], "bad-ask-arity"),
    ([MOVE_ASK, E1, True], "bad-ask-arity"),
    ([MOVE_ASK, 7], "bad-ask-address"),
    ([MOVE_ASK, ""], "bad-ask-address"),
    ([MOVE_ASK, [E1]], "bad-ask-address"),
    ([MOVE_ASK, "1" * 600], "bad-ask-address"),
]
GOOD_ANSWERS: list[Any] = [
    ["moved", 0],
    ["moved", 12],
    ["cannot", "not-a-proxy"],
    ["error", "unauthenticated"],
]
BAD_ANSWERS: list[tuple[Any, str]] = [
    (None, "not-an-answer"),
    (["moved"], "not-an-answer"),
    (["moved", 1, 2], "not-an-answer"),
    ({"moved": 1}, "not-an-answer"),
    (["moved", -1], "bad-count"),
    (["moved", True], "bad-count"),
    (["moved", 1.5], "bad-count"),
    (["moved", "7"], "bad-count"),
    (["moved", 10**7], "bad-count"),
    (["cannot", ""], "bad-reason"),
    (["cannot", "x" * 65], "bad-reason"),
    (["error", 3], "bad-reason"),
    (["yes", 1], "unknown-answer"),
]


@pytest.mark.parametrize("ask", GOOD_ASKS)
def test_a_well_formed_ask_passes(ask: Any) -> None:
    assert ask_problem(ask) is None


@pytest.mark.parametrize(("ask", "reason"), BAD_ASKS)
def test_a_malformed_ask_is_named_by_reason(ask: Any, reason: str) -> None:
    assert ask_problem(ask) == reason


@pytest.mark.parametrize("answer", GOOD_ANSWERS)
def test_a_well_formed_answer_passes(answer: Any) -> None:
    assert answer_problem(answer) is None


@pytest.mark.parametrize(("answer", "reason"), BAD_ANSWERS)
def test_a_malformed_answer_is_named_by_reason(answer: Any, reason: str) -> None:
    assert answer_problem(answer) == reason


PLAIN = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8) | st.binary(max_size=4),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=10,
)


@settings(max_examples=300, deadline=None)
@given(value=PLAIN | st.lists(st.sampled_from([MOVE_ASK, "moved", "cannot", "error", E1]) | PLAIN))
def test_no_value_from_a_peer_raises_on_either_side(value: Any) -> None:
    """Whatever msgpack can carry: judged, never raised; an answer judged bad moves nothing."""
    ask_problem(value)
    mover = PoolMoves(Peering("127.0.0.1:1", (), Pool()), SECRET, lambda _: 0, 1.0)
    moved, why = mover.judge("127.0.0.1:2", value)
    assert (moved is None) == (why != "")
    malformed = value is not None and answer_problem(value) is not None  # None: it gave no answer
    assert malformed == (sum(mover.rejected.values()) == 1)


async def two(sides: list[Side]) -> tuple[Side, Side, list[str]]:
    """A takes asks from B (its peer); neither opens links of its own."""
    a, b = sides
    members = [await a.listen(), await b.listen()]
    a.accept(members)
    b.accept(members)
    return a, b, members


async def raw_hello(port: int, hello: Any) -> Any:
    """A client writing its own hello (a function of the challenge); the picker's answer."""
    client = await Client.connect(port)
    try:
        client.write(msgpack.packb(hello(client.challenge)))
        return await client.read()
    finally:
        client.close()


async def raw_ask(side: Side, sender: str, ask: Any) -> Any:
    """A member's handshake by hand, then `ask` as its first frame; the picker's answer, opened."""
    client = await Client.connect(port_of(side))
    try:
        await client.handshake_as(MOVES, sender, side.name, SECRET)
        client.send(ask)
        return await client.answer()
    finally:
        client.close()


def port_of(side: Side) -> int:
    return int(side.name.rsplit(":", 1)[1])


async def test_a_members_ask_moves_the_streams_through_the_pickers_mover(sides: list[Side]) -> None:
    a, b, _ = await two(sides)
    assert a.service is not None
    asked: list[str] = []
    a.service.mover = lambda address: asked.append(address) or 3
    assert await peer_moves(a.name, b.name, SECRET, "[FD00::1]:8000", 2.0) == ["moved", 3]
    assert asked == ["[fd00::1]:8000"]  # the address as this picker's pool names it
    assert a.service.refused == 0 and sum(a.service.rejected.values()) == 0


async def test_a_picker_that_cannot_move_streams_says_so(sides: list[Side]) -> None:
    """`picker serve` (no mover: Envoy cannot re-issue a request mid-response) answers `cannot`."""
    a, b, _ = await two(sides)
    assert await peer_moves(a.name, b.name, SECRET, E1, 2.0) == ["cannot", "not-a-proxy"]


async def test_only_an_authenticated_member_may_ask(sides: list[Side]) -> None:
    a, b, _ = await two(sides)
    assert a.service is not None
    asked: list[str] = []
    a.service.mover = lambda address: asked.append(address) or 3
    assert await peer_moves(a.name, b.name, "wrong-secret", E1, 2.0) == ["error", "unauthenticated"]
    stranger = "10.66.6.6:9004"
    assert await peer_moves(a.name, stranger, SECRET, E1, 2.0) == ["error", "not-a-member"]
    replayed = Handshake(MOVES, b.name, a.name, "0" * 32, "1" * 32).hello(SECRET)  # another nonce's
    assert await raw_hello(port_of(a), lambda nonce: replayed) == ["error", "unauthenticated"]
    assert asked == [] and a.service.refused == 3


@pytest.mark.parametrize(("ask", "reason"), [*BAD_ASKS, ([MOVE_ASK, "no-port"], "bad-ask-address")])
async def test_a_malformed_ask_is_counted_and_refused_and_moves_nothing(
    sides: list[Side], ask: Any, reason: str
) -> None:
    a, b, _ = await two(sides)
    assert a.service is not None
    asked: list[str] = []
    a.service.mover = lambda address: asked.append(address) or 3
    answer = await raw_ask(a, b.name, ask)
    assert answer == ["error", "bad-ask"]
    assert asked == [] and a.service.rejected == {reason: 1}


async def test_a_hello_of_the_wrong_shape_is_refused(sides: list[Side]) -> None:
    """The ask is the session's first frame: a hello carrying it is none; nor is the hello of a
    picker before the mutual handshake (`[kind, sender, proof, ask]`)."""
    a, b, _ = await two(sides)
    assert a.service is not None
    asked: list[str] = []
    a.service.mover = lambda address: asked.append(address) or 3

    def with_ask(nonce: str) -> list[Any]:
        return [*Handshake(MOVES, b.name, a.name, nonce, "1" * 32).hello(SECRET), [MOVE_ASK, E1]]

    assert await raw_hello(port_of(a), with_ask) == ["error", "not-a-hello"]
    old = await raw_hello(port_of(a), lambda nonce: [MOVES, b.name, "0" * 64, [MOVE_ASK, E1]])
    assert old == ["error", "old-protocol"]
    events = await raw_hello(port_of(a), lambda nonce: [EVENTS, b.name, "0" * 64])
    assert events == ["error", "old-protocol"]
    assert asked == [] and a.service.rejected == {"not-a-hello": 1, "old-protocol": 2}


async def test_a_mover_that_fails_is_answered_not_raised(sides: list[Side]) -> None:
    a, b, _ = await two(sides)
    assert a.service is not None

    def broken(address: str) -> int:
        raise RuntimeError("boom")

    a.service.mover = broken
    assert await peer_moves(a.name, b.name, SECRET, E1, 2.0) == ["cannot", "failed"]
    assert await peer_moves(a.name, b.name, SECRET, E2, 2.0) == ["cannot", "failed"]  # still listening


async def test_the_pool_move_counts_every_pickers_streams_and_names_who_was_not_reached(
    sides: list[Side],
) -> None:
    """B moves its own 2 and asks A (3 moved), a silent peer, a closed port, a peer with a malformed
    answer and one that cannot: 5 in all, each other peer named with why, in under the timeout."""
    a, b, _ = await two(sides)
    assert a.service is not None
    a.service.mover = lambda address: 3
    silent, garbled, cannot = FakePeer(None), FakePeer(["moved", "7"]), FakePeer(["cannot", "not-a-proxy"])
    closed = f"127.0.0.1:{free_port()}"
    try:
        fakes = [await silent.start(), await garbled.start(), await cannot.start()]
        members = [a.name, b.name, *fakes, closed]
        own: list[str] = []
        moves = PoolMoves(Peering(b.name, members, b.pool), SECRET, lambda x: own.append(x) or 2, 0.5)
        loop = asyncio.get_running_loop()
        started = loop.time()
        answer = await moves.move(E1)
        took = loop.time() - started
    finally:
        for fake in (silent, garbled, cannot):
            await fake.close()
    assert answer == {
        "moved_streams": 5,
        "moved_streams_by_picker": {b.name: 2, a.name: 3},
        "moved_streams_unreached": {
            fakes[0]: "no-answer",
            fakes[1]: "malformed: bad-count",
            fakes[2]: "cannot: not-a-proxy",
            closed: "no-answer",
        },
    }
    assert own == [E1] and 0.45 <= took < 2.0  # the silent peer held it for its timeout, no longer
    assert moves.rejected == {"bad-count": 1}
    assert silent.hellos[0][0] == MOVES and garbled.asks == [[MOVE_ASK, E1]]
    metrics = Metrics(pool="default")
    metrics.register_rejections("peer_move_answers", lambda: moves.rejected)
    assert 'picker_peer_move_answers_rejected_total{reason="bad-count"} 1.0' in metrics.exposition().decode()


async def test_a_peer_that_accepts_but_never_challenges_cannot_hold_the_ask() -> None:
    """A listener whose accept queue takes the connection and nothing more: the ask times out."""
    listener = socket.create_server(("127.0.0.1", 0))
    try:
        peer = f"127.0.0.1:{listener.getsockname()[1]}"
        moves = PoolMoves(Peering("127.0.0.1:1", ["127.0.0.1:1", peer], Pool()), SECRET, lambda _: 0, 0.2)
        answer = await asyncio.wait_for(moves.move(E1), 5)
    finally:
        listener.close()
    assert answer["moved_streams"] == 0 and answer["moved_streams_unreached"] == {peer: "no-answer"}


async def test_the_admin_answer_carries_the_pool_move() -> None:
    """POST .../drain?move_streams=true with peers: the answer is the pool's, not this picker's alone."""
    pool = Pool()
    pool.apply(ready=[E1, E2])
    own: list[str] = []

    async def pool_moves(address: str) -> dict[str, Any]:
        return {
            "moved_streams": 5,
            "moved_streams_by_picker": {"p1": 2, "p2": 3},
            "moved_streams_unreached": {},
        }

    app = admin_app(
        pool, Metrics(pool="default"), move_streams=lambda x: own.append(x) or 2, pool_moves=pool_moves
    )
    client = TestClient(TestServer(app, host="127.0.0.1"))
    await client.start_server()
    try:
        response = await client.post(f"/admin/endpoints/{E1}/drain?move_streams=true")
        body = await response.json()
    finally:
        await client.close()
    assert response.status == 200, body
    assert body["moved_streams"] == 5 and body["moved_streams_by_picker"] == {"p1": 2, "p2": 3}
    assert body["endpoint"]["state"] == "draining" and own == []  # the pool move moves this one's too


async def test_a_rollback_moves_the_candidates_streams_on_every_picker_sharing_the_books() -> None:
    """rollout.move_streams with peers: the rollback's move is the admin move's, asking every peer to
    move its streams off the candidate too (each proxy holds its own streams' bytes)."""
    secret = PEERS_SECRET
    peer = FakePeer([MOVED, 4], secret)
    tasks: set[asyncio.Task[None]] = set()
    try:
        address = await peer.start()
        config = PickerConfig.model_validate(
            {
                "peers": {"members": [SELF, address], "advertise": SELF, "secret": secret},
                "rollout": {"candidate": "v2", "move_streams": True},
            }
        )
        core = build_core(config)
        label = config.rollout.group_label
        core.pool.reconcile({E1: EndpointState.READY, E2: EndpointState.READY}, "file",
                            labels={E1: {label: "v1"}, E2: {label: "v2"}})  # fmt: skip
        own: list[str] = []
        core.admin(partial(spawn_owned, tasks), move=lambda a: own.append(a) or 2)
        assert core.rollout is not None
        await core.rollout.command("abort")
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await peer.close()
    assert core.pool.get(E2).state is EndpointState.DRAINING  # type: ignore[union-attr]
    assert own == [E2] and peer.asks == [[MOVE_ASK, E2]]


def test_a_rollout_with_peers_and_no_shared_drain_store_says_its_rollback_drains_here_only(
    caplog: pytest.LogCaptureFixture,
) -> None:
    config = PickerConfig.model_validate(
        {
            "peers": {"members": [SELF, "127.0.0.1:2"], "advertise": SELF, "secret": PEERS_SECRET},
            "rollout": {"candidate": "v2"},
        }
    )
    core = build_core(config)
    core.admin(lambda coro, name: coro.close())
    said = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("no shared drain store" in m for m in said), said


def rolling_back(peer: str, candidates: int) -> tuple[RolloutRunner, list[str]]:
    """A rollout over `candidates` candidate endpoints (and one stable), its rollback moving streams
    as the wiring has it (`everywhere`: this picker's own, then its peer's); what moved here."""
    pool = Pool()
    addresses = [f"10.1.0.{i}:8000" for i in range(1, candidates + 1)]
    pool.reconcile(
        {a: EndpointState.READY for a in (E1, *addresses)},
        "file",
        labels={E1: {LABEL: "v1"}, **{a: {LABEL: "v2"} for a in addresses}},
    )
    runner = RolloutRunner(Canary(CanaryPlan.of(RolloutConfig(candidate="v2")), pool.now()), pool, 1.0)
    runner.store = LocalDrains(pool)
    own: list[str] = []
    moves = PoolMoves(Peering(B, (B, peer), pool), SECRET, lambda a: own.append(a) or 1, 2.0)
    runner.move_streams = everywhere(lambda a: own.append(a) or 1, moves)
    return runner, own


async def test_a_rollback_of_more_candidates_than_the_peers_hello_cap_reaches_the_peer_for_each() -> None:
    """12 candidate endpoints against a real peer listener, which admits at most 8 connections from
    one member's address before their hellos (peers.max_unauthenticated_per_source): every move
    reaches the peer. Before: all 12 asks opened at once, some were refused at the peer's gate
    (too-many-from-source) and those endpoints' streams on the peer were left where they were."""
    listener = await listening(per_source=8, peer=B, port=free_port())
    asked: list[str] = []
    listener.inbox.mover = lambda address: asked.append(address) or 1
    try:
        runner, own = rolling_back(f"127.0.0.1:{listener.port}", 12)
        candidates = runner.candidates()
        await runner.command("abort")
    finally:
        await listener.inbox.close()
    assert len(candidates) == 12 and sorted(own) == sorted(candidates)
    assert listener.refused == {} and sorted(asked) == sorted(candidates)


async def test_a_rollback_move_that_does_not_reach_a_peer_is_a_warning_with_the_count(
    caplog: pytest.LogCaptureFixture,
) -> None:
    closed = f"127.0.0.1:{free_port()}"
    runner, own = rolling_back(closed, 2)
    runner_log = "picker.rollout.runner"
    with caplog.at_level(logging.INFO, logger=runner_log):
        await runner.command("abort")
    said = [r.getMessage() for r in caplog.records if r.name == runner_log and r.levelname == "WARNING"]
    assert len(own) == 2
    assert len([m for m in said if "1 peer(s) not reached" in m and closed in m]) == 2, said
