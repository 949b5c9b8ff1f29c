"""The request path both frontends share: view -> admit -> pick -> track -> release.

Frontends translate their wire format into these calls; nothing here knows about gRPC or HTTP.
"""

from __future__ import annotations

import logging
import random
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, assert_never

from picker.config import AffinityConfig
from picker.contract import Outcome, Reply, reply_for
from picker.flow import FlowController, FlowLimits, Ticket
from picker.inference import InferenceRequest
from picker.objectives import Objectives
from picker.peering import Peering, apply_summary
from picker.placement import Placement
from picker.pool import DrainEnd, EndpointState, Pool
from picker.pool.sessions import Sessions
from picker.scheduling import LoadPolicy, pick, without_metrics
from picker.streams import Attempts, EndReason, RequestRecord, ResponseTracker, from_access_log, from_body
from picker.streams.classify import shutting_down
from picker.telemetry import Metrics
from picker.tracing import Tracing

_RECENT_KEPT = 4096  # ended records kept for late access-log entries (a few seconds of traffic)

Schedule = Callable[[float, Callable[[], None]], Callable[[], None]]  # (delay, fn) -> cancel


class Tokenizer(Protocol):
    """Token ids of a request as an engine reads them (picker/sources/tokenizer.py); None: unknown."""

    async def tokenize(self, model: str, request: Mapping[str, Any]) -> list[int] | None: ...


def _call_later(delay: float, fn: Callable[[], None]) -> Callable[[], None]:
    import asyncio

    return asyncio.get_running_loop().call_later(delay, fn).cancel


def drain_end(reason: EndReason) -> DrainEnd:
    """The pool's words for how a request ended (drain records count these)."""
    match reason:
        case EndReason.COMPLETED:
            return DrainEnd.COMPLETED
        case EndReason.CLIENT_DISCONNECT:
            return DrainEnd.CLIENT_DISCONNECT
        case EndReason.UPSTREAM_ERROR_EVENT | EndReason.UPSTREAM_ERROR_STATUS:
            return DrainEnd.UPSTREAM_ERROR
        case EndReason.UPSTREAM_TRUNCATED | EndReason.STALLED | EndReason.SHUTDOWN_CUT:
            return DrainEnd.CUT
        case EndReason.REJECTED | EndReason.UNOBSERVED:
            return DrainEnd.UNKNOWN
        case _:
            assert_never(reason)


log = logging.getLogger(__name__)


def _started_at(record: RequestRecord) -> float:
    """When a request's response started, or (no data plane reports responses) when it was admitted."""
    return record.response_started_at if record.response_started_at is not None else record.admitted_at


