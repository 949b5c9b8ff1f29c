"""Several pickers, one set of books: each request's end reaches the picker that routed it, and every
picker counts the others' requests on each endpoint.

Envoy picks a `picker` host for each ext_proc stream on its own (no ext_proc option pins a request's streams
to one host: `GrpcService.EnvoyGrpc` has no hash policy, its `initial_metadata` is static), so a request's
observer stream, and its access-log entry, often reach a picker other than the one that routed it. The
routing picker's request id names it (`<name>~<id>`, `name` the address its peers reach it at). What a peer
tells it, over the channel between pickers (picker/peers/channel.py, picker/peers/inbox.py):
- to the request's owner, from the picker its observer stream came to: `claim` (an observer joined),
  `started` (status, who served, streaming), `first` (the first byte), `alive` (a stream still flowing, at
  most every few seconds, so the owner's stall sweep holds), `ended` (the body's summary: how it ended,
  tokens, usage), and from the picker its access-log entry came to: `log`;
- to every peer, from the owner: `pick` / `move` (the endpoint a request is on) and `end`; from the picker
  that saw the stream end (its observer's), `end` to every picker but the owner, at once; the owner's own
  `end` then skips that picker (with two pickers: nothing more to send). `first` and `ended` carry when they
  happened as an age (seconds before the message left), so the owner dates the first token and the end as
  the observer saw them, not a flush and a hop later, on clocks that need not agree (pickers on different
  nodes): TTFT, drain records. Each picker adds the others' requests to each endpoint's load
  (`Endpoint.peer_in_flight`), and picks staggered (`scheduling.Stagger`), so load spreads as with one
  picker. A peer whose channel breaks leaves its requests behind as *orphans*: they still count on their
  endpoints (their streams run on, whatever happened to the picker) until their end is seen here, the peer
  resends its books, or the endpoint's engine gauges show it no longer runs them (`settle_orphans`, after
  each scrape): never counted for ever, never dropped early.
The observer side keeps a *shadow* record per foreign request (its tracker parses the stream as for a
request of its own) and reports the events; the owner applies them to its own record, so drain records,
truncation counts and end reasons stay exact. Plain synchronous code on the picker's loop: the transport
calls `book` and the path's `peer_event` with what it reads, and drains `Outbox`.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Collection, Sequence
from typing import Any

from picker.peers.outbox import BOOKKEEPING, CLAIM_WITHIN_S, Event, Outbox
from picker.pool import ClientConnections, EndpointState, Pool
from picker.scheduling import Stagger
from picker.streams import Attempts, RequestRecord, ResponseTracker

log = logging.getLogger(__name__)

SEPARATOR = "~"  # in a request id: <owner>~<hex>
PULL = "/kv"  # a prefill hand-off's id in the books: its request's id and this
ALIVE_EVERY_S = 5.0  # a foreign stream's heartbeat to its owner (its stall sweep reads it)
_TOMBSTONES = 4096  # the last ends heard: a pick of one of them, heard later, is stale


def owner_of(request_id: str) -> str | None:
    """The picker a request id names as its router, or None (an id without one: a single picker)."""
    owner, separator, _ = request_id.partition(SEPARATOR)
    return owner if separator else None


class Peering:
    """This picker's side of the shared books (see the module docstring)."""

    def __init__(
        self,
        name: str,
        members: Sequence[str],
        pool: Pool,
        clock: Callable[[], float] = time.monotonic,
        observer_grace_s: float = 2.0,
    ):
        self.name = name
        self.peers = tuple(m for m in members if m != name)
        # a claim reaches the owner before its grace for an observer runs out
        self.outbox = Outbox(clock=clock, claim_within_s=min(CLAIM_WITHIN_S, observer_grace_s / 4))
        self._pool = pool
        self._clock = clock
        self._shadows: dict[str, RequestRecord] = {}  # foreign requests whose observer is here
        self._alive_at: dict[str, float] = {}
        # per peer: its requests in flight and where (it adds to those endpoints' loads)
        self._books: dict[str, dict[str, str]] = {peer: {} for peer in self.peers}
        self._orphans: dict[str, str] = {}  # request -> endpoint: a broken-off peer's, still counted
        self._ended: OrderedDict[str, None] = OrderedDict()  # see _TOMBSTONES
        self.connections = ClientConnections(pool)  # HTTP/1.x: a newer request on one shows the last ended
        pool.peer_pulls = self.pulls_on  # what a drain of a prefill replica waits for, as this one's
        self._stagger: Stagger | None = None
        self.connected: set[str] = set()  # peers the transport's links reach now
        self.heard: set[str] = set()  # peers whose own link to this picker is open (their books here)
        self.discovering = False  # peers found by DNS: the first lookup has not answered yet
        self.observers = 0  # foreign requests whose observer stream came here
        self.forwarded = 0  # events sent to an owner
        self.applied = 0  # events from peers applied to a record of this picker
        self.unknown = 0  # events about a request this picker does not have (ended, or never routed)

    @property
    def dropped(self) -> int:
        return self.outbox.dropped

    def pulls_on(self, address: str) -> int:
        """The other pickers' prefill hand-offs waiting on `address` (an admin read's, not the pick's)."""
        entries = [*self._orphans.items(), *(e for book in self._books.values() for e in book.items())]
        return sum(a == address and i.endswith(PULL) for i, a in entries)

    @property
    def superseded_total(self) -> int:
        return self.connections.total

    @property
    def known_connections(self) -> int:
        return len(self.connections)

    @property
    def stagger(self) -> Stagger:
        """This picker's place among all of them, by name (each picker computes the same order)."""
        if self._stagger is None:
            names = sorted({self.name, *self.peers})
            self._stagger = Stagger(names.index(self.name), len(names))
        return self._stagger

    def unlinked(self) -> list[str]:
        """Known peers not linked both ways yet (their books not here, or this picker's picks not
        reaching them): a pick here is blind to their requests (readiness waits, bounded)."""
        return [p for p in self.peers if p not in self.connected or p not in self.heard]

    def linked(self) -> bool:
        return not self.discovering and not self.unlinked()

    # --- this picker routes -------------------------------------------------------------------------

    def new_id(self, local: str) -> str:
        return f"{self.name}{SEPARATOR}{local}"

    def arrived(self, record: RequestRecord) -> None:
        """A request of this picker's, before its pick: the last one on its client connection has
        ended (picker/pool/connections.py), whoever routed it."""
        if record.connection is not None:
            self.connections.arrived(record.connection, record.request_id)

    def placed(self, record: RequestRecord, address: str, moved: bool = False) -> None:
        """A request of this picker is on `address` (picked, or moved there by Envoy's fallback)."""
        event: Event = ["move" if moved else "pick", record.request_id, address]
        if moved:
            self.connections.moved(record.request_id, address)
        elif record.connection is not None:
            self.connections.placed(record.request_id, record.connection, address)
            event.append(record.connection)  # its peers learn it too
        for peer in self.peers:
            self.outbox.to(peer, event)

    def pulling(self, record: RequestRecord, address: str, held: bool = True) -> None:
        """A request's prefill hand-off waits on `address` (`held`), or no longer: booked as a request."""
        pull = record.request_id + PULL
        for peer in self.peers:
            self.outbox.to(peer, ["pick", pull, address] if held else ["end", pull])

    def ended(self, record: RequestRecord) -> None:
        self.connections.ended(record.request_id)
        # its observer's picker told the others; this tells them again (one may not have heard), not it
        told = record.observed_by if record.peers_told else None
        for peer in self.peers:
            if peer != told:
                self.outbox.to(peer, ["end", record.request_id])

    # --- another picker routed it: this picker sees its observer stream or its access-log entry ------

    def shadow(self, request_id: str) -> RequestRecord | None:
        """A record to track a foreign request's response here, or None (no such peer)."""
        owner = owner_of(request_id)
        if owner is None or owner == self.name or owner not in self._books:
            return None
        record = RequestRecord(request_id=request_id, admitted_at=self._clock(), owner=owner)
        record.observed = True
        self._shadows[request_id] = record
        self.observers += 1
        self.outbox.to(owner, ["claim", request_id])
        return record

    def started(self, record: RequestRecord, status: int, served: str | None, streaming: bool | None) -> None:
        record.status = status
        record.response_started_at = self._clock()
        record.tracker = ResponseTracker(streaming=bool(streaming))
        self._report(record, ["started", record.request_id, status, served, streaming])

    def chunk(self, record: RequestRecord, chunk: bytes) -> None:
        tracker = record.tracker
        if tracker is None:
            return
        first = tracker.first_byte_at is None
        now = self._clock()
        tracker.feed(chunk, now)
        if first and tracker.first_byte_at is not None:
            self._alive_at[record.request_id] = now
            self._report(record, ["first", record.request_id, now])
        elif now - self._alive_at.get(record.request_id, now) >= ALIVE_EVERY_S:
            self._alive_at[record.request_id] = now
            self._report(record, ["alive", record.request_id])
        if tracker.done:  # `data: [DONE]`: its end, as for a request of this picker's own
            self.observer_ended(record, True)

    def observer_ended(self, record: RequestRecord, end_of_stream: bool) -> None:
        if self._shadows.pop(record.request_id, None) is None:
            return  # told already (at its [DONE]; the end of stream follows)
        tracker = record.tracker
        if tracker is not None:
            tracker.end()
        summary = tracker.summary() if tracker is not None else None
        self._report(record, ["ended", record.request_id, end_of_stream, summary, self._clock()])
        # this picker saw it end first: its endpoint's load drops now, here and on every other
        # picker, not when the owner's `end` comes round a hop later (a request picked meanwhile
        # would see the replica still busy, and all of them pick another: herding)
        assert record.owner is not None
        end: Event = ["end", record.request_id]
        self.book(self.name, end)
        for peer in self.peers:
            if peer != record.owner:
                self.outbox.to(peer, end)
        self._alive_at.pop(record.request_id, None)

    def logged(self, request_id: str, attempts: Attempts) -> bool:
        """A foreign request's access-log entry: True when it was forwarded to its owner."""
        owner = owner_of(request_id)
        if owner is None or owner == self.name or owner not in self._books:
            return False
        entry = [
            "log",
            request_id,
            attempts.count,
            sorted(attempts.flags),
            attempts.status,
            attempts.upstream,
        ]
        self.outbox.to(owner, entry)
        self.forwarded += 1
        return True

    def blind(self, record: RequestRecord) -> None:
        """Its observer stream here sees no body (response headers only): no end will be seen here;
        the owner's engine gauges (or access log) end it, and nothing is left behind here."""
        if self._shadows.pop(record.request_id, None) is not None:
            self._alive_at.pop(record.request_id, None)
            self._report(record, ["blind", record.request_id])

    def _report(self, record: RequestRecord, event: Event) -> None:
        assert record.owner is not None
        self.outbox.to(record.owner, event)
        self.forwarded += 1

    # --- what peers said -------------------------------------------------------------------------

    @property
    def orphans(self) -> int:
        return len(self._orphans)

    def held(self) -> dict[str, Any]:
        """What this picker keeps for others, by table: each peer's book, the records of peers'
        requests whose observer is here, the orphans, the events not yet sent. All empty when no
        request runs: anything left is a leak."""
        return {
            "books": {peer: len(book) for peer, book in self._books.items()},
            "shadows": len(self._shadows),
            "orphans": len(self._orphans),
            "outbox": sum(len(events) for events in self.outbox.pending.values()),
            "connections": len(self.connections),
        }

    def set_members(self, members: Sequence[str]) -> tuple[list[str], list[str]]:
        """The pickers are now `members` (peer discovery re-resolved): (added, removed). A removed
        peer's requests become orphans; a peer that writes before it is discovered is booked anyway."""
        wanted = tuple(dict.fromkeys(m for m in members if m != self.name))
        added = [m for m in wanted if m not in self.peers]
        removed = [m for m in self.peers if m not in wanted]
        for peer in removed:
            self.peer_gone(peer)
            self._books.pop(peer, None)
            self.outbox.pending.pop(peer, None)
            self.connected.discard(peer)
            self.heard.discard(peer)
        for peer in added:
            self._books.setdefault(peer, {})
        self.peers = wanted
        self._stagger = None  # its place may have changed
        return added, removed

    def peer_gone(self, peer: str) -> None:
        """A peer's channel broke: its requests become orphans (still counted where they run)."""
        book = self._books.get(peer)
        if not book:
            return
        self._orphans.update(book)
        book.clear()

    def settle_orphans(self) -> None:
        """Forget the orphans each endpoint's engine no longer runs (after a scrape; see the module).

        What the pickers count on an endpoint beyond the engine's running + waiting gauges, less the
        requests sent since the scrape began, has ended: that many of its orphans go (a gone endpoint's
        all go). Only orphans: this picker's own and connected peers' requests are exact.
        """
        if not self._orphans:
            return
        where: dict[str, list[str]] = defaultdict(list)
        for request_id, address in self._orphans.items():
            where[address].append(request_id)
        for address, request_ids in where.items():
            endpoint = self._pool.get(address)
            if endpoint is None or endpoint.state is EndpointState.GONE:
                excess = len(request_ids)
            elif endpoint.load is None:
                continue
            else:
                load = endpoint.load
                unseen = endpoint.arrivals - load.arrivals_before
                counted = endpoint.in_flight + endpoint.peer_in_flight
                excess = counted - int(load.running + load.waiting) - unseen
            for request_id in request_ids[: max(0, excess)]:
                del self._orphans[request_id]
                self._add(address, -1)
                self.connections.ended(request_id)

    def book(self, peer: str, event: Event) -> bool:
        """`pick` / `move` / `end` from `peer` (an `end` also from the picker its observer stream
        went to: it goes in its owner's book); False when the event is not a bookkeeping one."""
        kind, request_id = event[0], event[1]
        if kind not in BOOKKEEPING:
            return False
        owner = owner_of(request_id) or peer
        if owner == self.name:
            return True  # one of this picker's own: its record is the book
        if kind == "sync":
            self._resync(owner, event[2])
            return True
        orphaned = self._orphans.pop(request_id, None)  # its owner is back, or its end was seen here
        if orphaned is not None:
            self._add(orphaned, -1)
        book = self._books.setdefault(owner, {})  # a peer not discovered yet still counts
        if kind != "end" and request_id in self._ended:
            return True  # a pick of a request whose end was heard: stale (the tombstone stays)
        if kind in ("pick", "move"):
            self._place(book, request_id, event[2])
            if kind == "move":
                self.connections.moved(request_id, event[2])
            elif len(event) > 3 and isinstance(event[3], str):
                self.connections.placed(request_id, event[3], event[2])
        else:
            self.connections.ended(request_id)
            previous = book.pop(request_id, None)
            if previous is not None:
                self._add(previous, -1)
            # every end leaves a tombstone: a pick of the request heard later is stale, whether it
            # was queued behind a broken link, resent with the owner's books before the owner heard
            # of an end another picker saw, or read last from a connection the owner had replaced
            self._ended[request_id] = None
            if len(self._ended) > _TOMBSTONES:
                self._ended.popitem(last=False)
        return True

    def sync(self, records: Sequence[RequestRecord], to: Collection[str] | None = None) -> None:
        """This picker's books whole, to the peers `to` (every one when None); the transport calls it
        every SYNC_EVERY_S for the peers it reaches (a peer away gets the books on its reconnect)."""
        entries = [[r.request_id, r.endpoint] for r in records if r.endpoint and r.owner is None]
        entries += [[r.request_id + PULL, r.pulling] for r in records if r.pulling and r.owner is None]
        for peer in self.peers:
            if to is None or peer in to:
                self.outbox.to(peer, ["sync", self.new_id(""), entries])

    def _resync(self, owner: str, entries: list[list[str]]) -> None:
        """An owner's books, whole: what this copy holds beyond them has ended there (its end was
        lost); what it lacks is booked (unless its end was heard here first). Only the owner's own
        requests: an entry naming another picker (this one, or a third) is no part of its books."""
        wanted = {
            request_id: address
            for request_id, address in entries
            if request_id not in self._ended and owner_of(request_id) == owner
        }
        book = self._books.setdefault(owner, {})
        for request_id in [r for r in book if r not in wanted]:
            self._add(book.pop(request_id), -1)
            self.connections.ended(request_id)
        for request_id, address in wanted.items():
            if book.get(request_id) == address:
                continue
            orphaned = self._orphans.pop(request_id, None)
            if orphaned is not None:
                self._add(orphaned, -1)
            self._place(book, request_id, address)

    def _place(self, book: dict[str, str], request_id: str, address: str) -> None:
        """A peer's request is on `address` now (booked anew, or moved from where it was)."""
        previous = book.get(request_id)
        if previous is not None:
            self._add(previous, -1)
        book[request_id] = address
        self._add(address, 1)

    def _add(self, address: str, delta: int) -> None:
        endpoint = self._pool.get(address)
        if endpoint is None:
            return
        endpoint.peer_in_flight = max(0, endpoint.peer_in_flight + delta)
        if delta > 0:
            endpoint.arrivals += 1
            endpoint.peer_arrivals += 1
        else:
            endpoint.departures += 1
