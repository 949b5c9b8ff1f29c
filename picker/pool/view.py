"""The pool: the desired endpoint set from a source, reconciled with what is still in flight.

State rules (docs "Endpoint states"): a source states the whole desired set, each listed address
READY, DRAINING or NOT_READY; an address it no longer lists becomes GONE and is forgotten once its
last in-flight request ends. An admin drain holds an endpoint the source calls READY in DRAINING
until it is undrained or the source stops listing it. Entering DRAINING opens a drain record
(picker/pool/drain.py); leaving it closes the record.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import Any, assert_never

from picker.pool.deletion_rank import ScaleDownRanks
from picker.pool.drain import DrainCause, DrainEnd, DrainExit, DrainRecord, DrainTotals
from picker.pool.endpoint import Endpoint, EndpointState
from picker.pool.health import Health
from picker.pool.lease import Lease, PullLease
from picker.pool.roles import LLM_D_ROLE, role_of

log = logging.getLogger(__name__)

Clock = Callable[[], float]

_EXITS = {
    EndpointState.READY: DrainExit.READY,
    EndpointState.NOT_READY: DrainExit.NOT_READY,
    EndpointState.GONE: DrainExit.GONE,
}


class UnknownEndpoint(LookupError):
    """The pool has no endpoint at that address."""


class EndpointConflict(ValueError):
    """The request makes no sense in the endpoint's current state (the message says why)."""


