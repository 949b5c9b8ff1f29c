"""Rank endpoints: the best one with room is the primary; the next best are fallbacks."""

from __future__ import annotations

import functools
import heapq
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Protocol

from picker.scheduling.load import LoadPolicy, LoadView, assess


class Candidate(LoadView, Protocol):
    @property
    def address(self) -> str: ...


@dataclass(frozen=True, slots=True)
class Stagger:
    """This picker's place among `pickers` active ones (picker/peers/books.py).

    A burst reaches them all at once, and each picks before the others' picks reach it, so by load
    alone every one would choose the same least-loaded endpoint (herding). Staggered, each takes
    endpoints within one request's load of each other in its own order, so that pickers picking at
    once choose apart, whichever endpoints tie: pickers come in pairs, one taking a ring of the
    addresses in order and the other in reverse (any two tied endpoints: one each), each pair's
    ring rotated by its place (all tied: every picker's first choice differs).
    """

    place: int
    pickers: int

    def order(self, addresses: Sequence[str]) -> Mapping[str, int]:
        """Each address's place in this picker's order (0 first). Every pick asks, mostly of the
        same candidates: computed once per set of addresses."""
        return _order(self.place, self.pickers, tuple(addresses))

    @staticmethod
    def whole(score: float, policy: LoadPolicy) -> float:
        """A load score in whole requests: what the pickers' shared books tell apart. Finer (the
        scrape's KV usage, the same on every picker) would send them all to one endpoint."""
        return math.floor(score / (policy.weight_load or 1.0) + 1e-9)


@functools.lru_cache(maxsize=64)
def _order(place: int, pickers: int, addresses: tuple[str, ...]) -> Mapping[str, int]:
    ring = sorted(addresses)
    pairs = (max(1, pickers) + 1) // 2
    offset = (place // 2) * len(ring) // pairs
    backwards = place % 2 == 1
    size = len(ring)
    return MappingProxyType(
        {
            address: (size - 1 - (i - offset) % size) if backwards else (i - offset) % size
            for i, address in enumerate(ring)
        }
    )


def pick(
    candidates: Sequence[Candidate],
    count: int,
    rng: random.Random,
    now: float = 0.0,
    policy: LoadPolicy | None = None,
    last_resort: frozenset[str] = frozenset(),
    stagger: Stagger | None = None,
) -> list[str]:
    """Up to `count` addresses, primary first; [] when no candidate has room for one more request.

    Fallbacks are only used by Envoy when the primary cannot be reached before response headers, so
    they may include saturated endpoints (after every unsaturated one): better queued than failed.
    The random key breaks ties so equal endpoints share a burst; with `stagger` (several pickers),
    loads are compared in whole requests and ties go by the picker's own order.

    `last_resort` (suspect endpoints: their answers kept failing before the first byte) are listed
    after every other candidate, saturated or not, and are the primary only when no other candidate
    is left at all (Envoy's outlier detection "panics" alike rather than eject the whole pool).
    """
    policy = policy or LoadPolicy(use_metrics=False)
    if count <= 0 or not candidates:
        return []
    keyed: list[tuple[bool, bool, float, float, str]] = []
    if stagger is not None:
        order = stagger.order([candidate.address for candidate in candidates])
        for candidate in candidates:
            full, rank = assess(candidate, now, policy)
            address = candidate.address
            keyed.append((address in last_resort, full, stagger.whole(rank, policy), order[address], address))
    else:
        for candidate in candidates:
            full, rank = assess(candidate, now, policy)
            suspect = candidate.address in last_resort
            keyed.append((suspect, full, rank, rng.random(), candidate.address))
    best = heapq.nsmallest(count, keyed)
    if best[0][1]:
        return []
    return [address for *_, address in best]
