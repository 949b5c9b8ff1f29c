"""The channel between pickers: the transport of picker/peers/books.py's events, over TCP with msgpack.
This module sends (and finds peers); picker/peers/inbox.py receives.

Each picker listens on `peers.port` (plaintext, like the health port) and keeps one connection open
to every other member. A connection starts with the receiver's challenge and the sender's hello,
`[kind, sender, proof]` (picker/peers/auth.py: an HMAC with the pickers' own credential, never sent;
the receiver also checks that the sender is one of its peers); then, on an `events` connection, each
message is the list of events one loop turn produced for that peer (msgpack's stream framing: no
length prefix). A broken connection is reopened with backoff; on each (re)connect the picker first sends a
`pick` for each request it has in flight, so a peer that restarted, or orphaned this picker's books
when the connection broke, counts them again. A `drains` hello is answered with this picker's drain
records and closed (`GET /admin/drains?scope=pool`); a `moves` hello carries a fourth field, the ask
to move the receiver's streams off an address (picker/peers/events.py), and is answered with how many
moved, then closed (`?move_streams=true`, picker/peers/moves.py).
Why not gRPC, as everything else here: measured (loadtest/bench_peers.py), a small message costs
36 us of CPU to send and 45 to receive over a grpc.aio stream, 7 and 6 this way, and a request
makes several.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, cast

import msgpack

from picker.config.model import canonical_address, format_address, parse_address
from picker.peers.auth import challenge_of, proof
from picker.peers.books import Peering
from picker.peers.events import MOVE_ASK
from picker.peers.outbox import BOOKKEEPING, SYNC_EVERY_S, Event
from picker.request.pipeline import RequestPath

log = logging.getLogger(__name__)

EVENTS, DRAINS, MOVES = "events", "drains", "moves"  # what a connection is for (its hello's first field)
_BACKOFF_S = (0.05, 0.1, 0.2, 0.5, 1.0, 2.0)
MAX_BUFFER = 16 * 1024 * 1024  # a peer's message larger than this closes its connection
HELLO_TIMEOUT_S = 5.0


async def _next(reader: asyncio.StreamReader, unpacker: msgpack.Unpacker) -> Any:
    """The next whole msgpack object on the connection, or None when it closed."""
    while True:
        try:
            return unpacker.unpack()
        except msgpack.OutOfData:
            pass
        data = await reader.read(65536)
        if not data:
            return None
        unpacker.feed(data)


async def wait_linked(peering: Peering, timeout_s: float, step_s: float = 0.02) -> bool:
    """Until every peer is linked both ways (`Peering.linked`) or `timeout_s` passed: True if linked.
    A link reopens with backoff, so a peer started after this picker can take a second or two."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not peering.linked():
        if loop.time() >= deadline:
            return False
        await asyncio.sleep(step_s)  # polls a few fields: no event to wait on across both transports
    return True


async def resolve(service: str) -> list[str]:
    """Every address a DNS name has (a headless Service lists each picker pod), as host:port."""
    host, port = parse_address(service)
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({canonical_address(format_address(str(info[4][0]), port)) for info in infos})


