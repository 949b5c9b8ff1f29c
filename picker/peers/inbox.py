"""The receiving side of the channel between pickers (picker/peers/channel.py sends): peers' events applied
to this picker's books and records, read when this picker needs them rather than when they arrive.

A connection starts with this picker's challenge and the peer's hello, `[kind, sender, proof]`
(picker/peers/auth.py); on an `events` connection each message is a list of events
(picker/peers/books.py), on a `drains` connection the answer is this picker's drain records, and a
`moves` hello carries a fourth field, a member's ask to move this picker's streams off an address
(picker/peers/events.py), answered with how many moved (through `mover`: picker proxy's own; else it
cannot). After the hello an events connection is not watched: what peers send waits in the socket
until `PeerInbox.catch_up` reads it, which the request path calls before every admission (a pick
sees every pick and end its peers sent until then), and a timer every `peers.read_every_s` (the
owner's records settle, a link that broke is noticed). While requests wait in the flow-control
queue the connections are watched again, so an end that frees a slot dispatches at once.
Why: a message to a process waiting on its socket costs a wake-up on both sides (the sender's
write wakes the receiver; the receiver runs its loop for one message). Measured with two pickers at
20 concurrent short requests (docs, "Two pickers"): the books' CPU per request (two pickers with
one set of books less two with separate books) went from 211 to 141-163 us, and a pick reads its
peers' latest picks and ends, which a message ready in the same loop turn as the request was not.
Plain non-blocking sockets on the loop (`add_reader`), not transports: a transport reads on its
own schedule, and a paused one cannot be read on demand.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections import Counter
from collections.abc import Callable
from typing import Any

import msgpack

from picker.config.model import canonical_address
from picker.peers.auth import CHALLENGE, new_nonce, verified
from picker.peers.books import Peering, owner_of
from picker.peers.channel import DRAINS, EVENTS, HELLO_TIMEOUT_S, MAX_BUFFER, MOVES
from picker.peers.events import CANNOT, MOVED, REFUSED, ask_problem, problem
from picker.request.pipeline import RequestPath

log = logging.getLogger(__name__)

_READ_SIZE = 65536
OWN_ONLY = frozenset({"pick", "move", "sync"})  # events a picker sends only about its own requests
_ANSWER_TIMEOUT_S = 5.0  # a drains answer or a refusal that cannot be written by then is dropped
_HELLO_FIELDS = {EVENTS: 3, DRAINS: 3, MOVES: 4}  # a moves hello carries its ask


class PeerInbox:
    """Every connection from a peer: the hello, then their events applied to this picker."""

    def __init__(
        self,
        peering: Peering,
        path: RequestPath,
        secret: str | None,
        drains: Callable[[], Any],
        read_every_s: float = 0.01,
    ) -> None:
        self._peering = peering
        self._path = path
        self._secret = secret  # the pickers' credential; None: peers.allow_unauthenticated
        self._drains = drains
        self.read_every_s = read_every_s
        self.refused = 0  # connections refused at their hello (no proof, not a member, no hello)
        self._said_refusals: set[str] = set()
        self.rejected: Counter[str] = Counter()  # events rejected whole, by reason
        self._said: set[tuple[str, str]] = set()
        self.watched = False  # events are read as they arrive (requests are queued), not on demand
        self._connections: set[_Inbound] = set()  # every open one, hello or not
        self._answers: set[asyncio.Task[None]] = set()
        self._listener: socket.socket | None = None
        # a member's move ask moves this picker's streams through this (picker proxy wires its own)
        self.mover: Callable[[str], int] | None = None

    async def listen(self, host: str, port: int) -> int:
        """Accept peers on host:port (0: any free port); the port."""
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, address = infos[0][0], infos[0][4]
        listener = socket.create_server(address, family=family)
        listener.setblocking(False)
        loop.add_reader(listener, self._accept)
        self._listener = listener
        if self._secret is None:
            log.warning(
                "peers.allow_unauthenticated: the peer port accepts any client that names a member; "
                "for loopback-only test setups, never a cluster"
            )
        return int(listener.getsockname()[1])

    def _accept(self) -> None:
        assert self._listener is not None
        while True:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of descriptors, say: the peer retries with backoff
                log.warning("accepting a peer connection failed: %s", exc)
                return
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._connections.add(_Inbound(self, sock))

    async def run(self) -> None:
        """Forever: read what peers sent every `read_every_s`; watch while requests are queued."""
        while True:
            await asyncio.sleep(self.read_every_s)  # the reading period, not a synchronisation
            try:
                self.catch_up()
                self.watch(self._path.flow.queued > 0)
            except Exception:  # supervised: one bad turn must not end the reading for good
                log.exception("reading peers failed; the next read runs in %.3f s", self.read_every_s)

    def catch_up(self) -> None:
        """Apply everything peers have sent so far (never waits)."""
        for connection in list(self._connections):
            if connection.sender is not None:
                connection.pull()

    def watch(self, on: bool) -> None:
        if on != self.watched:
            self.watched = on
            for connection in list(self._connections):
                if connection.sender is not None:
                    connection.watch(on)

    def hello(self, connection: _Inbound, hello: Any) -> bool:
        """A connection's first message: True when it may send events (else it is answered or closed).
        It must prove the pickers' credential over this connection's challenge (picker/peers/auth.py)
        and name one of this picker's peers."""
        if not (
            isinstance(hello, list)
            and len(hello) >= 3
            and isinstance(hello[0], str)
            and _HELLO_FIELDS.get(hello[0]) == len(hello)
            and isinstance(hello[1], str)
            and 0 < len(hello[1]) <= 512
        ):
            self._refuse(connection, "?", "not-a-hello")
            return False
        kind, name, presented = hello[:3]
        if self._secret is not None and not verified(self._secret, connection.nonce, kind, name, presented):
            self._refuse(connection, name, "unauthenticated")
            return False
        if name not in self._peering.peers:
            self._refuse(connection, name, "not-a-member")
            return False
        if kind == DRAINS:
            self.answer(connection, self._drains())
            return False
        if kind == MOVES:
            self.answer(connection, self.answer_move(name, hello[3]))
            return False
        connection.sender = str(name)
        connection.watch(self.watched)
        return True

    def answer_move(self, sender: str, ask: Any) -> list[Any]:
        """A member's ask to move this picker's streams off an address (picker/peers/events.py): the
        answer, `["moved", n]` or `["cannot", why]`; a malformed ask is counted, refused and moves
        nothing, and nothing raises from here."""
        reason = ask_problem(ask)
        address = ""
        if reason is None:
            try:
                address = canonical_address(ask[1])
            except ValueError:
                reason = "bad-ask-address"
        if reason is not None:
            self._reject(sender, reason)
            return [REFUSED, "bad-ask"]
        if self.mover is None:
            return [CANNOT, "not-a-proxy"]  # ext_proc: Envoy cannot re-issue a request mid-response
        try:
            moved = self.mover(address)
        except Exception:
            log.exception("peer %s asked to move the streams on %s: failed", sender, address)
            return [CANNOT, "failed"]
        log.info("peer %s asked: %d stream(s) on %s moving", sender, moved, address)
        return [MOVED, moved]

    def _refuse(self, connection: _Inbound, name: str, reason: str) -> None:
        """A connection that may not talk here: counted, said (once per cause), answered and closed."""
        self.refused += 1
        self.rejected[reason] += 1
        if reason not in self._said_refusals:
            self._said_refusals.add(reason)
            log.warning("a peer connection naming %.80s refused: %s", name, reason)
        self.answer(connection, ["error", reason])

    def answer(self, connection: _Inbound, message: Any) -> None:
        """Send `message` on `connection`, then close it (an answer can be larger than a socket buffer)."""
        connection.watch(False)
        task = asyncio.get_running_loop().create_task(connection.answer(msgpack.packb(message)))
        self._answers.add(task)
        task.add_done_callback(self._answers.discard)

    def apply(self, sender: str, events: Any) -> None:
        """One message: each event checked whole (picker/peers/events.py), then applied; a bad one is
        counted by reason and skipped, the others still apply, and nothing raises from here (this
        runs in the request path, before an admission)."""
        self._peering.heard.add(sender)  # the first message after the hello: the sender's books
        if not isinstance(events, list):
            self._reject(sender, "not-a-list")
            return
        members = self._peering.peers
        for event in events:
            reason = problem(event)
            if reason is None:
                owner = owner_of(event[1])
                if event[0] in OWN_ONLY and owner not in (None, sender):
                    reason = "not-its-own"  # a pick or move can only be in the sender's own books
                elif owner is not None and owner != self._peering.name and owner not in members:
                    reason = "unknown-owner"  # no book is opened for a picker nobody configured
            if reason is not None:
                self._reject(sender, reason)
                continue
            try:
                if not self._peering.book(sender, event):
                    self._path.peer_event(event, sender)
            except Exception:
                self._reject(sender, "failed")
                log.exception("peer %s: an event could not be applied; skipped", sender)

    def _reject(self, sender: str, reason: str) -> None:
        self.rejected[reason] += 1
        if (sender, reason) not in self._said:  # once per peer and cause: a flood must not flood the log
            if len(self._said) > 1024:
                self._said.clear()
            self._said.add((sender, reason))
            log.warning(
                "peer %s sent a malformed event or ask (%s); rejected whole, nothing applied", sender, reason
            )

    def closed(self, connection: _Inbound) -> None:
        self._connections.discard(connection)
        if connection.sender is None:
            return
        if not any(c.sender == connection.sender for c in self._connections):
            self._peering.heard.discard(connection.sender)
        self._path.peer_gone(connection.sender)

    async def close(self) -> None:
        """Stop accepting; close every connection (what they still held is not read)."""
        if self._listener is not None:
            asyncio.get_running_loop().remove_reader(self._listener)
            self._listener.close()
            self._listener = None
        for connection in list(self._connections):
            connection.close()
        await asyncio.gather(*self._answers, return_exceptions=True)


