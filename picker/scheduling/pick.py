"""Least in-flight first, random among equals."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Protocol


class Candidate(Protocol):
    @property
    def address(self) -> str: ...

    @property
    def in_flight(self) -> int: ...


def pick(candidates: Sequence[Candidate], count: int, rng: random.Random) -> list[str]:
    """The `count` best candidates in order: the first is the primary, the rest are fallbacks.

    The random key breaks ties so that equal endpoints share load instead of the first listed
    one taking every burst.
    """
    if count <= 0 or not candidates:
        return []
    ranked = sorted(candidates, key=lambda c: (c.in_flight, rng.random()))
    return [c.address for c in ranked[:count]]