class PeerLinks:
    """The sending side: one stream to each peer, fed from the outbox, reopened when it breaks.

    With a `service` name the members are re-resolved every `every_s` (peer discovery): a new
    picker gets a link (and this picker's books first), a gone one's requests become orphans."""

    def __init__(
        self,
        peering: Peering,
        path: RequestPath,
        secret: str | None,
        service: str | None = None,
        every_s: float = 5.0,
        resolver: Callable[[str], Awaitable[list[str]]] = resolve,
    ) -> None:
        self._peering = peering
        self._path = path
        self._secret = secret  # the pickers' credential (picker/peers/auth.py); None: unauthenticated
        self._static = peering.peers
        self._service, self._every_s, self._resolver = service, every_s, resolver
        self._links: dict[str, asyncio.Task[None]] = {}  # one connecting / reconnecting task per peer
        self._open_links: dict[str, _Outbound] = {}
        self._flush: asyncio.TimerHandle | None = None  # the next _send, when one is due
        self._flush_due = 0.0  # the loop time it is due at
        peering.outbox.wake = self._wake
        peering.discovering = service is not None  # until the first lookup answers (or fails)
        self.connected = peering.connected  # the metrics read it there
        self.sent = 0
        self._resolve_failed = False

    def _wake(self, peer: str, within_s: float) -> None:
        """Something for `peer` must leave within `within_s`: at once when 0 (the books: a peer reads
        them before its next pick, so a pick or an end written now is one it cannot miss), else by the
        soonest deadline queued, so that what is queued meanwhile shares the write (peering.py says
        how soon each event must go)."""
        if within_s <= 0:
            self._send_to(peer)
            return
        loop = asyncio.get_running_loop()
        due = loop.time() + within_s
        if self._flush is not None:
            if self._flush_due <= due:
                return  # already due soon enough
            self._flush.cancel()
        self._flush_due = due
        self._flush = loop.call_at(due, self._send)

    async def run(self) -> None:
        """Forever: a link to every peer, and discovery when configured (cancel to stop)."""
        for peer in self._peering.peers:
            self._open(peer)
        syncing = asyncio.create_task(self._sync(), name="peer-books-sync")
        try:
            while self._service is not None:
                await self.discover()
                await asyncio.sleep(self._every_s)  # the discovery period, not a synchronisation
            await asyncio.Event().wait()  # static members: the links run until cancelled
        finally:
            syncing.cancel()
            for task in self._links.values():
                task.cancel()
            await asyncio.gather(*self._links.values(), return_exceptions=True)

    async def _sync(self) -> None:
        """Every SYNC_EVERY_S: this picker's books whole to every peer (a lost `end` is put right)."""
        while True:
            await asyncio.sleep(SYNC_EVERY_S)  # the sync period, not a synchronisation
            try:
                self._peering.sync(self._path.live_records(), to=set(self._open_links))
            except Exception:
                log.exception("peer books sync failed; the next one runs in %.0f s", SYNC_EVERY_S)

    async def discover(self) -> None:
        """Re-resolve the service; open links to new members, close those of gone ones."""
        assert self._service is not None
        try:
            found = await self._resolver(self._service)
        except (OSError, ValueError) as exc:
            self._peering.discovering = False  # readiness waits for the peers it knows of
            if not self._resolve_failed:
                log.warning(
                    "peers service %s did not resolve (%s); keeping %d peers",
                    self._service,
                    exc,
                    len(self._peering.peers),
                )
            self._resolve_failed = True
            return
        self._resolve_failed = False
        added, removed = self._peering.set_members([*self._static, *found])
        self._peering.discovering = False
        for peer in removed:
            log.info("peer %s left", peer)
            task = self._links.pop(peer, None)
            if task is not None:
                task.cancel()
        for peer in added:
            log.info("peer %s joined", peer)
            self._open(peer)

    def _open(self, peer: str) -> None:
        self._links[peer] = asyncio.create_task(self._link(peer), name=f"peer-link {peer}")

    async def _link(self, peer: str) -> None:
        attempt = 0
        host, port = parse_address(peer)
        loop = asyncio.get_running_loop()
        while True:
            link: _Outbound | None = None
            try:
                outbound = partial(_Outbound, partial(self._send_to, peer))
                _, link = await loop.create_connection(outbound, host, port)
                nonce = await asyncio.wait_for(link.challenge, HELLO_TIMEOUT_S)
                # hello, then this picker's books; what was queued while down stays queued only
                # if it is a report (the books supersede its picks and ends)
                link.send([EVENTS, self._peering.name, self._proof(nonce, EVENTS)])
                queued = [e for e in self._peering.outbox.take(peer) if e[0] not in BOOKKEEPING]
                link.send([*self._in_flight(), *queued])
                self._open_links[peer] = link
                self.connected.add(peer)
                attempt = 0
                await link.lost
                log.info("peer %s: connection lost; reconnecting", peer)
            except (OSError, TimeoutError) as exc:
                if attempt == 0:
                    log.info("peer %s: %s; reconnecting", peer, type(exc).__name__)
            finally:
                self._open_links.pop(peer, None)
                self.connected.discard(peer)
                if link is not None:
                    link.close()
            await asyncio.sleep(_BACKOFF_S[min(attempt, len(_BACKOFF_S) - 1)])  # a backoff, not a sync
            attempt += 1

    def _proof(self, nonce: str, kind: str) -> str:
        return "" if self._secret is None else proof(self._secret, nonce, kind, self._peering.name)

    def _send(self) -> None:
        """One message per connected peer with everything queued for it."""
        self._flush = None
        for peer in list(self._open_links):
            self._send_to(peer)

    def _send_to(self, peer: str) -> None:
        link = self._open_links.get(peer)
        if link is None or link.paused:
            return  # not linked, or its socket buffer is full: the events wait in the outbox (bounded)
        events = self._peering.outbox.take(peer)
        if events:
            self.sent += len(events)
            link.send(events)
        if self._flush is not None and not self._peering.outbox.pending:
            self._flush.cancel()  # what it was due for has gone (its wake-up would find nothing)
            self._flush = None

    def _in_flight(self) -> list[Event]:
        return [["pick", r.request_id, r.endpoint] for r in self._path.live_records() if r.endpoint]


