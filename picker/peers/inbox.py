"""The receiving side of the channel between pickers (picker/peers/channel.py sends): peers' events applied
to this picker's books and records, read when this picker needs them rather than when they arrive.

A connection (picker/peers/listener.py accepts and reads it) starts with this picker's challenge and
the peer's hello; both sides prove the pickers' credential (picker/peers/auth.py) and every frame
after that is sealed (picker/peers/session.py). On an `events` session each frame is a list of events
(picker/peers/books.py); a `drains` session is answered with this picker's drain records, and a
`moves` session's first frame is a member's ask to move this picker's streams off an address
(picker/peers/events.py), answered with how many moved (through `mover`: picker proxy's own; else it
cannot). A member has one events session here: a newer one (the member restarted, or reconnected
before this picker saw the old connection break) supersedes the older, whose close then changes
nothing; the older one's books become orphans when the newer one opens, before its own books apply.

After the hello an events connection is not watched: what peers send waits in the socket until
`PeerInbox.catch_up` reads it, which the request path calls before every admission (a pick sees every
pick and end its peers sent until then), and a timer every `peers.read_every_s` (the owner's records
settle, a link that broke is noticed). While requests wait in the flow-control queue the connections
are watched again, so an end that frees a slot dispatches at once (a peer's `end` or `move` pumps
the queue as an own request's end does).
Why: a message to a process waiting on its socket costs a wake-up on both sides (the sender's
write wakes the receiver; the receiver runs its loop for one message). Reading what is ready as a
batch costs the books less CPU per request (loadtest/bench_peers.py), and a pick reads
its peers' latest picks and ends, which a message ready in the same loop turn as the request was not.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from collections import Counter
from collections.abc import Callable
from typing import Any

import msgpack

from picker.config.model import canonical_address, parse_address
from picker.peers import budget_share
from picker.peers.auth import DRAINS, EVENTS, REFUSAL, hello_of, proven
from picker.peers.books import Peering, owner_of
from picker.peers.events import CANNOT, MOVED, REFUSED, ask_problem, problem
from picker.peers.listener import Gate, Inbound, PeerListener
from picker.peers.session import Session
from picker.request.pipeline import RequestPath

log = logging.getLogger(__name__)

# events a picker sends only about its own requests (or its own spending)
OWN_ONLY = frozenset({"pick", "move", "sync", *budget_share.KINDS})
_SAID = 1024  # (who, cause) pairs logged once each, then forgotten: a flood must not flood the log


def member_addresses(peering: Peering) -> Callable[[str], bool]:
    """Whether a connection's source address is one a peer is named by (`ip:port` members, as
    peers.service resolves them; a peer named by DNS is not known this way), read at each call so
    a re-resolved member list counts at once."""

    def known(source: str) -> bool:
        address = _ip(source)
        return address is not None and any(_ip(member, named=True) == address for member in peering.peers)

    return known


def _ip(text: str, named: bool = False) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The address `text` is (a member's name `host:port` when `named`), None when it names none."""
    try:
        ip = ipaddress.ip_address(parse_address(text)[0] if named else text)
    except ValueError:
        return None
    mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
    return mapped or ip


