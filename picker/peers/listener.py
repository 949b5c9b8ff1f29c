"""The peer port itself: accepting connections and reading them, so that strangers cannot exhaust it
(picker/peers/inbox.py decides what each connection may do; picker/peers/channel.py connects out).

Until its hello is accepted a connection is a stranger's, and bounded: it may send HELLO_MAX bytes
(a hello is under 1.2 KiB; past that it is closed), for HELLO_TIMEOUT_S, and at most
`max_per_source` such connections from one source (an IPv4 address, an IPv6 /64) and `max_total` in
all are open at once (more are closed at accept, unread); the pool's own peers, known by the
addresses they are named by, wait in places of their own (`Gate`), so strangers cannot block them.
So what strangers can make a picker hold is about `max_total` x (HELLO_MAX + a 64 KiB read buffer +
a socket's buffers), whatever they send. Out of descriptors
(EMFILE, ENFILE), or any other failing accept, the accept loop stops reading the listener and tries
again after a backoff, instead of spinning on a listener that stays readable. Every refusal is
counted by reason (`picker_peer_connections_rejected_total`), with a proven peer's frame that fails
(picker/peers/session.py).

Plain non-blocking sockets on the loop (`add_reader`), not transports: a proven events connection is
read when the inbox pulls it (before each admission), and a paused transport cannot be read on demand.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections import Counter
from collections.abc import Callable
from typing import Any, Protocol

import msgpack

from picker.peers.auth import CHALLENGE, new_nonce
from picker.peers.session import HELLO_MAX, HELLO_TIMEOUT_S, MAX_FRAME, STREAM_LIMITS, FrameError, Session

log = logging.getLogger(__name__)

_READ_SIZE = 65536
_ANSWER_TIMEOUT_S = 5.0  # an answer or a refusal that cannot be written by then is dropped
_ACCEPT_BACKOFF_S = (0.05, 0.1, 0.2, 0.5, 1.0, 2.0)  # after a failed accept, by failures in a row


class Host(Protocol):
    """What a connection reports to (PeerInbox)."""

    watched: bool

    def opened(self, connection: Inbound) -> None: ...
    def hello(self, connection: Inbound, message: Any) -> None: ...
    def frame(self, connection: Inbound, message: Any) -> None: ...
    def failed(self, connection: Inbound | None, reason: str) -> None: ...
    def closed(self, connection: Inbound) -> None: ...


class Gate:
    """The connections not past their hello, by source: how many may be open (pure).

    A stranger's source is its prefix (`source_prefix`: an IPv4 address, an IPv6 /64), so one host
    with a whole /64 of addresses holds `max_per_source` places, not `max_total`. The pool's own
    peers (`known`: a source address a member is named by) wait in places of their own, each
    address up to `max_per_source`, so strangers holding every stranger's place never refuse a
    peer's new link or question."""

    def __init__(
        self, max_total: int, max_per_source: int, known: Callable[[str], bool] = lambda _: False
    ) -> None:
        self.max_total, self.max_per_source = max_total, max_per_source
        self._known = known
        self._by_source: Counter[str] = Counter()  # strangers' places, by prefix
        self._members: Counter[str] = Counter()  # known peers' places, by address
        self.total = 0  # strangers' places taken

    def enter(self, source: str) -> str | None:
        """None when a new connection from `source` may wait for its hello (it is counted); else why not."""
        if self._known(source):
            if self._members[source] >= self.max_per_source:
                return "too-many-from-source"
            self._members[source] += 1
            return None
        prefix = source_prefix(source)
        if self._by_source[prefix] >= self.max_per_source:
            return "too-many-from-source"
        if self.total >= self.max_total:
            return "too-many-unauthenticated"
        self._by_source[prefix] += 1
        self.total += 1
        return None

    def leave(self, source: str) -> None:
        """A connection from `source` said its hello, or closed without one. A source counted as a
        known peer's gives back a peer's place first (its connections are one pod's)."""
        if self._members[source] > 0:
            self._members[source] -= 1
            if not self._members[source]:
                del self._members[source]
            return
        prefix = source_prefix(source)
        self.total -= 1
        self._by_source[prefix] -= 1
        if self._by_source[prefix] <= 0:
            del self._by_source[prefix]


def source_prefix(source: str) -> str:
    """What a stranger's per-source cap counts by: an IPv4 address itself (an IPv4-mapped one too),
    an IPv6 address by its /64 (what one host or subscriber is given); anything else as it is."""
    try:
        ip = ipaddress.ip_address(source)
    except ValueError:
        return source
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


