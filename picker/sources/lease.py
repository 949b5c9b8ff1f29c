"""Leader election over a coordination.k8s.io/v1 Lease, the way client-go's leaderelection does it
(the reference picker's `--ha-enable-leader-election`): only the holder is ready.

Every replica reads the Lease each `retry_period_s`. The holder renews it (`renewTime`); another
replica takes it only once it has seen the same record unchanged for `lease_duration_s` on its own
clock (never by comparing clocks across machines), and a holder that could not renew for
`renew_deadline_s` stands down first, so two replicas never both believe they lead. A replica that
stops releases the Lease (holder "", duration 1 s) so a standby takes over at its next retry.
`Elector` is the decision, without I/O; `campaign` runs it against a `LeaseApi`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any, Protocol

from picker.sources.cancel import raise_if_cancelled
from picker.sources.kube import ApiFailure, Disconnected, SourceError
from picker.sources.kube_drains import WriteConflict

log = logging.getLogger(__name__)

RELEASED_DURATION_S = 1.0  # what a released lease says: a standby takes it at once (client-go's)


@dataclass(frozen=True)
class LeaseRecord:
    """The Lease's spec, as far as the election reads it."""

    holder: str  # "" when released
    duration_s: float
    transitions: int = 0
    acquired: datetime | None = None
    renewed: datetime | None = None


_INT32_MAX = 2**31 - 1  # the API's int32 fields


class LeaseInvalid(SourceError):
    """The Lease cannot be read as one (a type the API never writes, a value out of its range):
    refused whole; nobody leads on it until a valid one is written."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"the leader lease is refused ({reason}): {detail}")
        self.reason = reason


def lease_record(spec: Mapping[str, Any]) -> LeaseRecord:
    """The election's record from a Lease's spec (its fields as the client library read them:
    str, int, datetime or None), checked whole; LeaseInvalid names what is wrong."""
    holder, duration = spec.get("holderIdentity"), spec.get("leaseDurationSeconds")
    transitions = spec.get("leaseTransitions")
    if holder is not None and not isinstance(holder, str):
        raise LeaseInvalid("malformed", "holderIdentity is not a string")
    for name, value, least in (("leaseDurationSeconds", duration, 1), ("leaseTransitions", transitions, 0)):
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool):
            raise LeaseInvalid("malformed", f"{name} is not an integer")
        if not least <= value <= _INT32_MAX:
            raise LeaseInvalid("out-of-range", f"{name} {value} is outside {least}..{_INT32_MAX}")
    times = {name: spec.get(name) for name in ("acquireTime", "renewTime")}
    for name, value in times.items():
        if value is not None and not isinstance(value, datetime):
            raise LeaseInvalid("malformed", f"{name} is not a time")
    return LeaseRecord(
        holder=holder or "",
        duration_s=float(duration or 0),
        transitions=transitions or 0,
        acquired=times["acquireTime"],
        renewed=times["renewTime"],
    )


class LeaseApi(Protocol):
    async def read(self) -> tuple[LeaseRecord | None, str | None]:
        """The record and its resourceVersion; (None, None) when there is no Lease yet."""
        ...

    async def write(self, record: LeaseRecord, version: str | None) -> str | None:
        """Create (version None) or replace at `version`: the new resourceVersion. WriteConflict when
        someone wrote first."""
        ...


def _now() -> datetime:
    return datetime.now(UTC)


class Elector:
    """Whether this replica leads, and what it writes next. No I/O: `campaign` feeds it."""

    def __init__(
        self,
        identity: str,
        lease_duration_s: float,
        renew_deadline_s: float,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], datetime] = _now,
    ) -> None:
        self.identity = identity
        self.lease_duration_s = lease_duration_s
        self.renew_deadline_s = renew_deadline_s
        self.leading = False
        self.transitions = 0  # times this replica became the leader
        self._clock, self._wall = clock, wall
        self._observed: LeaseRecord | None = None
        self._observed_at = float("-inf")  # when the record last changed, on this replica's clock
        self._renewed_at = float("-inf")  # when this replica last wrote its hold

    def observe(self, record: LeaseRecord | None) -> None:
        if record != self._observed:
            self._observed, self._observed_at = record, self._clock()

    def proposal(self) -> LeaseRecord | None:
        """The record to write now (acquire or renew), or None: another replica holds a live Lease."""
        record, now, wall = self._observed, self._clock(), self._wall()
        if record is not None and record.holder == self.identity:
            return replace(record, duration_s=self.lease_duration_s, renewed=wall)
        if record is not None and record.holder and now < self._observed_at + record.duration_s:
            return None
        transitions = record.transitions + 1 if record is not None else 0
        return LeaseRecord(self.identity, self.lease_duration_s, transitions, acquired=wall, renewed=wall)

    def wrote(self, record: LeaseRecord) -> bool:
        """The write went through: this replica leads. True when it did not before."""
        self._observed, self._observed_at = record, self._clock()
        self._renewed_at = self._observed_at
        became = not self.leading
        self.leading = True
        self.transitions += became
        return became

    def standby(self) -> None:
        """Another replica holds the Lease."""
        self.leading = False

    def failed(self) -> None:
        """A read or write failed: the leader stands down once it is past its renew deadline."""
        if self.leading and self._clock() - self._renewed_at >= self.renew_deadline_s:
            self.leading = False

    def attempt_timeout(self) -> float:
        """How long one read-and-write may take: a leader's never outlasts its renew deadline."""
        if not self.leading:
            return self.renew_deadline_s
        return max(0.01, self.renew_deadline_s - (self._clock() - self._renewed_at))

    def release(self) -> LeaseRecord | None:
        """What to write when stopping (None: not holding it)."""
        if not self.leading or self._observed is None:
            return None
        return replace(self._observed, holder="", duration_s=RELEASED_DURATION_S, renewed=self._wall())


