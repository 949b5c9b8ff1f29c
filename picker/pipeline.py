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
from picker.flow import FlowController, FlowLimits, Ticket
from picker.inference import InferenceRequest
from picker.pool import Pool
from picker.scheduling import LoadPolicy, pick
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
        load_policy: LoadPolicy | None = None,
        flow_limits: FlowLimits | None = None,
        reject_without_endpoints: bool = False,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
        new_id: Callable[[], str] = lambda: uuid.uuid4().hex,
    ) -> None:
        self._pool = pool
        self._metrics = metrics
        self._fallback_count = fallback_count
        self._policy = load_policy or LoadPolicy(use_metrics=False)
        self._reject_without_endpoints = reject_without_endpoints
        self._clock = clock
        self._rng = rng or random.Random()
        self._new_id = new_id
        self._live: dict[str, RequestRecord] = {}
        self.flow: FlowController[RequestRecord] = FlowController(
            self._try_dispatch,
            lambda: bool(self._pool.ready()),
            flow_limits or FlowLimits(),
            on_outcome=metrics.count_admission,
            clock=clock,
        )
        self.arrivals = 0
        self.last_arrival_at: float | None = None
        self._idle_listeners: list[Callable[[], None]] = []
        metrics.register_flow(self.flow)

    @property
    def live(self) -> int:
        """Requests dispatched and not yet ended."""
        return len(self._live)

    @property
    def accepting(self) -> bool:
        return not self.flow.closed

    def records(self) -> list[RequestRecord]:
        return list(self._live.values())

    def admit(self, request: InferenceRequest, *, flow: str = "", priority: int = 0) -> Ticket[RequestRecord]:
        """Admit one parsed request: dispatched now, refused now, or queued (await `ticket.wait()`)."""
        now = self._clock()
        self.arrivals += 1
        self.last_arrival_at = now
        record = RequestRecord(
            request_id=self._new_id(),
            admitted_at=now,
            model=request.model,
            stream=request.stream,
            body_bytes=request.body_bytes,
        )
        if self._reject_without_endpoints and not self._pool.ready() and not self.flow.closed:
            return self.flow.refuse(record, Outcome.REJECTED_NO_ENDPOINTS)
        return self.flow.submit(record, flow=flow, priority=priority, size=request.body_bytes)

    def settle(self, ticket: Ticket[RequestRecord]) -> Routed | Reply:
        """What to answer for a ticket that is done: the route, or the contract's refusal."""
        outcome = ticket.outcome
        assert outcome is not None, "settle() needs a finished ticket"
        if outcome is Outcome.DISPATCHED:
            record = ticket.payload
            return Routed(record, record.picked)
        self._metrics.count_end(EndReason.REJECTED)
        return reply_for(outcome)

    def cancel(self, ticket: Ticket[RequestRecord]) -> None:
        """The client went away before its request left the queue."""
        self.flow.cancel(ticket)
        if ticket.outcome is Outcome.REJECTED_CONTEXT_CANCELLED:
            self._metrics.count_end(EndReason.REJECTED)

    def reject(self, reply: Reply) -> Reply:
        """Count a request the picker answers before admission (unparseable, too large)."""
        self._metrics.count_admission(reply.outcome, 0.0)
        self._metrics.count_end(EndReason.REJECTED)
        return reply

    def capacity_changed(self) -> None:
        """Load or endpoints changed (a scrape, a source update): queued requests may fit now."""
        self.flow.pump()

    def _try_dispatch(self, record: RequestRecord) -> bool:
        started = self._clock()
        destinations = pick(self._pool.ready(), 1 + self._fallback_count, self._rng, started, self._policy)
        if not destinations:
            return False
        record.picked = tuple(destinations)
        record.lease = self._pool.lease(destinations[0])
        self._live[record.request_id] = record
        self._metrics.count_pick(destinations[0], self._clock() - started)
        return True

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
        self.flow.pump()  # its slot may be the one a queued request waits for
        if not self._live:
            for listener in list(self._idle_listeners):
                listener()

    def on_idle(self, listener: Callable[[], None]) -> None:
        """Call `listener` each time the last live request ends (shutdown waits on it)."""
        self._idle_listeners.append(listener)
