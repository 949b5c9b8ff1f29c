"""Admin drains shared through one ConfigMap, for picker replicas on Kubernetes.

Why a ConfigMap and not a pod annotation: the picker then needs no `patch` on the model servers'
pods (only get/list/watch/create/update on one ConfigMap of its own), a drain of an address whose
pod is gone or not yet seen stays a record anyone can read (`kubectl get cm -o yaml`), and one object
holds the whole set, so a read-modify-write with its resourceVersion is one optimistic transaction.

The record: ConfigMap `kube.drains_configmap`, key `drained`, a JSON list of drains. An item is
"ip:port" (an operator's drain of whatever runs at that address) or an object:
    {"address": "ip:port", "pod": "<uid>"?, "cause": ...?, "rollout": ...?}
`pod`: that pod's drain only (a rollback's: a later pod given the same IP is not drained, and the
item is cleared once a replica sees the pod gone or another pod at the address). `cause`,
`rollout`: who made it (picker/sources/drain_causes.py; no cause: the operator's, as every item
written before causes were). One address may hold several drains (an operator's and a rollback's):
it is drained while any holds. An item that does not validate whole is not applied, counted
(`picker_drain_record_rejected_total`) and kept as it is when a picker rewrites the record (a newer
picker's, perhaps). A drain or undrain through
any replica's admin API writes it (create when missing; on a 409 conflict, read and try again); every
replica lists and watches that one object with the same list/watch loop as its endpoint source
(picker/sources/kube.py) and holds each recorded drain in an admin drain whenever its source lists
the address, so the drain outlives source updates, pod restarts at the same address (an operator's)
and picker restarts, until someone undrains it. The write is conditional on the resourceVersion
read, so the capacity guard's check judges and writes as one step across pickers.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

from picker.pool import Endpoint, EndpointConflict, EndpointState, Pool, UnknownEndpoint
from picker.sources.drain_causes import OPERATOR, Cause, CauseKind, Rejections
from picker.sources.drain_record import DATA_KEY, Drain, Record, parse_record, render_record
from picker.sources.drain_store import Check, DrainRecordUnavailable, Lifted
from picker.sources.kube import Collection, ListWatch, SourceError, WatchSettings

__all__ = [
    "DATA_KEY",
    "ConfigMapDrains",
    "DrainRecordApi",
    "Record",
    "WriteConflict",
    "parse_record",
    "render_record",
]

log = logging.getLogger(__name__)

_WRITE_ATTEMPTS = 5


class WriteConflict(Exception):
    """The ConfigMap changed since it was read (HTTP 409): read again."""


class DrainRecordApi(Protocol):
    """The one ConfigMap: listed and watched by the loop, read and written by the admin API."""

    def collection(self) -> Collection: ...

    async def read(self) -> tuple[Record, str | None]:
        """The record and the object's resourceVersion (None: there is no ConfigMap)."""
        ...

    async def write(self, record: Record, version: str | None) -> None:
        """Replace the record (create it when `version` is None); WriteConflict on 409."""
        ...


class DrainRecord:
    """The loop's store (kube.Store): the drains the watched ConfigMap records."""

    def __init__(self) -> None:
        self.current = Record()
        self.rejected = Rejections()

    @property
    def drained(self) -> frozenset[str]:
        return self.current.drained

    def __len__(self) -> int:
        return len(self.current)

    def replace(self, objects: Iterable[Mapping[str, Any]]) -> list[str]:
        found = list(objects)
        self.current, problems = parse_record(found[0] if found else None, self.rejected)
        return problems

    def apply(self, event_type: str, obj: Mapping[str, Any]) -> list[str]:
        self.current, problems = parse_record(None if event_type == "DELETED" else obj, self.rejected)
        return problems