class PeerListener:
    """The listening socket and its accept loop (see the module docstring)."""

    def __init__(self, host: Host, gate: Gate) -> None:
        self._host, self._gate = host, gate
        self._sock: socket.socket | None = None
        self._failures = 0  # accepts failed in a row
        self._resume: asyncio.TimerHandle | None = None

    async def open(self, address: str, port: int) -> int:
        """Listen on address:port (0: any free port); the port."""
        loop = asyncio.get_running_loop()
        infos = await loop.getaddrinfo(address, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, bound = infos[0][0], infos[0][4]
        sock = socket.create_server(bound, family=family)
        sock.setblocking(False)
        self._sock = sock
        loop.add_reader(sock, self._accept)
        return int(sock.getsockname()[1])

    def _accept(self) -> None:
        assert self._sock is not None
        while True:
            try:
                sock, address = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:
                continue  # this client gave up while queued: the next one may be fine
            except OSError as exc:  # out of descriptors, say: stop reading the listener for a while
                self._back_off(exc)
                return
            self._failures = 0
            source = str(address[0])
            reason = self._gate.enter(source)
            if reason is not None:
                sock.close()
                self._host.failed(None, reason)
                continue
            try:
                sock.setblocking(False)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:  # reset by the client already
                sock.close()
                self._gate.leave(source)
                continue
            Inbound(self._host, self._gate, sock, source)

    def _back_off(self, exc: OSError) -> None:
        assert self._sock is not None
        delay = _ACCEPT_BACKOFF_S[min(self._failures, len(_ACCEPT_BACKOFF_S) - 1)]
        if self._failures == 0:
            log.warning(
                "accepting a peer connection failed (%s); accepting again in %.2f s, backing off", exc, delay
            )
        self._failures += 1
        self._host.failed(None, "accept-failed")
        loop = asyncio.get_running_loop()
        loop.remove_reader(self._sock)
        self._resume = loop.call_later(delay, self._accept_again)

    def _accept_again(self) -> None:
        self._resume = None
        if self._sock is not None:
            asyncio.get_running_loop().add_reader(self._sock, self._accept)

    def close(self) -> None:
        if self._resume is not None:
            self._resume.cancel()
            self._resume = None
        if self._sock is not None:
            asyncio.get_running_loop().remove_reader(self._sock)
            self._sock.close()
            self._sock = None


class Inbound:
    """One connection from the peer port: read as it comes until it is proven (its hello) and, on an
    events session, then when pulled (or watched); the host decides what it may do."""

    def __init__(self, host: Host, gate: Gate, sock: socket.socket, source: str) -> None:
        self._host, self._gate, self._sock, self.source = host, gate, sock, source
        self._loop = asyncio.get_running_loop()
        # read_size: without it msgpack reserves 1 MiB per connection (measured), strangers' included
        self._unpacker = msgpack.Unpacker(
            raw=False, max_buffer_size=MAX_FRAME, read_size=_READ_SIZE, **STREAM_LIMITS
        )
        self._fed = 0  # bytes read before the hello was accepted
        self._watched = self._closed = False
        self._stopped = False  # answered or refused: nothing more is read
        self.proven = False  # its hello accepted (it no longer holds a stranger's place)
        self.kind: str | None = None
        self.peer: str | None = None  # the member it proved to be
        self.sender: str | None = None  # set for an events session: its frames are that member's books
        self.session: Session | None = None
        self.superseded = False  # a newer events session of the same member replaced it
        self.nonce = new_nonce()  # the challenge: fresh per connection, so no hello is replayed
        self._deadline: asyncio.TimerHandle | None = self._loop.call_later(HELLO_TIMEOUT_S, self._late)
        host.opened(self)
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
        """Read and take whatever has arrived; close on the peer's end or a broken connection."""
        while not (self._closed or self._stopped):
            size = _READ_SIZE if self.proven else HELLO_MAX + 1 - self._fed
            try:
                data = self._sock.recv(size)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                data = b""
            if not data:
                self.close()
                return
            if not self.proven:
                self._fed += len(data)
            self._received(data)
            if not (self.proven or self._closed or self._stopped) and self._fed > HELLO_MAX:
                self.fail("hello-too-large")

    def _received(self, data: bytes) -> None:
        try:
            self._unpacker.feed(data)
        except msgpack.BufferFull:
            self.fail("too-large")
            return
        while not (self._closed or self._stopped):
            try:
                message = self._unpacker.unpack()
            except msgpack.OutOfData:
                return
            except (msgpack.UnpackException, ValueError, TypeError):
                self.fail("unreadable")
                return
            if self.session is None:
                self._host.hello(self, message)
                continue
            try:
                opened = self.session.open(message)
            except FrameError as exc:
                self.fail(exc.reason)
                return
            self._host.frame(self, opened)

    def prove(self, kind: str, peer: str, session: Session) -> None:
        """Its hello was accepted: a member's session, out of the strangers' places."""
        self.kind, self.peer, self.session, self.proven = kind, peer, session, True
        self._gate.leave(self.source)

    def send_now(self, data: bytes) -> bool:
        """Write a few bytes (a welcome) into the socket's buffer; False when it could not (closed)."""
        try:
            sent = self._sock.send(data)
        except OSError:
            sent = 0
        if sent != len(data):
            self.close()
            return False
        return True

    def start_events(self, sender: str, watched: bool) -> None:
        """An events session: its frames are `sender`'s books, read when pulled (or watched)."""
        self.sender = sender
        self._cancel_deadline()
        self.watch(watched)

    def fail(self, reason: str) -> None:
        """Closed for what it sent (or did not send in time): counted by reason."""
        self._host.failed(self, reason)
        self.close()

    def _late(self) -> None:
        self._deadline = None
        self.fail("no-hello" if not self.proven else "no-ask")

    def _cancel_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def stop(self) -> None:
        """Nothing more is read (it is being answered, or refused)."""
        self._stopped = True
        self._cancel_deadline()
        self.watch(False)

    async def answer(self, data: bytes) -> None:
        """Send `data` (an answer can be larger than a socket buffer), then close."""
        self.stop()
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
        self._cancel_deadline()
        if not self.proven:
            self._gate.leave(self.source)
        self._sock.close()
        self._host.closed(self)
