"""Admin drains shared through one ConfigMap, for picker replicas on Kubernetes.

Why a ConfigMap and not a pod annotation: the picker then needs no `patch` on the model servers'
pods (only get/list/watch/create/update on one ConfigMap of its own), a drain of an address whose
pod is gone or not yet seen stays a record anyone can read (`kubectl get cm -o yaml`), and one object
holds the whole set, so a read-modify-write with its resourceVersion is one optimistic transaction.

The record: ConfigMap `kube.drains_configmap`, key `drained`, a JSON list whose items are "ip:port"
(an operator's drain: whatever runs at that address) or {"address": "ip:port", "pod": "<uid>"} (a
rollback's drain: that pod's only; a later pod given the same IP is not drained, and the entry is
cleared once a replica sees the pod gone or another pod at the address). A drain or undrain through
any replica's admin API writes it (create when missing; on a 409 conflict, read and try again); every
replica lists and watches that one object with the same list/watch loop as its endpoint source
(picker/sources/kube.py) and holds each recorded drain in an admin drain whenever its source lists
the address, so the drain outlives source updates, pod restarts at the same address (an operator's)
and picker restarts, until someone undrains it. The write is conditional on the resourceVersion
read, so the capacity guard's check judges and writes as one step across pickers.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from picker.config.model import canonical_address
from picker.pool import Endpoint, EndpointConflict, EndpointState, Pool, UnknownEndpoint
from picker.sources.drain_store import Check, DrainRecordUnavailable
from picker.sources.kube import Collection, ListWatch, SourceError, WatchSettings

log = logging.getLogger(__name__)

DATA_KEY = "drained"
_WRITE_ATTEMPTS = 5


class WriteConflict(Exception):
    """The ConfigMap changed since it was read (HTTP 409): read again."""


@dataclass(frozen=True, slots=True)
class Record:
    """What the ConfigMap records: drains by address (an operator's) and by pod (a rollback's)."""

    addresses: frozenset[str] = frozenset()
    pinned: frozenset[tuple[str, str]] = frozenset()  # (address, pod uid)

    def __len__(self) -> int:
        return len(self.addresses) + len(self.pinned)

    @property
    def drained(self) -> frozenset[str]:
        """Every address the record drains, whichever instance."""
        return self.addresses | {address for address, _ in self.pinned}

    def holds(self, address: str, instance: str | None) -> bool:
        """Whether the record drains what runs at `address` now (`instance`: its pod, if known)."""
        return address in self.addresses or (instance is not None and (address, instance) in self.pinned)

    def adding(self, address: str, pod: str | None) -> Record:
        if pod is None:
            return Record(self.addresses | {address}, self.pinned)
        return Record(self.addresses, self.pinned | {(address, pod)})

    def removing(self, address: str, pod: str | None) -> Record:
        """Without the pod's drain (`pod`), or without every drain at the address (None)."""
        if pod is not None:
            return Record(self.addresses, self.pinned - {(address, pod)})
        return Record(self.addresses - {address}, frozenset(p for p in self.pinned if p[0] != address))

    def dropping(self, stale: Iterable[tuple[str, str]]) -> Record:
        return Record(self.addresses, self.pinned - set(stale))


class DrainRecordApi(Protocol):
    """The one ConfigMap: listed and watched by the loop, read and written by the admin API."""

    def collection(self) -> Collection: ...

    async def read(self) -> tuple[Record, str | None]:
        """The record and the object's resourceVersion (None: there is no ConfigMap)."""
        ...

    async def write(self, record: Record, version: str | None) -> None:
        """Replace the record (create it when `version` is None); WriteConflict on 409."""
        ...


def parse_record(obj: Mapping[str, Any] | None) -> tuple[Record, list[str]]:
    """The drains a ConfigMap records, and what in it was ignored (problems, for one log line)."""
    if obj is None:
        return Record(), []
    raw = (obj.get("data") or {}).get(DATA_KEY)
    if raw is None:
        return Record(), []
    try:
        listed = json.loads(raw)
    except ValueError:
        return Record(), [f"data.{DATA_KEY} is not JSON"]
    if not isinstance(listed, list):
        return Record(), [f"data.{DATA_KEY} is not a JSON list"]
    addresses: set[str] = set()
    pinned: set[tuple[str, str]] = set()
    problems = []
    for item in listed:
        try:
            if isinstance(item, dict):
                pod = item.get("pod")
                if set(item) != {"address", "pod"} or not isinstance(pod, str) or not pod:
                    raise ValueError(f"{item!r} is not {{address, pod}}")
                pinned.add((canonical_address(str(item["address"])), pod))
            else:
                addresses.add(canonical_address(str(item)))
        except ValueError as exc:
            problems.append(f"data.{DATA_KEY}: {exc}")
    return Record(frozenset(addresses), frozenset(pinned)), problems


def render_record(record: Record) -> str:
    items: list[Any] = sorted(record.addresses)
    items += [{"address": address, "pod": pod} for address, pod in sorted(record.pinned)]
    return json.dumps(items)


class DrainRecord:
    """The loop's store (kube.Store): the drains the watched ConfigMap records."""

    def __init__(self) -> None:
        self.current = Record()

    @property
    def drained(self) -> frozenset[str]:
        return self.current.drained

    def __len__(self) -> int:
        return len(self.current)

    def replace(self, objects: Iterable[Mapping[str, Any]]) -> list[str]:
        found = list(objects)
        self.current, problems = parse_record(found[0] if found else None)
        return problems

    def apply(self, event_type: str, obj: Mapping[str, Any]) -> list[str]:
        self.current, problems = parse_record(None if event_type == "DELETED" else obj)
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
        self._stale: set[tuple[str, str]] = set()
        pool.on_change(self.apply)
        pool.on_forget(self._forgotten)

    async def drain(self, address: str, *, pod: str | None = None, check: Check | None = None) -> Endpoint:
        endpoint = self._pool.get(address)
        if endpoint is None:
            raise UnknownEndpoint(address)
        if endpoint.state is EndpointState.GONE:
            raise EndpointConflict(f"{address} is gone: its source no longer lists it")
        await self._update(lambda record: record.adding(address, pod), check=check)
        self.record.current = self.record.current.adding(address, pod)  # at once here; the watch confirms
        self.apply()
        return endpoint

    async def undrain(self, address: str, *, pod: str | None = None) -> Endpoint:
        endpoint = self._pool.get(address)
        recorded = address in self.record.drained
        if endpoint is None and not recorded:
            raise UnknownEndpoint(address)
        if not recorded and not self._pool.admin_drained(address):
            return self._pool.undrain(address)  # raises the pool's own conflict (not drained, or source)
        await self._update(lambda record: record.removing(address, pod))
        self.record.current = self.record.current.removing(address, pod)
        self.apply()
        if endpoint is None:
            raise UnknownEndpoint(address)  # the record is lifted; the pool has no such endpoint
        return endpoint

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
                        pinned[0] == address
                        and endpoint.instance is not None
                        and (endpoint.state is EndpointState.GONE or endpoint.instance != pinned[1])
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
        self._mark_stale({p for p in self.record.current.pinned if p[0] == address})

    def _mark_stale(self, stale: set[tuple[str, str]]) -> None:
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
                log.info("drain record cleared %d drain(s) of pods gone: %s", len(stale), sorted(stale))
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
