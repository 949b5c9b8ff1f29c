"""The request path both frontends share: view -> admit -> pick -> track -> release.

Frontends translate their wire format into these calls; nothing here knows about gRPC or HTTP.
"""

from __future__ import annotations

import logging
import random
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from picker.contract import Outcome, Reply, reply_for
from picker.inference import InferenceRequest
from picker.pool import Pool
from picker.scheduling import pick
from picker.streams import EndReason, RequestRecord
from picker.telemetry import Metrics

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Routed:
    """A dispatch decision: where to send the request, primary first."""

    record: RequestRecord
    destinations: tuple[str, ...]


class RequestPath:
    """Admission, picking and in-flight bookkeeping for every request the picker routes."""

    def __init__(
        self,
        pool: Pool,
        metrics: Metrics,
        *,
        fallback_count: int,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
        new_id: Callable[[], str] = lambda: uuid.uuid4().hex,
    ) -> None:
        self._pool = pool
        self._metrics = metrics
        self._fallback_count = fallback_count
        self._clock = clock
        self._rng = rng or random.Random()
        self._new_id = new_id
        self._live: dict[str, RequestRecord] = {}
        self.accepting = True

    @property
    def live(self) -> int:
        """Requests admitted and not yet ended."""
        return len(self._live)

    def records(self) -> list[RequestRecord]:
        return list(self._live.values())

    def route(self, request: InferenceRequest) -> Routed | Reply:
        """Admit one parsed request and pick its endpoints, or answer it with a contract reply."""
        started = self._clock()
        if not self.accepting:
            return self.reject(reply_for(Outcome.REJECTED_SHUTTING_DOWN))
        destinations = pick(self._pool.ready(), 1 + self._fallback_count, self._rng)
        if not destinations:
            return self.reject(reply_for(Outcome.REJECTED_NO_ENDPOINTS))
        record = RequestRecord(
            request_id=self._new_id(),
            admitted_at=started,
            model=request.model,
            stream=request.stream,
            body_bytes=request.body_bytes,
            picked=tuple(destinations),
            lease=self._pool.lease(destinations[0]),
        )
        self._live[record.request_id] = record
        self._metrics.count_outcome(Outcome.DISPATCHED)
        self._metrics.count_pick(destinations[0], self._clock() - started)
        return Routed(record, tuple(destinations))

    def reject(self, reply: Reply) -> Reply:
        """Count a request the picker answers itself (parse errors, no endpoints, shutdown)."""
        self._metrics.count_outcome(reply.outcome)
        self._metrics.count_end(EndReason.REJECTED)
        return reply

    def response_started(self, record: RequestRecord, status: int, served: str | None) -> None:
        """Response headers left the model server: attribute the request to who really served it.

        Both ext_proc streams of a request report the headers, in either order: the first one counts.
        """
        if record.ended or record.response_started_at is not None:
            return
        record.status = status
        record.response_started_at = self._clock()
        if served:
            record.served = served
            if record.picked and served != record.picked[0]:
                self._metrics.count_fallback_served()
            if record.lease is not None:
                record.lease.move(served)

    def attach_observer(self, request_id: str) -> RequestRecord | None:
        """Join the observer stream of a request to its record (None: not routed by this picker)."""
        record = self._live.get(request_id)
        if record is None:
            self._metrics.count_unmatched_observer()
            return None
        record.observed = True
        return record

    def finish(self, record: RequestRecord, reason: EndReason) -> None:
        """End a request: release its endpoint slot and count why. Safe to call more than once."""
        if record.ended:
            return
        record.end_reason = reason
        record.ended_at = self._clock()
        if record.lease is not None:
            record.lease.release()
        self._live.pop(record.request_id, None)
        self._metrics.count_end(reason)
