"""Who made a drain: the operator (the admin API), a pod's preStop hook (`picker drain-wait`), or a
canary rollout's rollback (with that rollout's id). The cause is recorded with the drain in the
shared drain store (picker/sources/drain_store.py, kube_drains.py), so it outlives a picker's
restart and every picker reads the same one: a rollout's `resume` lifts only drains whose cause is
its own rollback, never an operator's or a preStop hook's.

How a stored item names its cause (the ConfigMap's JSON items, the endpoints file's `drained_by`):

    no "cause" key                                  the operator's (records older than causes read so)
    "cause": "operator"                             the operator's
    "cause": "prestop"                              a preStop hook's
    "cause": "rollback", "rollout": "<id>"          that rollout's rollback (`<group_label>=<candidate>`)

Anything else (an unknown cause, a rollback without its rollout, a rollout on another cause) is
malformed: the item is not applied, and counted once by reason (`picker_drain_record_rejected_total`).
"""

from __future__ import annotations

import enum
import json
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

MAX_ROLLOUT_ID = 512  # a label name (<= 317 with its prefix) '=' a label value (<= 63): room to spare


class CauseKind(enum.Enum):
    """Who made a drain (closed set)."""

    OPERATOR = "operator"  # POST /admin/endpoints/<addr>/drain (`?cause=operator`, the default)
    PRESTOP = "prestop"  # `picker drain-wait` (the model server's preStop hook): `?cause=prestop`
    ROLLBACK = "rollback"  # a canary's rollback (picker/rollout/runner.py), with the rollout's id


@dataclass(frozen=True, slots=True)
class Cause:
    kind: CauseKind
    rollout: str | None = None  # ROLLBACK only: the rollout's id

    def __str__(self) -> str:
        return self.kind.value if self.rollout is None else f"{self.kind.value}:{self.rollout}"

    def as_dict(self) -> dict[str, str]:
        """As the admin API shows it, and as the record stores it (but the operator's: no key)."""
        shown = {"cause": self.kind.value}
        if self.rollout is not None:
            shown["rollout"] = self.rollout
        return shown

    def stored(self) -> dict[str, str]:
        """The item's fields that name this cause; none for the operator's, so a picker that
        predates causes reads the item as it always did."""
        return {} if self.kind is CauseKind.OPERATOR else self.as_dict()

    def matches(self, only: CauseKind | None) -> bool:
        return only is None or self.kind is only


OPERATOR = Cause(CauseKind.OPERATOR)
PRESTOP = Cause(CauseKind.PRESTOP)


class MalformedCause(ValueError):
    """A stored cause that cannot be read; `reason` is its counter label."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def named(verb: str, name: str | None) -> tuple[Cause, CauseKind | None]:
    """The admin API's `?cause=`: who makes a drain (`operator`, the default, or `prestop`: a
    rollback's drains are its rollout's), or which drains an undrain lifts (`operator`, `prestop`,
    `rollback`; absent: every one). ValueError, worded for the caller, otherwise."""
    if verb == "drain":
        made = {None: OPERATOR, "operator": OPERATOR, "prestop": PRESTOP}.get(name)
        if made is None:
            raise ValueError("cause must be operator or prestop (a rollback's drains are its rollout's)")
        return made, None
    try:
        return OPERATOR, None if name is None else CauseKind(name)
    except ValueError:
        raise ValueError("cause must be operator, prestop or rollback") from None


def shown(summaries: list[dict[str, Any]], held: Mapping[str, list[Cause]]) -> list[dict[str, Any]]:
    """Drain records (the scorecard's) with who holds each open one, where the store holds it."""
    for summary in summaries:
        causes = held.get(str(summary.get("address"))) if summary.get("open") else None
        if causes:
            summary["drained_by"] = [c.as_dict() for c in causes]
    return summaries


def rollback(rollout: str) -> Cause:
    """The cause of a drain made by the rollback of rollout `rollout`."""
    if not _valid_rollout(rollout):
        raise ValueError(f"a rollout id must be 1 to {MAX_ROLLOUT_ID} printable characters: {rollout!r}")
    return Cause(CauseKind.ROLLBACK, rollout)


def cause_of(item: Mapping[str, Any]) -> Cause:
    """The cause a stored item names (see the module's docstring); MalformedCause otherwise."""
    name, rollout = item.get("cause"), item.get("rollout")
    if name is None:
        if "rollout" in item:
            raise MalformedCause("bad-rollout", "a rollout without a rollback cause")
        return OPERATOR
    try:
        kind = CauseKind(name) if isinstance(name, str) else None
    except ValueError:
        kind = None
    if kind is None:
        raise MalformedCause(
            "unknown-cause", f"cause {_short(name)} is not one of operator, prestop, rollback"
        )
    if kind is CauseKind.ROLLBACK:
        if not isinstance(rollout, str) or not _valid_rollout(rollout):
            raise MalformedCause("bad-rollout", f"a rollback needs its rollout's id, not {_short(rollout)}")
        return Cause(kind, rollout)
    if "rollout" in item:
        raise MalformedCause("bad-rollout", f"a rollout on a {kind.value} cause")
    return Cause(kind)


def _valid_rollout(rollout: str) -> bool:
    return 0 < len(rollout) <= MAX_ROLLOUT_ID and rollout.isprintable()


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


class Rejections:
    """Stored items not applied, by reason; each distinct item is counted once, however often the
    record holding it is read again (every watch event re-reads the whole record)."""

    _REMEMBERED = 1024

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self._seen: set[str] = set()

    def count(self, reason: str, item: Any) -> None:
        key = f"{reason}\0{json.dumps(item, sort_keys=True, default=repr)[:4096]}"
        if key in self._seen:
            return
        if len(self._seen) >= self._REMEMBERED:
            self._seen.clear()
        self._seen.add(key)
        self.counts[reason] += 1
