"""A peer listener strangers cannot exhaust (issue 53, item 2). Before: a connection that had not said
its hello could make the picker buffer 16 MiB for 5 s, and nothing capped how many such connections
there were (16 of them, 8 MiB each: +135 MiB of RSS); out of descriptors, the accept loop spun on a
listener that stayed readable; and a challenge split across two reads closed the outbound link."""

from __future__ import annotations

import asyncio
import errno
import socket
from collections.abc import AsyncIterator
from typing import Any

import msgpack
import pytest

from loadtest.procs import async_wait_until
from picker.observability.metrics import Metrics
from picker.peers.auth import CHALLENGE, EVENTS, Handshake, new_nonce, welcome_of
from picker.peers.books import Peering
from picker.peers.channel import _Outbound
from picker.peers.inbox import PeerInbox
from picker.peers.session import HELLO_MAX, Session
from picker.pool import Pool
from picker.request.pipeline import RequestPath
from tests.unit.peers.peer_client import Client

SECRET = "s3cret"
A, B = "127.0.0.1:1", "127.0.0.1:2"  # the listening picker's name, and its peer's
E1, E2 = "10.0.0.1:8000", "10.0.0.2:8000"


class Listening:
    """A picker's peer port, with its caps, and nothing else running."""

    def __init__(self, inbox: PeerInbox, port: int, peering: Peering, pool: Pool) -> None:
        self.inbox, self.port, self.peering, self.pool = inbox, port, peering, pool

    @property
    def refused(self) -> dict[str, int]:
        return dict(self.inbox.connections_refused)


async def listening(per_source: int = 8, total: int = 64, peer: str = B, port: int = 0) -> Listening:
    """`port`: listen there, named by it (a peer's asks reach it by its name), else anywhere as A."""
    pool = Pool()
    pool.apply(ready=[E1, E2])
    name = f"127.0.0.1:{port}" if port else A
    peering = Peering(name, (name, peer), pool)
    path = RequestPath(
        pool, Metrics(pool="default"), fallback_count=0, schedule=lambda d, f: lambda: None, peering=peering
    )
    inbox = PeerInbox(
        peering,
        path,
        SECRET,
        lambda: [],
        max_unauthenticated=total,
        max_unauthenticated_per_source=per_source,
    )
    return Listening(inbox, await inbox.listen("127.0.0.1", port), peering, pool)


@pytest.fixture
async def opened() -> AsyncIterator[list[Any]]:
    made: list[Any] = []
    yield made
    for item in made:
        if isinstance(item, Client):
            item.close()
        else:
            await item.inbox.close()


async def test_a_stranger_that_sends_more_than_a_hello_is_closed_at_once_and_counted(
    opened: list[Any],
) -> None:
    """A str header promising 16 MiB, then 64 KiB of it: closed once past the hello's few KiB, not 5 s
    later with 64 KiB (up to 16 MiB) held."""
    listener = await listening()
    opened.append(listener)
    client = await Client.connect(listener.port)
    opened.append(client)
    client.write(b"\xdb" + (2**24 - 16).to_bytes(4, "big") + b"a" * 65536)
    assert await client.closed_by_peer(timeout=2)  # the hello's own deadline is 5 s
    assert listener.refused == {"hello-too-large": 1}


async def test_a_stranger_announcing_huge_arrays_is_refused_before_anything_is_made(
    opened: list[Any],
) -> None:
    """Array headers announcing 16 M items each, nested (4 KiB of them): msgpack's C reader made
    each list at its announced length (~128 MiB a header) and leaked the half-read nested ones when
    the reader was dropped. The stream's reader refuses anything longer than a hello."""
    listener = await listening()
    opened.append(listener)
    client = await Client.connect(listener.port)
    opened.append(client)
    client.write(b"\xdd\x00\xff\xff\xff" * 800)
    assert await client.closed_by_peer(timeout=2)
    # refused at the first header as unreadable (before: read on until past the hello's 4 KiB)
    assert listener.refused == {"unreadable": 1}