class Pool:
    """Endpoints by address. A source states the whole desired set; the pool does the bookkeeping."""

    def __init__(self, clock: Clock = time.monotonic, wall: Clock = time.time, keep_drains: int = 32) -> None:
        self._clock = clock
        self._wall = wall
        self._endpoints: dict[str, Endpoint] = {}
        self._desired: dict[str, EndpointState] = {}
        self._admin_drained: set[str] = set()
        self.source, self._listed_drain = "static", DrainCause.SOURCE  # what a listed drain opens as
        self.totals = DrainTotals()
        self._recent: deque[DrainRecord] = deque(maxlen=keep_drains)
        self._drain_listeners: list[Callable[[DrainRecord], None]] = []
        self._change_listeners: list[Callable[[], None]] = []
        self._forget_listeners: list[Callable[[str], None]] = []
        # answers that failed before their first byte, per endpoint (suspects; drain records)
        self.health = Health(clock=clock)
        self.failed_window_s = 10.0  # a drain record counts failures this long before it opened
        self.scale_down: ScaleDownRanks | None = None  # kube.deletion_cost (pool/deletion_rank.py)
        self.role_labels: tuple[str, ...] = (LLM_D_ROLE,)  # pd.role_labels: where roles are read
        # several pickers (picker/peers/books.py): the other pickers' hand-offs on an address
        self.peer_pulls: Callable[[str], int] = lambda _: 0

    def __len__(self) -> int:
        return len(self._endpoints)

    def get(self, address: str) -> Endpoint | None:
        return self._endpoints.get(address)

    def endpoints(self) -> list[Endpoint]:
        return list(self._endpoints.values())

    def ready(self) -> list[Endpoint]:
        return [e for e in self._endpoints.values() if e.state is EndpointState.READY]

    def in_flight(self) -> int:
        return sum(e.in_flight for e in self._endpoints.values())

    def now(self) -> float:
        return self._clock()

    def wall_time(self, at: float) -> float:
        """A pool-clock time as wall-clock seconds since the epoch (for people and other logs)."""
        return self._wall() - (self._clock() - at)

    def recent_drains(self) -> list[DrainRecord]:
        """Closed drain records, newest first (bounded)."""
        return list(self._recent)

    def drain_summaries(self) -> list[dict[str, Any]]:
        """Every open drain record, newest first, then the recently closed ones (the scorecard's input)."""
        now = self._clock()
        open_records = sorted(
            (e.drain for e in self._endpoints.values() if e.drain is not None),
            key=lambda r: r.started_at,
            reverse=True,
        )
        return [r.summary(now) for r in [*open_records, *self._recent]]

    def admin_drained(self, address: str) -> bool:
        return address in self._admin_drained

    def on_drain_closed(self, listener: Callable[[DrainRecord], None]) -> None:
        self._drain_listeners.append(listener)

    def on_forget(self, listener: Callable[[str], None]) -> None:
        """Called with an address the pool forgets (GONE and its last request ended): whatever was
        kept per endpoint (metric series, indexes) can go with it."""
        self._forget_listeners.append(listener)

    def on_change(self, listener: Callable[[], None]) -> None:
        """Called after any state change (queued requests may fit now, or no longer)."""
        self._change_listeners.append(listener)

    def reconcile(
        self,
        desired: Mapping[str, EndpointState],
        source: str,
        labels: Mapping[str, Mapping[str, str]] | None = None,
        instances: Mapping[str, str] | None = None,
        listed_drain: DrainCause = DrainCause.SOURCE,
    ) -> None:
        """Replace the desired set: listed endpoints take the given state, the rest become GONE.
        `labels`: each address's labels, when the source has them (canary groups); `instances`:
        which instance (pod uid) stands behind each address, when the source knows. `listed_drain`:
        what a listed drain's record says (ADMIN: the source is the admin drains' record, a file)."""
        self.source, self._listed_drain = source, listed_drain
        self._desired = {a: s for a, s in desired.items() if s is not EndpointState.GONE}
        # An admin drain is about one instance: it ends when the source stops listing the address,
        # or lists another instance behind it (a new pod given a former one's IP).
        self._admin_drained &= self._desired.keys()
        for address, instance in (instances or {}).items():
            endpoint = self._endpoints.get(address)
            if endpoint is not None and endpoint.instance not in (None, instance):
                self._admin_drained.discard(address)
        changed = False
        for address in list(dict.fromkeys([*self._desired, *self._endpoints])):
            changed |= self._refresh(address)
        if instances is not None:
            for address, endpoint in self._endpoints.items():
                endpoint.instance = instances.get(address)
        if labels is not None:
            for address, endpoint in self._endpoints.items():
                now = labels.get(address)
                if now != endpoint.labels and (now or endpoint.labels):
                    endpoint.labels = dict(now) if now else None
                    endpoint.role = role_of(endpoint.labels, self.role_labels)
                    if endpoint.role is None:
                        log.warning("endpoint role label names no role address=%s", address)
                    changed = True
        if changed:
            self._changed()

    def apply(self, ready: Iterable[str], draining: Iterable[str] = (), source: str = "static") -> None:
        """`reconcile` from two lists; an address in both is READY."""
        wanted = {a: EndpointState.DRAINING for a in draining}
        wanted.update({a: EndpointState.READY for a in ready})
        self.reconcile(wanted, source)

    def set_state(self, address: str, state: EndpointState) -> None:
        """Change what the source says about one address (GONE: no longer listed)."""
        if state is EndpointState.GONE:
            self._desired.pop(address, None)
            self._admin_drained.discard(address)
        else:
            self._desired[address] = state
        if self._refresh(address):
            self._changed()

    def drain(self, address: str) -> Endpoint:
        """Admin drain: no new work for this endpoint until `undrain`, whatever the source says."""
        endpoint = self._known(address)
        if address not in self._desired:
            raise EndpointConflict(f"{address} is gone: its source no longer lists it")
        self._admin_drained.add(address)
        if self._refresh(address):
            self._changed()
        return endpoint

    def undrain(self, address: str) -> Endpoint:
        """Lift an admin drain; the endpoint takes the state its source gives it again."""
        endpoint = self._known(address)
        if address not in self._admin_drained:
            if endpoint.state is EndpointState.DRAINING:
                raise EndpointConflict(
                    f"{address} drains because its source ({self.source}) says so; "
                    "undrain only lifts an admin drain"
                )
            raise EndpointConflict(
                f"{address} is not drained by the admin API (state {endpoint.state.value})"
            )
        self._admin_drained.discard(address)
        if self._refresh(address):
            self._changed()
        return endpoint

    def lease(self, address: str, pull: bool = False) -> Lease:
        """A claim on `address` for a request picked there; `pull`: a prefill hand-off's
        (picker/pool/lease.py `PullLease`), counted in its `pulls` too."""
        if address not in self._endpoints:
            raise UnknownEndpoint(address)
        self._arrived(address, picked=True, pull=pull)
        return (PullLease if pull else Lease)(self, address, self._clock())

    def _known(self, address: str) -> Endpoint:
        endpoint = self._endpoints.get(address)
        if endpoint is None:
            raise UnknownEndpoint(address)
        return endpoint

    def _effective(self, address: str) -> EndpointState:
        state = self._desired.get(address, EndpointState.GONE)
        if state is EndpointState.READY and address in self._admin_drained:
            return EndpointState.DRAINING
        return state

    def _refresh(self, address: str) -> bool:
        """Bring one endpoint to its effective state; True when something changed."""
        target = self._effective(address)
        now = self._clock()
        endpoint = self._endpoints.get(address)
        if endpoint is None:
            if target is EndpointState.GONE:
                return False
            endpoint = self._endpoints[address] = Endpoint(address, target, now)
            log.info("endpoint added address=%s state=%s source=%s", address, target.value, self.source)
            if target is EndpointState.DRAINING:
                self._open_drain(endpoint, self._cause(address))
            return True
        if endpoint.state is target:
            return False
        log.info(
            "endpoint state address=%s %s->%s in_flight=%d source=%s",
            address,
            endpoint.state.value,
            target.value,
            endpoint.in_flight,
            self.source,
        )
        endpoint.state = target
        endpoint.since = now
        match target:
            case EndpointState.DRAINING:
                if endpoint.drain is None:
                    self._open_drain(endpoint, self._cause(address))
            case EndpointState.READY | EndpointState.NOT_READY:
                if endpoint.drain is not None:
                    self._close_drain(endpoint, _EXITS[target])
            case EndpointState.GONE:
                endpoint.prefix = endpoint.kv = None  # what it cached goes with it
                if endpoint.drain is None and endpoint.in_flight > 0:
                    self._open_drain(endpoint, DrainCause.REMOVED)
                self._forget_if_done(endpoint)
            case _:
                assert_never(target)
        return True

    def _cause(self, address: str) -> DrainCause:
        if self._desired.get(address) is EndpointState.READY and address in self._admin_drained:
            return DrainCause.ADMIN
        return self._listed_drain

    def _open_drain(self, endpoint: Endpoint, cause: DrainCause) -> None:
        now = self._clock()
        endpoint.drain = DrainRecord(
            address=endpoint.address,
            cause=cause,
            source=self.source,
            started_at=now,
            started_wall=self._wall(),
            in_flight_at_start=endpoint.in_flight,
            pulls_at_start=endpoint.pulls,
            failed_before_start=self.health.failed_within(endpoint.address, self.failed_window_s),
        )
        self.totals.opened += 1
        log.info(
            "drain started address=%s cause=%s source=%s in_flight=%d pulls=%d",
            endpoint.address,
            cause.value,
            self.source,
            endpoint.in_flight,
            endpoint.pulls,
        )

    def _close_drain(self, endpoint: Endpoint, exit_state: DrainExit) -> None:
        record = endpoint.drain
        if record is None:
            return
        now = self._clock()
        record.close(exit_state, now)
        endpoint.drain = None
        self.totals.closed[exit_state] += 1
        self._recent.appendleft(record)
        log.info(record.log_line(now))
        for listener in list(self._drain_listeners):
            listener(record)

    def _arrived(
        self, address: str, *, picked: bool, picked_at: float | None = None, pull: bool = False
    ) -> None:
        """One more request on `address`: picked as primary, or served there by Envoy (a fallback
        of a list handed out at `picked_at`)."""
        endpoint = self._endpoints.get(address)
        if endpoint is None:
            # Served by an endpoint the picker never listed (Envoy's fallback policy): track it as
            # GONE so its request is still counted until it ends, and never picked.
            endpoint = self._endpoints[address] = Endpoint(address, EndpointState.GONE, self._clock())
            log.warning("request served by an unlisted endpoint address=%s", address)
        endpoint.picks += picked
        endpoint.in_flight += 1
        endpoint.pulls += pull
        endpoint.arrivals += 1
        if endpoint.state is not EndpointState.READY:
            self.totals.picks_not_ready += 1
            log.warning("new work on a %s endpoint address=%s", endpoint.state.value, address)
        drain = endpoint.drain
        if drain is None:
            return
        if picked_at is not None and picked_at < drain.started_at:
            drain.moved_in_request()  # listed while it was ready; Envoy walked onto it after its drain began
        else:
            drain.picked()
            self.totals.picks_after_start += 1

    def drains_older_than(self, seconds: float) -> list[str]:
        """Endpoints draining for at least `seconds` with requests still on them (their streams may
        move elsewhere rather than hold the drain open: streams.move_after_s)."""
        now = self._clock()
        return [
            e.address
            for e in self._endpoints.values()
            if e.drain is not None
            and e.drain.open
            and e.in_flight > 0
            and now - e.drain.started_at >= seconds
        ]

    def _left(self, address: str, end: DrainEnd | None, at: float | None = None, pull: bool = False) -> None:
        """One request fewer on `address`: it ended (`end`, at `at` or now), or moved away (None);
        `pull`: a prefill hand-off's claim."""
        endpoint = self._endpoints.get(address)
        if endpoint is None:
            log.error("in-flight change for unknown endpoint address=%s", address)
            return
        endpoint.in_flight -= 1
        endpoint.pulls = max(0, endpoint.pulls - pull)
        endpoint.departures += 1
        if end is DrainEnd.CUT:
            endpoint.cut += 1
        elif end is DrainEnd.UPSTREAM_ERROR:
            endpoint.failed += 1
        if endpoint.in_flight < 0:
            log.error("in-flight below zero address=%s", address)
            endpoint.in_flight = 0
        record = endpoint.drain
        if record is not None:
            now = self._clock() if at is None else min(at, self._clock())
            if end is None:
                record.request_moved_away(endpoint.in_flight, now)
            else:
                record.request_ended(end, endpoint.in_flight, now)
                self.totals.ends[end] += 1
        self._forget_if_done(endpoint)

    def _forget_if_done(self, endpoint: Endpoint) -> None:
        if endpoint.state is EndpointState.GONE and endpoint.in_flight == 0:
            self._close_drain(endpoint, DrainExit.GONE)
            del self._endpoints[endpoint.address]
            self.health.forget(endpoint.address)
            log.info("endpoint forgotten address=%s", endpoint.address)
            for listener in list(self._forget_listeners):
                listener(endpoint.address)

    def _changed(self) -> None:
        for listener in list(self._change_listeners):
            listener()
