"""Prefill / decode pairs: which endpoints may be a destination, whether a request takes a prefill
hop, and which replica prefills it. Pure functions over the view.

A pool is disaggregated once some READY endpoint serves prefill alone (`Role.PREFILL`). Then:
- the destination is a decode-capable endpoint (DECODE or BOTH) of a revision that has a complete
  pair: a READY decode-capable and a READY prefill-capable endpoint of the same revision (the
  revision label's value). A revision missing a role gets no new work, so no pair ever spans two
  revisions in a rollout. With no complete pair anywhere the decode replicas serve alone, computing
  the prompt themselves: slower, never a failure, never a cross-revision pull;
- the prefill hop is taken only when the destination would otherwise compute at least
  `min_tokens` prompt tokens (the prompt's uncached part there): a short prompt, or one the decode
  replica mostly holds, costs less to compute in place than to hand over;
- the prefill replica is the one where this prompt would be ready soonest: the fewest uncached
  prompt tokens waiting there including this one's (its prefill backlog and what it holds of this
  prompt), then the least load, then a random key. Never the destination itself, never a suspect
  while another candidate is left, never a full one while one has room.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

from picker.pool.roles import Role
from picker.scheduling.load import LoadPolicy, LoadView, assess


class PairView(LoadView, Protocol):
    @property
    def address(self) -> str: ...

    @property
    def role(self) -> Role | None: ...

    @property
    def pending_prefill(self) -> float: ...


E = TypeVar("E", bound=PairView)


def disaggregated(ready: Sequence[PairView]) -> bool:
    """Whether the pool is routed as pairs: some READY endpoint serves prefill alone."""
    return any(e.role is Role.PREFILL for e in ready)


def destinations(
    candidates: Sequence[E], prefillers: Sequence[E], revision: Callable[[E], str | None]
) -> tuple[list[E], bool]:
    """Of a request's candidates, those that may be its destination in a disaggregated pool, and
    whether they form complete pairs with the READY `prefillers` that may prefill it (False: no
    revision has both; the decode replicas serve alone)."""
    decoders = [e for e in candidates if e.role is not None and e.role.decodes]
    prefilled = {revision(e) for e in prefillers if e.role is not None and e.role.prefills}
    paired = [e for e in decoders if revision(e) in prefilled]
    return (paired, True) if paired else (decoders, False)


def wants_prefill(uncached_tokens: float, min_tokens: int) -> bool:
    """The decider: a prefill hop only for a prompt the destination would compute much of itself."""
    return uncached_tokens >= max(1, min_tokens)


def prefill_candidates(ready: Sequence[E], destination: E, revision: Callable[[E], str | None]) -> list[E]:
    """READY prefill-capable endpoints of the destination's revision, other than the destination."""
    mine = revision(destination)
    return [
        e
        for e in ready
        if e.role is not None and e.role.prefills and e.address != destination.address and revision(e) == mine
    ]


def pick_prefill(
    candidates: Sequence[E],
    uncached: Callable[[E], float],
    now: float,
    policy: LoadPolicy,
    rng: random.Random,
    suspects: frozenset[str] = frozenset(),
) -> E | None:
    """The replica that would have this prompt ready soonest (module docstring); None with none."""
    best: tuple[bool, bool, float, float, float] | None = None
    chosen: E | None = None
    for e in candidates:
        full, rank = assess(e, now, policy)
        key = (e.address in suspects, full, e.pending_prefill + uncached(e), rank, rng.random())
        if best is None or key < best:
            best, chosen = key, e
    return chosen