class ConfigMapDrains:
    """A DrainStore (picker/sources/drain_store.py) over one ConfigMap every picker replica watches."""

    shared = True

    def __init__(
        self,
        api: DrainRecordApi,
        pool: Pool,
        settings: WatchSettings,
        on_event: Any = lambda _: None,
    ) -> None:
        self._api = api
        self._pool = pool
        self.record = DrainRecord()
        self.watch = ListWatch(
            api.collection(),
            self.record,
            settings,
            what="configmaps",
            publish=self.apply,
            on_event=on_event,
        )
        self._applying = False
        self._clearing: asyncio.Task[None] | None = None
        self._stale: set[Drain] = set()
        pool.on_change(self.apply)
        pool.on_forget(self._forgotten)

    @property
    def rejected(self) -> Mapping[str, int]:
        return self.record.rejected.counts

    def drained_by(self) -> dict[str, list[Cause]]:
        """Who drains each address this replica's pool holds drained by the record."""
        shown: dict[str, list[Cause]] = {}
        for endpoint in self._pool.endpoints():
            causes = self.record.current.causes(endpoint.address, endpoint.instance)
            if causes:
                shown[endpoint.address] = causes
        return shown

    async def drain(
        self, address: str, *, cause: Cause = OPERATOR, pod: str | None = None, check: Check | None = None
    ) -> Endpoint:
        endpoint = self._pool.get(address)
        if endpoint is None:
            raise UnknownEndpoint(address)
        if endpoint.state is EndpointState.GONE:
            raise EndpointConflict(f"{address} is gone: its source no longer lists it")
        made = Drain(address, cause, pod)
        await self._update(lambda record: record.adding(made), check=check)
        self.record.current = self.record.current.adding(made)  # at once here; the watch confirms
        self.apply()
        return endpoint

    async def undrain(self, address: str, *, only: CauseKind | None = None, pod: str | None = None) -> Lifted:
        endpoint = self._pool.get(address)
        recorded = address in self.record.drained
        if endpoint is None and not recorded:
            raise UnknownEndpoint(address)
        if not recorded and not self._pool.admin_drained(address):
            return Lifted(
                self._pool.undrain(address), ()
            )  # raises the pool's conflict (not drained, or source)
        lifted: list[Drain] = []

        def change(record: Record) -> Record:
            lifted[:] = record.matching(address, only, pod)
            if not lifted and only is not None:
                held = ", ".join(
                    str(c) for c in sorted({d.cause for d in record.matching(address, None)}, key=str)
                )
                raise EndpointConflict(
                    f"{address} holds no {only.value} drain (drained by: {held or 'nobody'})"
                )
            return record.dropping(lifted)

        await self._update(change)
        here = self.record.current  # at once here, as the record now reads; the watch confirms
        self.record.current = here.dropping([*lifted, *here.matching(address, only, pod)])
        self.apply()
        if endpoint is None:
            raise UnknownEndpoint(address)  # the record is lifted; the pool has no such endpoint
        return Lifted(endpoint, tuple(sorted({d.cause for d in lifted}, key=str)))

    async def lift(self, cause: Cause) -> list[str]:
        """Remove every drain of `cause` from the record, in one write; the addresses it held."""
        lifted: list[str] = []

        def change(record: Record) -> Record:
            lifted[:] = sorted({d.address for d in record.drains if d.cause == cause})
            return record.lifting(cause)

        await self._update(change)
        self.record.current = self.record.current.lifting(cause)
        self.apply()
        return lifted

    def apply(self) -> None:
        """Hold every recorded drain the source lists in an admin drain; lift the others. A pod's
        drain whose pod is gone (its address gone, or another pod's now) is cleared from the record."""
        if self._applying:
            return  # the pool's change announcements while this runs
        self._applying = True
        try:
            record, stale = self.record.current, set()
            for endpoint in self._pool.endpoints():
                address = endpoint.address
                for pinned in record.pinned:
                    if (
                        pinned.address == address
                        and endpoint.instance is not None
                        and (endpoint.state is EndpointState.GONE or endpoint.instance != pinned.pod)
                    ):
                        stale.add(pinned)
                wanted = record.holds(address, endpoint.instance)
                held = self._pool.admin_drained(address)
                if wanted and not held and endpoint.state is not EndpointState.GONE:
                    try:
                        self._pool.drain(address)
                    except EndpointConflict:
                        pass  # not listed by the source any more: applied again if it returns
                elif held and not wanted:
                    self._pool.undrain(address)
            self._mark_stale(stale)
        finally:
            self._applying = False

    def _forgotten(self, address: str) -> None:
        """The source stopped listing `address` and its last request ended: no pod runs there, so
        every pod's drain recorded at it is over."""
        self._mark_stale({p for p in self.record.current.pinned if p.address == address})

    def _mark_stale(self, stale: set[Drain]) -> None:
        self._stale |= stale
        if self._stale and self._clearing is None:
            self._clearing = _spawn(self._clear())

    async def _clear(self) -> None:
        """Remove pods' drains whose pods are gone (any replica may; the write is conditional)."""
        try:
            while self._stale:
                stale = frozenset(self._stale)
                await self._update(lambda record, gone=stale: record.dropping(gone))
                self._stale -= stale
                log.info(
                    "drain record cleared %d drain(s) of pods gone: %s",
                    len(stale),
                    sorted(f"{d.address} pod={d.pod} cause={d.cause}" for d in stale),
                )
        except DrainRecordUnavailable as exc:
            log.warning("drain record: drains of pods gone not cleared now (%s); tried again later", exc)
            self._stale.clear()  # found again at the next change
        finally:
            self._clearing = None

    async def _update(self, change: Callable[[Record], Record], *, check: Check | None = None) -> None:
        for _ in range(_WRITE_ATTEMPTS):
            try:
                record, version = await self._api.read()
                wanted = change(record)
                if wanted == record and version is not None:
                    return
                if check is not None:
                    check(record.drained)  # judged on the record this write replaces, or not at all
                await self._api.write(wanted, version)
                log.info("drain record written: %d drain(s)", len(wanted))
                return
            except WriteConflict:
                continue  # another replica wrote in between: read again
            except SourceError as exc:
                raise DrainRecordUnavailable(f"the drain record cannot be changed now ({exc})") from None
        raise DrainRecordUnavailable(f"the drain record kept changing ({_WRITE_ATTEMPTS} attempts)")


def _spawn(work: Any) -> asyncio.Task[None] | None:
    """A background task when a loop runs (the pool announces changes from sync code too)."""
    try:
        return asyncio.get_running_loop().create_task(work)
    except RuntimeError:
        work.close()
        return None
