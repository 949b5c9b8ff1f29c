"""Mutual, bound peer sessions (issue 53, item 3). Before, the hello proved the sender to the receiver
only: it named no receiver (a member could relay a hello meant for another picker), the connecting
picker never learnt whether it spoke to a member, and what followed the hello carried no integrity.
Now both sides prove the credential over both nonces, both names and the kind, and every frame after
the hello carries a MAC under the session's key and its sequence number."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loadtest.procs import async_wait_until
from picker.observability.metrics import Metrics
from picker.peers.asks import peer_drains, peer_moves
from picker.peers.auth import DRAINS, EVENTS, Handshake, hello_of, new_nonce, proven
from picker.peers.books import Peering
from picker.peers.channel import PeerLinks
from picker.peers.session import FrameError, Session
from picker.pool import Pool
from picker.request.pipeline import RequestPath
from tests.unit.peers.peer_client import Client, FakePeer
from tests.unit.peers.test_peer_links import DRAIN_RECORDS, E1, REQUEST, Side, peer_counts

SECRET = "s3cret"  # Side's

# --- the frames, pure ----------------------------------------------------------------------------------

MESSAGES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=16)
    | st.binary(max_size=16),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=12,
)


def pair() -> tuple[Session, Session]:
    handshake = Handshake(EVENTS, "10.1.0.2:9004", "10.1.0.1:9004", new_nonce(), new_nonce())
    return Session.connector(handshake, SECRET), Session.listener(handshake, SECRET)


def body_of(frame: bytes) -> bytes:
    inner = msgpack.unpackb(frame)
    assert isinstance(inner, bytes)
    return inner


@settings(max_examples=200, deadline=None)
@given(messages=st.lists(MESSAGES, min_size=1, max_size=5))
def test_sealed_frames_open_in_order_each_way(messages: list[Any]) -> None:
    connector, listener = pair()
    for message in messages:  # compared as msgpack bytes: NaN is not equal to itself
        wire = msgpack.packb(message)
        assert msgpack.packb(listener.open(body_of(connector.seal(message)))) == wire
        assert msgpack.packb(connector.open(body_of(listener.seal(message)))) == wire


@settings(max_examples=200, deadline=None)
@given(message=MESSAGES, data=st.data())
def test_any_altered_byte_is_caught(message: Any, data: st.DataObject) -> None:
    connector, listener = pair()
    inner = bytearray(body_of(connector.seal(message)))
    index = data.draw(st.integers(0, len(inner) - 1))
    inner[index] ^= data.draw(st.integers(1, 255))
    with pytest.raises(FrameError) as caught:
        listener.open(bytes(inner))
    assert caught.value.reason == "bad-mac"


def test_a_replayed_dropped_reordered_or_reflected_frame_is_caught() -> None:
    connector, listener = pair()
    first, second, third = (body_of(connector.seal(["n", n])) for n in range(3))
    assert listener.open(first) == ["n", 0]
    for wrong in (first, third):  # replayed; the second dropped (or the third before it)
        with pytest.raises(FrameError):
            listener.open(wrong)
    assert listener.open(second) == ["n", 1]  # a failed frame does not move the sequence
    with pytest.raises(FrameError):
        connector.open(body_of(connector.seal(["back"])))  # its own frame, sent back to it
    elsewhere, _ = pair()
    _, here = pair()
    with pytest.raises(FrameError):
        here.open(body_of(elsewhere.seal(["n", 0])))  # another session's first frame


@settings(max_examples=300, deadline=None)
@given(value=MESSAGES | st.binary(min_size=0, max_size=64))
def test_anything_received_as_a_frame_opens_or_fails_as_a_frame_error(value: Any) -> None:
    _, listener = pair()
    with pytest.raises(FrameError):
        listener.open(value)


@settings(max_examples=300, deadline=None)
@given(value=MESSAGES | st.lists(st.sampled_from([EVENTS, "a:1", "b:2", "x" * 32, "é" * 64]) | MESSAGES))
def test_no_hello_raises(value: Any) -> None:
    """A listener reads whatever a stranger sends as a hello: named or refused, never raised."""
    parsed = hello_of(value, new_nonce())
    if not isinstance(parsed, str):
        handshake, presented = parsed
        assert proven(handshake.hello_proof(SECRET), presented) in (True, False)
    assert not proven("0" * 64, "é" * 64)  # non-ASCII: refused, where compare_digest would raise


@pytest.mark.parametrize("field", ["kind", "sender", "receiver", "listener_nonce", "connector_nonce"])
def test_each_proof_binds_every_field(field: str) -> None:
    base = Handshake(EVENTS, "10.1.0.2:9004", "10.1.0.1:9004", "a" * 32, "b" * 32)
    changed = Handshake(**{**{f: getattr(base, f) for f in base.__slots__}, field: {
        "kind": DRAINS, "sender": "10.1.0.3:9004", "receiver": "10.1.0.3:9004",
        "listener_nonce": "c" * 32, "connector_nonce": "c" * 32,
    }[field]})  # fmt: skip
    assert base.hello_proof(SECRET) != changed.hello_proof(SECRET)
    assert base.welcome_proof(SECRET) != changed.welcome_proof(SECRET)
    assert base.keys(SECRET) != changed.keys(SECRET)
    assert base.hello_proof(SECRET) != base.welcome_proof(SECRET)  # a hello is no welcome


# --- over the wire ---------------------------------------------------------------------------------------


async def accepting(sides: list[Side]) -> tuple[Side, Side, int]:
    """A takes links from B (its peer) and opens none; A's port."""
    a, b = sides
    members = [await a.listen(), await b.listen()]
    a.accept(members)
    return a, b, int(a.name.rsplit(":", 1)[1])


