"""Which pods the ReplicaSet controller deletes when its replicas go down, as kube-controller-manager
(1.33) orders them: pkg/controller/controller_utils.go `ActivePodsWithRanks.Less`, with the
PodDeletionCost (beta, on since 1.22) and LogarithmicScaleDown (on since 1.22) features.

Deleted first, criterion by criterion (the first that differs decides):
1. not yet on a node; 2. Pending, then Unknown, then Running; 3. not ready;
4. a lower `controller.kubernetes.io/pod-deletion-cost` (no annotation, or not an int32: 0);
5. more of the ReplicaSet's pods on its node (a single node here: equal);
6. both ready at different times: ready for less time, compared as int(log2(nanoseconds)) since;
   the same rank: by uid (random, in a real cluster);
7. more container restarts;
8. created later, compared the same way (the same rank: by uid).
Pure: pods as the API's JSON mappings, `now` in the same seconds as their timestamps.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import cmp_to_key
from typing import Any

DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
_PHASES = {"Pending": 0, "Unknown": 1, "Running": 2}


def _seconds(stamp: Any) -> float | None:
    if not isinstance(stamp, str):
        return None
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def _rank_diff(t1: float, t2: float, now: float) -> int:
    """logarithmicRankDiff: int(log2(ns since t1)) - int(log2(ns since t2)) (0 for no time since)."""

    def rank(t: float) -> int:
        since = (now - t) * 1e9
        return int(math.log2(since)) if since > 0 else 0

    return rank(t1) - rank(t2)


def _ready_since(pod: Mapping[str, Any]) -> float | None:
    for condition in (pod.get("status") or {}).get("conditions") or ():
        if condition.get("type") == "Ready" and condition.get("status") == "True":
            return _seconds(condition.get("lastTransitionTime")) or 0.0
    return None


def deletion_cost(pod: Mapping[str, Any]) -> int:
    text = ((pod.get("metadata") or {}).get("annotations") or {}).get(DELETION_COST)
    try:
        value = int(text, 10) if isinstance(text, str) else 0
    except ValueError:
        return 0
    return value if -(2**31) <= value < 2**31 else 0


def less(a: Mapping[str, Any], b: Mapping[str, Any], now: float) -> bool:
    """Whether the controller deletes `a` before `b`."""
    meta_a, meta_b = a.get("metadata") or {}, b.get("metadata") or {}
    node_a, node_b = (a.get("spec") or {}).get("nodeName", ""), (b.get("spec") or {}).get("nodeName", "")
    if node_a != node_b and (not node_a or not node_b):
        return not node_a
    phase_a = _PHASES.get((a.get("status") or {}).get("phase", ""), 1)
    phase_b = _PHASES.get((b.get("status") or {}).get("phase", ""), 1)
    if phase_a != phase_b:
        return phase_a < phase_b
    ready_a, ready_b = _ready_since(a), _ready_since(b)
    if (ready_a is None) != (ready_b is None):
        return ready_a is None
    if deletion_cost(a) != deletion_cost(b):
        return deletion_cost(a) < deletion_cost(b)
    if ready_a is not None and ready_b is not None and ready_a != ready_b:
        diff = _rank_diff(ready_a, ready_b, now)
        return meta_a.get("uid", "") < meta_b.get("uid", "") if diff == 0 else diff < 0
    restarts_a, restarts_b = _restarts(a), _restarts(b)
    if restarts_a != restarts_b:
        return restarts_a > restarts_b
    created_a, created_b = (
        _seconds(meta_a.get("creationTimestamp")),
        _seconds(meta_b.get("creationTimestamp")),
    )
    if created_a != created_b:
        if created_a is None or created_b is None:
            return created_a is None
        diff = _rank_diff(created_a, created_b, now)
        return meta_a.get("uid", "") < meta_b.get("uid", "") if diff == 0 else diff < 0
    return False


def _restarts(pod: Mapping[str, Any]) -> int:
    return sum(c.get("restartCount", 0) for c in (pod.get("status") or {}).get("containerStatuses") or ())


def victims(pods: Sequence[Mapping[str, Any]], count: int, now: float) -> list[Mapping[str, Any]]:
    """The `count` pods the controller deletes to scale down by that many (pods already being deleted
    are not counted: the controller leaves them to finish)."""
    active = [p for p in pods if not (p.get("metadata") or {}).get("deletionTimestamp")]
    ordered = sorted(active, key=cmp_to_key(lambda a, b: -1 if less(a, b, now) else int(less(b, a, now))))
    return ordered[:count]
