"""Where an admin drain is recorded: in this replica's pool only, or where every picker replica reads it.

Why: `config/k8s/picker.yaml` runs two pickers behind one Service; a `POST .../drain` reaches one of
them, and a drain only that one knows about lets the other keep picking the endpoint. A shared
record makes every replica's admin API change the one place all of them read:

- `EndpointsFileDrains` (no Kubernetes): the endpoints file itself. A drain rewrites it atomically
  (a temp file renamed over it, under an flock so two replicas on one host never lose each other's
  write) with `draining: true` on that entry; undrain removes the flag. This replica re-reads it at
  once, the others at their next poll (`pool.endpoints_file_poll_s`, 1 s). Every replica's drain
  record says `admin` (the file holds admin drains only): it lasts until someone undrains it or edits
  the file, restarts included.
  The rewrite keeps every entry and its order, not comments.
- `ConfigMapDrains` (Kubernetes, `kube.drains_configmap`; picker/sources/kube_drains.py): one
  ConfigMap every replica lists and watches.
- `LocalDrains`: the pool's own admin drain (a static list, or Kubernetes without the ConfigMap).

Each drain records who made it (picker/sources/drain_causes.py): the operator, a preStop hook, or a
rollout's rollback. An address may hold drains of several causes at once and stays drained while
any holds. The endpoints file keeps them in the entry's `drained_by` list, beside `draining: true`
(left out when the operator's is the only one: the file then reads as before causes existed; a
`draining: true` without it, hand-written or older, is the operator's). The store answers who holds
each drain (`drained_by`), lifts one address's drains of one kind of cause or any (`undrain`: the
admin API's `?cause=`), and every drain of one cause (`lift`: a rollout's `resume`).
"""

from __future__ import annotations

import fcntl
import logging
import os
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import yaml

from picker.config.model import canonical_address
from picker.pool import Endpoint, EndpointConflict, Pool, UnknownEndpoint
from picker.sources.drain_causes import OPERATOR, Cause, CauseKind, MalformedCause, Rejections, cause_of
from picker.sources.static_file import (
    EndpointsFile,
    EndpointsFileError,
    parse_endpoints,
)

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


@dataclass(frozen=True, slots=True)
class Lifted:
    """What an undrain did: the endpoint as this replica now sees it, and whose drains it lifted."""

    endpoint: Endpoint
    causes: tuple[Cause, ...]


class DrainStore(Protocol):
    """Admin drain / undrain of one endpoint (canonical address); raises UnknownEndpoint (404) or
    EndpointConflict (409) like `Pool.drain`, and returns the endpoint as this replica now sees it.

    `cause`: who makes the drain (drain_causes.py). `pod`: the drain is that instance's (a
    rollback's), not the address's: it does not hold a later pod given the same IP, and is cleared
    once the pod is gone, where the store can tell (the ConfigMap store, over a source that knows
    pods). An undrain lifts the address's drains whose cause is of kind `only` (None: every one;
    a conflict when it holds none of that kind), of that `pod` only when given."""

    shared: bool  # True: every picker replica reading the same source sees the change

    @property
    def rejected(self) -> Mapping[str, int]:
        """Stored drains not applied (malformed), by reason (`picker_drain_record_rejected_total`)."""
        ...

    def drained_by(self) -> dict[str, list[Cause]]:
        """Who holds each drained address's drain, as this replica reads the record now."""
        ...

    async def drain(
        self, address: str, *, cause: Cause = OPERATOR, pod: str | None = None, check: Check | None = None
    ) -> Endpoint: ...

    async def undrain(
        self, address: str, *, only: CauseKind | None = None, pod: str | None = None
    ) -> Lifted: ...

    async def lift(self, cause: Cause) -> list[str]:
        """Lift every drain of exactly this cause (an address another cause holds stays drained);
        the addresses it was recorded at."""
        ...


class DrainRecordUnavailable(RuntimeError):
    """The shared record cannot be read or written now (an API server down): retry (503)."""


