"""The request path both frontends share: view -> admit -> pick -> track -> release.

Frontends translate their wire format into these calls; nothing here knows about gRPC or HTTP.
`RequestPath` is admission and the books (the live records, the queue, the pool's leases) here, the
pick and the re-pick in dispatch.py, the response side in tracking.py; what stands alone is its own
module (placement, pairing, hints, inference).
"""

from __future__ import annotations

import logging
import math
import os
import random
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from picker.config.model import AffinityConfig, PdConfig
from picker.contract import Outcome, Reply, reply_for
from picker.flow import FlowController, FlowLimits, Ticket
from picker.flow.tenants import Tenants
from picker.observability.metrics import Metrics
from picker.observability.tracing import Tracing
from picker.peers import budget_share
from picker.peers.books import Peering
from picker.pool import EndpointState, Pool
from picker.pool.sessions import Sessions
from picker.request.dispatch import Dispatch
from picker.request.inference import InferenceRequest
from picker.request.objectives import Objectives
from picker.request.pairing import Pairing
from picker.request.placement import Placement
from picker.request.tracking import ResponseSide
from picker.rollout import Canary
from picker.scheduling import LoadPolicy
from picker.scheduling.fit import CHARS_PER_TOKEN, need_of, refusal
from picker.scheduling.load import room
from picker.streams import EndReason, RequestRecord
from picker.streams.ends import DataPlanes
from picker.streams.inferred import inferred_ends
from picker.streams.record import Slo

Schedule = Callable[[float, Callable[[], None]], Callable[[], None]]  # (delay, fn) -> cancel


class Tokenizer(Protocol):
    """Token ids of a request as an engine reads them (picker/sources/tokenizer.py); None: unknown."""

    async def tokenize(self, model: str, request: Mapping[str, Any]) -> list[int] | None: ...


def _call_later(delay: float, fn: Callable[[], None]) -> Callable[[], None]:
    import asyncio

    return asyncio.get_running_loop().call_later(delay, fn).cancel


log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Routed:
    """A dispatch decision: where to send the request, primary first, and the headers the routed
    request must carry (the trace context naming the picker's span, with tracing on)."""

    record: RequestRecord
    destinations: tuple[str, ...]
    headers: tuple[tuple[str, str], ...] = ()


