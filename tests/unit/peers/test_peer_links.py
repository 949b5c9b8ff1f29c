"""The channel between pickers over real loopback TCP, in process (picker/peers/channel.py sends,
picker/peers/inbox.py receives): books cross it, a pick reads what peers sent before it, a wrong token
is refused, a peer found by discovery gets a link and one that leaves is orphaned."""

from __future__ import annotations

import asyncio
import select
from collections import Counter
from typing import Any

import msgpack

from loadtest.procs import async_wait_until
from picker.observability.metrics import Metrics
from picker.peers.asks import peer_drains
from picker.peers.auth import CHALLENGE, new_nonce
from picker.peers.books import Peering
from picker.peers.channel import PeerLinks, wait_linked
from picker.peers.inbox import PeerInbox
from picker.peers.session import HELLO_MAX
from picker.pool import Pool
from picker.request.inference import InferenceRequest
from picker.request.pipeline import RequestPath
from picker.streams import EndReason

E1, E2 = "10.0.0.1:8000", "10.0.0.2:8000"
REQUEST = InferenceRequest(method="POST", path="/v1/completions", model="m", stream=True)


def drain_summaries() -> list[dict[str, Any]]:
    """One drain record of E1, as a picker answers the drains query (`Pool.drain_summaries`)."""
    pool = Pool()
    pool.apply(ready=[E1, E2])
    pool.apply(ready=[E2], draining=[E1])
    return pool.drain_summaries()


DRAIN_RECORDS = drain_summaries()


def many_drain_summaries(count: int) -> list[dict[str, Any]]:
    """`count` drain records, one per endpoint (a picker after a rollout of a large pool)."""
    pool = Pool()
    addresses = [f"10.0.1.{i}:8000" for i in range(1, count + 1)]
    pool.apply(ready=addresses)
    pool.apply(ready=[], draining=addresses)
    return pool.drain_summaries()


class Side:
    """One picker's peering, its server on a loopback port and its links (started by `run`)."""

    def __init__(self, token: str | None = "s3cret", drains: list[dict[str, Any]] | None = None) -> None:
        self.pool = Pool()
        self.drains = DRAIN_RECORDS if drains is None else drains
        self.pool.apply(ready=[E1, E2])
        self.token = token
        self.peering: Peering | None = None
        self.service: PeerInbox | None = None
        self.tasks: list[asyncio.Task[None]] = []

    async def listen(self, read_every_s: float = 0.01) -> str:
        self.probe = Peering("127.0.0.1:1", (), self.pool)  # renamed once the port is known
        self.path = RequestPath(
            self.pool, Metrics(pool="default"), fallback_count=0, schedule=lambda d, f: lambda: None
        )
        self.service = PeerInbox(self.probe, self.path, self.token, lambda: self.drains, read_every_s)
        port = await self.service.listen("127.0.0.1", 0)
        self.tasks.append(asyncio.create_task(self.service.run()))
        self.name = f"127.0.0.1:{port}"
        return self.name

    def accept(self, members: list[str]) -> None:
        """Take links from these members (they are its peers) without opening any of its own."""
        assert self.service is not None
        self.probe = Peering(self.name, members, self.pool)
        self.service._peering = self.probe

    def join(self, members: list[str], resolver: object | None = None) -> PeerLinks:
        self.peering = Peering(self.name, members, self.pool)
        self.path = RequestPath(
            self.pool,
            Metrics(pool="default"),
            fallback_count=0,
            schedule=lambda d, f: lambda: None,
            peering=self.peering,
        )
        assert self.service is not None
        self.service._peering, self.service._path = self.peering, self.path  # the wired objects
        self.path.catch_up = self.service.catch_up
        self.peering.heard |= self.probe.heard  # links that came in before
        kwargs = {"service": "pickers:9004", "every_s": 0.05, "resolver": resolver} if resolver else {}
        links = PeerLinks(self.peering, self.path, self.token, **kwargs)  # type: ignore[arg-type]
        self.tasks.append(asyncio.create_task(links.run()))
        return links

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        if self.service is not None:
            await self.service.close()


