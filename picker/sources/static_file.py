"""The endpoints-file source: a YAML list of endpoints, reloaded when the file changes.

Format (either form; an entry is "ip:port" or a mapping):

    - 10.0.0.1:8000
    - {address: 10.0.0.2:8000, draining: true}
    - {address: 10.0.0.4:8000, draining: true, drained_by: [{cause: prestop}]}
    - {address: 10.0.0.3:8000, labels: {app.kubernetes.io/version: v2}}
    - {address: 10.0.0.5:8000, role: prefill}   # prefill / decode pools: prefill, decode or both

or `{endpoints: [...same entries...]}`. Write it atomically (a temp file renamed over it): a
replaced file is read at the next check. A file changed in place is read only once it has stopped
changing for one check interval, and a file that does not parse or validate (a partial write, a
typo) is rejected with one log line while the last good view stays in force. An empty file is
rejected too (the usual partial write); an explicit `[]` empties the pool. So is anything that
breaks the reading itself (YAML nested thousands deep, a surprise from the parser): no version
of the file can stop the watch.

`check()` is the finite step (stat, maybe read, maybe publish); `run()` repeats it every interval.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from picker.config.model import canonical_address
from picker.pool import DrainCause, EndpointState, Pool
from picker.pool.roles import LLM_D_ROLE, Role

ROLES = tuple(role.value for role in Role)

log = logging.getLogger(__name__)

SOURCE = "file"


class EndpointsFileError(ValueError):
    """The file's content is not a valid endpoints list (the message says where)."""


Labels = dict[str, dict[str, str]]


def decoded(data: bytes) -> str:
    """The file's text as every reader of it takes it: UTF-8, a byte that is not replaced (a stray
    byte in a comment must not make one reader fail where another accepts the file)."""
    return data.decode("utf-8", "replace")


def parse_endpoints(text: str) -> dict[str, EndpointState]:
    """The desired state of each endpoint listed in `text`; EndpointsFileError when invalid."""
    return read_endpoints(text)[0]


def read_endpoints(text: str) -> tuple[dict[str, EndpointState], Labels]:
    """Each listed endpoint's desired state, and the labels of those that have them."""
    return _states(_listed(text))


def _read_whole(text: str) -> tuple[tuple[dict[str, EndpointState], Labels], list[Any]]:
    """`read_endpoints` and the entries as written, from one parse."""
    entries = _listed(text)
    return _states(entries), entries


def listed_entries(text: str) -> list[Any]:
    """The file's entries as written, once the whole file is one the source accepts (one parse:
    the drain store reads its `drained_by` items from them)."""
    entries = _listed(text)
    _states(entries)
    return entries


def _listed(text: str) -> list[Any]:
    """The file's list of entries (EndpointsFileError when it is not one)."""
    if not text.strip():
        raise EndpointsFileError("the file is empty (a partial write?)")
    try:
        data: Any = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise EndpointsFileError(f"not valid YAML: {exc}".replace("\n", " ")) from None
    except RecursionError:
        raise EndpointsFileError("nested too deeply to read") from None
    if isinstance(data, dict):
        if set(data) != {"endpoints"}:
            raise EndpointsFileError("a mapping must have exactly one key, 'endpoints'")
        data = data["endpoints"]
    if not isinstance(data, list):
        raise EndpointsFileError("expected a list of endpoints")
    return data


def _states(data: list[Any]) -> tuple[dict[str, EndpointState], Labels]:
    """Each entry's desired state and labels (EndpointsFileError at the first entry that is wrong)."""
    desired: dict[str, EndpointState] = {}
    labels: Labels = {}
    for index, entry in enumerate(data):
        where = f"entry #{index}"
        tags: Any = None
        if isinstance(entry, str):
            address, draining = entry, False
        elif isinstance(entry, dict):
            # drained_by: who holds its drain, the drain store's to read (picker/sources/drain_store.py)
            unknown = set(entry) - {"address", "draining", "labels", "drained_by", "role"}
            if unknown:
                raise EndpointsFileError(f"{where}: unknown keys {sorted(map(str, unknown))}")
            address, draining = entry.get("address"), entry.get("draining", False)
            if not isinstance(address, str):
                raise EndpointsFileError(f"{where}: 'address' must be a host:port string")
            if not isinstance(draining, bool):
                raise EndpointsFileError(f"{where}: 'draining' must be true or false")
            tags = entry.get("labels")
            if tags is not None and not (
                isinstance(tags, dict)
                and all(isinstance(k, str) and isinstance(v, str) for k, v in tags.items())
            ):
                raise EndpointsFileError(f"{where}: 'labels' must map strings to strings")
            role = entry.get("role")
            if role is not None:
                if role not in ROLES:
                    raise EndpointsFileError(f"{where}: 'role' must be one of {', '.join(ROLES)}")
                tags = {**(tags or {}), LLM_D_ROLE: role}  # read as a pod's role label is
        else:
            raise EndpointsFileError(f"{where}: expected 'host:port' or {{address, draining}}")
        try:
            canonical = canonical_address(address)
        except ValueError as exc:
            raise EndpointsFileError(f"{where}: {exc}") from None
        if canonical in desired:
            raise EndpointsFileError(f"{where}: {canonical} is listed twice")
        desired[canonical] = EndpointState.DRAINING if draining else EndpointState.READY
        if tags:
            labels[canonical] = dict(tags)
    return desired, labels


