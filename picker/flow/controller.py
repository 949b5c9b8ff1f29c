"""The flow controller: tickets for admission, released by capacity, time-to-live or shutdown."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from picker.config.model import FlowConfig, TenantsConfig
from picker.contract import Outcome
from picker.flow.budgets import Budgets, TokenBudget, budgets_of
from picker.flow.queue import AdmissionQueue, QueuedItem
from picker.flow.tenants import FairShare, Tenants

log = logging.getLogger(__name__)

T = TypeVar("T")

# Restricted requests one pump may look past (each costs one pick over its subset).
_MAX_PASSED = 64


MAX_REQUEST_TOKENS = 10_000_000  # more tokens than any context window: a reported count is bounded by it


@dataclass(frozen=True, slots=True)
class FlowLimits:
    max_queued: int = 1000
    max_queued_bytes: int = 256 * 1024 * 1024
    ttl_s: float = 30.0
    fair_share: FairShare | None = None  # between tenants (flow/tenants.py); None: turns by request
    budgets: Mapping[str, TokenBudget] = field(default_factory=dict)  # by tenant (flow/budgets.py)
    default_max_tokens: int = 256  # reserved for a request that sets no max_tokens

    @classmethod
    def of(cls, flow: FlowConfig, tenants: TenantsConfig) -> FlowLimits:
        share = FairShare.of(tenants) if tenants.fair_share == "on" else None
        budgets = budgets_of(tenants.budgets)
        limits = (flow.max_queued, flow.max_queued_bytes, flow.ttl_s)
        return cls(*limits, share, budgets, tenants.default_max_tokens)


class Ticket(Generic[T]):
    """One request's place in admission. Done at once when it dispatched or was refused at the door."""

    __slots__ = ("_future", "charged", "item", "outcome", "payload", "queued", "retry_after_s")

    def __init__(self, payload: T) -> None:
        self.payload = payload
        self.outcome: Outcome | None = None
        self.queued = False
        self.item: QueuedItem | None = None
        self.charged: tuple[str, int] | None = None  # (tenant, tokens) its budget was charged
        self.retry_after_s: float | None = None  # over budget: when the tenant's budget has room
        self._future: asyncio.Future[Outcome] | None = None

    @property
    def done(self) -> bool:
        return self.outcome is not None

    async def wait(self) -> Outcome:
        """The outcome; cancelling the caller (the client went away) is the controller's `cancel`."""
        if self.outcome is not None:
            return self.outcome
        assert self._future is not None
        return await asyncio.shield(self._future)

    def _resolve(self, outcome: Outcome) -> None:
        if self.outcome is not None:
            return
        self.outcome = outcome
        if self._future is not None and not self._future.done():
            self._future.set_result(outcome)