async def test_a_hello_sent_one_byte_at_a_time_is_taken(opened: list[Any]) -> None:
    listener = await listening()
    opened.append(listener)
    client = await Client.connect(listener.port)
    opened.append(client)
    handshake = Handshake(EVENTS, B, A, client.challenge, new_nonce())
    hello = msgpack.packb(handshake.hello(SECRET))
    assert len(hello) < HELLO_MAX
    for index in range(len(hello)):
        client.write(hello[index : index + 1])
        await client.writer.drain()
        for _ in range(3):  # loop turns, so that the picker reads each byte on its own
            await asyncio.sleep(0)
    assert welcome_of(await client.read()) == handshake.welcome_proof(SECRET)


async def test_unauthenticated_connections_are_capped_per_source(opened: list[Any]) -> None:
    listener = await listening(per_source=2)
    opened.append(listener)
    first, second = await Client.connect(listener.port), await Client.connect(listener.port)
    third = await Client.connect(listener.port, challenged=False)
    opened += [first, second, third]
    assert await third.read() is None  # closed without a challenge
    assert listener.refused == {"too-many-from-source": 1}
    await second.handshake_as(EVENTS, B, A, SECRET)  # proven: it no longer holds a place
    fourth = await Client.connect(listener.port)
    opened.append(fourth)
    first.close()
    await async_wait_until(lambda: len(listener.inbox._connections) == 2, 5, what="the first's close")
    fifth = await Client.connect(listener.port)  # the first's place is free again
    opened.append(fifth)
    assert listener.refused == {"too-many-from-source": 1}


async def test_unauthenticated_connections_are_capped_in_all(opened: list[Any]) -> None:
    listener = await listening(per_source=64, total=2, peer="10.0.0.9:2")  # 127.0.0.1: no peer's address
    opened.append(listener)
    clients = [await Client.connect(listener.port), await Client.connect(listener.port)]
    opened += clients
    refused = await Client.connect(listener.port, challenged=False)
    opened.append(refused)
    assert await refused.read() is None
    assert listener.refused == {"too-many-unauthenticated": 1}
    metrics = Metrics(pool="default")
    metrics.register_rejections("peer_connections", lambda: listener.inbox.connections_refused)
    assert (
        metrics.registry.get_sample_value(
            "picker_peer_connections_rejected_total", {"reason": "too-many-unauthenticated"}
        )
        == 1
    )