class PeerInbox:
    """Every connection from a peer: the hello, then their events applied to this picker."""

    def __init__(
        self,
        peering: Peering,
        path: RequestPath,
        secret: str | None,
        drains: Callable[[], Any],
        read_every_s: float = 0.01,
        max_unauthenticated: int = 64,
        max_unauthenticated_per_source: int = 8,
    ) -> None:
        self._peering = peering
        self._path = path
        self._secret = secret  # the pickers' credential; None: peers.allow_unauthenticated
        self._drains = drains
        self.read_every_s = read_every_s
        self.refused = 0  # connections refused at their hello (no proof, not a member, no hello)
        self.rejected: Counter[str] = Counter()  # hellos, events and asks rejected whole, by reason
        # connections refused or closed for what they did, by reason (see picker/peers/listener.py)
        self.connections_refused: Counter[str] = Counter()
        self._said: set[tuple[str, str]] = set()
        self.watched = False  # events are read as they arrive (requests are queued), not on demand
        self._connections: set[Inbound] = set()  # every open one, hello or not
        self._answers: set[asyncio.Task[None]] = set()
        self._gate = Gate(max_unauthenticated, max_unauthenticated_per_source, member_addresses(peering))
        self._listener: PeerListener | None = None
        # a member's move ask moves this picker's streams through this (picker proxy wires its own)
        self.mover: Callable[[str], int] | None = None

    async def listen(self, host: str, port: int) -> int:
        """Accept peers on host:port (0: any free port); the port."""
        self._listener = PeerListener(self, self._gate)
        bound = await self._listener.open(host, port)
        if self._secret is None:
            log.warning(
                "peers.allow_unauthenticated: the peer port accepts any client that names a member; "
                "for loopback-only test setups, never a cluster"
            )
        return bound

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

    # --- what the listener's connections report (picker/peers/listener.py's Host) ------------------------

    def opened(self, connection: Inbound) -> None:
        self._connections.add(connection)

    def hello(self, connection: Inbound, message: Any) -> None:
        """A connection's first message. It must prove the pickers' credential over both nonces, name
        this picker as its receiver and one of its peers as its sender (picker/peers/auth.py); then
        this picker proves itself in turn (the welcome) and the session's frames begin."""
        parsed = hello_of(message, connection.nonce)
        if isinstance(parsed, str):
            self._refuse(connection, "?", parsed)
            return
        handshake, presented = parsed
        sender = handshake.sender
        if not proven(handshake.hello_proof(self._secret), presented):
            self._refuse(connection, sender, "unauthenticated")
        elif handshake.receiver != self._peering.name:
            self._refuse(connection, sender, "wrong-receiver")  # a hello meant for another picker
        elif sender not in self._peering.peers:
            self._refuse(connection, sender, "not-a-member")
        else:
            session = Session.listener(handshake, self._secret)
            connection.prove(handshake.kind, sender, session)
            welcome = msgpack.packb(handshake.welcome(self._secret))
            if handshake.kind == DRAINS:
                self._answer(connection, welcome + session.seal(self._drains()))
            elif connection.send_now(welcome) and handshake.kind == EVENTS:
                self._supersede(sender, connection)
                connection.start_events(sender, self.watched)
            # a moves session: its ask is its first frame (`frame`)

    def frame(self, connection: Inbound, message: Any) -> None:
        """A proven frame: an events session's books, or a moves session's ask (then answered)."""
        assert connection.session is not None and connection.peer is not None
        if connection.sender is not None:
            self.apply(connection.sender, message)
            return
        self._answer(connection, connection.session.seal(self.answer_move(connection.peer, message)))

    def failed(self, connection: Inbound | None, reason: str) -> None:
        """A connection refused at accept (None), or closed for what it sent: counted by reason."""
        self.connections_refused[reason] += 1
        who = (connection.peer or connection.source) if connection is not None else "?"
        self._say(who, reason, "a peer connection from %s closed: %s")

    def closed(self, connection: Inbound) -> None:
        self._connections.discard(connection)
        sender = connection.sender
        if sender is None or connection.superseded:
            return  # not an events session, or a newer one of the same member holds its books now
        if any(c.sender == sender for c in self._connections):
            return
        self._peering.heard.discard(sender)
        self._path.peer_gone(sender)

    # --- what members may do -------------------------------------------------------------------------------

    def _supersede(self, sender: str, newer: Inbound) -> None:
        """`sender` opened a new events session: the older ones are read to the end of what they
        hold, then closed, and their books become orphans (the newer session's books follow)."""
        older = [c for c in self._connections if c is not newer and c.sender == sender]
        for connection in older:
            connection.superseded = True
            connection.pull()
            connection.close()
        if older:
            log.info("peer %s opened a new session; its older one is closed", sender)
            self._path.peer_gone(sender)

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

    def apply(self, sender: str, events: Any) -> None:
        """One message: each event checked whole (picker/peers/events.py), then applied; a bad one is
        counted by reason and skipped, the others still apply, and nothing raises from here (this
        runs in the request path, before an admission). A pick, move or sync may only be about the
        sender's own requests: a sync's every entry too, or none of it applies."""
        self._peering.heard.add(sender)  # the first message after the hello: the sender's books
        if not isinstance(events, list):
            self._reject(sender, "not-a-list")
            return
        members = self._peering.peers
        freed = False  # a peer's request ended or moved: a slot may have freed for the queue here
        for event in events:
            reason = problem(event)
            if reason is None:
                owner = owner_of(event[1])
                if event[0] in OWN_ONLY and owner not in (None, sender):
                    reason = "not-its-own"  # a pick or move can only be in the sender's own books
                elif event[0] == "sync" and any(owner_of(entry[0]) != sender for entry in event[2]):
                    reason = "not-its-own"  # its books whole: this picker's requests, or a third's
                elif owner is not None and owner != self._peering.name and owner not in members:
                    reason = "unknown-owner"  # no book is opened for a picker nobody configured
            if reason is not None:
                self._reject(sender, reason)
                continue
            try:
                if event[0] in budget_share.KINDS:
                    budget_share.apply(self._path.flow.budgets, sender, event)
                elif not self._peering.book(sender, event):
                    self._path.peer_event(event, sender)
                freed = freed or event[0] in ("end", "move")
            except Exception:
                self._reject(sender, "failed")
                log.exception("peer %s: an event could not be applied; skipped", sender)
        if freed and self._path.flow.queued:
            self._path.flow.pump()  # as an own request's end does: queued requests take the slot now

    # --- answers and refusals ------------------------------------------------------------------------------

    def _refuse(self, connection: Inbound, name: str, reason: str) -> None:
        """A hello that may not talk here: counted, said (once per cause), answered and closed."""
        self.refused += 1
        self.rejected[reason] += 1
        self._say(name[:80], reason, "a peer connection naming %s refused: %s")
        self._answer(connection, msgpack.packb([REFUSAL, reason]))

    def _answer(self, connection: Inbound, data: bytes) -> None:
        """Send `data` on `connection`, then close it (an answer can be larger than a socket buffer)."""
        connection.stop()
        task = asyncio.get_running_loop().create_task(connection.answer(data))
        self._answers.add(task)
        task.add_done_callback(self._answers.discard)

    def _reject(self, sender: str, reason: str) -> None:
        self.rejected[reason] += 1
        self._say(
            sender, reason, "peer %s sent a malformed event or ask (%s); rejected whole, nothing applied"
        )

    def _say(self, who: str, reason: str, text: str) -> None:
        """Log once per (who, cause)."""
        if (who, reason) in self._said:
            return
        if len(self._said) > _SAID:
            self._said.clear()
        self._said.add((who, reason))
        log.warning(text, who, reason)

    async def close(self) -> None:
        """Stop accepting; close every connection (what they still held is not read)."""
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        for connection in list(self._connections):
            connection.close()
        await asyncio.gather(*self._answers, return_exceptions=True)