async def test_a_member_and_the_picker_prove_themselves_to_each_other(sides: list[Side]) -> None:
    a, b, port = await accepting(sides)
    client = await Client.connect(port)
    await client.handshake_as(EVENTS, b.name, a.name, SECRET)  # the welcome checked there
    client.send([["pick", f"{b.name}~x", E1]])
    await async_wait_until(lambda: peer_counts(a) == 1, 5, what="the sealed pick to count")
    client.close()


async def test_a_hello_made_for_another_picker_is_refused(sides: list[Side]) -> None:
    """A member relays A's challenge to B's hello for C: it proves the credential, but not to A."""
    a, b, port = await accepting(sides)
    client = await Client.connect(port)
    client.hello(EVENTS, b.name, "127.0.0.1:3", SECRET)
    assert await client.read() == ["error", "wrong-receiver"]
    assert a.service is not None and a.service.rejected == {"wrong-receiver": 1}


async def test_a_proof_for_another_kind_or_an_old_hello_is_refused(sides: list[Side]) -> None:
    a, b, port = await accepting(sides)
    client = await Client.connect(port)
    drains = Handshake(DRAINS, b.name, a.name, client.challenge, new_nonce())
    client.write(msgpack.packb([EVENTS, *drains.hello(SECRET)[1:]]))
    assert await client.read() == ["error", "unauthenticated"]
    client = await Client.connect(port)
    client.write(msgpack.packb([EVENTS, b.name, "0" * 64]))  # a picker of the version before
    assert await client.read() == ["error", "old-protocol"]
    assert a.service is not None and a.service.rejected == {"unauthenticated": 1, "old-protocol": 1}


def tampered(client: Client, sent: list[bytes]) -> None:
    assert client.session is not None
    frame = bytearray(client.session.seal([["end", "x~y"]]))
    frame[-1] ^= 1
    client.write(bytes(frame))


def replayed(client: Client, sent: list[bytes]) -> None:
    client.write(sent[-1])


def dropped(client: Client, sent: list[bytes]) -> None:
    assert client.session is not None
    client.session.seal([["end", "x~y"]])  # sealed, never sent: the next frame is one too far
    client.send([])


def unsealed(client: Client, sent: list[bytes]) -> None:
    client.write(msgpack.packb([["end", "x~y"]]))


