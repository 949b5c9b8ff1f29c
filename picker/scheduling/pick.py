"""Rank endpoints: the best one with room is the primary; the next best are fallbacks."""

from __future__ import annotations

import heapq
import random
from collections.abc import Sequence
from typing import Protocol

from picker.scheduling.load import LoadPolicy, LoadView, assess


class Candidate(LoadView, Protocol):
    @property
    def address(self) -> str: ...


def pick(
    candidates: Sequence[Candidate],
    count: int,
    rng: random.Random,
    now: float = 0.0,
    policy: LoadPolicy | None = None,
    last_resort: frozenset[str] = frozenset(),
) -> list[str]:
    """Up to `count` addresses, primary first; [] when no candidate has room for one more request.

    Fallbacks are only used by Envoy when the primary cannot be reached before response headers, so
    they may include saturated endpoints (after every unsaturated one): better queued than failed.
    The random key breaks ties so equal endpoints share a burst.

    `last_resort` (suspect endpoints: their answers kept failing before the first byte) are listed
    after every other candidate, saturated or not, and are the primary only when no other candidate
    is left at all (Envoy's outlier detection "panics" alike rather than eject the whole pool).
    """
    policy = policy or LoadPolicy(use_metrics=False)
    if count <= 0 or not candidates:
        return []
    keyed = []
    for candidate in candidates:
        full, rank = assess(candidate, now, policy)
        suspect = candidate.address in last_resort
        keyed.append((suspect, full, rank, rng.random(), candidate.address))
    best = heapq.nsmallest(count, keyed)
    if best[0][1]:
        return []
    return [address for *_, address in best]
