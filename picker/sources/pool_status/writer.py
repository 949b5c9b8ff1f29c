"""The writer: the picker's reading of its pool (picker/pool/status.py) written on the InferencePool
as a `Ready` condition, and events on changes of state, drains and rollbacks.

Where the condition goes: `status.parents[]` is the only place the v1 InferencePool has for
conditions (a top-level `status.conditions` is not in its schema and would be pruned). Writing into a
gateway controller's entry would fight that controller, which owns it; so the picker keeps one entry
of its own, whose `parentRef` names the picker as the pool does (`spec.endpointPickerRef`: group,
kind, name), holding one condition of type `Ready` (the name proposed upstream, GIE #2925). Every
picker of the pool, and a restarted one, names the same entry: a new writer replaces it, never adds
one. The list is atomic: read, replace that entry, write back under the read's resourceVersion
(api.py says why a merge patch and not server-side apply).

Bounded: a write only when the (state, reason) to show differs from what the entry says, after the
view has held still for `debounce_s` (a burst of pod changes is one look; a change of the endpoint
source's problem wakes it too); every `resync_s` the entry is read again and rewritten only if
someone removed or changed it. A write that a controller races (409) is read and tried again at once,
once. Events: one per change of
state, one per drain this picker sees start (at most `_MAX_DRAIN_EVENTS` a look, the rest summed up
in one), one per rollback of this picker's canary.

One writer per pool, as kube.deletion_cost (deletion_cost.writer_gate): the Lease's holder, or the
first of the linked peers; the others stand by, looking at the gate every `_STANDBY_CHECK_S` (a look
that stands by does no I/O), so a new writer writes within about a second of a handover. At shutdown
the writer writes `Stopping` unless another picker serves on (a linked peer in another pod); then it
records the `PickerStopping` event alone and leaves the condition to it. A standby for the Lease is
no such picker (only the holder is ready, and there may be no standby at all): the leader writes
`Stopping`, and a standby's first look as the new holder writes `Ready`.

Permission: asked at start (SelfSubjectAccessReview) for `patch inferencepools/status` and `create
events`; with neither the picker refuses to start (PoolStatusRefused); with one, it does what that
one allows and says so once (no condition: events only, as the issue asks where the status cannot be
written). An API server that does not serve the review (404) answers neither way: the picker says
so once, never asks again, and tries both, each failure counted (writes and events by result).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from picker.config.model import ConfigError
from picker.contract.pool_status import CONDITION_TYPE, STATE_EVENT, PoolEvent, PoolState
from picker.pool import Pool
from picker.pool.status import Phase, PoolHealth, pool_health
from picker.sources.cancel import raise_if_cancelled
from picker.sources.kube import ReviewNotServed, SourceError
from picker.sources.pool_status.body import condition, event_body, parent_ref, same_ref, shows

log = logging.getLogger(__name__)

_MAX_DRAIN_EVENTS = 5
_MAX_PARENTS = 32  # the CRD's maxItems
_STANDBY_CHECK_S = 1.0  # a picker standing by looks at the writer gate this often (no I/O)


class PoolStatusRefused(ConfigError):
    """kube.pool_status is on and the API server lets this picker neither write the pool's status
    nor create events."""


class StatusApi(Protocol):
    """What the writer needs of the API server (api.py `LightkubePoolStatusApi`)."""

    namespace: str

    async def may(self, verb: str, resource: str, group: str, subresource: str = "") -> tuple[bool, str]: ...

    async def read(self, name: str) -> tuple[list[Mapping[str, Any]], str, str, int, Mapping[str, Any]]: ...

    async def write(self, name: str, parents: list[Mapping[str, Any]], version: str) -> str: ...

    async def record(self, event: Mapping[str, Any]) -> None: ...

    async def aclose(self) -> None: ...


@dataclass(frozen=True)
class Grants:
    """What the API server lets this picker do (None in `verified`: it could not be asked yet)."""

    status: bool
    events: bool


_LET_THE_WRITES_SAY = "the review is not served: not asked again, the writes will say what is allowed"


async def verified(api: StatusApi) -> Grants | None:
    """At start: the grants; None when they could not be asked (asked again before the first write);
    both when the review is not served (the writes say, their failures counted); PoolStatusRefused
    when neither is granted."""
    try:
        return await _asked(api)
    except ReviewNotServed as exc:
        log.warning("kube.pool_status: %s; %s", exc, _LET_THE_WRITES_SAY)
        return Grants(True, True)
    except SourceError as exc:
        log.warning("kube.pool_status: cannot ask what this picker may write (%s); asking again later", exc)
        return None


async def _asked(api: StatusApi) -> Grants:
    status = await api.may("patch", "inferencepools", "inference.networking.k8s.io", "status")
    events = await api.may("create", "events", "events.k8s.io")
    return _grants(api.namespace, status, events)


def _grants(namespace: str, status: tuple[bool, str], events: tuple[bool, str]) -> Grants:
    if not status[0] and not events[0]:
        raise PoolStatusRefused(
            f"kube.pool_status: this picker may neither patch inferencepools/status nor create events in "
            f"namespace {namespace}; grant them (config/k8s/pool-status/rbac.yaml) or turn the feature off"
        )
    if not status[0]:
        log.warning(
            "kube.pool_status: may not patch inferencepools/status in %s (%s): events only, no condition",
            namespace,
            status[1] or "denied",
        )
    if not events[0]:
        log.warning("kube.pool_status: may not create events in %s: the condition only", namespace)
    return Grants(status[0], events[0])


class PoolStatusWriter:
    """Looks at the pool when it changes (debounced) and writes what changed; counts it all."""

    def __init__(
        self,
        api: StatusApi,
        pool: Pool,
        name: str,
        *,
        identity: str,
        debounce_s: float,
        resync_s: float,
        writing: Callable[[], bool] = lambda: True,
        successor: Callable[[], bool] = lambda: False,
        grants: Grants | None = Grants(True, True),
        problem: Callable[[], str | None] = lambda: None,
        drained_by: Callable[[], Mapping[str, Sequence[object]]] = dict,
        rollbacks: Callable[[], tuple[int, str | None]] = lambda: (0, None),
        wall: Callable[[], float] = time.time,
    ) -> None:
        self._api, self._pool, self.name = api, pool, name
        self.identity = identity
        self.uid = ""  # the pool's, from its last read: the events' `regarding.uid`
        self.debounce_s, self.resync_s = debounce_s, resync_s
        self._writing, self._successor = writing, successor
        self.grants, self._problem = grants, problem
        self._drained_by, self._rollbacks, self._wall = drained_by, rollbacks, wall
        self.phase = Phase.SERVING
        self.handing_over = False  # stopping, with a successor to write the condition
        self.writer = False
        self.shown: tuple[PoolState, str] | None = None  # (state, reason) the entry says, as last read
        self.announced: PoolState | None = None  # the state the last state event said
        self._drains: set[tuple[str, float]] = self._open_drains()
        self._rolled_back = rollbacks()[0]
        self._wake = asyncio.Event()
        self._lock = asyncio.Lock()  # one look at a time: run()'s and stopping()'s
        pool.on_change(self._wake.set)
        self.writes: Counter[str] = Counter()  # written | unchanged | conflict | failed
        self.events: Counter[str] = Counter()  # created | failed
        self.skipped: Counter[str] = Counter()  # standby
        self.problem: str | None = None  # the last failure, logged once

    def figures(self) -> tuple[bool, Counter[str], Counter[str]]:
        """For the metrics: (writing now, condition writes by result, events by result)."""
        return self.writer, self.writes, self.events

    def health(self) -> PoolHealth:
        return pool_health(self._pool.endpoints(), self.phase, self._problem())

    def wake(self) -> None:
        """A look soon (debounced): something the pool view does not show changed (the source's problem,
        the writer gate)."""
        self._wake.set()

    async def step(self, *, resync: bool = False) -> bool:
        """One look: events for what happened, the condition if it must change. True: written."""
        async with self._lock:
            return await self._look(resync)

    async def _look(self, resync: bool) -> bool:
        if not self._writing():
            if self.writer:
                log.info("kube.pool_status: another picker writes the pool's status now; standing by")
            self.writer, self.shown, self.announced = False, None, None
            self._drains, self._rolled_back = self._open_drains(), self._rollbacks()[0]
            self.skipped["standby"] += 1
            return False
        if not self.writer:
            log.info("kube.pool_status: this picker writes InferencePool %s's status", self.name)
        self.writer = True
        if self.grants is None and not await self._ask():
            return False
        health = self.health()
        if self.grants is not None and self.grants.events:
            await self._announce(health)
        if self.grants is None or not self.grants.status or self.handing_over:
            return False
        if not resync and self.shown == (health.state, health.reason.value):
            return False
        return await self._write(health)

    async def _write(self, health: PoolHealth) -> bool:
        """The entry written if it must change; a conflict (a controller wrote meanwhile) is read and
        tried again at once, once (then left to the next look)."""
        for attempt in range(2):
            try:
                written = await self._write_once(health)
            except SourceError as exc:
                conflict = exc.kind == "conflict"
                self.writes["conflict" if conflict else "failed"] += 1
                if conflict and attempt == 0:
                    continue
                if not conflict:
                    self._failed(exc)
                return False
            if written is None:  # no room for the entry: no state shown
                return False
            self.shown = (health.state, health.reason.value)
            if written:
                self.writes["written"] += 1
                self.problem = None
                log.info(
                    "kube.pool_status: InferencePool %s %s=%s reason=%s",
                    self.name,
                    CONDITION_TYPE,
                    health.status,
                    health.reason.value,
                )
            return written
        return False

    async def _write_once(self, health: PoolHealth) -> bool | None:
        """Read, replace the picker's entry, write back under the read's version. False: the entry says
        it already; None: there is no room for it (SourceError from the API)."""
        parents, version, self.uid, generation, spec = await self._api.read(self.name)
        ref = parent_ref(spec, self.name, self._api.namespace)
        ours = next((p for p in parents if same_ref(p, ref)), None)
        wanted = condition(health, generation, ours, self._wall())
        if ours is not None and shows(ours, wanted):
            self.writes["unchanged"] += 1
            return False
        others = [p for p in parents if p is not ours]
        if len(others) >= _MAX_PARENTS:
            self._failed(f"InferencePool {self.name} has {len(others)} parents: no room for the picker's")
            self.writes["failed"] += 1
            return None
        await self._api.write(self.name, [*others, {"parentRef": ref, "conditions": [wanted]}], version)
        return True

    async def _announce(self, health: PoolHealth) -> None:
        now = self._open_drains()
        fresh = sorted(now - self._drains)
        self._drains = now
        causes = self._drained_by() if fresh else {}
        for address, _ in fresh[:_MAX_DRAIN_EVENTS]:
            endpoint = self._pool.get(address)
            record = endpoint.drain if endpoint is not None else None
            why = record.cause.value if record is not None else "source"
            held = ", ".join(str(c) for c in causes.get(address, ()))
            note = f"endpoint {address} draining (cause {why}{f', by {held}' if held else ''})"
            if record is not None:
                note += f", {record.in_flight_at_start} request(s) in flight"
            await self._event(PoolEvent.DRAINING, note)
        if len(fresh) > _MAX_DRAIN_EVENTS:
            rest = [a for a, _ in fresh[_MAX_DRAIN_EVENTS:]]
            await self._event(PoolEvent.DRAINING, f"{len(rest)} more endpoints draining: {', '.join(rest)}")
        count, reason = self._rollbacks()
        if count > self._rolled_back:
            self._rolled_back = count
            await self._event(PoolEvent.ROLLED_BACK, f"canary rolled back: {reason or 'aborted'}")
        if health.state is not self.announced and health.state in STATE_EVENT:  # after its causes
            self.announced = health.state
            note = f"{health.reason.value}: {health.message}"
            await self._event(STATE_EVENT[health.state], note)

    async def _event(self, reason: PoolEvent, note: str) -> None:
        try:
            if not self.uid:  # the pool's uid, read once (a status write reads it too)
                self.uid = (await self._api.read(self.name))[2]
            body = event_body(
                reason,
                note,
                pool=self.name,
                namespace=self._api.namespace,
                uid=self.uid,
                instance=self.identity,
                at=self._wall(),
            )
            await self._api.record(body)
        except SourceError as exc:
            self.events["failed"] += 1
            self._failed(exc)
            return
        self.events["created"] += 1

    def _open_drains(self) -> set[tuple[str, float]]:
        return {(e.address, e.drain.started_at) for e in self._pool.endpoints() if e.drain is not None}

    async def _ask(self) -> bool:
        try:
            self.grants = await _asked(self._api)
        except ReviewNotServed as exc:
            self._failed(f"{exc}; {_LET_THE_WRITES_SAY}")
            self.grants = Grants(True, True)
        except (SourceError, PoolStatusRefused) as exc:
            self._failed(exc)
            return False
        return True

    def _failed(self, problem: object) -> None:
        text = str(problem)
        if text != self.problem:
            log.warning("kube.pool_status: %s", text)
        self.problem = text

    async def stopping(self, timeout_s: float) -> None:
        """Shutdown's first step, within `timeout_s`, while still the writer: with a successor (a linked
        peer that serves on) the `PickerStopping` event alone, the condition left to it (its first
        look writes what it sees); without one, the entry says Stopping too."""
        self.phase = Phase.STOPPING
        self.handing_over = self._successor()
        try:
            await asyncio.wait_for(self.step(), timeout_s)
        except TimeoutError:
            log.warning("kube.pool_status: Stopping not written within %.1f s", timeout_s)

    async def run(self) -> None:
        """Forever: a look after each change of the pool once it held still for `debounce_s`, a re-read
        every `resync_s`, and while standing by a look at the writer gate every `_STANDBY_CHECK_S`. A
        look that raises is logged; the next one runs."""
        resync = True
        while True:
            raise_if_cancelled()  # one the HTTP client swallowed (picker/sources/cancel.py)
            self._wake.clear()  # before the look: a change while it awaits the API server gets the next
            try:
                await self.step(resync=resync)
            except Exception:
                log.exception("kube.pool_status look failed; the next one runs on the next change")
            wait_s = self.resync_s if self.writer else min(self.resync_s, _STANDBY_CHECK_S)
            try:
                await asyncio.wait_for(self._wake.wait(), wait_s)
                resync = False
            except TimeoutError:
                resync = True
                continue
            # debounce: until the pool has held still for debounce_s (at most 4 of them: a pool that
            # never holds still is still reported)
            for _ in range(4):
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), self.debounce_s)
                except TimeoutError:
                    break