MISBEHAVIOURS: dict[str, tuple[Callable[[Client, list[bytes]], None], str]] = {
    "tampered": (tampered, "bad-mac"),
    "replayed": (replayed, "bad-mac"),
    "dropped": (dropped, "bad-mac"),
    "unsealed": (unsealed, "not-a-frame"),
}


@pytest.mark.parametrize("how", list(MISBEHAVIOURS))
async def test_a_frame_that_fails_closes_the_session_and_applies_nothing(sides: list[Side], how: str) -> None:
    a, b, port = await accepting(sides)
    assert a.service is not None
    client = await Client.connect(port)
    await client.handshake_as(EVENTS, b.name, a.name, SECRET)
    sent = [client.send([["pick", f"{b.name}~one", E1]])]
    await async_wait_until(lambda: peer_counts(a) == 1, 5, what="the first pick")
    misbehave, reason = MISBEHAVIOURS[how]
    misbehave(client, sent)
    client.send([["pick", f"{b.name}~two", E1]])  # after the bad frame: never read
    assert await client.closed_by_peer()
    assert a.service.connections_refused == {reason: 1}
    assert peer_counts(a) == 1 and b.name not in a.probe.heard  # the pick after it never applied


async def test_the_picker_reorders_nothing_it_sends() -> None:
    """Two sealed frames swapped on the wire: the second one read first fails."""
    connector, listener = pair()
    first, second = body_of(connector.seal(["a"])), body_of(connector.seal(["b"]))
    with pytest.raises(FrameError):
        listener.open(second)
    assert listener.open(first) == ["a"] and listener.open(second) == ["b"]


async def test_a_link_to_a_listener_that_cannot_prove_itself_sends_nothing() -> None:
    """Anyone listening at a member's address (a reused pod IP, say) gets the hello, no books."""
    impostor = FakePeer(answer=[], secret="another-secret")
    address = await impostor.start()
    pool = Pool()
    pool.apply(ready=[E1])
    peering = Peering("127.0.0.1:1", ("127.0.0.1:1", address), pool)
    path = RequestPath(
        pool, Metrics(pool="default"), fallback_count=0, schedule=lambda d, f: lambda: None, peering=peering
    )
    refused: Counter[str] = Counter()
    links = PeerLinks(peering, path, SECRET, refused=refused)
    task = asyncio.create_task(links.run())
    try:
        await async_wait_until(lambda: refused["unproven-peer"] >= 1, 5, what="the welcome refused")
        assert address not in peering.connected and impostor.hellos and impostor.frames == []
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await impostor.close()


async def test_an_ask_to_a_listener_that_cannot_prove_itself_gets_no_answer() -> None:
    impostors = [FakePeer(DRAIN_RECORDS, secret="x"), FakePeer(["moved", 9], secret="x")]
    try:
        drains_at, moves_at = [await f.start() for f in impostors]
        rejected: Counter[str] = Counter()
        assert await peer_drains(drains_at, "127.0.0.1:1", SECRET, rejected=rejected) == []
        assert await peer_moves(moves_at, "127.0.0.1:1", SECRET, E1, 2.0, rejected=rejected) is None
        assert rejected == {"unproven-peer": 2} and impostors[1].asks == []  # the ask never left
    finally:
        for impostor in impostors:
            await impostor.close()


async def test_every_kind_still_works_between_two_pickers(sides: list[Side]) -> None:
    a, b = sides
    members = [await a.listen(), await b.listen()]
    a.join(members)
    b.join(members)
    assert a.service is not None
    a.service.mover = lambda address: 4
    b.path.admit(REQUEST)
    await async_wait_until(lambda: peer_counts(a) == 1, 5, what="A to count B's request")
    assert await peer_drains(a.name, b.name, SECRET) == DRAIN_RECORDS
    assert await peer_moves(a.name, b.name, SECRET, E1, 2.0) == ["moved", 4]
    assert a.service.refused == 0 and a.service.connections_refused == {}
