"""Where an admin drain is recorded: in this replica's pool only, or where every picker replica reads it.

Why: `config/k8s/picker.yaml` runs two pickers behind one Service; a `POST .../drain` reaches one of
them, and a drain only that one knows about lets the other keep picking the endpoint. A shared
record makes every replica's admin API change the one place all of them read:

- `EndpointsFileDrains` (no Kubernetes): the endpoints file itself. A drain rewrites it atomically
  (a temp file renamed over it, under an flock so two replicas on one host never lose each other's
  write) with `draining: true` on that entry; undrain removes the flag. This replica re-reads it at
  once, the others at their next poll (`pool.endpoints_file_poll_s`, 1 s). The drain is then the
  file's (cause `source`): it lasts until someone undrains it or edits the file, restarts included.
  The rewrite keeps every entry and its order, not comments.
- `ConfigMapDrains` (Kubernetes, `kube.drains_configmap`; picker/sources/kube_drains.py): one
  ConfigMap every replica lists and watches.
- `LocalDrains`: the pool's own admin drain (a static list, or Kubernetes without the ConfigMap).
"""

from __future__ import annotations

import fcntl
import logging
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import yaml

from picker.config.model import canonical_address
from picker.pool import Endpoint, EndpointConflict, Pool, UnknownEndpoint
from picker.sources.static_file import EndpointsFile, EndpointsFileError, parse_endpoints

log = logging.getLogger(__name__)


class DrainRefused(Exception):
    """A drain's check (the capacity guard) refused it against the record it would have changed."""

    def __init__(self, reason: str, figures: dict[str, object]) -> None:
        super().__init__(reason)
        self.reason, self.figures = reason, figures


# Judges a drain against the shared record it is about to change, inside that change: called with
# the addresses the record drains now (ones this replica may not have applied yet); raises
# DrainRefused. A store whose write is conditional (the ConfigMap's resourceVersion, the file's
# lock) judges and writes as one step, so two pickers' drains cannot both pass on the same record.
Check = Callable[[frozenset[str]], None]


class DrainStore(Protocol):
    """Admin drain / undrain of one endpoint (canonical address); raises UnknownEndpoint (404) or
    EndpointConflict (409) like `Pool.drain`, and returns the endpoint as this replica now sees it.

    `pod`: the drain is that instance's (a rollback's), not the address's: it does not hold a later
    pod given the same IP, and is cleared once the pod is gone, where the store can tell
    (the ConfigMap store, over a source that knows pods). An undrain with `pod` lifts only that."""

    shared: bool  # True: every picker replica reading the same source sees the change

    async def drain(
        self, address: str, *, pod: str | None = None, check: Check | None = None
    ) -> Endpoint: ...

    async def undrain(self, address: str, *, pod: str | None = None) -> Endpoint: ...


class DrainRecordUnavailable(RuntimeError):
    """The shared record cannot be read or written now (an API server down): retry (503)."""


class LocalDrains:
    """Drains that live in this replica's pool only."""

    shared = False

    def __init__(self, pool: Pool) -> None:
        self._pool = pool

    async def drain(self, address: str, *, pod: str | None = None, check: Check | None = None) -> Endpoint:
        if check is not None:
            check(frozenset())  # the pool is the record: what it drains, the guard already sees
        return self._pool.drain(address)  # the pool lifts it when another instance takes the address

    async def undrain(self, address: str, *, pod: str | None = None) -> Endpoint:
        return self._pool.undrain(address)


class EndpointsFileDrains:
    """Drains recorded in the endpoints file every replica watches."""

    shared = True

    def __init__(self, file: EndpointsFile, pool: Pool) -> None:
        self._file = file
        self._pool = pool

    async def drain(self, address: str, *, pod: str | None = None, check: Check | None = None) -> Endpoint:
        self._rewrite(address, draining=True, check=check)  # the file names no pods: by address
        return self._known(address)

    async def undrain(self, address: str, *, pod: str | None = None) -> Endpoint:
        if self._pool.admin_drained(address):  # drained through this replica's pool before: lift it
            self._pool.undrain(address)
        self._rewrite(address, draining=False)
        return self._known(address)

    def _known(self, address: str) -> Endpoint:
        endpoint = self._pool.get(address)
        if endpoint is None:
            raise UnknownEndpoint(address)
        return endpoint

    def _rewrite(self, address: str, *, draining: bool, check: Check | None = None) -> None:
        path = self._file.path
        with _locked(path):
            try:
                text = path.read_text()
                parse_endpoints(text)  # a file the source would reject is not ours to rewrite
            except (OSError, EndpointsFileError) as exc:
                raise EndpointConflict(f"the endpoints file {path} cannot be changed now ({exc})") from None
            data: Any = yaml.safe_load(text)
            entries: list[Any] = data["endpoints"] if isinstance(data, dict) else data
            index = _find(entries, address)
            if index is None:
                if self._pool.get(address) is not None:
                    raise EndpointConflict(f"{address} is gone: the endpoints file no longer lists it")
                raise UnknownEndpoint(address)
            entry = entries[index]
            listed = entry if isinstance(entry, str) else entry["address"]
            was = isinstance(entry, dict) and entry.get("draining") is True
            if draining and not was and check is not None:
                check(frozenset(_drained_in(entries)))  # under the lock: no other replica writes
            if was == draining:
                if not draining:
                    raise EndpointConflict(f"{address} is not drained (the endpoints file lists it ready)")
            else:
                if isinstance(entry, dict) and set(entry) - {"address", "draining"}:
                    entry = dict(entry)  # its labels stay
                    entry.pop("draining", None)
                    entries[index] = {**entry, "draining": True} if draining else entry
                else:
                    entries[index] = {"address": listed, "draining": True} if draining else listed
                _replace(path, yaml.safe_dump(data, sort_keys=False, default_flow_style=False))
                log.info("endpoints file %s rewritten: %s draining=%s", path, address, str(draining).lower())
        self._file.check()  # this replica at once; the others at their next poll


def _drained_in(entries: list[Any]) -> set[str]:
    """The addresses the file marks `draining: true`."""
    out = set()
    for entry in entries:
        drained = isinstance(entry, dict) and entry.get("draining") is True
        if drained and isinstance(entry.get("address"), str):
            try:
                out.add(canonical_address(entry["address"]))
            except ValueError:
                continue
    return out


def _find(entries: list[Any], address: str) -> int | None:
    for index, entry in enumerate(entries):
        listed = (
            entry if isinstance(entry, str) else entry.get("address") if isinstance(entry, dict) else None
        )
        try:
            if isinstance(listed, str) and canonical_address(listed) == address:
                return index
        except ValueError:
            continue
    return None


class _locked:
    """An exclusive flock on `<file>.lock` beside the endpoints file, for one read-modify-write."""

    def __init__(self, path: Path) -> None:
        self._lock_path = path.with_name(path.name + ".lock")
        self._fd = -1

    def __enter__(self) -> None:
        self._fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(self._fd, fcntl.LOCK_EX)

    def __exit__(self, *_: object) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)


def _replace(path: Path, text: str) -> None:
    """Write `text` to a temp file beside `path`, then rename it over `path` (readers see old or new)."""
    handle, temp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        os.chmod(temp, path.stat().st_mode & 0o777)
        with os.fdopen(handle, "w") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise
