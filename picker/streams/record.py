"""The record of one request, from admission to its single end reason."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from picker.pool import Lease
from picker.pool.cache import CacheKeys
from picker.pool.served import Need
from picker.streams.tracker import ResponseTracker


class EndReason(enum.Enum):
    """How a request ended (closed set; each request gets exactly one)."""

    COMPLETED = "completed"  # the response reached its end: finish_reason / [DONE] / end of body
    CLIENT_DISCONNECT = "client-disconnect"  # the client went away first (the engine was told to abort)
    UPSTREAM_TRUNCATED = "upstream-truncated"  # ended after the commit point without completing
    UPSTREAM_ERROR_EVENT = "upstream-error-event"  # an SSE error event inside a 200 stream
    UPSTREAM_ERROR_STATUS = "upstream-error-status"  # the model server answered 5xx before any token
    STALLED = "stalled"  # the model server stopped sending without closing
    SHUTDOWN_CUT = "shutdown-cut"  # the picker's own drain deadline ended it (`picker proxy` only)
    REJECTED = "rejected"  # answered by the picker itself (status contract), never dispatched
    UNOBSERVED = "unobserved"  # dispatched, but nothing ever reported how it ended


@dataclass(slots=True)
class Attempts:
    """What Envoy's access log said about the upstream side of one request."""

    count: int = 1
    flags: frozenset[str] = frozenset()
    status: int = 0
    upstream: str = ""


class TraceHooks(Protocol):
    """What the request path tells a request's trace (picker/observability/tracing.py `RequestTrace`)."""

    def outgoing(self) -> tuple[tuple[str, str], ...]: ...
    def queued(self) -> None: ...
    def refused(self, outcome: str) -> None: ...
    def picked(self, destinations: Sequence[str], started_ns: int) -> None: ...
    def response_started(self, status: int, served: str | None, primary: str | None) -> None: ...
    def first_token(self) -> None: ...
    def ended(
        self, reason: str, tokens: int, endpoint: str | None, resumed_on: tuple[str, ...] = ()
    ) -> None: ...


@dataclass(frozen=True, slots=True)
class Slo:
    """A request's latency objectives, in seconds (None: no objective for that)."""

    ttft_s: float | None = None
    tpot_s: float | None = None

    def met_by(self, ttft_s: float, tpot_s: float) -> bool:
        return (self.ttft_s is None or ttft_s <= self.ttft_s) and (
            self.tpot_s is None or tpot_s <= self.tpot_s
        )


@dataclass(slots=True)
class RequestRecord:
    request_id: str
    admitted_at: float
    model: str = ""
    stream: bool = False
    body_bytes: int = 0
    fallbacks: bool = True  # list fallbacks after the primary (override_host data planes only)
    allowed: frozenset[str] | None = None  # the data plane's subset hint (EPP protocol): pick only these
    picked: tuple[str, ...] = ()
    lease: Lease | None = None
    # a prefill / decode pool: the prefill replica named for it, and its hand-off's claim there
    # (picker/request/pairing.py); `unpaired`: no revision had both roles ready at its pick
    prefill_on: str | None = None
    pull: Lease | None = None
    unpaired: bool = False
    status: int | None = None
    served: str | None = None
    response_started_at: float | None = None  # the commit point: nothing may retry after it
    observed: bool = False  # an observer stream joined this request
    observer_done: bool = False  # ... and has ended
    engine_tracked: bool = False  # nothing sees its response end: the engine's gauges settle it
    tracker: ResponseTracker | None = None
    response_ended: bool = False  # the observer saw the response's end of stream
    access_log: Attempts | None = None
    # its response's end was seen, but not how it ended (the routing stream's close in kgateway's
    # shape): the end's time; Envoy's access log, a moment later, says how
    closed_at: float | None = None
    stalled: bool = False
    ended_at: float | None = None
    end_reason: EndReason | None = None
    trace: TraceHooks | None = None  # with tracing on (picker/observability/tracing.py)
    keys: CacheKeys | None = None  # what it looks up in caches (cache-aware routing)
    predicted_blocks: int = 0  # of its blocks, how many the picker expected its primary to hold
    prefill: float = 0.0  # uncached prompt tokens it adds to its endpoint's backlog until its first token
    prefill_at: str | None = None  # ... which endpoint's
    # another picker routed it; this one only tracks its response for it (picker/peers/books.py)
    owner: str | None = None
    observed_by: str | None = None  # the peer its observer stream went to (it reports the end)
    peers_told: bool = False  # ... and that peer told the other pickers it ended
    need: Need | None = None  # scheduling.by_model: only endpoints that serve this may take it
    group: str | None = None  # a canary runs: the group it was sent to (picker/rollout)
    # the client connection it came on, when an HTTP/1.x one (picker/pool/connections.py)
    connection: str | None = None
    priority: int = 0  # flow control's: below 0, sheddable
    max_tokens: int | None = None  # what it asks for (None: the engine's default)
    slo: Slo | None = None  # its latency objectives (SLO headers, with affinity.latency on)
    # fair share (picker/flow/tenants.py): its tenant, and the tokens reserved for it at admission
    # (prompt, output), settled at its end to what the engine reported
    tenant: str = ""
    reserved: tuple[int, int] = (0, 0)
    # affinity.latency: when it was picked, and the features its primary's predictions were made
    # from (the model learns from them at its first token and its end)
    dispatched_at: float | None = None
    ttft_x: tuple[float, ...] | None = None
    tpot_x: tuple[float, ...] | None = None
    predicted_ttft: float | None = None
    # ... and its last pick chose to wait for a busy replica predicted to serve it sooner than any
    # with room: the queue looks past it (requests behind it may go where it would not)
    waits_for_quicker: bool = False
    # streams.resume (picker proxy): the replicas its stream was continued on, after cuts
    resumed_on: tuple[str, ...] = ()
    cut_on: tuple[str, ...] = ()  # ... and the replicas it was cut on
    part_started_at: float | None = None  # ... and when its current part began (silence counts from it)
    resumable: bool = False  # picker proxy may continue its stream on another replica
    stall_kept: bool = False  # judged stalled with nowhere to move: it waits on its own replica

    @property
    def pulling(self) -> str | None:
        """The prefill replica its hand-off still waits on (a prefill / decode pool), if any."""
        return self.prefill_on if self.pull is not None and self.pull.held else None

    @property
    def ended(self) -> bool:
        return self.end_reason is not None

    @property
    def endpoint(self) -> str | None:
        """Where the request is attributed now (served, else the primary pick)."""
        return self.lease.address if self.lease is not None else (self.served or None)