@dataclass(frozen=True, slots=True)
class Routed:
    """A dispatch decision: where to send the request, primary first, and the headers the routed
    request must carry (the trace context naming the picker's span, with tracing on)."""

    record: RequestRecord
    destinations: tuple[str, ...]
    headers: tuple[tuple[str, str], ...] = ()


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
        schedule: Schedule = _call_later,
        access_log_grace_s: float = 1.0,
        stall_after_s: float = 30.0,
        cut_after_silence_s: float = 5.0,
        engine_gauges: bool = True,
        tracing: Tracing | None = None,
        affinity: AffinityConfig | None = None,
        peering: Peering | None = None,
    ) -> None:
        self._pool = pool
        self._metrics = metrics
        self._fallback_count = fallback_count
        self._policy = load_policy or LoadPolicy(use_metrics=False)
        self._reject_without_endpoints = reject_without_endpoints
        self._clock = clock
        self._rng = rng or random.Random()
        # several pickers (picker/peering.py): ids name this picker, ends reach their owner
        self.peering = peering
        self._new_id = (lambda: peering.new_id(new_id())) if peering is not None else new_id
        self._schedule = schedule
        self._access_log_grace_s = access_log_grace_s
        self._stall_after_s = stall_after_s
        self._cut_after_silence_s = cut_after_silence_s
        self._engine_gauges = engine_gauges  # endpoints are scraped: their running counts are known
        self._tracing = tracing  # None: no trace is started, no hook is called
        # cache-aware routing (picker/placement.py); off unless configured (the wiring turns it on)
        affinity = affinity or AffinityConfig(prefix="off")
        sessions = Sessions(affinity.session_ttl_s, clock=clock) if affinity.session_header else None
        self.placement = Placement(pool, affinity, metrics, sessions)
        self.tokenizer: Tokenizer | None = None  # precise prefix affinity: set by the wiring
        self._engine_tracked = 0
        # Envoy's gRPC access log has reported a request: it can tell each response's end.
        self.access_log_seen = False
        self._live: dict[str, RequestRecord] = {}
        # InferenceObjective name -> priority (the pool source keeps it current); None: header only.
        self.objectives: Objectives | None = None
        self._blind_policy = LoadPolicy(use_metrics=False)
        self._warned_without_metrics = False
        self._warned_unobservable = False
        self._recent: OrderedDict[str, RequestRecord] = OrderedDict()
        self.flow: FlowController[RequestRecord] = FlowController(
            self._try_dispatch,
            lambda: bool(self._pool.ready()),
            flow_limits or FlowLimits(),
            on_outcome=metrics.count_admission,
            clock=clock,
            # a request limited to a subset (the data plane's hint) that finds no room says nothing
            # about the others: the queue looks past it rather than hold everyone behind it
            restricted=lambda record: record.allowed is not None,
        )
        self.arrivals = 0
        self.last_arrival_at: float | None = None
        self._idle_listeners: list[Callable[[], None]] = []
        metrics.register_flow(self.flow)

    @property
    def live(self) -> int:
        """Requests dispatched and not yet ended."""
        return len(self._live)

    def live_records(self) -> list[RequestRecord]:
        """The requests dispatched and not yet ended (what peers are told this picker has in flight)."""
        return list(self._live.values())

    @property
    def accepting(self) -> bool:
        return not self.flow.closed

    def admit(
        self,
        request: InferenceRequest,
        *,
        flow: str = "",
        priority: int = 0,
        allowed: frozenset[str] | None = None,
        fallbacks: bool = True,
        trace_context: Mapping[str, str] | None = None,
        session: str | None = None,
        tokens: Sequence[int] | None = None,
    ) -> Ticket[RequestRecord]:
        """Admit one parsed request: dispatched now, refused now, or queued (await `ticket.wait()`).

        `allowed` restricts the pick to these endpoints (the data plane's subset hint); `fallbacks`
        false answers with the primary alone (an ORIGINAL_DST data plane cannot use a list).
        `trace_context`: the client's `traceparent` / `tracestate`, continued with tracing on.
        `session`: the request's session (affinity.session_header); `tokens`: its prompt's token ids
        from an engine (precise prefix affinity).
        """
        now = self._clock()
        self.arrivals += 1
        self.last_arrival_at = now
        record = RequestRecord(
            request_id=self._new_id(),
            admitted_at=now,
            model=request.model,
            stream=request.stream,
            body_bytes=request.body_bytes,
            allowed=allowed,
            fallbacks=fallbacks,
            keys=self.placement.keys(request, session, tokens),
        )
        if self._tracing is not None:
            record.trace = self._tracing.start(
                trace_context or {},
                {
                    "gen_ai.request.model": request.model,
                    "picker.stream": request.stream,
                    "picker.request_id": record.request_id,
                    "picker.flow": flow,
                    "picker.priority": priority,
                },
            )
        if self._reject_without_endpoints and not self._pool.ready() and not self.flow.closed:
            return self.flow.refuse(record, Outcome.REJECTED_NO_ENDPOINTS)
        ticket = self.flow.submit(record, flow=flow, priority=priority, size=request.body_bytes)
        if record.trace is not None and not ticket.done:
            record.trace.queued()
        return ticket

    def wants_tokens(self, request: InferenceRequest) -> bool:
        """Whether the frontend should get the request's token ids (`tokens`) before admitting it."""
        return (
            self.placement.mode == "precise" and self.tokenizer is not None and request.tokenize is not None
        )

    async def tokens(self, request: InferenceRequest) -> list[int] | None:
        """The request's token ids from an engine (precise affinity), or None."""
        if self.tokenizer is None or request.tokenize is None:
            return None
        return await self.tokenizer.tokenize(request.model, request.tokenize)

    def settle(self, ticket: Ticket[RequestRecord]) -> Routed | Reply:
        """What to answer for a ticket that is done: the route, or the contract's refusal."""
        outcome = ticket.outcome
        assert outcome is not None, "settle() needs a finished ticket"
        record = ticket.payload
        if outcome is Outcome.DISPATCHED:
            return Routed(record, record.picked, record.trace.outgoing() if record.trace else ())
        self._metrics.count_end(EndReason.REJECTED)
        if record.trace is not None:
            record.trace.refused(outcome.value)
        return reply_for(outcome)

    def cancel(self, ticket: Ticket[RequestRecord]) -> None:
        """The client went away while its request waited in the queue.

        The queue may have released it in the same turn (its slot taken, the waiter not yet
        resumed): then nobody else will ever end that record, so it ends here.
        """
        self.flow.cancel(ticket)
        if ticket.outcome is Outcome.REJECTED_CONTEXT_CANCELLED:
            self._metrics.count_end(EndReason.REJECTED)
            if ticket.payload.trace is not None:
                ticket.payload.trace.refused(ticket.outcome.value)
        elif ticket.outcome is Outcome.DISPATCHED:
            self.finish(ticket.payload, EndReason.CLIENT_DISCONNECT)

    def eligible(self, allowed: frozenset[str]) -> bool:
        """Whether any ready (so never a draining) endpoint is in `allowed`."""
        return any(endpoint.address in allowed for endpoint in self._pool.ready())

    def reject(self, reply: Reply) -> Reply:
        """Count a request the picker answers before admission (unparseable, too large)."""
        self._metrics.count_admission(reply.outcome, 0.0)
        self._metrics.count_end(EndReason.REJECTED)
        return reply

    def capacity_changed(self) -> None:
        """Load or endpoints changed (a scrape, a source update): queued requests may fit now."""
        self.placement.tune()
        if self.peering is not None:
            self.peering.settle_orphans()  # before this picker's own: peers' counts are then exact
        if self._engine_tracked:
            self._settle_from_engines()
        self.flow.pump()

    def hand_to_engine(self, record: RequestRecord) -> None:
        """No filter sees this response end (no observer, response bodies NONE): keep its slot until
        its engine's scraped gauges show fewer requests than the picker still counts there."""
        if record.ended or record.engine_tracked:
            return
        if not self._engine_gauges:
            if not self._warned_unobservable:
                self._warned_unobservable = True
                log.warning(
                    "requests whose end nothing reports (no observer, no access log) and no scraping: "
                    "each is released at once, as unobserved (picker_request_ends_total)"
                )
            self.finish(record, EndReason.UNOBSERVED)
            return
        record.engine_tracked = True
        self._engine_tracked += 1

    def _settle_from_engines(self) -> None:
        """End the oldest engine-tracked requests of each endpoint beyond what its engine still runs.

        The engine's running + waiting gauges count every request it holds; the picker's own count
        there, less that, is how many of the engine-tracked ones have ended (the oldest first). An
        idle engine ends them all, which is what closes a drain record in this shape.
        """
        tracked: dict[str, list[RequestRecord]] = {}
        for record in self._live.values():
            if record.engine_tracked:
                tracked.setdefault(record.endpoint or "", []).append(record)
        for address, records in tracked.items():
            endpoint = self._pool.get(address)
            if endpoint is None or endpoint.state is EndpointState.GONE:
                ended = records
            else:
                load = endpoint.load
                if load is None:
                    continue
                started = [r for r in records if _started_at(r) < load.at]
                # requests sent since the scrape started may not be in its gauges yet: keep as many
                unseen = endpoint.arrivals - load.arrivals_before
                engine = int(load.running + load.waiting) - endpoint.peer_in_flight  # this picker's share
                excess = endpoint.in_flight - engine - unseen
                started.sort(key=_started_at)
                ended = started[: max(0, excess)]
            for record in ended:
                self.finish(record, EndReason.UNOBSERVED)

    def _try_dispatch(self, record: RequestRecord) -> bool:
        started = self._clock()
        started_ns = time.time_ns() if record.trace is not None else 0
        candidates = self._pool.ready()
        if record.allowed is not None:
            candidates = [endpoint for endpoint in candidates if endpoint.address in record.allowed]
        count = 1 + (self._fallback_count if record.fallbacks else 0)
        policy = self._policy
        if without_metrics(candidates, policy):
            policy = self._blind_policy  # no candidate has load data: pick by in-flight counts
            self._metrics.count_pick_without_metrics()
            if not self._warned_without_metrics:
                self._warned_without_metrics = True
                log.warning(
                    "no endpoint has load data and every scrape failed (model servers without vLLM "
                    "metrics?): picking by the picker's own in-flight counts"
                )
        suspects = self._pool.health.suspects()  # failing fast: never the primary, last resort only
        choice = self.placement.choose(record, candidates, count, self._rng, started, policy, suspects)
        if choice is not None:
            destinations = choice.destinations
        else:
            destinations = pick(candidates, count, self._rng, started, policy, suspects)
        if not destinations:
            return False
        record.picked = tuple(destinations)
        record.lease = self._pool.lease(destinations[0])
        self.placement.dispatched(record, destinations[0])
        if self.peering is not None:
            self.peering.placed(record, destinations[0])
        self._live[record.request_id] = record
        self._metrics.count_pick(destinations[0], self._clock() - started)
        if record.trace is not None:
            record.trace.picked(record.picked, started_ns)
        return True

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
        record.observed = True
        return record

    def body_chunk(self, record: RequestRecord, chunk: bytes) -> None:
        """One response body chunk went past (hot path: once per token chunk of every stream)."""
        if record.owner is not None:
            assert self.peering is not None
            self.peering.chunk(record, chunk)
            return
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
            if record.prefill_at is not None:
                self.placement.prefilled(record)
            if record.trace is not None:
                record.trace.first_token()
        elif gap is not None:
            self._metrics.observe_itl(record.model, gap)

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

    def await_access_log(self, record: RequestRecord) -> None:
        """No filter sees this response's body (no observer, or one without bodies): Envoy's access
        log entry ends it, with who cut it from its flags. No chunks come, so silence is no stall."""
        if record.ended:
            return
        record.tracker = None  # nothing will feed it: token counts and TTFT are not known here
        record.observer_done = True  # the log settles it the moment it arrives
        if record.access_log is not None:
            self._settle_from_log(record)

    def _settle_from_log(self, record: RequestRecord) -> None:
        if not record.ended and record.access_log is not None:
            self.finish(record, from_access_log(record, record.access_log))

    def _settle_without_log(self, record: RequestRecord) -> None:
        if not record.ended:
            self.finish(record, EndReason.UNOBSERVED)

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
            if tracker is None or not tracker.streaming or record.stalled or record.engine_tracked:
                continue
            last = tracker.last_chunk_at or record.response_started_at
            if last is None or now - last < self._stall_after_s:
                continue
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
            if known is None or known.state is EndpointState.GONE:
                # Its engine is gone: it will never send again. Stop counting it against anyone.
                self.finish(record, EndReason.STALLED)
        return found

    def finish(self, record: RequestRecord, reason: EndReason) -> None:
        """End a request: release its endpoint slot and count why. Safe to call more than once."""
        if record.ended:
            return
        if record.engine_tracked:
            self._engine_tracked -= 1
        now = self._clock()
        if reason is EndReason.CLIENT_DISCONNECT and self._silent(record, now):
            reason = EndReason.STALLED  # the engine had stopped sending: the client left because of it
        record.end_reason = reason
        record.ended_at = now
        # counted before the release: a GONE endpoint's last request ending forgets it, series too
        tokens = record.tracker.tokens if record.tracker else 0
        self._metrics.count_end(reason, record.endpoint, record.model, tokens)
        if record.prefill_at is not None:
            self.placement.prefilled(record)
        if self.peering is not None:
            self.peering.ended(record)
        if record.trace is not None:
            record.trace.ended(reason.value, tokens, record.endpoint)
        if reason is EndReason.COMPLETED:
            self.placement.ended(record)
        if record.lease is not None:
            record.lease.release(drain_end(reason))
        self._live.pop(record.request_id, None)
        self._recent[record.request_id] = record  # Envoy's access-log entry may still be on its way
        if len(self._recent) > _RECENT_KEPT:
            self._recent.popitem(last=False)
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
        """What a peer reported about a request this picker routed (picker/peering.py)."""
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
                record.observed = True  # an observer stream joined it, on another picker
                record.observed_by = sender
            case "started":
                self.response_started(record, int(event[2]), event[3] or None, event[4])
            case "first":
                tracker = record.tracker
                if tracker is not None and tracker.first_byte_at is None:
                    now = self._clock()
                    tracker.first_byte_at = tracker.last_chunk_at = now
                    self._metrics.observe_ttft(record.model, now - record.admitted_at)
                    if record.trace is not None:
                        record.trace.first_token()
                    if record.prefill_at is not None:
                        self.placement.prefilled(record)
            case "alive":
                if record.tracker is not None:
                    record.tracker.last_chunk_at = self._clock()
            case "ended":
                if record.tracker is None:
                    record.tracker = ResponseTracker(streaming=record.stream)
                if isinstance(event[3], dict):
                    apply_summary(record.tracker, event[3], self._clock())
                self.observer_ended(record, bool(event[2]))
            case _:
                log.warning("peer event of unknown kind %r; ignored", kind)

    def on_idle(self, listener: Callable[[], None]) -> None:
        """Call `listener` each time the last live request ends (shutdown waits on it)."""
        self._idle_listeners.append(listener)