class LocalDrains:
    """Drains that live in this replica's pool only (their causes too: a restart forgets both)."""

    shared = False

    def __init__(self, pool: Pool) -> None:
        self._pool = pool
        self._causes: dict[str, set[Cause]] = {}
        self.rejected: Mapping[str, int] = {}  # nothing is read from outside

    def drained_by(self) -> dict[str, list[Cause]]:
        return {a: sorted(held, key=str) for a in list(self._causes) if (held := self._held(a))}

    async def drain(
        self, address: str, *, cause: Cause = OPERATOR, pod: str | None = None, check: Check | None = None
    ) -> Endpoint:
        if check is not None:
            check(frozenset())  # the pool is the record: what it drains, the guard already sees
        self._held(address)  # forget the causes of a drain the pool has lifted since
        endpoint = self._pool.drain(address)  # the pool lifts it when another instance takes the address
        self._causes.setdefault(address, set()).add(cause)
        return endpoint

    async def undrain(self, address: str, *, only: CauseKind | None = None, pod: str | None = None) -> Lifted:
        held = self._held(address)
        if not held:
            return Lifted(self._pool.undrain(address), ())  # raises the pool's conflict
        lifted = {c for c in held if c.matches(only)}
        if not lifted:
            names = ", ".join(sorted(str(c) for c in held))
            raise EndpointConflict(f"{address} holds no {only and only.value} drain (drained by: {names})")
        held -= lifted
        if held:
            endpoint = self._pool.get(address)
            assert endpoint is not None  # admin-drained: the pool knows it
        else:
            self._causes.pop(address, None)
            endpoint = self._pool.undrain(address)
        return Lifted(endpoint, tuple(sorted(lifted, key=str)))

    async def lift(self, cause: Cause) -> list[str]:
        lifted = sorted(a for a in list(self._causes) if cause in self._held(a))
        for address in lifted:
            held = self._causes[address]
            held.discard(cause)
            if not held:
                del self._causes[address]
                self._pool.undrain(address)
        return lifted

    def _held(self, address: str) -> set[Cause]:
        """The causes of the address's admin drain; none once the pool lifted it itself (the source
        stopped listing it, or another pod took it); an admin drain made on the pool directly is
        the operator's."""
        if not self._pool.admin_drained(address):
            self._causes.pop(address, None)
            return set()
        return self._causes.setdefault(address, {OPERATOR})


