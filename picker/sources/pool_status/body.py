"""What the writer puts on the InferencePool: the picker's own entry in `status.parents` (its
`parentRef`, how to find it among the others), its `Ready` condition, and one events.k8s.io/v1
Event. Pure functions; no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from picker.contract.pool_status import (
    CONDITION_TYPE,
    EVENT_ACTION,
    EVENT_TYPE,
    REPORTING_CONTROLLER,
    PoolEvent,
)
from picker.pool.status import PoolHealth

POOL_API = "inference.networking.k8s.io/v1"
_NAME_MAX = 253  # metadata.name: a DNS subdomain
_NOTE_MAX = 1024  # events.k8s.io/v1: note is at most 1 kB (bytes)
_FIELD_MAX = 128  # reportingInstance, action, reason


def parent_ref(spec: Mapping[str, Any], pool: str, namespace: str) -> dict[str, str]:
    """The picker's own entry in `status.parents`: the pool's `endpointPickerRef` (a Service by default)."""
    ref = spec.get("endpointPickerRef") if isinstance(spec.get("endpointPickerRef"), Mapping) else {}
    name = ref.get("name") if isinstance(ref.get("name"), str) and ref.get("name") else f"{pool}-epp"
    kind = ref.get("kind") if isinstance(ref.get("kind"), str) and ref.get("kind") else "Service"
    group = ref.get("group") if isinstance(ref.get("group"), str) else ""
    return {"group": group, "kind": kind, "name": name, "namespace": namespace}


def same_ref(entry: Mapping[str, Any], ref: Mapping[str, str]) -> bool:
    """Whether a `status.parents` entry is the one `ref` names."""
    theirs = entry.get("parentRef") if isinstance(entry.get("parentRef"), Mapping) else {}
    defaults = {"group": "gateway.networking.k8s.io", "kind": "Gateway", "namespace": ref["namespace"]}
    # a key left out takes the CRD's default; the core group "" is a value, not an absence
    return all(theirs.get(key, defaults.get(key, "")) == ref[key] for key in ref)


def stamp(at: float) -> str:
    return datetime.fromtimestamp(at, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def ready_condition(entry: Mapping[str, Any]) -> Mapping[str, Any] | None:
    conditions = entry.get("conditions") if isinstance(entry.get("conditions"), list) else []
    return next((c for c in conditions if isinstance(c, Mapping) and c.get("type") == CONDITION_TYPE), None)


def condition(
    health: PoolHealth, generation: int, ours: Mapping[str, Any] | None, now: float
) -> dict[str, Any]:
    """The `Ready` condition for `health`; its lastTransitionTime kept from `ours` unless the status moved."""
    before = ready_condition(ours) if ours is not None else None
    since = before.get("lastTransitionTime") if before is not None else None
    if before is None or before.get("status") != health.status or not isinstance(since, str):
        since = stamp(now)  # the status moved: a new transition (a reason alone does not)
    return {
        "type": CONDITION_TYPE,
        "status": health.status,
        "reason": health.reason.value,
        "message": health.message[:1024],
        "lastTransitionTime": since,
        "observedGeneration": generation,
    }


def shows(entry: Mapping[str, Any], wanted: Mapping[str, Any]) -> bool:
    """Whether the entry already says what the `wanted` condition would (message aside: counts move)."""
    current = ready_condition(entry)
    if current is None or len(entry.get("conditions") or []) != 1:
        return False
    return all(current.get(k) == wanted[k] for k in ("status", "reason", "observedGeneration"))


def event_body(
    reason: PoolEvent, note: str, *, pool: str, namespace: str, uid: str, instance: str, at: float
) -> dict[str, Any]:
    """One events.k8s.io/v1 Event about the pool, within what the API server takes: a name of at
    most 253 characters (the pool's name cut, the time kept), a note of at most 1 kB cut between
    characters, a reportingInstance never empty."""
    suffix = f"{int(at * 1e9):x}"
    prefix = pool[: _NAME_MAX - len(suffix) - 1].rstrip("-.")
    regarding = {"apiVersion": POOL_API, "kind": "InferencePool", "name": pool, "namespace": namespace}
    if uid:
        regarding["uid"] = uid
    return {
        "metadata": {"name": f"{prefix}.{suffix}", "namespace": namespace},
        "eventTime": datetime.fromtimestamp(at, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
        "reportingController": REPORTING_CONTROLLER,
        "reportingInstance": instance[:_FIELD_MAX] or REPORTING_CONTROLLER,
        "action": EVENT_ACTION[reason],
        "reason": reason.value,
        "type": EVENT_TYPE[reason],
        "note": note.encode()[:_NOTE_MAX].decode(errors="ignore"),
        "regarding": regarding,
    }