class RequestPath(Dispatch, ResponseSide):
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
        new_id: Callable[[], str] = lambda: os.urandom(16).hex(),  # unguessable; uuid4's cost / 4
        schedule: Schedule = _call_later,
        access_log_grace_s: float = 1.0,
        stall_after_s: float = 30.0,
        cut_after_silence_s: float = 5.0,
        engine_gauges: bool = True,
        engine_transit_s: float = 0.05,
        tracing: Tracing | None = None,
        affinity: AffinityConfig | None = None,
        peering: Peering | None = None,
        by_model: bool = False,
        pd: PdConfig | None = None,
    ) -> None:
        self._pool = pool
        self._metrics = metrics
        self._fallback_count = fallback_count
        self._policy = load_policy or LoadPolicy(use_metrics=False)
        self._engaged_policy = self._policy.engaged()  # auto, while its predictions are engaged
        self._reject_without_endpoints = reject_without_endpoints
        self._clock = clock
        self._rng = rng or random.Random()
        # several pickers (picker/peers/books.py): ids name this picker, ends reach their owner
        self.peering = peering
        self._by_model = by_model  # scheduling.by_model: model and window decide who may take it
        self.canary: Canary | None = None  # rollout.candidate set: the wiring sets the canary
        self._new_id = (lambda: peering.new_id(new_id())) if peering is not None else new_id
        self._schedule = schedule
        self._access_log_grace_s = access_log_grace_s
        self._stall_after_s = stall_after_s
        self._cut_after_silence_s = cut_after_silence_s
        self._engine_gauges = engine_gauges  # endpoints are scraped: their running counts are known
        self._engine_transit_s = engine_transit_s  # a request sent this recently may not be on its engine yet
        self._tracing = tracing  # None: no trace is started, no hook is called
        # cache-aware routing (picker/request/placement.py); off unless configured (the wiring turns it on)
        affinity = affinity or AffinityConfig(prefix="off")
        sessions = Sessions(affinity.session_ttl_s, clock=clock) if affinity.session_header else None
        self.placement = Placement(pool, affinity, metrics, sessions)
        if self.placement.latency is not None:
            metrics.register_latency(self.placement.latency)
        self.tokenizer: Tokenizer | None = None  # precise prefix affinity: set by the wiring
        # prefill / decode pairs: active only while some READY endpoint serves prefill alone
        self.pairing = Pairing(pool, pd or PdConfig(), metrics)
        self.pairing.peering = peering
        self._engine_tracked = 0
        # what each data-plane connection shows of responses' ends (the frontends note it)
        self.data_planes = DataPlanes()
        metrics.register_data_planes(self.data_planes)
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
            # (and one that chose to wait for a busy replica predicted quicker: others may go elsewhere)
            restricted=lambda record: (
                record.allowed is not None or record.need is not None or record.waits_for_quicker
            ),
        )
        self.arrivals = 0
        self.last_arrival_at: float | None = None
        # applies what peers sent and this picker has not read yet (picker/peers/inbox.py; the wiring's)
        self.catch_up: Callable[[], None] = lambda: None
        self._idle_listeners: list[Callable[[], None]] = []
        self.on_stall: Callable[[RequestRecord], bool] | None = None
        if self.flow.limits.fair_share is not None:  # between tenants (picker/flow/tenants.py)
            share = self.flow.limits.fair_share
            tenants = Tenants(share, lambda: room(self._pool.ready(), self._policy), clock)
            self.flow.share_by(tenants)
            metrics.register_tenants(tenants)
        if self.flow.budgets is not None:  # token budgets (picker/flow/budgets.py), one across pickers
            metrics.register_budgets(self.flow.budgets)
            if peering is not None:
                budget_share.share(peering, self.flow.budgets)
        metrics.register_flow(self.flow)
        metrics.register_running(lambda: [record.model for record in self._live.values()])
        metrics.register_load_policy(self._policy, clock)

    @property
    def engine_gauges(self) -> bool:
        """Whether endpoints are scraped, so that their gauges can end requests nobody reports."""
        return self._engine_gauges

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
        connection: str | None = None,
        slo: Slo | None = None,
    ) -> Ticket[RequestRecord]:
        """Admit one parsed request: dispatched now, refused now, or queued (await `ticket.wait()`).

        `allowed` restricts the pick to these endpoints (the data plane's subset hint); `fallbacks`
        false answers with the primary alone (an ORIGINAL_DST data plane cannot use a list).
        `trace_context`: the client's `traceparent` / `tracestate`, continued with tracing on.
        `session`: the request's session (affinity.session_header); `tokens`: its prompt's token ids
        from an engine (precise prefix affinity). `connection`: the HTTP/1.x client connection it
        came on (picker/pool/connections.py). `slo`: its latency objectives (SLO headers): with
        affinity.latency on, a sheddable one (priority < 0) no replica is predicted to meet now is
        refused (`rejected-slo-unattainable`); the others go where the prediction is best.
        """
        self.catch_up()  # the books as fresh as can be for this pick (peers' picks and ends)
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
            connection=connection,
            priority=priority,
            slo=slo,
            max_tokens=request.max_tokens,
        )
        if self.peering is not None:
            self.peering.arrived(record)
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
        if self._by_model:
            record.need = need_of(
                request.model, request.prompt_chars, request.max_tokens, len(tokens) if tokens else None
            )
            never = refusal(
                (e.served for e in self._pool.endpoints() if e.state is not EndpointState.GONE), record.need
            )
            if never is not None and not self.flow.closed:
                return self.flow.refuse(record, never)
        if not self.flow.closed and (shed := self.placement.shed(record, self._pool, self._policy, now)):
            return self.flow.refuse(record, shed)
        if flow and (self.flow.tenants is not None or self.flow.budgets is not None):  # its reservation
            flow = record.tenant = self.flow.tenants.key(flow) if self.flow.tenants is not None else flow
            prompt = len(tokens) if tokens else math.ceil(request.prompt_chars / CHARS_PER_TOKEN)
            record.reserved = (prompt, request.max_tokens or self.flow.limits.default_max_tokens)
        objective = slo.ttft_s if slo is not None else None
        ticket = self.flow.submit(
            record,
            flow=flow,
            priority=priority,
            size=request.body_bytes,
            objective_s=objective,
            cost=sum(record.reserved),
        )
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
            extra = record.trace.outgoing() if record.trace else ()
            if record.prefill_on is not None:
                extra = (*extra, *self.pairing.headers(record))
            return Routed(record, record.picked, extra)
        self._metrics.count_end(EndReason.REJECTED)
        self._metrics.count_refusal(record.model, outcome)
        if record.trace is not None:
            record.trace.refused(outcome.value)
        return reply_for(outcome, retry_after_s=ticket.retry_after_s)

    def cancel(self, ticket: Ticket[RequestRecord]) -> None:
        """The client went away while its request waited in the queue.

        The queue may have released it in the same turn (its slot taken, the waiter not yet
        resumed): then nobody else will ever end that record, so it ends here.
        """
        self.flow.cancel(ticket)
        if ticket.outcome is Outcome.REJECTED_CONTEXT_CANCELLED:
            self._metrics.count_end(EndReason.REJECTED)
            self._metrics.count_refusal(ticket.payload.model, ticket.outcome)
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
        self._metrics.count_refusal("", reply.outcome)
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
        """End the engine-tracked requests each endpoint's gauges show have ended (the oldest first;
        picker/streams/inferred.py). An idle engine ends them all, which closes a drain in this shape."""
        tracked = {record.endpoint or "" for record in self._live.values() if record.engine_tracked}
        if not tracked:
            return
        mine: dict[str, list[RequestRecord]] = {address: [] for address in tracked}
        for record in self._live.values():
            if record.endpoint in mine:
                mine[record.endpoint].append(record)
        for address, records in mine.items():
            endpoint = self._pool.get(address)
            if endpoint is None or endpoint.state is EndpointState.GONE:
                ended = [r for r in records if r.engine_tracked]
            else:
                ended = inferred_ends(records, endpoint, self._engine_transit_s)
            for record in ended:
                self.finish(record, EndReason.UNOBSERVED)
            if ended and endpoint is not None and endpoint.load is not None:
                # the gauges already left these out: ends counted after the scrape must not be
                # subtracted from it a second time (scheduling/load.py `estimated_load`)
                shown = endpoint.load.departures_after + len(ended)
                endpoint.load = replace(endpoint.load, departures_after=shown)

    def on_idle(self, listener: Callable[[], None]) -> None:
        """Call `listener` each time the last live request ends (shutdown waits on it)."""
        self._idle_listeners.append(listener)
