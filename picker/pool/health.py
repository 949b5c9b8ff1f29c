"""Endpoint health as the request path sees it: answers that failed before their first byte.

A replica that fails fast (a 5xx, a reset, a refused connection before any response byte) ends each
request at once, so it holds the fewest requests and keeps the best load score: without this it
attracts traffic. After `after` failures in a row an endpoint is suspect: never a primary pick, last
resort only, for a backoff that doubles with each suspicion in a row (up to a maximum); one success
clears it. Like Envoy's outlier detection, but in the picker's view, so it also orders the fallbacks.

Pure bookkeeping with an injected clock; the pool owns one (drain records read recent failures).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

Clock = Callable[[], float]

_NONE: frozenset[str] = frozenset()
_KEPT = 64  # failure times kept per endpoint (drain records count the last few seconds of them)


@dataclass(frozen=True, slots=True)
class SuspectPolicy:
    after: int = 3  # failures in a row before an endpoint is suspect (0: never)
    backoff_s: float = 1.0  # first suspicion lasts this long ...
    max_backoff_s: float = 30.0  # ... doubling with each suspicion in a row, up to this


@dataclass(slots=True)
class _Health:
    in_a_row: int = 0
    suspicions: int = 0  # suspicions in a row (no success since): sets the next backoff
    until: float = 0.0  # suspect until this time (pool clock)
    failed_at: deque[float] = field(default_factory=lambda: deque(maxlen=_KEPT))


class Health:
    """Per-address failure counts and suspicion windows."""

    def __init__(self, policy: SuspectPolicy | None = None, clock: Clock = time.monotonic) -> None:
        self.policy = policy or SuspectPolicy()
        self._clock = clock
        self._by_address: dict[str, _Health] = {}
        self.failures = 0  # counted failures, every endpoint (telemetry reads these totals)
        self.suspected = 0  # transitions into suspect
        self.cleared = 0  # suspect endpoints a success cleared
        self._latest_until = 0.0  # no endpoint is suspect past this (the pick's fast path)

    def answered(self, picked: Sequence[str], served: str | None, status: int) -> None:
        """A response started: count it for or against each endpoint it tried.

        Envoy walks the picker's list in order and moves on only when an attempt failed before any
        response byte (connect failure, reset, a retriable 5xx): every endpoint listed before the one
        that served failed so. A 5xx that reached the client failed on the endpoint that sent it.
        """
        if served and served in picked:
            for address in picked[: picked.index(served)]:
                self.failed(address)
        endpoint = served or (picked[0] if picked else None)
        if endpoint is None:
            return
        if status >= 500:
            self.failed(endpoint)
        else:
            self.succeeded(endpoint)

    def unanswered(self, tried: Sequence[str]) -> None:
        """Envoy's access log: no attempt got a response (refused, reset) on these endpoints."""
        for address in tried:
            self.failed(address)

    def failed(self, address: str) -> bool:
        """One answer failed before its first byte on `address`; True when this made it suspect."""
        now = self._clock()
        health = self._by_address.setdefault(address, _Health())
        health.in_a_row += 1
        health.failed_at.append(now)
        self.failures += 1
        policy = self.policy
        if policy.after <= 0 or health.in_a_row < policy.after or health.until > now:
            return False
        backoff = min(policy.max_backoff_s, policy.backoff_s * 2**health.suspicions)
        health.suspicions += 1
        health.in_a_row = 0  # after the backoff, `after` more failures in a row suspect it again
        self._suspect_until(health, now + backoff)
        return True

    def shutting_down(self, address: str) -> bool:
        """`address` refused work because its engine is shutting down (vLLM's drain 500): suspect at
        once for the longest backoff, without waiting for more failures in a row (the failure itself
        is counted by `failed`). True when this made it suspect."""
        if self.policy.after <= 0:
            return False
        now = self._clock()
        health = self._by_address.setdefault(address, _Health())
        fresh = health.until <= now
        health.suspicions = max(health.suspicions, 1)
        self._suspect_until(health, max(health.until, now + self.policy.max_backoff_s))
        return fresh

    def _suspect_until(self, health: _Health, until: float) -> None:
        if health.until <= self._clock():
            self.suspected += 1
        health.until = until
        self._latest_until = max(self._latest_until, until)

    def succeeded(self, address: str) -> bool:
        """An answer from `address` started well; True when this cleared a suspicion."""
        health = self._by_address.get(address)
        if health is None:
            return False
        was = health.until > self._clock()
        health.in_a_row = health.suspicions = 0
        health.until = 0.0  # the failure times stay: a drain record counts them whatever came between
        self.cleared += was
        return was

    def suspect(self, address: str) -> bool:
        health = self._by_address.get(address)
        return health is not None and health.until > self._clock()

    def suspects(self) -> frozenset[str]:
        """Addresses suspect now (the scheduler lists them last, never as the primary)."""
        now = self._clock()
        if self._latest_until <= now:
            return _NONE
        return frozenset(a for a, h in self._by_address.items() if h.until > now)

    def failed_within(self, address: str, window_s: float) -> int:
        """Failures counted on `address` in the last `window_s` seconds (drain records read this)."""
        health = self._by_address.get(address)
        if health is None:
            return 0
        since = self._clock() - window_s
        return sum(1 for at in health.failed_at if at >= since)

    def forget(self, address: str) -> None:
        """The endpoint left the pool: its history goes with it."""
        self._by_address.pop(address, None)
