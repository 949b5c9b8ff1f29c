"""Ends inferred from an engine's gauges, for requests whose end nothing reports (picker/streams/ends.py).

The engine's running + waiting gauges count every request it holds. The picker's own count on an
endpoint, less that and less its requests still in transit when the scrape was sent (the engine may
not hold them yet), is how many of its engine-tracked requests there have ended: the oldest first.
Exact in number; which ones is a guess that only end reasons and timings depend on.
"""

from __future__ import annotations

from collections.abc import Sequence

from picker.pool import Endpoint
from picker.streams.record import RequestRecord


def sent_at(record: RequestRecord) -> float:
    """When a request was sent to its endpoint (its pick, or its admission before one)."""
    return record.lease.picked_at if record.lease is not None else record.admitted_at


def answered(record: RequestRecord, before: float) -> bool:
    """Its response had started before `before`: its engine held it then (no longer in transit)."""
    return record.response_started_at is not None and record.response_started_at < before


def started_at(record: RequestRecord) -> float:
    """When its response started, or (no data plane reports responses) when it was admitted."""
    return record.response_started_at if record.response_started_at is not None else record.admitted_at


def inferred_ends(
    records: Sequence[RequestRecord], endpoint: Endpoint, transit_s: float
) -> list[RequestRecord]:
    """Of this picker's live `records` on `endpoint`, the engine-tracked ones its last scrape shows
    have ended. A request not answered before the scrape was sent may not have reached the engine
    yet: it counts as on its way, and is never ended by this scrape. That is every request still
    waiting for its response headers (a burst can keep one in Envoy's hands for long), and, where no
    response ever reaches the picker (the NGINX shim), one sent within `transit_s` of the scrape."""
    load = endpoint.load
    if load is None:
        return []
    sent = load.at if load.sent_at is None else load.sent_at
    cutoff = sent - transit_s
    moving = [not answered(r, sent) and (not r.engine_tracked or sent_at(r) >= cutoff) for r in records]
    # arrivals since the scrape was sent (a fallback moved here, say) are in transit too
    unseen = max(sum(moving), endpoint.arrivals - load.arrivals_before)
    engine = int(load.running + load.waiting) - endpoint.peer_in_flight  # this picker's share
    excess = endpoint.in_flight - engine - unseen
    if excess <= 0:
        return []
    held = [r for r, m in zip(records, moving, strict=True) if r.engine_tracked and not m]
    return sorted(held, key=started_at)[:excess]
