"""The channel between pickers: the transport of picker/peers/books.py's events, over TCP with msgpack.
This module sends (and finds peers); picker/peers/inbox.py receives; picker/peers/asks.py asks a
peer a question on a connection of its own (its drain records, or to move its streams).

Each picker listens on `peers.port` (plaintext, like the health port) and keeps one connection open
to every other member. A connection starts with the mutual handshake (picker/peers/auth.py: the
receiver's challenge, this picker's hello, the receiver's welcome, each side proving the pickers' own
credential, never sent); nothing follows until the welcome is proven. Then every message is a sealed
frame (picker/peers/session.py: a MAC under the session's key and its sequence number): on an
`events` connection, the list of events one loop turn produced for that peer. A broken connection is
reopened with backoff; on each (re)connect the picker first sends a `pick` for each request it has in
flight, so a peer that restarted, or orphaned this picker's books when the connection broke, counts
them again. What the peer sends is read as it comes, however the reads split it.
Why not gRPC, as everything else here: a small message costs several times the CPU to send and to
receive over a grpc.aio stream than this way, and a request makes several (loadtest/bench_peers.py).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections import Counter
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, cast

import msgpack

from picker.config.model import canonical_address, format_address, parse_address
from picker.peers import budget_share
from picker.peers.auth import EVENTS, REFUSAL, Handshake, challenge_of, new_nonce, proven, welcome_of
from picker.peers.books import Peering
from picker.peers.outbox import BOOKKEEPING, SYNC_EVERY_S, Event
from picker.peers.session import HELLO_MAX, HELLO_TIMEOUT_S, MAX_FRAME, STREAM_LIMITS, FrameError, Session
from picker.request.pipeline import RequestPath

log = logging.getLogger(__name__)

_BACKOFF_S = (0.05, 0.1, 0.2, 0.5, 1.0, 2.0)


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


_SUPERSEDED = BOOKKEEPING | {budget_share.SPENT}  # what a reopened link's first message restates


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
        refused: Counter[str] | None = None,
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
        # links closed for what the peer sent (a welcome not proven, a frame that failed), by reason
        self.refused: Counter[str] = refused if refused is not None else Counter()

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
                if (budgets := self._path.flow.budgets) is not None:
                    for peer in self._open_links:
                        self._peering.outbox.to(peer, budget_share.view(self._peering, budgets))
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
                name, secret = self._peering.name, self._secret
                outbound = partial(
                    _Outbound, partial(self._send_to, peer), EVENTS, name, peer, secret, self.refused
                )
                _, link = await loop.create_connection(outbound, host, port)
                await asyncio.wait_for(link.ready, HELLO_TIMEOUT_S)  # both proven, the session open
                # then this picker's books; what was queued while down stays queued only if it is
                # a report (the books supersede its picks and ends, the budgets view its totals)
                queued = [e for e in self._peering.outbox.take(peer) if e[0] not in _SUPERSEDED]
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
        """What a link opens with: this picker's books, and its view of the tenants' budgets."""
        books: list[Event] = [
            ["pick", r.request_id, r.endpoint] for r in self._path.live_records() if r.endpoint
        ]
        budgets = self._path.flow.budgets
        return books if budgets is None else [*books, budget_share.view(self._peering, budgets)]


class _Outbound(asyncio.Protocol):
    """This picker's connection to one peer: the handshake (the peer's challenge, this picker's hello,
    the peer's welcome, proven) read as it comes, then written to with sealed frames and read only
    for what the peer says: a refusal before the welcome; after it, nothing on an events link (a
    frame is opened, so a forged one still ends the link, and dropped)."""

    def __init__(
        self,
        on_resume: Callable[[], None],
        kind: str,
        sender: str,
        receiver: str,
        secret: str | None,
        refused: Counter[str] | None = None,
    ) -> None:
        loop = asyncio.get_running_loop()
        self.lost: asyncio.Future[None] = loop.create_future()
        self.ready: asyncio.Future[None] = loop.create_future()  # the peer's welcome, proven
        self._unpacker = msgpack.Unpacker(raw=False, max_buffer_size=MAX_FRAME, **STREAM_LIMITS)
        self._fed = 0  # bytes read
        self._kind, self._sender, self._receiver, self._secret = kind, sender, receiver, secret
        self._refused = refused if refused is not None else Counter()
        self._handshake: Handshake | None = None
        self.session: Session | None = None
        self.paused = False
        self._on_resume = on_resume
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not an asyncio.Transport subclass

    def send(self, message: Any) -> None:
        if self.session is not None and self._transport is not None and not self._transport.is_closing():
            self._transport.write(self.session.seal(message))

    def data_received(self, data: bytes) -> None:
        """Take every whole message read so far; before the welcome, a message whose part read so
        far is larger than HELLO_MAX closes the link (bounded by itself, not by the read it shares)."""
        self._fed += len(data)
        try:
            self._unpacker.feed(data)
            for message in self._unpacker:
                if self._transport is None or self._transport.is_closing():
                    return
                self._take(message)
        except FrameError as exc:
            self._fail(exc.reason)
            return
        except (msgpack.UnpackException, ValueError, TypeError):
            self._fail("unreadable")
            return
        if self.session is None and self._fed - self._unpacker.tell() > HELLO_MAX:
            self._fail("too-large")

    def _take(self, message: Any) -> None:
        assert self._transport is not None
        if self._handshake is None:
            nonce = challenge_of(message)
            if nonce is None:
                raise FrameError("no-challenge")
            self._handshake = Handshake(self._kind, self._sender, self._receiver, nonce, new_nonce())
            self._transport.write(msgpack.packb(self._handshake.hello(self._secret)))
        elif self.session is None:
            if isinstance(message, list) and len(message) == 2 and message[0] == REFUSAL:
                log.warning("peer %s refused this picker: %.80s", self._receiver, message[1])
                self._transport.close()
            elif proven(self._handshake.welcome_proof(self._secret), welcome_of(message)):
                self.session = Session.connector(self._handshake, self._secret)
                if not self.ready.done():
                    self.ready.set_result(None)
            else:
                raise FrameError("unproven-peer")  # it does not hold the pickers' credential
        else:
            self.session.open(message)  # nothing is expected here: checked, then dropped

    def _fail(self, reason: str) -> None:
        if not self._refused[reason]:
            log.warning("peer %s: %s; the link is closed (and reopened)", self._receiver, reason)
        self._refused[reason] += 1
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
        if not self.ready.done():
            self.ready.set_exception(ConnectionError("closed before its welcome"))
