"""Admin drains shared through one ConfigMap, for picker replicas on Kubernetes.

Why a ConfigMap and not a pod annotation: the picker then needs no `patch` on the model servers'
pods (only get/list/watch/create/update on one ConfigMap of its own), a drain of an address whose
pod is gone or not yet seen stays a record anyone can read (`kubectl get cm -o yaml`), and one object
holds the whole set, so a read-modify-write with its resourceVersion is one optimistic transaction.

The record: ConfigMap `kube.drains_configmap`, key `drained`, a JSON list of "ip:port". A drain or
undrain through any replica's admin API writes it (create when missing; on a 409 conflict, read and
try again); every replica lists and watches that one object with the same list/watch loop as its
endpoint source (picker/sources/kube.py) and holds each recorded address in an admin drain whenever
its source lists it, so the drain outlives source updates, pod restarts at the same address and
picker restarts, until someone undrains it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

from picker.config import canonical_address
from picker.pool import Endpoint, EndpointConflict, EndpointState, Pool, UnknownEndpoint
from picker.sources.drain_store import DrainRecordUnavailable
from picker.sources.kube import Collection, ListWatch, SourceError, WatchSettings

log = logging.getLogger(__name__)

DATA_KEY = "drained"
_WRITE_ATTEMPTS = 5


class WriteConflict(Exception):
    """The ConfigMap changed since it was read (HTTP 409): read again."""


class DrainRecordApi(Protocol):
    """The one ConfigMap: listed and watched by the loop, read and written by the admin API."""

    def collection(self) -> Collection: ...

    async def read(self) -> tuple[set[str], str | None]:
        """The recorded addresses and the object's resourceVersion (None: there is no ConfigMap)."""
        ...

    async def write(self, drained: set[str], version: str | None) -> None:
        """Replace the record (create it when `version` is None); WriteConflict on 409."""
        ...


def parse_record(obj: Mapping[str, Any] | None) -> tuple[set[str], list[str]]:
    """The addresses a ConfigMap records, and what in it was ignored (problems, for one log line)."""
    if obj is None:
        return set(), []
    raw = (obj.get("data") or {}).get(DATA_KEY)
    if raw is None:
        return set(), []
    try:
        listed = json.loads(raw)
    except ValueError:
        return set(), [f"data.{DATA_KEY} is not JSON"]
    if not isinstance(listed, list):
        return set(), [f"data.{DATA_KEY} is not a JSON list"]
    drained: set[str] = set()
    problems = []
    for item in listed:
        try:
            drained.add(canonical_address(str(item)))
        except ValueError as exc:
            problems.append(f"data.{DATA_KEY}: {exc}")
    return drained, problems


def render_record(drained: Iterable[str]) -> str:
    return json.dumps(sorted(drained))


class DrainRecord:
    """The loop's store (kube.Store): the addresses the watched ConfigMap records."""

    def __init__(self) -> None:
        self.drained: set[str] = set()

    def __len__(self) -> int:
        return len(self.drained)

    def replace(self, objects: Iterable[Mapping[str, Any]]) -> list[str]:
        found = list(objects)
        self.drained, problems = parse_record(found[0] if found else None)
        return problems

    def apply(self, event_type: str, obj: Mapping[str, Any]) -> list[str]:
        self.drained, problems = parse_record(None if event_type == "DELETED" else obj)
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
        pool.on_change(self.apply)

    async def drain(self, address: str) -> Endpoint:
        endpoint = self._pool.get(address)
        if endpoint is None:
            raise UnknownEndpoint(address)
        if endpoint.state is EndpointState.GONE:
            raise EndpointConflict(f"{address} is gone: its source no longer lists it")
        await self._update(address, add=True)
        self.record.drained.add(address)  # at once here; the watch confirms it
        self.apply()
        return endpoint

    async def undrain(self, address: str) -> Endpoint:
        endpoint = self._pool.get(address)
        if endpoint is None and address not in self.record.drained:
            raise UnknownEndpoint(address)
        if address not in self.record.drained and not self._pool.admin_drained(address):
            return self._pool.undrain(address)  # raises the pool's own conflict (not drained, or source)
        await self._update(address, add=False)
        self.record.drained.discard(address)
        self.apply()
        if endpoint is None:
            raise UnknownEndpoint(address)  # the record is lifted; the pool has no such endpoint
        return endpoint

    def apply(self) -> None:
        """Hold every recorded address the source lists in an admin drain; lift the others."""
        if self._applying:
            return  # the pool's change announcements while this runs
        self._applying = True
        try:
            for endpoint in self._pool.endpoints():
                address = endpoint.address
                wanted = address in self.record.drained
                held = self._pool.admin_drained(address)
                if wanted and not held and endpoint.state is not EndpointState.GONE:
                    try:
                        self._pool.drain(address)
                    except EndpointConflict:
                        pass  # not listed by the source any more: applied again if it returns
                elif held and not wanted:
                    self._pool.undrain(address)
        finally:
            self._applying = False

    async def _update(self, address: str, *, add: bool) -> None:
        for _ in range(_WRITE_ATTEMPTS):
            try:
                drained, version = await self._api.read()
                wanted = drained | {address} if add else drained - {address}
                if wanted == drained and version is not None:
                    return
                await self._api.write(wanted, version)
                log.info("drain record %s %s", "added" if add else "removed", address)
                return
            except WriteConflict:
                continue  # another replica wrote in between: read again
            except SourceError as exc:
                raise DrainRecordUnavailable(f"the drain record cannot be changed now ({exc})") from None
        raise DrainRecordUnavailable(f"the drain record kept changing ({_WRITE_ATTEMPTS} attempts)")