class FlowController(Generic[T]):
    """Dispatch now when there is room and nobody waits ahead, else queue until `pump()` finds room.

    `try_dispatch(payload)` is the pipeline's: it picks and takes the endpoint slot, or returns False
    when no endpoint has room. `has_endpoints()` tells a TTL expiry with no ready endpoint (503)
    from one where all were busy (429).
    """

    def __init__(
        self,
        try_dispatch: Callable[[T], bool],
        has_endpoints: Callable[[], bool],
        limits: FlowLimits,
        on_outcome: Callable[[Outcome, float], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        restricted: Callable[[T], bool] = lambda payload: False,
    ) -> None:
        self._try_dispatch = try_dispatch
        self._has_endpoints = has_endpoints
        self.limits = limits
        self._queue = AdmissionQueue(limits.max_queued, limits.max_queued_bytes)
        self._on_outcome = on_outcome or (lambda outcome, waited: None)
        self._clock = clock
        self._restricted = restricted
        self._timers: dict[int, asyncio.TimerHandle] = {}
        self._aside = 0  # requests the pump passed and holds aside until it ends (queued still)
        self.closed = False
        self.tenants: Tenants | None = None  # fair share between fairness ids (`share_by`)
        # token budgets by tenant (flow/budgets.py); None: none configured, nothing counted
        self.budgets: Budgets | None = Budgets(limits.budgets, clock) if limits.budgets else None

    def share_by(self, tenants: Tenants) -> None:
        """Fair share on: the queue serves tenants by tokens per weight, with the reserve (tenants.py)."""
        self.tenants = tenants
        self._queue.choose = tenants.choose

    @property
    def queued(self) -> int:
        return len(self._queue) + self._aside

    @property
    def ahead(self) -> int:
        """Requests waiting ahead of the one being dispatched now: those the pump looked past (0 for
        a request that arrives to an empty queue)."""
        return self._aside

    @property
    def queued_bytes(self) -> int:
        return self._queue.bytes

    def submit(
        self,
        payload: T,
        *,
        flow: str = "",
        priority: int = 0,
        size: int = 0,
        objective_s: float | None = None,
        cost: int = 0,
    ) -> Ticket[T]:
        """Dispatch, queue or refuse one request. `objective_s`: its time-to-first-token objective,
        which makes it due that long after now (queued, it goes ahead of its flow's requests due
        later: those without one are due when their time to live ends). `cost`: the tokens its
        tenant (`flow`, a key of `tenants`) is charged when it dispatches, with fair share on, and its
        budget at once, if it has one (over budget: refused)."""
        ticket: Ticket[T] = Ticket(payload)
        tenants = self.tenants if flow else None
        if tenants is not None:
            tenants.arrived(flow)
        if self.closed:
            self._finish(ticket, Outcome.REJECTED_SHUTTING_DOWN, 0.0)
        elif self.budgets is not None and flow in self.budgets and self._over_budget(ticket, flow, cost):
            self._finish(ticket, Outcome.REJECTED_OVER_BUDGET, 0.0)
        elif (
            not len(self._queue)
            and (tenants is None or not tenants.held_back(flow))
            and self._try_dispatch(payload)
        ):
            if tenants is not None:
                tenants.dispatched(flow, cost)
            self._finish(ticket, Outcome.DISPATCHED, 0.0)
        elif not self._queue.fits(size):
            self._finish(ticket, Outcome.REJECTED_SATURATED, 0.0)
        else:
            self._enqueue(ticket, flow, priority, size, objective_s, cost)
            self.pump()  # it may be first in line for room that is there already
        return ticket

    def settle(self, flow: str, reserved: tuple[int, int], prompt: int | None, output: int | None) -> None:
        """A dispatched request of tenant `flow` ended: the (prompt, output) tokens reserved for it
        become what the engine reported (None: it reported no usage, the reservation stands)."""
        if self.tenants is None and self.budgets is None:
            return
        # the engine's (or a peer's) word, bounded: a count no request can have would move a
        # tenant's share and a budget shared by every picker past any repair
        prompt = reserved[0] if prompt is None else min(max(0, int(prompt)), MAX_REQUEST_TOKENS)
        output = reserved[1] if output is None else min(max(0, int(output)), MAX_REQUEST_TOKENS)
        used = prompt + output
        if self.tenants is not None:
            self.tenants.ended(flow, sum(reserved), used)
        if self.budgets is not None and flow in self.budgets:
            self.budgets.settle(flow, used - sum(reserved))

    def _over_budget(self, ticket: Ticket[T], flow: str, cost: int) -> bool:
        """Charge `flow`'s budget `cost` tokens (False; refunded if the request is not dispatched
        after all), or refuse (True: its bucket is empty)."""
        assert self.budgets is not None
        wait = self.budgets.take(flow, cost)
        if not wait:
            ticket.charged = (flow, cost)
            return False
        ticket.retry_after_s = wait
        tenant = self.tenants.get(flow) if self.tenants is not None else None
        if tenant is not None:
            tenant.over_budget += 1
        return True

    def refuse(self, payload: T, outcome: Outcome) -> Ticket[T]:
        """A ticket refused at the door by the caller's own rule, counted like every other outcome."""
        ticket: Ticket[T] = Ticket(payload)
        self._finish(ticket, outcome, 0.0)
        return ticket

    def pump(self) -> int:
        """Dispatch queued requests in order while there is room. Called whenever room may have freed.

        A request that finds no room stops the pump, keeping its turn: nobody behind it could be
        served either. Unless it is `restricted` (it may only go to some endpoints): those may be
        full while others have room, so the pump looks past it (a bounded number per call) and the
        requests it passed keep their places at the head.
        """
        dispatched = 0
        passed: list[QueuedItem] = []
        while len(self._queue):
            item = self._queue.pop()
            if item is None:
                break
            ticket: Ticket[T] = item.payload
            if self._try_dispatch(ticket.payload):
                self._dequeued(item, dispatched=True)
                self._finish(ticket, Outcome.DISPATCHED, self._clock() - item.enqueued_at)
                dispatched += 1
                continue
            if self._restricted(ticket.payload) and len(passed) < _MAX_PASSED:
                passed.append(item)
                self._aside = len(passed)
                continue
            self._queue.unpop(item)  # no room: it keeps its turn
            break
        self._aside = 0
        for item in reversed(passed):
            self._queue.unpop(item)
        return dispatched

    def cancel(self, ticket: Ticket[T]) -> None:
        """The client went away while queued: free its place and count it."""
        if ticket.done or ticket.item is None:
            return
        if self._queue.remove(ticket.item):
            self._dequeued(ticket.item)
        self._finish(ticket, Outcome.REJECTED_CONTEXT_CANCELLED, self._clock() - ticket.item.enqueued_at)

    def close(self) -> int:
        """Shutdown: refuse new requests and evict every queued one, retryably."""
        self.closed = True
        evicted = 0
        for item in self._queue.drain():
            self._dequeued(item)
            self._finish(item.payload, Outcome.REJECTED_SHUTTING_DOWN, self._clock() - item.enqueued_at)
            evicted += 1
        return evicted

    def _dequeued(self, item: QueuedItem, dispatched: bool = False) -> None:
        if self.tenants is not None and item.flow:
            self.tenants.queued(item.flow, -1)
            if dispatched:
                self.tenants.dispatched(item.flow, item.cost)

    def _enqueue(
        self, ticket: Ticket[T], flow: str, priority: int, size: int, objective_s: float | None, cost: int
    ) -> None:
        now = self._clock()
        timed = objective_s is not None
        due = now + (objective_s if objective_s is not None else self.limits.ttl_s)
        item = QueuedItem(flow, priority, size, now, ticket, deadline=due, timed=timed, cost=cost)
        if self.tenants is not None and flow:
            self.tenants.queued(flow, 1)
        ticket.item = item
        ticket.queued = True
        loop = asyncio.get_running_loop()
        ticket._future = loop.create_future()
        self._queue.push(item)
        self._timers[id(ticket)] = loop.call_later(self.limits.ttl_s, self._expire, ticket)

    def _expire(self, ticket: Ticket[T]) -> None:
        self._timers.pop(id(ticket), None)
        if ticket.done or ticket.item is None:
            return
        if self._queue.remove(ticket.item):
            self._dequeued(ticket.item)
        outcome = Outcome.REJECTED_TTL_EXPIRED if self._has_endpoints() else Outcome.REJECTED_NO_ENDPOINTS
        self._finish(ticket, outcome, self._clock() - ticket.item.enqueued_at)

    def _finish(self, ticket: Ticket[T], outcome: Outcome, waited: float) -> None:
        timer = self._timers.pop(id(ticket), None)
        if timer is not None:
            timer.cancel()
        if ticket.charged is not None and outcome is not Outcome.DISPATCHED and self.budgets is not None:
            self.budgets.settle(ticket.charged[0], -ticket.charged[1])  # never dispatched: refunded
        ticket._resolve(outcome)
        self._on_outcome(outcome, waited)
