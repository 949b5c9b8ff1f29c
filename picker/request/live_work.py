"""The live requests as the work each endpoint would lose in a scale-down (picker/pool/deletion_cost.py):
where each is, what it asked for, how far it got. Read once per deletion-cost step, never per request."""

from __future__ import annotations

from collections.abc import Iterable

from picker.pool.deletion_cost import Stream
from picker.streams import RequestRecord


def live_streams(records: Iterable[RequestRecord]) -> list[Stream]:
    """One `Stream` per live request attributed to an endpoint. A request whose response no filter
    sees (no tracker: Envoy's access log ends it) counts as one that has sent nothing yet."""
    out: list[Stream] = []
    for record in records:
        endpoint = record.endpoint
        if endpoint is None or record.ended:
            continue
        tracker = record.tracker
        sent = tracker.tokens if tracker is not None else 0
        first = tracker.first_byte_at if tracker is not None else None
        out.append(Stream(endpoint, record.max_tokens, sent, first))
    return out