class EndpointsFileDrains:
    """Drains recorded in the endpoints file every replica watches."""

    shared = True

    def __init__(self, file: EndpointsFile, pool: Pool) -> None:
        self._file = file
        self._pool = pool
        self._rejections = Rejections()
        self._shown: dict[str, list[Cause]] = {}  # the answer for the version in force ...
        self._read_from: list[Any] | None = None  # ... read from these entries

    @property
    def rejected(self) -> Mapping[str, int]:
        return self._rejections.counts

    def drained_by(self) -> dict[str, list[Cause]]:
        """Who holds each drain, from the version of the file the source has in force (never a
        fresh read: a version the source rejects, a partial write or garbage, is not shown and
        cannot make a read fail); this store's own writes are loaded at once (`_rewrite`)."""
        entries = self._file.entries
        if entries is self._read_from:
            return dict(self._shown)
        shown: dict[str, list[Cause]] = {}
        for entry in entries:
            address = _address_of(entry)
            causes = self._causes_of(entry)
            if address is not None and causes:
                shown[address] = sorted(causes, key=str)
        self._shown, self._read_from = shown, entries
        return dict(shown)

    async def drain(
        self, address: str, *, cause: Cause = OPERATOR, pod: str | None = None, check: Check | None = None
    ) -> Endpoint:
        def add(held: set[Cause], entries: list[Any]) -> set[Cause]:
            if not held and check is not None:
                check(frozenset(_drained_in(entries)))  # under the lock: no other replica writes
            return held | {cause}

        self._rewrite(address, add)  # the file names no pods: by address
        return self._known(address)

    async def undrain(self, address: str, *, only: CauseKind | None = None, pod: str | None = None) -> Lifted:
        lifted: set[Cause] = set()

        def remove(held: set[Cause], _: list[Any]) -> set[Cause]:
            if not held:
                raise EndpointConflict(f"{address} is not drained (the endpoints file lists it ready)")
            lifted.update(c for c in held if c.matches(only))
            if not lifted:
                names = ", ".join(sorted(str(c) for c in held))
                raise EndpointConflict(
                    f"{address} holds no {only and only.value} drain (drained by: {names})"
                )
            return held - lifted

        if only is None and self._pool.admin_drained(address):  # drained through this pool before: lift it
            self._pool.undrain(address)
        self._rewrite(address, remove)
        return Lifted(self._known(address), tuple(sorted(lifted, key=str)))

    async def lift(self, cause: Cause) -> list[str]:
        lifted: list[str] = []
        path = self._file.path
        with _locked(path):
            data, entries = self._entries()
            for index, entry in enumerate(entries):
                held = self._causes_of(entry)
                if cause in held:
                    entries[index] = _with_causes(entry, held - {cause})
                    lifted.append(_address_of(entry) or "?")
            if lifted:
                _replace(path, yaml.safe_dump(data, sort_keys=False, default_flow_style=False))
                log.info("endpoints file %s rewritten: drains by %s lifted: %s", path, cause, lifted)
        self._file.check()
        return lifted

    def _known(self, address: str) -> Endpoint:
        endpoint = self._pool.get(address)
        if endpoint is None:
            raise UnknownEndpoint(address)
        return endpoint

    def _entries(self) -> tuple[Any, list[Any]]:
        """The file's data and its entries list, if the source would accept the file."""
        path = self._file.path
        try:
            text = path.read_bytes().decode("utf-8")  # strict: a rewrite would replace other bytes
            parse_endpoints(text)  # a file the source would reject is not ours to rewrite
        except UnicodeDecodeError as exc:
            why = f"not UTF-8 at byte {exc.start}: a rewrite would change it"
            raise EndpointConflict(f"the endpoints file {path} cannot be changed now ({why})") from None
        except (OSError, EndpointsFileError) as exc:
            raise EndpointConflict(f"the endpoints file {path} cannot be changed now ({exc})") from None
        data: Any = yaml.safe_load(text)
        return data, data["endpoints"] if isinstance(data, dict) else data

    def _causes_of(self, entry: Any) -> set[Cause]:
        """Who holds the entry's drain: its `drained_by` items that validate (the others counted and
        not applied); a `draining: true` with no cause left is the operator's."""
        if not (isinstance(entry, dict) and entry.get("draining") is True):
            return set()
        listed = entry.get("drained_by")
        causes: set[Cause] = set()
        if listed is not None and not isinstance(listed, list):
            self._rejections.count("bad-item", listed)
            listed = []
        for item in listed or []:
            try:
                if not isinstance(item, dict) or set(item) - {"cause", "rollout"}:
                    raise MalformedCause("bad-item", "a drained_by item is {cause, rollout}")
                causes.add(cause_of(item))
            except MalformedCause as exc:
                self._rejections.count(exc.reason, item)
                log.warning("endpoints file: a drained_by item of %s ignored: %s", entry.get("address"), exc)
        return causes or {OPERATOR}

    def _rewrite(self, address: str, change: Callable[[set[Cause], list[Any]], set[Cause]]) -> None:
        """Under the file's lock: the address's entry with the causes `change` returns (none: ready)."""
        path = self._file.path
        with _locked(path):
            data, entries = self._entries()
            index = _find(entries, address)
            if index is None:
                if self._pool.get(address) is not None:
                    raise EndpointConflict(f"{address} is gone: the endpoints file no longer lists it")
                raise UnknownEndpoint(address)
            entry = entries[index]
            held = self._causes_of(entry)
            wanted = change(held, entries)
            if wanted != held:
                entries[index] = _with_causes(entry, wanted)
                _replace(path, yaml.safe_dump(data, sort_keys=False, default_flow_style=False))
                causes = ",".join(sorted(str(c) for c in wanted)) or "-"
                log.info(
                    "endpoints file %s rewritten: %s draining=%s by=%s", path, address, bool(wanted), causes
                )
        self._file.check()  # this replica at once; the others at their next poll


def _with_causes(entry: Any, causes: set[Cause]) -> Any:
    """The entry drained by `causes` (none: ready): its labels stay; the operator's alone needs no list."""
    listed = entry if isinstance(entry, str) else entry["address"]
    rest = (
        {k: v for k, v in entry.items() if k not in ("address", "draining", "drained_by")}
        if isinstance(entry, dict)
        else {}
    )
    if not causes:
        return {"address": listed, **rest} if rest else listed
    out: dict[str, Any] = {"address": listed, "draining": True}
    if causes != {OPERATOR}:
        out["drained_by"] = [c.as_dict() for c in sorted(causes, key=str)]
    return {**out, **rest}


def _address_of(entry: Any) -> str | None:
    listed = entry if isinstance(entry, str) else entry.get("address") if isinstance(entry, dict) else None
    try:
        return canonical_address(listed) if isinstance(listed, str) else None
    except ValueError:
        return None


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
    return next((index for index, entry in enumerate(entries) if _address_of(entry) == address), None)


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