def peer_counts(side: Side) -> int:
    return sum(e.peer_in_flight for e in side.pool.endpoints())


async def test_a_pick_and_its_end_cross_the_channel(sides: list[Side]) -> None:
    a, b = sides
    members = [await a.listen(), await b.listen()]
    a.join(members)
    b.join(members)
    record = a.path.admit(REQUEST).payload
    await async_wait_until(lambda: peer_counts(b) == 1, 5, what="B to count A's request")
    a.path.finish(record, EndReason.COMPLETED)
    await async_wait_until(lambda: peer_counts(b) == 0, 5, what="B to drop it")
    assert await peer_drains(a.name, b.name, "s3cret") == DRAIN_RECORDS
    assert await peer_drains(a.name, b.name, "wrong") == []  # refused: not its drains


async def test_a_peers_drain_records_past_a_hellos_size_all_arrive(sides: list[Side]) -> None:
    """The welcome and the drains come in one write: each message is bounded by itself, not the read."""
    many = many_drain_summaries(24)
    a = Side(drains=many)
    sides.append(a)
    asker = await sides[0].listen()
    a.accept([await a.listen(), asker])
    assert len(msgpack.packb(many)) > HELLO_MAX
    rejected: Counter[str] = Counter()
    assert await peer_drains(a.name, asker, "s3cret", rejected=rejected) == many
    assert not rejected


