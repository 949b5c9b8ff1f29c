"""The response side of the request path: from the response's headers to the request's end.

What the frontends report once a request is on its way (headers, body chunks, the observer's end,
Envoy's access-log entry, a peer's report) and how each request ends: its reason, its endpoint's
in-flight count and drain record, the first-token commit, truncations. `RequestPath` (pipeline.py)
is this plus admission and the pick; the split follows the flow, admit -> pick | track -> release.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from picker.observability.metrics import Metrics
from picker.peers.books import Peering
from picker.peers.outbox import happened_at
from picker.pool import EndpointState, Pool
from picker.request.pairing import Pairing
from picker.request.placement import Placement
from picker.request.stalls import queued_on_engine
from picker.rollout import Canary
from picker.streams import Attempts, EndReason, RequestRecord, ResponseTracker, from_access_log, from_body
from picker.streams.classify import drain_end, shutting_down

log = logging.getLogger(__name__)

_RECENT_KEPT = 4096  # ended records kept for late access-log entries (a few seconds of traffic)


class ResponseSide:
    """Track and release: the methods of `RequestPath` after the pick (state is RequestPath's)."""

    _pool: Pool
    _metrics: Metrics
    _clock: Callable[[], float]
    _schedule: Callable[[float, Callable[[], None]], Callable[[], None]]
    _access_log_grace_s: float
    _stall_after_s: float
    _cut_after_silence_s: float
    _live: dict[str, RequestRecord]
    _recent: OrderedDict[str, RequestRecord]
    _idle_listeners: list[Callable[[], None]]
    _engine_tracked: int
    canary: Canary | None
    placement: Placement
    pairing: Pairing
    peering: Peering | None
    # a frontend that can continue a stream elsewhere (picker proxy's resume): told of each stall;
    # True when it is moving that stream
    on_stall: Callable[[RequestRecord], bool] | None
    access_log_seen: bool
    # and RequestPath's hand_to_engine(record): the engine's gauges settle a request nobody reports

    def response_started(
        self, record: RequestRecord, status: int, served: str | None, streaming: bool | None = None
    ) -> None:
        """Response headers left the model server: attribute the request to who really served it.

        Both ext_proc streams of a request report the headers, in either order: the first one counts.
        """
        if record.owner is not None:  # another picker's request: tell its owner
            assert self.peering is not None
            if record.response_started_at is None:
                self.peering.started(record, status, served, streaming)
            return
        if record.ended or record.response_started_at is not None:
            return
        record.status = status
        record.response_started_at = self._clock()
        record.tracker = ResponseTracker(streaming=record.stream if streaming is None else streaming)
        if served:
            record.served = served
            if record.picked and served != record.picked[0]:
                self._metrics.count_fallback_served()
                self.placement.dispatched(record, served)  # its prompt is cached where it ran
                if self.peering is not None:
                    self.peering.placed(record, served, moved=True)
            if record.lease is not None:
                record.lease.move(served)
        self._pool.health.answered(record.picked, served, status)  # suspects: failing fast
        if record.trace is not None:
            record.trace.response_started(status, served, record.picked[0] if record.picked else None)

    def attach_observer(self, request_id: str) -> RequestRecord | None:
        """Join the observer stream of a request to its record (None: not routed by this picker)."""
        record = self._live.get(request_id)
        if record is None:
            shadow = self.peering.shadow(request_id) if self.peering is not None else None
            if shadow is None:
                self._metrics.count_unmatched_observer()
            return shadow
        if record.observed:  # the routing stream sees the bodies itself: one tracker per response
            return None
        self._observed(record)
        return record

    def _observed(self, record: RequestRecord) -> None:
        """An observer stream joined it (here, or on another picker): that observer reports its end,
        not the engine's gauges it may have been handed to meanwhile."""
        record.observed = True
        if record.engine_tracked:
            record.engine_tracked = False
            self._engine_tracked -= 1

    def body_chunk(self, record: RequestRecord, chunk: bytes) -> None:
        """One response body chunk went past (hot path: once per token chunk of every stream)."""
        if record.owner is not None:
            assert self.peering is not None
            return self.peering.chunk(record, chunk)
        tracker = record.tracker
        if tracker is None or record.ended:
            return
        if record.status == 500 and tracker.first_byte_at is None and shutting_down(chunk):
            self._pool.health.shutting_down(record.endpoint or "")
        first = tracker.first_byte_at is None
        now = self._clock()
        gap = tracker.feed(chunk, now)
        if first and tracker.first_byte_at is not None:
            self._metrics.observe_ttft(record.model, now - record.admitted_at)
            self.placement.first_token(record)
            self.pairing.pulled(record)  # the destination has the prompt's KV: the hand-off is done
            if record.trace is not None:
                record.trace.first_token()
        elif gap is not None:
            self._metrics.observe_itl(record.model, gap)
        if tracker.done:  # [DONE] ends it, the slot free at once: framing follows (docs, "Two pickers")
            self.observer_ended(record, True)

    def observer_ended(self, record: RequestRecord, end_of_stream: bool) -> None:
        """The observer stream is over: with the response's end of stream, or cut short."""
        if record.owner is not None:
            assert self.peering is not None
            self.peering.observer_ended(record, end_of_stream)
            return
        if record.ended:
            return
        record.response_ended = end_of_stream
        record.observer_done = True
        if record.tracker is not None:
            record.tracker.end()
        reason = from_body(record)
        if reason is not None:
            self.finish(record, reason)
        elif record.access_log is not None:
            self.finish(record, from_access_log(record, record.access_log))
        else:  # only Envoy's access log can say who cut it: give it a moment
            self._schedule(self._access_log_grace_s, lambda: self._settle_without_log(record))

    def response_ended(self, record: RequestRecord, end_of_stream: bool, cut: EndReason) -> None:
        """A frontend that carries the response itself saw it end, so it knows who cut it.

        The body settles the ending when it can (one classifier for both frontends); `cut` is the
        frontend's word for an ending the body cannot explain (client gone, upstream closed early).
        """
        if record.ended:
            return
        record.response_ended = end_of_stream
        record.observer_done = True
        if record.tracker is not None:
            record.tracker.end()
        reason = from_body(record)
        if reason is None:
            reason = EndReason.STALLED if record.stalled else cut
        self.finish(record, reason)

    def observer_blind(self, record: RequestRecord) -> None:
        """An observer stream that sees no response body (Envoy ends it at the headers): the access
        log, else the engine's gauges, end the request; another picker's, on that picker."""
        if record.owner is not None:
            assert self.peering is not None
            self.peering.blind(record)
        elif self.access_log_seen:
            self.await_access_log(record)
        else:
            self.hand_to_engine(record)

    def upstream_retried(self, record: RequestRecord, retries: int) -> None:
        """The frontend retried before the first byte (the proxy; Envoy reports it in its access log)."""
        if retries > 0:
            self._metrics.count_upstream_retry(record.endpoint or "", retries)

    def access_logged(self, request_id: str, attempts: Attempts) -> None:
        """Envoy's access log entry for a request: retries, response flags, final status."""
        self.access_log_seen = True
        record = self._live.get(request_id) or self._recent.get(request_id)
        if record is None and self.peering is not None and self.peering.logged(request_id, attempts):
            return  # another picker's request: its owner settles it
        if record is None or record.access_log is not None:
            return
        record.access_log = attempts
        if record.response_started_at is None:  # no response headers reached the picker
            if attempts.status >= 500:  # each attempt failed before its first byte
                self._pool.health.unanswered(record.picked[: max(1, attempts.count)])
            elif attempts.status:
                self._pool.health.answered(record.picked, attempts.upstream or None, attempts.status)
        if attempts.count > 1:
            self._metrics.count_upstream_retry(record.endpoint or "", attempts.count - 1)
        if record.ended:  # the body had already settled it; the log only adds the retries
            return
        if record.observed and not record.observer_done:
            # the observer's own end is on its way; if it never comes, the log settles it
            self._schedule(self._access_log_grace_s, lambda: self._settle_from_log(record))
            return
        self._settle_from_log(record)

    def await_access_log(self, record: RequestRecord, closed: bool = False) -> None:
        """No filter sees this response's body (no observer, or one without bodies): Envoy's access
        log entry ends it, with who cut it from its flags. No chunks come, so silence is no stall.
        `closed`: it ended now (kgateway's routing stream closed): dated now, whenever the log comes."""
        if record.ended:
            return
        record.tracker = None  # nothing will feed it: token counts and TTFT are not known here
        record.observer_done = True  # the log settles it the moment it arrives
        record.closed_at = self._clock() if closed else None
        if record.access_log is not None:
            self._settle_from_log(record)
        elif closed:  # without a log it ends unobserved
            self._schedule(self._access_log_grace_s, lambda: self._settle_without_log(record))

    def _settle_from_log(self, record: RequestRecord) -> None:
        if not record.ended and record.access_log is not None:
            self.finish(record, from_access_log(record, record.access_log))

    def _settle_without_log(self, record: RequestRecord) -> None:
        if not record.ended:
            self.finish(record, EndReason.UNOBSERVED)

    def movable(self, record: RequestRecord) -> bool:
        """Whether a stalled stream has somewhere to move (RequestPath knows the candidates)."""
        return False

    def sweep_stalls(self) -> int:
        """Mark streams silent for longer than the stall bound; end those whose endpoint is gone."""
        now = self._clock()
        found = 0
        for record in list(self._live.values()):
            tracker = record.tracker
            if tracker is None and record.observer_done and self._engine_gauges:
                # awaiting its access-log entry: should Envoy have dropped it, the engine's gauges
                # end the request once it is no longer running there (a backstop, never sooner)
                started = record.response_started_at
                if started is not None and now - started >= self._stall_after_s:
                    self.hand_to_engine(record)
                continue
            if tracker is None or not tracker.streaming or record.engine_tracked:
                continue
            last = max(tracker.last_chunk_at or 0.0, record.part_started_at or 0.0)
            last = last or record.response_started_at
            if record.stalled:
                if record.stall_kept and last is not None and now - last < self._stall_after_s:
                    record.stalled = record.stall_kept = False  # it sends again: judged afresh
                elif record.stall_kept and self.on_stall is not None:
                    home = self._pool.get(record.endpoint or "")
                    if home is None or home.state is EndpointState.GONE:  # it will never send again
                        if not self.on_stall(record):  # the frontend cuts it (no replica), or it ends here
                            self.finish(record, EndReason.STALLED)
                    elif self.movable(record):
                        self.on_stall(record)  # a replica has room now: the kept stream moves
                continue
            if last is None or now - last < self._stall_after_s:
                continue
            if queued_on_engine(record, self._pool, now, self._stall_after_s):
                continue  # no token yet from a replica that queues requests: waiting, not stalled
            record.stalled = True
            found += 1
            endpoint = record.endpoint or ""
            self._metrics.count_stall(endpoint)
            known = self._pool.get(endpoint)
            log.warning(
                "stream stalled request_id=%s endpoint=%s silent_s=%.1f endpoint_state=%s",
                record.request_id,
                endpoint,
                now - last,
                known.state.value if known else "forgotten",
            )
            resumable = record.resumable and self.on_stall is not None
            gone = known is None or known.state is EndpointState.GONE
            # a stream whose finish went out lacks only its end (the frontend writes it); one whose
            # replica is gone goes to the frontend even with no target: it ends the silent part
            movable = tracker.completed or gone or self.movable(record)
            moving = resumable and movable and self.on_stall(record)  # type: ignore[misc]
            if not moving and gone:
                self.finish(record, EndReason.STALLED)  # its engine will never send again
            elif not moving and resumable:
                record.stall_kept = True  # nowhere to move: it waits on its own replica
                self._metrics.count_resume("stall-kept")
        return found

    def finish(self, record: RequestRecord, reason: EndReason) -> None:
        """End a request: release its endpoint slot and count why. Safe to call more than once."""
        if record.ended:
            return
        if record.engine_tracked:
            self._engine_tracked -= 1
        # dated when its end was seen, should its reason have come later (kgateway's access log)
        now = self._clock() if record.closed_at is None else record.closed_at
        if reason is EndReason.CLIENT_DISCONNECT and self._silent(record, now):
            reason = EndReason.STALLED  # the engine had stopped sending: the client left because of it
        record.end_reason = reason
        record.ended_at = now
        # counted before the release: a GONE endpoint's last request ending forgets it, series too
        tokens = record.tracker.tokens if record.tracker else 0
        self._metrics.count_request_end(reason, record, now, tokens)
        self.placement.prefilled(record)
        if self.peering is not None:
            self.peering.ended(record)
        if record.trace is not None:
            record.trace.ended(reason.value, tokens, record.endpoint, record.resumed_on)
        if record.resumed_on:  # streams.resume: the record of its moves
            log.info(
                "request_id=%s end=%s resumed=%d on=%s cut_on=%s",
                record.request_id, reason.value, len(record.resumed_on),
                ",".join(record.resumed_on), ",".join(record.cut_on),
            )  # fmt: skip
        if reason is EndReason.COMPLETED:
            self.placement.ended(record)
        if record.group is not None and self.canary is not None:
            self.canary.request_ended(record, reason, now, self._pool.get(record.endpoint or ""))
        if record.lease is not None:
            record.lease.release(drain_end(reason), at=record.closed_at)
        self.pairing.ended(record)  # its prefill hand-off, if one is still held
        self._live.pop(record.request_id, None)
        self._recent[record.request_id] = record  # Envoy's access-log entry may still be on its way
        if len(self._recent) > _RECENT_KEPT:
            self._recent.popitem(last=False)
        if record.tenant:  # fair share: its reservation settled to the tokens the engine reported
            self.flow.settle(
                record.tenant, record.reserved, *(t.usage if (t := record.tracker) else (None, None))
            )
        self.flow.pump()  # its slot may be the one a queued request waits for
        if not self._live:
            for listener in list(self._idle_listeners):
                listener()

    def _silent(self, record: RequestRecord, now: float) -> bool:
        """A stream whose engine sent tokens, then nothing for `cut_after_silence_s` before it ended
        (a wait for the first token is queueing, not a cut)."""
        tracker = record.tracker
        if tracker is None or not tracker.streaming or tracker.completed:
            return False
        last = tracker.last_chunk_at
        return last is not None and now - last >= self._cut_after_silence_s

    def peer_gone(self, peer: str) -> None:
        """A peer's channel broke: its requests stay counted as orphans, and this picker's requests
        whose observer stream went to it can no longer hear their end there: the engine's gauges
        settle them, as for a response no filter sees (`hand_to_engine`)."""
        if self.peering is None:
            return
        self.peering.peer_gone(peer)
        for record in [r for r in self._live.values() if r.observed_by == peer]:
            self.hand_to_engine(record)

    def peer_event(self, event: list[Any], sender: str | None = None) -> None:
        """What a peer reported about a request this picker routed (picker/peers/books.py)."""
        kind, request_id = event[0], event[1]
        record = self._live.get(request_id)
        if kind == "log":
            count, flags, status, upstream = event[2:6]
            self.access_logged(request_id, Attempts(int(count), frozenset(flags), int(status), str(upstream)))
            return
        if record is None or record.ended:
            if self.peering is not None:
                self.peering.unknown += 1
            return
        if self.peering is not None:
            self.peering.applied += 1
        match kind:
            case "claim":
                self._observed(record)  # an observer stream joined it, on another picker
                record.observed_by = sender
            case "started":
                self.response_started(record, int(event[2]), event[3] or None, event[4])
            case "first":
                tracker = record.tracker
                if tracker is not None and tracker.first_byte_at is None:
                    at = happened_at(event, self._clock(), record.admitted_at)  # as the observer saw it
                    tracker.first_byte_at = tracker.last_chunk_at = at
                    self._metrics.observe_ttft(record.model, at - record.admitted_at)
                    if record.trace is not None:
                        record.trace.first_token()
                    self.placement.first_token(record)
                    self.pairing.pulled(record)
            case "blind":  # its observer, on that picker, sees no body: no end will come from there
                self.observer_blind(record)
            case "alive":
                if record.tracker is not None:
                    record.tracker.last_chunk_at = self._clock()
            case "ended":
                record.peers_told = True  # its sender booked the end on every picker
                if record.tracker is None:
                    record.tracker = ResponseTracker(streaming=record.stream)
                if isinstance(event[3], dict):
                    record.tracker.apply(event[3], self._clock())
                record.closed_at = happened_at(event, self._clock(), record.admitted_at)  # its end, dated
                self.observer_ended(record, bool(event[2]))
            case _:
                log.warning("peer event of unknown kind %r; ignored", kind)
