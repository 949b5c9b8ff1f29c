"""The shared drain record's content, read and written whole (the ConfigMap's `drained` key; the
format is in picker/sources/kube_drains.py): plain data, no I/O.

Reading validates every item whole (its address, pod, cause and rollout) before it counts: an item
that fails is not applied, counted by reason, and kept verbatim (at most `_KEPT_UNREAD`) so that a
picker rewriting the record does not wipe a drain it cannot read (a newer picker's).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from picker.config.model import canonical_address
from picker.sources.drain_causes import OPERATOR, Cause, CauseKind, MalformedCause, Rejections, cause_of

DATA_KEY = "drained"
_ITEM_KEYS = frozenset({"address", "pod", "cause", "rollout"})
_KEPT_UNREAD = 64
_MAX_POD = 253


@dataclass(frozen=True, slots=True)
class Drain:
    """One recorded drain: who made it, and of what (a pod's only, or whatever runs at the address)."""

    address: str
    cause: Cause = OPERATOR
    pod: str | None = None  # a pod's uid: that instance only; None: the address's

    def holds(self, address: str, instance: str | None) -> bool:
        """Whether it drains what runs at `address` now (`instance`: its pod, when known)."""
        return self.address == address and (
            self.pod is None or (instance is not None and self.pod == instance)
        )

    def item(self) -> str | dict[str, str]:
        """As stored: an operator's drain of an address is the bare "ip:port" (older pickers read it)."""
        if self.cause == OPERATOR and self.pod is None:
            return self.address
        stored = {"address": self.address, **self.cause.stored()}
        if self.pod is not None:
            stored["pod"] = self.pod
        return stored

    def sort_key(self) -> tuple[str, str, str]:
        return self.address, str(self.cause), self.pod or ""


@dataclass(frozen=True, slots=True)
class Record:
    """Every drain the record holds, and the items this picker could not read (kept as they are)."""

    drains: frozenset[Drain] = frozenset()
    unread: tuple[str, ...] = ()  # JSON text of each item not applied

    def __len__(self) -> int:
        return len(self.drains)

    @property
    def drained(self) -> frozenset[str]:
        """Every address the record drains, whichever instance."""
        return frozenset(d.address for d in self.drains)

    @property
    def pinned(self) -> frozenset[Drain]:
        """The drains of one pod each."""
        return frozenset(d for d in self.drains if d.pod is not None)

    def holds(self, address: str, instance: str | None) -> bool:
        return any(d.holds(address, instance) for d in self.drains)

    def causes(self, address: str, instance: str | None) -> list[Cause]:
        """Who drains what runs at `address` now (each cause once)."""
        return sorted({d.cause for d in self.drains if d.holds(address, instance)}, key=str)

    def matching(self, address: str, only: CauseKind | None, pod: str | None = None) -> list[Drain]:
        """The address's drains of that kind of cause (None: any), of that pod (None: any)."""
        return sorted(
            (
                d
                for d in self.drains
                if d.address == address and d.cause.matches(only) and (pod is None or d.pod == pod)
            ),
            key=Drain.sort_key,
        )

    def adding(self, drain: Drain) -> Record:
        return Record(self.drains | {drain}, self.unread)

    def dropping(self, gone: Iterable[Drain]) -> Record:
        return Record(self.drains - set(gone), self.unread)

    def lifting(self, cause: Cause) -> Record:
        """Without any drain of that cause."""
        return Record(frozenset(d for d in self.drains if d.cause != cause), self.unread)


def parse_record(
    obj: Mapping[str, Any] | None, rejected: Rejections | None = None
) -> tuple[Record, list[str]]:
    """The drains a ConfigMap records, and what in it was not applied (for one log line each)."""
    rejected = rejected if rejected is not None else Rejections()
    if obj is None:
        return Record(), []
    raw = (obj.get("data") or {}).get(DATA_KEY)
    if raw is None:
        return Record(), []
    try:
        listed = json.loads(raw)
    except (TypeError, ValueError, RecursionError):
        rejected.count("not-json", str(raw)[:256])
        return Record(), [f"data.{DATA_KEY} is not JSON"]
    if not isinstance(listed, list):
        rejected.count("not-a-list", listed)
        return Record(), [f"data.{DATA_KEY} is not a JSON list"]
    drains: set[Drain] = set()
    unread: list[str] = []
    problems = []
    for item in listed:
        try:
            drains.add(_drain_of(item))
        except MalformedCause as exc:
            rejected.count(exc.reason, item)
            problems.append(f"data.{DATA_KEY}: {_short(item)}: {exc}")
            if len(unread) < _KEPT_UNREAD:
                unread.append(json.dumps(item, sort_keys=True))
    return Record(frozenset(drains), tuple(unread)), problems


def render_record(record: Record) -> str:
    items: list[Any] = [d.item() for d in sorted(record.drains, key=Drain.sort_key)]
    items += [json.loads(text) for text in record.unread]
    return json.dumps(items)


def _drain_of(item: Any) -> Drain:
    if isinstance(item, str):
        return Drain(_address(item))
    if not isinstance(item, dict):
        raise MalformedCause("bad-item", "an item is an address or an object")
    unknown = set(item) - _ITEM_KEYS
    if unknown:
        raise MalformedCause("unknown-keys", f"unknown keys {sorted(unknown)}")
    address, pod = item.get("address"), item.get("pod")
    if not isinstance(address, str):
        raise MalformedCause("bad-address", "no address")
    if pod is not None and not (isinstance(pod, str) and 0 < len(pod) <= _MAX_POD and pod.isprintable()):
        raise MalformedCause("bad-pod", "a pod is its uid, a non-empty string")
    return Drain(_address(address), cause_of(item), pod)


def _address(text: str) -> str:
    try:
        return canonical_address(text)
    except ValueError as exc:
        raise MalformedCause("bad-address", str(exc)) from None


def _short(value: Any) -> str:
    text = json.dumps(value, default=repr)
    return text if len(text) <= 120 else text[:117] + "..."