async def test_a_strangers_welcome_larger_than_a_hello_is_refused_unread() -> None:
    """Whoever listens at a peer's address may not be a member: its welcome is bounded."""

    async def stranger(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(msgpack.packb([CHALLENGE, new_nonce()]))
        await reader.read(65536)  # the hello
        writer.write(msgpack.packb(b"w" * (16 * HELLO_MAX)))
        await reader.read()  # until the asker closes
        writer.close()

    server = await asyncio.start_server(stranger, "127.0.0.1", 0)
    try:
        peer = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
        rejected: Counter[str] = Counter()
        assert await peer_drains(peer, "127.0.0.1:1", "s3cret", rejected=rejected) == []
        assert rejected == {"too-large": 1}
    finally:
        server.close()
        await server.wait_closed()


def linked_from(side: Side, peer: Side) -> bool:
    """`peer`'s connection to `side` is past its hello."""
    return side.service is not None and any(c.sender == peer.name for c in side.service._connections)


async def test_a_peers_pick_waits_in_the_socket_and_the_next_admission_reads_it(sides: list[Side]) -> None:
    """No wake-up per message: a pick is written at once, and waits in the peer's socket until that
    peer admits its next request, which reads it first (its pick counts the other's request)."""
    a, b = sides
    members = [await a.listen(), await b.listen(read_every_s=60)]  # B reads only when it admits
    links = a.join(members)
    b.join(members)
    assert a.peering is not None and b.service is not None
    connected = a.peering.connected
    await async_wait_until(lambda: b.name in connected and linked_from(b, a), 5, what="A's link to B")
    sent = links.sent
    a.path.admit(REQUEST)
    assert links.sent == sent + 1  # written before the loop turn ends
    connection = next(c for c in b.service._connections if c.sender == a.name)
    readable, _, _ = await asyncio.to_thread(select.select, [connection._sock], [], [], 5)
    assert readable
    assert peer_counts(b) == 0  # there, unread
    b.path.admit(REQUEST)
    assert peer_counts(b) == 1


async def test_an_urgent_write_takes_what_waited_and_its_timer_with_it(sides: list[Side]) -> None:
    """A report waits up to 5 ms to share a write; the end that follows takes it along at once, and
    the flush it was waiting for is cancelled (it would wake the picker to find nothing)."""
    a, b = sides
    members = [await a.listen(), await b.listen()]
    links = a.join(members)
    b.join(members)
    assert a.peering is not None
    await async_wait_until(lambda: b.name in a.peering.connected, 5, what="A's link to B")  # type: ignore[union-attr]
    sent = links.sent
    a.peering.outbox.to(b.name, ["started", "x", 200, E1, True])
    assert links.sent == sent and links._flush is not None  # waiting to share a write
    a.peering.outbox.to(b.name, ["end", "x"])
    assert links.sent == sent + 2 and links._flush is None


async def test_watched_a_peers_events_apply_as_they_come(sides: list[Side]) -> None:
    a, b = sides
    members = [await a.listen(), await b.listen(read_every_s=60)]
    a.join(members)
    b.join(members)
    assert b.service is not None
    await async_wait_until(lambda: linked_from(b, a), 5, what="A's link to B")
    b.service.watch(True)
    a.path.admit(REQUEST)
    await async_wait_until(lambda: peer_counts(b) == 1, 5, what="B to apply A's pick as it came")


async def test_requests_queued_here_turn_watching_on_until_none_is(sides: list[Side]) -> None:
    """A queued request waits for a slot, which a peer's end may free: read it as it comes."""
    _, b = sides
    b.join([await b.listen()])
    assert b.service is not None
    b.pool.apply(ready=[], draining=[E1, E2])  # nowhere to go: the request queues
    ticket = b.path.admit(REQUEST)
    assert ticket.queued and not b.service.watched
    await async_wait_until(lambda: b.service.watched, 5, what="watching while queued")  # type: ignore[union-attr]
    b.path.flow.cancel(ticket)
    await async_wait_until(lambda: not b.service.watched, 5, what="not watching once none is")  # type: ignore[union-attr]


async def test_linked_means_both_ways_and_a_missing_peer_only_delays_readiness(sides: list[Side]) -> None:
    """What readiness waits for (App._await_peers): this picker's link to each peer open, and each
    peer's link here (its books in). One way is not enough; a peer that never comes is a timeout."""
    a, b = sides
    members = [await a.listen(), await b.listen()]
    b.accept(members)  # B knows A as a peer (else it refuses A's link) but links nowhere yet
    a.join(members)
    assert a.peering is not None
    await async_wait_until(
        lambda: b.name in a.peering.connected and linked_from(b, a),  # type: ignore[union-attr]
        5,
        what="A's link to B",
    )
    assert not a.peering.linked()  # B has not linked back: A has not got B's books
    b.join(members)
    assert await wait_linked(a.peering, 5)
    assert b.peering is not None and await wait_linked(b.peering, 5)
    await b.close()  # B's link to A goes: A no longer hears B
    await async_wait_until(lambda: not a.peering.linked(), 5, what="A to notice B's link gone")  # type: ignore[union-attr]
    alone = Peering("127.0.0.1:1", ("127.0.0.1:1", "127.0.0.1:2"), Pool())  # its peer never answers
    assert not await wait_linked(alone, 0.05)


async def test_a_wrong_token_gets_no_books_in(sides: list[Side]) -> None:
    a, b = sides
    members = [await a.listen(), await b.listen()]
    b.token = "other"
    a.join(members)
    b.join(members)
    b.path.admit(REQUEST)
    assert a.service is not None
    await async_wait_until(lambda: a.service.refused >= 1, 5, what="A to refuse B")  # type: ignore[union-attr]
    assert peer_counts(a) == 0


async def test_discovery_opens_links_to_new_pickers_and_orphans_gone_ones(sides: list[Side]) -> None:
    a, b = sides
    found = [await a.listen(), await b.listen()]
    listed = list(found)

    async def resolver(service: str) -> list[str]:
        return list(listed)

    a.join([], resolver)
    b.join([], resolver)
    await async_wait_until(lambda: a.peering is not None and b.name in a.peering.connected, 5, what="a link")
    b.path.admit(REQUEST)
    await async_wait_until(lambda: peer_counts(a) == 1, 5, what="A to count B's request")
    listed.remove(b.name)  # B's pod left the headless Service
    assert a.peering is not None
    await async_wait_until(lambda: b.name not in a.peering.peers, 5, what="A to drop B")
    assert peer_counts(a) == 1 and a.peering.orphans == 1  # its stream may still run: an orphan
