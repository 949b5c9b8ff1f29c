"""A request's claim on an endpoint's in-flight count (picker/pool/view.py keeps the counts)."""

from __future__ import annotations

from typing import Protocol

from picker.pool.drain import DrainEnd


class Pool(Protocol):
    """The books a lease changes (picker/pool/view.py `Pool`)."""

    def _arrived(self, address: str, *, picked: bool, picked_at: float | None = None) -> None: ...

    def _left(
        self, address: str, end: DrainEnd | None, at: float | None = None, pull: bool = False
    ) -> None: ...


class Lease:
    """One request's claim on an endpoint's in-flight count, released exactly once. Envoy may serve
    a request from a fallback rather than the primary: `move` gives the claim to the one that did."""

    __slots__ = ("_address", "_picked_at", "_pool")

    def __init__(self, pool: Pool, address: str, picked_at: float) -> None:
        self._pool: Pool | None = pool
        self._address = address
        self._picked_at = picked_at  # a move onto an endpoint whose drain began later is no late pick

    @property
    def address(self) -> str:
        return self._address

    @property
    def held(self) -> bool:
        return self._pool is not None

    @property
    def picked_at(self) -> float:
        return self._picked_at

    def move(self, address: str) -> None:
        if self._pool is None or address == self._address:
            return
        self._pool._left(self._address, None)
        self._pool._arrived(address, picked=False, picked_at=self._picked_at)
        self._address = address

    def release(self, end: DrainEnd = DrainEnd.UNKNOWN, at: float | None = None) -> None:
        """End the claim; `end` says how the request ended (drain records count it), `at` when, if
        that was before now (its reason came later)."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool._left(self._address, end, at)


class PullLease(Lease):
    """A prefill replica's claim for one hand-off: its KV waits there until the decode replica pulls
    it. Counted in the endpoint's in-flight work (a drain waits for it) and in its `pulls`, released
    at the decode side's first token (the pull is done by then), at the request's end, or when the
    endpoint's drain reaches `drain.kv_pull_timeout_s`. It never moves: the KV is where it is."""

    __slots__ = ()

    def move(self, address: str) -> None:
        return

    def release(self, end: DrainEnd = DrainEnd.PULLED, at: float | None = None) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            pool._left(self._address, end, at, pull=True)