@dataclass(frozen=True, slots=True)
class _Signature:
    device: int
    inode: int
    size: int
    mtime_ns: int

    @classmethod
    def of(cls, stat: os.stat_result) -> _Signature:
        return cls(stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns)

    def same_file(self, other: _Signature | None) -> bool:
        return other is not None and (self.device, self.inode) == (other.device, other.inode)


class EndpointsFile:
    """Feeds the pool from one endpoints file."""

    def __init__(
        self,
        path: Path,
        pool: Pool,
        *,
        poll_s: float,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        on_event: Callable[[str], None] = lambda _: None,
    ) -> None:
        self.path = path
        self._pool = pool
        self._poll_s = poll_s
        self._sleep = sleep
        self._on_event = on_event
        self._applied: _Signature | None = None  # the version in force
        self._seen: _Signature | None = None  # the last version looked at (applied or not)
        self._complained: object = None  # what was last logged as rejected (a version, or an error)
        self.loads = 0
        # the entries of the version in force, as written: what the admin API reads (drained_by),
        # never the disk, so that a bad version on disk never makes a read fail or show it
        self.entries: list[Any] = []

    def load(self) -> None:
        """The first read, at startup: any problem is an error (there is no last good view yet)."""
        signature, text = self._read()
        try:
            desired, entries = _read_whole(text)
        except EndpointsFileError as exc:
            raise EndpointsFileError(f"endpoints file {self.path}: {exc}") from None
        self._apply(signature, desired, entries)

    def check(self) -> bool:
        """One look at the file; True when a new version was published to the pool."""
        try:
            signature = _Signature.of(self.path.stat())
        except OSError as exc:
            self._complain(("stat", exc.errno), f"cannot read it ({exc.strerror})")
            return False
        if signature == self._applied:
            self._seen = signature
            return False
        replaced = not signature.same_file(self._applied)
        settled = signature == self._seen
        self._seen = signature
        if not (replaced or settled):
            log.info("endpoints file %s changed in place; reading it once it stops changing", self.path)
            return False
        try:
            read_signature, text = self._read()
        except OSError as exc:
            self._complain(signature, f"cannot read it ({exc.strerror})")
            return False
        if read_signature != signature:  # written to while being read: look again next time
            self._seen = read_signature
            return False
        try:
            desired, entries = _read_whole(text)
        except EndpointsFileError as exc:
            self._complain(signature, str(exc))
            return False
        except Exception as exc:  # a parser bug or surprise: this version is bad, not the watch
            self._complain(signature, f"could not be read ({type(exc).__name__}: {exc})")
            return False
        self._apply(signature, desired, entries)
        return True

    async def run(self) -> None:
        """Forever: check every poll interval. Nothing one check raises ends the watch."""
        while True:
            await self._sleep(self._poll_s)
            try:
                self.check()
            except Exception as exc:
                self._complain(("check", type(exc).__name__), f"check failed ({type(exc).__name__}: {exc})")

    def _read(self) -> tuple[_Signature, str]:
        with self.path.open("rb") as handle:
            data = handle.read()
            signature = _Signature.of(os.fstat(handle.fileno()))
        return signature, decoded(data)

    def _apply(
        self, signature: _Signature, listed: tuple[dict[str, EndpointState], Labels], entries: list[Any]
    ) -> None:
        desired, labels = listed
        # the file is the admin drains' record (picker/sources/drain_store.py): a `draining: true`
        # is the operator's, a preStop hook's or a rollback's, on every replica that reads it
        self._pool.reconcile(desired, source=SOURCE, labels=labels, listed_drain=DrainCause.ADMIN)
        self._applied = self._seen = signature
        self.entries = entries
        self._complained = None
        self.loads += 1
        self._on_event("loaded")
        draining = sum(1 for s in desired.values() if s is EndpointState.DRAINING)
        log.info("endpoints file %s loaded endpoints=%d draining=%d", self.path, len(desired), draining)

    def _complain(self, what: object, why: str) -> None:
        """Log a rejection once per distinct problem (a version of the file, or a read error)."""
        if self._complained == what:
            return
        self._complained = what
        self._on_event("rejected")
        log.error(
            "endpoints file %s rejected: %.500s; keeping the last good view (%d endpoints)",
            self.path,
            why,
            len(self._pool),
        )