class _Inbound:
    """One connection from a peer: read as it comes until its hello, then when pulled (or watched)."""

    def __init__(self, inbox: PeerInbox, sock: socket.socket) -> None:
        self._inbox = inbox
        self._sock = sock
        self._loop = asyncio.get_running_loop()
        self._unpacker = msgpack.Unpacker(raw=False, max_buffer_size=MAX_BUFFER)
        self._watched = False
        self._closed = False
        self._hello_timer: asyncio.TimerHandle | None = self._loop.call_later(HELLO_TIMEOUT_S, self.close)
        self.sender: str | None = None
        # what the hello must prove the credential over: fresh per connection, so none is replayed
        self.nonce = new_nonce()
        try:
            sock.send(msgpack.packb([CHALLENGE, self.nonce]))  # a few bytes into an empty buffer
        except OSError:
            self.close()
            return
        self.watch(True)

    def watch(self, on: bool) -> None:
        """Read as data arrives (on), or only when pulled (off)."""
        if self._closed or on == self._watched:
            return
        if on:
            self._loop.add_reader(self._sock, self.pull)
        else:
            self._loop.remove_reader(self._sock)
        self._watched = on

    def pull(self) -> None:
        """Read and apply whatever has arrived; close on the peer's end or a broken connection."""
        while not self._closed:
            try:
                data = self._sock.recv(_READ_SIZE)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                data = b""
            if not data:
                self.close()
                return
            self._received(data)

    def _received(self, data: bytes) -> None:
        try:
            self._unpacker.feed(data)
            for message in self._unpacker:
                if self.sender is not None:
                    self._inbox.apply(self.sender, message)
                    continue
                if self._hello_timer is not None:
                    self._hello_timer.cancel()
                    self._hello_timer = None
                if not self._inbox.hello(self, message):
                    return
        except (msgpack.UnpackException, ValueError) as exc:
            log.warning("peer %s: unreadable message (%s); connection closed", self.sender or "?", exc)
            self.close()

    async def answer(self, data: bytes) -> None:
        try:
            async with asyncio.timeout(_ANSWER_TIMEOUT_S):
                await self._loop.sock_sendall(self._sock, data)
        except (OSError, TimeoutError) as exc:
            log.info("an answer to a peer was not delivered: %s", type(exc).__name__)
        finally:
            self.close()

    def close(self) -> None:
        if self._closed:
            return
        self.watch(False)
        self._closed = True
        if self._hello_timer is not None:
            self._hello_timer.cancel()
            self._hello_timer = None
        self._sock.close()
        self._inbox.closed(self)