class Election:
    """`Elector` against a `LeaseApi`, every `retry_period_s`; `on_change(leading)` on each flip."""

    def __init__(
        self,
        api: LeaseApi,
        elector: Elector,
        retry_period_s: float,
        on_change: Callable[[bool], None],
    ) -> None:
        self.api = api
        self.elector = elector
        self._retry_period_s = retry_period_s
        self._on_change = on_change
        self._version: str | None = None
        self.problem: str | None = None  # the last failure, for the log (once per kind)
        self._released = False  # stopping: never campaign again
        self.rejected: dict[str, int] = {}  # Leases refused whole, by reason (picker_lease_rejected_total)
        self._idle = asyncio.Event()  # no step in flight (the release waits for one, bounded)
        self._idle.set()

    async def run(self) -> None:
        """Until released (or cancelled)."""
        while not self._released:
            await self.step()
            raise_if_cancelled()  # one the HTTP client swallowed (picker/sources/cancel.py)
            await asyncio.sleep(self._retry_period_s)  # the campaign's period, not a synchronisation

    async def step(self) -> None:
        if self._released:  # stopping: the campaign is over
            return
        self._idle.clear()
        try:
            await self._step()
        finally:
            self._idle.set()

    async def _step(self) -> None:
        elector = self.elector
        was = elector.leading
        try:
            await asyncio.wait_for(self._attempt(), elector.attempt_timeout())
            self.problem = None
        except WriteConflict:
            elector.failed()  # another replica wrote in between: read again next time
        except LeaseInvalid as exc:
            self.rejected[exc.reason] = self.rejected.get(exc.reason, 0) + 1
            if str(exc) != self.problem:
                log.warning("%s", exc)
            self.problem = str(exc)
            elector.failed()
        except (ApiFailure, Disconnected, TimeoutError) as exc:
            text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
            if text != self.problem:
                log.warning("leader lease: %s", text)
            self.problem = text
            elector.failed()
        if elector.leading != was:
            log.info(
                "leader lease %s identity=%s", "acquired" if elector.leading else "lost", elector.identity
            )
            self._on_change(elector.leading)

    async def _attempt(self) -> None:
        record, self._version = await self.api.read()
        self.elector.observe(record)
        proposal = self.elector.proposal()
        if proposal is None:
            self.elector.standby()
            return
        self._version = await self.api.write(proposal, self._version)
        self.elector.wrote(proposal)

    async def release(self, timeout_s: float = 2.0) -> None:
        """Hand the Lease back when stopping, so a standby need not wait out its duration. The
        campaign stops first (after the step in flight, whose write may be the last renewal): a
        picker draining for minutes must not take the Lease again and renew it, unready."""
        self._released = True
        with contextlib.suppress(TimeoutError):  # a step stuck past its own timeout: release anyway
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        await self._hand_back(timeout_s)

    async def _hand_back(self, timeout_s: float) -> None:
        record = self.elector.release()
        was = self.elector.leading
        self.elector.leading = False
        if was:
            self._on_change(False)
        if record is None:
            return
        try:
            await asyncio.wait_for(self._release(record), timeout_s)
            log.info("leader lease released identity=%s", self.elector.identity)
        except (WriteConflict, ApiFailure, Disconnected, TimeoutError) as exc:
            log.warning("leader lease not released (%s); a standby takes it when it expires", exc)

    async def _release(self, record: LeaseRecord) -> None:
        """Write the release; on a conflict (this replica's own last renewal landed after the read it
        knew, its answer cut off by the stop) read again and release once more if it still holds it."""
        try:
            await self.api.write(record, self._version)
        except WriteConflict:
            current, self._version = await self.api.read()
            if current is None or current.holder != self.elector.identity:
                raise
            await self.api.write(replace(current, holder="", duration_s=RELEASED_DURATION_S), self._version)