class Exhausted:
    """The listening socket, out of descriptors until `failing` is turned off."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.failing, self.calls = sock, True, 0

    def accept(self) -> tuple[socket.socket, Any]:
        self.calls += 1
        if self.failing:
            raise OSError(errno.EMFILE, "Too many open files")
        return self.sock.accept()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sock, name)


async def test_out_of_descriptors_the_accept_loop_backs_off_and_resumes(opened: list[Any]) -> None:
    listener = await listening()
    opened.append(listener)
    exhausted = Exhausted(listener.inbox._listener._sock)  # type: ignore[union-attr]
    listener.inbox._listener._sock = exhausted  # type: ignore[union-attr,assignment]
    waiting = socket.create_connection(("127.0.0.1", listener.port))  # in the accept queue
    try:
        for _ in range(50):  # loop turns: a readable listener runs its accept once in each
            await asyncio.sleep(0)
        assert exhausted.calls == 1  # before: once per loop turn, 50 failed accepts (and log lines)
        assert listener.refused == {"accept-failed": 1}
        exhausted.failing = False
        await async_wait_until(lambda: len(listener.inbox._connections) == 1, 5, what="accepting again")
    finally:
        waiting.close()


class FakeTransport:
    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.closing = False

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True


def one_byte_at_a_time(link: _Outbound, data: bytes) -> None:
    for index in range(len(data)):
        link.data_received(data[index : index + 1])


async def test_the_outbound_link_takes_a_challenge_and_welcome_split_across_reads() -> None:
    """Before: a challenge in two reads closed the link (and it reconnected, with backoff)."""
    link = _Outbound(lambda: None, EVENTS, B, A, SECRET)
    transport = FakeTransport()
    link.connection_made(transport)  # type: ignore[arg-type]
    nonce = new_nonce()
    one_byte_at_a_time(link, msgpack.packb([CHALLENGE, nonce]))
    assert not transport.closing and len(transport.written) == 1  # the hello
    kind, sender, receiver, connector_nonce, _ = msgpack.unpackb(transport.written[0])
    handshake = Handshake(kind, sender, receiver, nonce, connector_nonce)
    assert (kind, sender, receiver) == (EVENTS, B, A)
    one_byte_at_a_time(link, msgpack.packb(handshake.welcome(SECRET)))
    assert link.ready.done() and link.ready.exception() is None and not transport.closing
    link.send([["pick", f"{B}~x", "10.0.0.1:8000"]])
    session = Session.listener(handshake, SECRET)
    assert session.open(msgpack.unpackb(transport.written[-1])) == [["pick", f"{B}~x", "10.0.0.1:8000"]]


async def test_the_outbound_link_takes_a_welcome_and_a_large_frame_in_one_read() -> None:
    """Each message before the welcome is bounded by itself, not by the read it shares with the next."""
    link = _Outbound(lambda: None, EVENTS, B, A, SECRET)
    transport = FakeTransport()
    link.connection_made(transport)  # type: ignore[arg-type]
    nonce = new_nonce()
    link.data_received(msgpack.packb([CHALLENGE, nonce]))
    kind, sender, receiver, connector_nonce, _ = msgpack.unpackb(transport.written[0])
    handshake = Handshake(kind, sender, receiver, nonce, connector_nonce)
    session = Session.listener(handshake, SECRET)
    large = session.seal(["x" * 100] * (2 * HELLO_MAX // 100))
    assert len(large) > HELLO_MAX
    link.data_received(msgpack.packb(handshake.welcome(SECRET)) + large)
    assert link.ready.done() and link.ready.exception() is None and not transport.closing


async def test_the_outbound_link_closes_on_a_welcome_larger_than_a_hello() -> None:
    link = _Outbound(lambda: None, EVENTS, B, A, SECRET)
    transport = FakeTransport()
    link.connection_made(transport)  # type: ignore[arg-type]
    link.data_received(msgpack.packb([CHALLENGE, new_nonce()]))
    one_byte_at_a_time(link, msgpack.packb(b"w" * (2 * HELLO_MAX))[: HELLO_MAX + 8])
    assert transport.closing and not link.ready.done()


def test_strangers_are_capped_by_prefix_and_cannot_crowd_out_a_known_peer() -> None:
    """Strangers holding every pre-hello place (from many IPv6 addresses: one /64 counts as one
    source) do not keep a member's address out: the pool's peers have places of their own."""
    from picker.peers.listener import Gate

    gate = Gate(max_total=4, max_per_source=2, known=lambda source: source in ("10.0.0.7", "fd00:1::7"))
    assert [gate.enter(f"2001:db8:0:1::{i}") for i in range(1, 4)] == [None, None, "too-many-from-source"]
    assert gate.enter("::ffff:192.0.2.1") is None and gate.enter("192.0.2.1") is None  # one IPv4 address
    assert gate.enter("192.0.2.1") == "too-many-from-source"
    assert gate.enter("2001:db8:0:2::1") == "too-many-unauthenticated"  # every strangers' place taken
    assert gate.enter("10.0.0.7") is None and gate.enter("fd00:1::7") is None  # the peers still get in
    assert gate.enter("10.0.0.7") is None and gate.enter("10.0.0.7") == "too-many-from-source"
    for source in ("10.0.0.7", "10.0.0.7", "2001:db8:0:1::2"):
        gate.leave(source)
    assert gate.enter("2001:db8:0:2::1") is None  # the stranger's place freed, not the peer's
    assert gate.enter("2001:db8:0:3::1") == "too-many-unauthenticated"


def test_a_peers_address_is_known_by_the_listening_picker() -> None:
    """Peers named by address (as peers.service resolves them) are known by the source address
    their connections come from, an IPv4-mapped one too."""
    from picker.peers.inbox import member_addresses

    peering = Peering(
        "10.0.0.1:9004", ("10.0.0.1:9004", "10.0.0.2:9004", "[fd00::3]:9004", "picker-d:9004"), Pool()
    )
    known = member_addresses(peering)
    assert known("10.0.0.2") and known("::ffff:10.0.0.2") and known("fd00:0::3")
    assert not known("10.0.0.1") and not known("10.0.0.9") and not known("picker-d")