class _Outbound(asyncio.Protocol):
    """This picker's connection to one peer: written to synchronously, read for the peer's challenge
    (the first message) and then only for its end (a refusal)."""

    def __init__(self, on_resume: Callable[[], None]) -> None:
        loop = asyncio.get_running_loop()
        self.lost: asyncio.Future[None] = loop.create_future()
        self.challenge: asyncio.Future[str] = loop.create_future()
        self._unpacker = msgpack.Unpacker(raw=False, max_buffer_size=4096)
        self.paused = False
        self._on_resume = on_resume
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not an asyncio.Transport subclass

    def send(self, message: Any) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.write(msgpack.packb(message))

    def data_received(self, data: bytes) -> None:
        if not self.challenge.done():
            with contextlib.suppress(Exception):
                self._unpacker.feed(data)
                nonce = challenge_of(next(self._unpacker))
                if nonce is not None:
                    self.challenge.set_result(nonce)
                    return
        else:
            with contextlib.suppress(Exception):
                log.warning("peer refused this picker: %s", msgpack.unpackb(data, raw=False))
        if self._transport is not None:
            self._transport.close()

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        self._on_resume()  # what waited in the outbox goes now

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.lost.done():
            self.lost.set_result(None)
        if not self.challenge.done():
            self.challenge.set_exception(ConnectionError("closed before its challenge"))


async def _ask(peer: str, kind: str, name: str, secret: str | None, timeout_s: float, *ask: Any) -> Any:
    """One question on a connection of its own: the hello (`ask` after its proof), then the answer
    (None when the peer closed without one). Raises OSError, TimeoutError, msgpack.UnpackException or
    ValueError when the peer cannot be asked; nothing waits longer than `timeout_s`."""
    host, port = parse_address(peer)
    writer: asyncio.StreamWriter | None = None
    try:
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_connection(host, port)
            unpacker = msgpack.Unpacker(raw=False, max_buffer_size=MAX_BUFFER)
            nonce = challenge_of(await _next(reader, unpacker))
            if nonce is None:
                raise ValueError("no challenge")
            presented = "" if secret is None else proof(secret, nonce, kind, name)
            writer.write(msgpack.packb([kind, name, presented, *ask]))
            await writer.drain()
            return await _next(reader, unpacker)
    finally:
        if writer is not None:
            writer.close()


async def peer_drains(
    peer: str, name: str, secret: str | None, timeout_s: float = 2.0
) -> list[dict[str, Any]]:
    """A peer's drain records (its admin API's `drains`), or [] when it does not answer."""
    try:
        drains = await _ask(peer, DRAINS, name, secret, timeout_s)
    except (OSError, TimeoutError, msgpack.UnpackException, ValueError) as exc:
        log.warning("drains from peer %s: %s", peer, type(exc).__name__)
        return []
    if isinstance(drains, list) and drains and drains[0] == "error":
        log.warning("drains from peer %s: %s", peer, drains[1] if len(drains) > 1 else "refused")
        return []
    return drains if isinstance(drains, list) else []


async def peer_moves(peer: str, name: str, secret: str | None, address: str, timeout_s: float) -> Any:
    """Ask a peer to move its streams off `address` now: its answer as it came (judged whole by
    picker/peers/events.py's `answer_problem`), or None when it gave none within `timeout_s`."""
    try:
        return await _ask(peer, MOVES, name, secret, timeout_s, [MOVE_ASK, address])
    except (OSError, TimeoutError, msgpack.UnpackException, ValueError) as exc:
        log.warning("moving streams through peer %s: %s", peer, type(exc).__name__)
        return None
