"""Tenants: fair share of a saturated pool by tokens, weighted, with a bound on the ids tracked.

A tenant is a request's fairness id (the Gateway API header). Each one tracked has a weight and a
virtual time: the tokens dispatched for it divided by its weight (a request's prompt, estimated at
admission, plus its `max_tokens`; corrected by what the engine reported when it ends). Between the
flows of one priority band the queue serves the tenant whose virtual time is lowest, so under
saturation the tokens each tenant gets follow its weight, whatever its requests' sizes. A tenant
that starts to queue takes at least the lowest virtual time of those queued (start-time fair
queueing): time it spent idle is not credit it can spend in a burst.

Order alone cannot help a light tenant once the heavy one's requests hold every batch slot: the
light one's next request waits for a slot to free. So while several tenants are active and the
pool's batch slots are known, a tenant holding more than its weighted share of the slots may not
take the pool's last free ones: a reserve is kept for the tenants under their share, as large as
each one's recent peak of requests in flight plus one (never above its share). A tenant alone, or
on a pool with free slots beyond the reserve, is never held back.

Bounded: at most `max_tracked` tenants are tracked (idle ones are forgotten first); an id beyond
that shares the `OTHER` bucket, and so does its metric label. A tenant id is only ever a key.
Runs on the flow controller's loop, without locks and without I/O.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from picker.config.model import TenantsConfig
from picker.flow.budgets import TokenBudget, budgets_of

OTHER = "other"  # the bucket of every tenant past the cap


@dataclass(frozen=True, slots=True)
class FairShare:
    """The rules: weights by tenant (`default_weight` for the rest), the cap on tracked tenants,
    how long a tenant stays active after its last request, and the estimate of a request's output
    when it sets no `max_tokens`."""

    weights: Mapping[str, float] = field(default_factory=dict)
    default_weight: float = 1.0
    max_tracked: int = 1000
    active_s: float = 10.0
    default_max_tokens: int = 256
    budgets: Mapping[str, TokenBudget] = field(default_factory=dict)

    @classmethod
    def of(cls, config: TenantsConfig) -> FairShare:
        return cls(
            weights=dict(config.weights),
            default_weight=config.default_weight,
            max_tracked=config.max_tracked,
            active_s=config.active_s,
            default_max_tokens=config.default_max_tokens,
            budgets=budgets_of(config.budgets),
        )


@dataclass(slots=True)
class Tenant:
    name: str
    weight: float
    vtime: float = 0.0  # tokens dispatched / weight
    queued: int = 0
    in_flight: int = 0
    peak: float = 0.0  # recent peak of requests in flight (decays over `active_s`)
    peak_at: float = 0.0
    last_seen: float = -math.inf
    requests: int = 0
    tokens: int = 0  # reserved at dispatch, settled to what the engine reported
    held: int = 0  # times it was held back to keep the reserve
    over_budget: int = 0  # refused by its token budget


# (free batch slots, total batch slots) of the READY endpoints, or None while some are not known
Room = Callable[[], tuple[int, int] | None]


class Tenants:
    """The books of every tracked tenant, the order between them and the reserve."""

    def __init__(self, rules: FairShare, room: Room, clock: Callable[[], float] = time.monotonic) -> None:
        self.rules = rules
        self._room = room
        self._clock = clock
        self._tenants: OrderedDict[str, Tenant] = OrderedDict()  # least recently seen first
        self._floor = 0.0  # the virtual time of the last tenant served (a newcomer starts there)

    def __len__(self) -> int:
        return len(self._tenants)

    def get(self, name: str) -> Tenant | None:
        return self._tenants.get(name)

    def all(self) -> list[Tenant]:
        return list(self._tenants.values())

    def key(self, flow: str) -> str:
        """The tenant a fairness id counts as: itself while it is tracked or there is room (an idle
        tenant is forgotten to make room), else `OTHER`."""
        if flow in self._tenants or flow == OTHER or flow in self.rules.budgets:
            return flow  # a budgeted tenant is its own, whatever the cap: its budget is by name
        if len(self._tenants) < self.rules.max_tracked:
            return flow
        for name, tenant in self._tenants.items():  # least recently seen first
            if not tenant.queued and not tenant.in_flight and name not in self.rules.weights:
                del self._tenants[name]
                return flow
        return OTHER

    def arrived(self, name: str) -> Tenant:
        """A request of `name` (a `key`) was admitted."""
        tenant = self._tenants.get(name)
        if tenant is None:
            weight = self.rules.weights.get(name, self.rules.default_weight)
            tenant = self._tenants[name] = Tenant(name, weight)
        else:
            self._tenants.move_to_end(name)
        tenant.last_seen = self._clock()
        tenant.requests += 1
        return tenant

    def queued(self, name: str, delta: int) -> None:
        tenant = self._tenants.get(name)
        if tenant is None:
            return
        if delta > 0 and not tenant.queued and not tenant.in_flight:
            tenant.vtime = max(tenant.vtime, self._floor)  # idle time is no credit
        tenant.queued += delta

    def dispatched(self, name: str, cost: int) -> None:
        """A request of `name` took a slot: its reservation of `cost` tokens is charged."""
        tenant = self._tenants.get(name)
        if tenant is None:
            return
        if not tenant.queued and not tenant.in_flight:
            tenant.vtime = max(tenant.vtime, self._floor)
        self._floor = max(self._floor, tenant.vtime)
        tenant.vtime += cost / tenant.weight
        tenant.tokens += cost
        tenant.in_flight += 1
        self._note_peak(tenant)

    def ended(self, name: str, reserved: int, used: int) -> None:
        """A request of `name` ended having used `used` tokens of the `reserved`: settled."""
        tenant = self._tenants.get(name)
        if tenant is None:
            return
        tenant.in_flight = max(0, tenant.in_flight - 1)
        tenant.vtime += (used - reserved) / tenant.weight
        tenant.tokens += used - reserved
        self._note_peak(tenant)

    def choose(self, flows: Iterable[str]) -> str | None:
        """Which of a band's queued flows (in turn order) goes next: the lowest virtual time of those
        not held back, the earlier in turn on a tie; None when every one is held back."""
        best: Tenant | None = None
        held: bool | None = None
        for name in flows:
            tenant = self._tenants.get(name)
            if tenant is None:
                return name  # not tracked (no fairness id): served in its turn
            if best is not None and tenant.vtime >= best.vtime:
                continue
            if self.held_back(name):
                held = True
                continue
            best = tenant
        if best is None and held:
            return None
        return best.name if best is not None else None

    def held_back(self, name: str) -> bool:
        """Whether a request of `name` must leave the pool's last free slots to others (the reserve)."""
        tenant = self._tenants.get(name)
        if tenant is None:
            return False
        now = self._clock()
        active = [t for t in self._tenants.values() if self._active(t, now)]
        if len(active) < 2:
            return False
        room = self._room()
        if room is None:
            return False
        free, total = room
        weights = sum(t.weight for t in active) or 1.0
        if tenant.in_flight < total * tenant.weight / weights:
            return False  # under its share: never held back
        reserve = 0.0
        for other in active:
            if other is tenant:
                continue
            share = total * other.weight / weights
            if other.in_flight < share:
                wanted = min(share, math.ceil(self._peak(other, now)) + 2.0)
                reserve += max(0.0, wanted - other.in_flight)
        if free - 1 < reserve:
            tenant.held += 1
            return True
        return False

    def shares(self) -> dict[str, float]:
        """Each active tenant's share of the pool now: its weight over the active tenants' weights."""
        now = self._clock()
        active = [t for t in self._tenants.values() if self._active(t, now)]
        weights = sum(t.weight for t in active)
        return {t.name: t.weight / weights for t in active} if weights > 0 else {}

    def _active(self, tenant: Tenant, now: float) -> bool:
        return bool(tenant.queued or tenant.in_flight) or now - tenant.last_seen <= self.rules.active_s

    def _peak(self, tenant: Tenant, now: float) -> float:
        decay = math.exp(-(now - tenant.peak_at) / self.rules.active_s) if self.rules.active_s else 0.0
        return max(float(tenant.in_flight), tenant.peak * decay)

    def _note_peak(self, tenant: Tenant) -> None:
        now = self._clock()
        tenant.peak = self._peak(tenant, now)
        tenant.peak_at = now
