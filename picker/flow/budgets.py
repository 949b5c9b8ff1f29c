"""Token budgets: a bucket per budgeted tenant, one budget across the pickers that share the books.

A budgeted tenant's request is reserved its prompt (estimated) and `max_tokens` at admission and
settled at its end to the tokens the engine reported. The budget is a bucket: it refills at
`tokens_per_minute`, holds at most `burst`, and a request is admitted while the bucket holds more
than nothing (its own reservation may take it below zero); otherwise it is refused with the time
until the bucket is above zero again (the reply's Retry-After).

Several pickers count what every one of them spent. A picker's own spending per tenant is a running
total; after each change it tells its peers the new total (`on_spend`), and with every sync of the
books its whole view (`view`): per tenant, the bucket's level and its own total. A peer's new total
less the last one heard from it comes off the bucket, so a message lost or heard twice changes
nothing and the next one puts it right. The first view heard from a peer (one that starts, or
restarts under a new incarnation) sets the floor instead: the bucket falls to the peer's level if
that is lower, and the peer's total is the baseline for what follows. So a picker that restarts
finds the budget where its peers left it, and a new one adds nothing twice.

The bound, with N pickers linked: over any T seconds they admit at most burst + rate x T + one
reservation per picker (the request that took each one's view below zero) + what was admitted
while its spending was on its way (events leave at once). While a link is down each side admits
against what it has heard; the next view after it reopens settles the difference.
Runs on the picker's loop, without locks and without I/O.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from picker.config.model import TokenBudgetConfig


@dataclass(frozen=True, slots=True)
class TokenBudget:
    """A tenant's token budget: refilled at `tokens_per_minute`, holding at most `burst`."""

    tokens_per_minute: float
    burst: float


@dataclass(slots=True)
class Bucket:
    rate: float  # tokens a second
    burst: float
    level: float
    at: float  # when `level` was last refilled
    spent: float = 0.0  # this picker's own: reserved, then settled (a running total)
    refused: int = 0


_PEERS = 1024  # peers whose totals are kept (what they spent stays counted when they are dropped)

# a view's row: (tenant, level, the sender's own running total)
ViewRow = tuple[str, float, float]


class Budgets:
    """Every budgeted tenant's bucket, as this picker knows it (see the module docstring)."""

    def __init__(
        self,
        budgets: Mapping[str, TokenBudget],
        clock: Callable[[], float] = time.monotonic,
        incarnation: str | None = None,
    ) -> None:
        self._clock = clock
        now = clock()
        self._buckets = {
            name: Bucket(b.tokens_per_minute / 60.0, b.burst, b.burst, now) for name, b in budgets.items()
        }
        self.incarnation = incarnation or secrets.token_hex(6)  # a restart is a new one
        # per peer: its incarnation and its running total per tenant, as last heard
        self._heard: dict[str, tuple[str, dict[str, float]]] = {}
        self.on_spend: Callable[[str, float], None] | None = None  # (tenant, own total): tell the peers

    def __contains__(self, tenant: object) -> bool:
        return tenant in self._buckets

    def level(self, tenant: str) -> float:
        """Tokens in `tenant`'s bucket now (below zero: owed)."""
        return self._refill(self._buckets[tenant])

    def take(self, tenant: str, cost: int) -> float:
        """Admit a request of `tenant` reserving `cost` tokens: 0.0 when admitted (charged), else the
        seconds until its bucket is above zero (refused, nothing charged)."""
        bucket = self._buckets[tenant]
        level = self._refill(bucket)
        if level <= 0:
            bucket.refused += 1
            return max(-level / bucket.rate, 1e-3)
        self._spend(tenant, bucket, float(cost))
        return 0.0

    def settle(self, tenant: str, delta: int) -> None:
        """A request of `tenant` ended: its reservation is off by `delta` tokens (used - reserved)."""
        bucket = self._buckets.get(tenant)
        if bucket is not None and delta:
            self._refill(bucket)
            self._spend(tenant, bucket, float(delta))

    def heard(self, peer: str, incarnation: str, tenant: str, total: float) -> None:
        """A peer's running total for `tenant`: what it spent since last heard comes off the bucket."""
        bucket = self._buckets.get(tenant)
        if bucket is None:
            return  # not budgeted here (configurations differ): nothing to count it against
        known = self._heard.get(peer)
        if known is None or known[0] != incarnation:  # a peer new, or restarted: from zero
            known = self._remember(peer, incarnation)
        totals = known[1]
        delta = total - totals.get(tenant, 0.0)
        totals[tenant] = total
        if delta:
            self._refill(bucket)
            bucket.level = min(bucket.burst, bucket.level - delta)

    def adopt(self, peer: str, incarnation: str, rows: list[ViewRow]) -> None:
        """A peer's whole view. Its first (per incarnation) is a floor: each bucket falls to the peer's
        level if lower, the peer's totals the baseline; later ones count as `heard`."""
        known = self._heard.get(peer)
        if known is not None and known[0] == incarnation:
            for tenant, _level, total in rows:
                self.heard(peer, incarnation, tenant, total)
            return
        totals = self._remember(peer, incarnation)[1]
        for tenant, level, total in rows:
            bucket = self._buckets.get(tenant)
            if bucket is None:
                continue
            totals[tenant] = total
            bucket.level = min(self._refill(bucket), level)

    def view(self) -> list[ViewRow]:
        """What this picker tells its peers at each sync of the books."""
        return [(name, self._refill(b), b.spent) for name, b in self._buckets.items()]

    def _remember(self, peer: str, incarnation: str) -> tuple[str, dict[str, float]]:
        self._heard.pop(peer, None)
        if len(self._heard) >= _PEERS:  # pickers come and go (new addresses): the earliest heard goes
            del self._heard[next(iter(self._heard))]
        known = self._heard[peer] = (incarnation, {})
        return known

    def rows(self) -> list[dict[str, float | int | str]]:
        """Each budget now, for the status page and the admin API."""
        return [
            {
                "tenant": name,
                "tokens_per_minute": b.rate * 60.0,
                "burst": b.burst,
                "level": round(self._refill(b), 1),
                "spent": b.spent,
                "refused": b.refused,
            }
            for name, b in self._buckets.items()
        ]

    def _spend(self, tenant: str, bucket: Bucket, tokens: float) -> None:
        bucket.level = min(bucket.burst, bucket.level - tokens)
        bucket.spent += tokens
        if self.on_spend is not None:
            self.on_spend(tenant, bucket.spent)

    def _refill(self, bucket: Bucket) -> float:
        now = self._clock()
        if now > bucket.at:
            bucket.level = min(bucket.burst, bucket.level + (now - bucket.at) * bucket.rate)
            bucket.at = now
        return bucket.level


def budgets_of(config: Mapping[str, TokenBudgetConfig]) -> dict[str, TokenBudget]:
    """The configured budgets (tenants.budgets) as plain values; burst defaults to a minute's tokens."""
    return {
        name: TokenBudget(b.tokens_per_minute, b.burst if b.burst is not None else b.tokens_per_minute)
        for name, b in config.items()
    }
