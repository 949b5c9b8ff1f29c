"""What leaves one picker for each of its peers (picker/peers/books.py's events), and how soon.

The events are msgpack-able lists, `[kind, request_id, ...]`. The transport (picker/peers/channel.py) drains
the outbox; bookkeeping events leave at once (load spreading reads them), reports may wait a few
milliseconds to share a write. Dated events carry when they happened as an age, so clocks that do
not agree still date a first token and an end as the observer saw them.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# broadcast; resent whole on every reconnect (a `sync` is the whole of a picker's books, every few
# seconds: what a receiver's copy lost, however, is put right by the next one)
BOOKKEEPING = frozenset({"pick", "move", "end", "sync"})
SYNC_EVERY_S = 5.0
# How soon an event leaves (seconds; the transport sends everything queued for a peer at once). At
# once: what load spreading reads (a stream's end frees its slot for the next pick; a peer reads its
# socket before each pick, picker/peers/inbox.py). Other reports wait a few milliseconds to share a
# write. A `claim` waits for its request's next report (`started`, or `ended`: for a short request
# all go as one message), at most `claim_within_s`, well inside the owner's observer grace.
URGENT = BOOKKEEPING | {"ended", "spent"}  # spent: a tenant's budget (picker/peers/budget_share.py)
REPORT_WITHIN_S = 0.005
CLAIM_WITHIN_S = 0.1
_MAX_QUEUED = 50_000  # events held for a peer that does not take them; the oldest go beyond
DATED = {"first": 2, "ended": 4}  # kind: the field holding when it happened (the sender's clock, then age)

Event = list[Any]  # msgpack-able: [kind, request_id, ...]


@dataclass
class Outbox:
    """What leaves for each peer, drained by the transport."""

    pending: dict[str, list[Event]] = field(default_factory=lambda: defaultdict(list))
    # the transport's: something is waiting to go to a peer, and must leave within so many seconds
    # (0: books, which load spreading reads; a report or a claim may wait to share a write)
    wake: Callable[[str, float], None] = lambda peer, within_s: None
    dropped: int = 0  # events a peer never took (it stayed away); its books are resent on reconnect
    clock: Callable[[], float] = time.monotonic
    claim_within_s: float = CLAIM_WITHIN_S

    def to(self, peer: str, event: Event) -> None:
        queued = self.pending[peer]
        queued.append(event)
        if len(queued) > _MAX_QUEUED:
            half = len(queued) // 2
            self.dropped += half
            del queued[:half]
        kind = event[0]
        within_s = 0.0 if kind in URGENT else self.claim_within_s if kind == "claim" else REPORT_WITHIN_S
        self.wake(peer, within_s)

    def take(self, peer: str) -> list[Event]:
        """Everything queued for `peer`, each dated event's time turned into its age now."""
        events = self.pending.pop(peer, [])
        now = self.clock()
        for index, event in enumerate(events):
            field_at = DATED.get(event[0])
            if field_at is not None and len(event) > field_at:
                events[index] = [*event[:field_at], max(0.0, now - event[field_at]), *event[field_at + 1 :]]
        return events


def happened_at(event: Event, now: float, earliest: float) -> float:
    """When a dated event (`DATED`) happened, on this picker's clock: its age before `now`, never
    before `earliest` (what it follows here); `now` for an event from a picker that sends none."""
    field_at = DATED.get(event[0])
    age = event[field_at] if field_at is not None and len(event) > field_at else None
    if not isinstance(age, (int, float)) or age != age or age <= 0:
        return now
    return max(earliest, now - age)
