"""The pool: the desired endpoint set from a source, reconciled with what is still in flight."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

from picker.pool.endpoint import Endpoint, EndpointState

log = logging.getLogger(__name__)

Clock = Callable[[], float]


class Lease:
    """One request's claim on an endpoint's in-flight count, released exactly once.

    Envoy may serve a request from a fallback rather than the primary; `move` re-attributes the
    claim to the endpoint that really served it.
    """

    __slots__ = ("_address", "_pool")

    def __init__(self, pool: Pool, address: str) -> None:
        self._pool: Pool | None = pool
        self._address = address

    @property
    def address(self) -> str:
        return self._address

    @property
    def held(self) -> bool:
        return self._pool is not None

    def move(self, address: str) -> None:
        if self._pool is None or address == self._address:
            return
        self._pool._adjust(self._address, -1)
        self._pool._adjust(address, +1, create=True)
        self._address = address

    def release(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            pool._adjust(self._address, -1)


class Pool:
    """Endpoints by address. A source states the whole desired set; the pool does the bookkeeping."""

    def __init__(self, clock: Clock = time.monotonic) -> None:
        self._clock = clock
        self._endpoints: dict[str, Endpoint] = {}

    def __len__(self) -> int:
        return len(self._endpoints)

    def get(self, address: str) -> Endpoint | None:
        return self._endpoints.get(address)

    def endpoints(self) -> list[Endpoint]:
        return list(self._endpoints.values())

    def ready(self) -> list[Endpoint]:
        return [e for e in self._endpoints.values() if e.state is EndpointState.READY]

    def in_flight(self) -> int:
        return sum(e.in_flight for e in self._endpoints.values())

    def apply(self, ready: Iterable[str], draining: Iterable[str] = ()) -> None:
        """Replace the desired set: listed endpoints take the given state, the rest become GONE."""
        wanted = {a: EndpointState.DRAINING for a in draining}
        wanted.update({a: EndpointState.READY for a in ready})
        for address, state in wanted.items():
            self._set_state(address, state)
        for address in [a for a in self._endpoints if a not in wanted]:
            self._set_state(address, EndpointState.GONE)

    def set_state(self, address: str, state: EndpointState) -> None:
        self._set_state(address, state)

    def lease(self, address: str) -> Lease:
        endpoint = self._endpoints[address]
        endpoint.picks += 1
        endpoint.in_flight += 1
        return Lease(self, address)

    def _set_state(self, address: str, state: EndpointState) -> None:
        endpoint = self._endpoints.get(address)
        if endpoint is None:
            if state is not EndpointState.GONE:
                self._endpoints[address] = Endpoint(address, state, self._clock())
                log.info("endpoint added address=%s state=%s", address, state.value)
            return
        if endpoint.state is state:
            return
        log.info(
            "endpoint state address=%s %s->%s in_flight=%d",
            address,
            endpoint.state.value,
            state.value,
            endpoint.in_flight,
        )
        endpoint.state = state
        endpoint.since = self._clock()
        self._forget_if_done(endpoint)

    def _adjust(self, address: str, delta: int, *, create: bool = False) -> None:
        endpoint = self._endpoints.get(address)
        if endpoint is None:
            if not create:
                log.error("in-flight change for unknown endpoint address=%s", address)
                return
            # Served by an endpoint the picker never listed (Envoy's fallback policy): track it as
            # GONE so its request is still counted until it ends, and never picked.
            endpoint = self._endpoints[address] = Endpoint(address, EndpointState.GONE, self._clock())
        endpoint.in_flight += delta
        if endpoint.in_flight < 0:
            log.error("in-flight below zero address=%s", address)
            endpoint.in_flight = 0
        self._forget_if_done(endpoint)

    def _forget_if_done(self, endpoint: Endpoint) -> None:
        if endpoint.state is EndpointState.GONE and endpoint.in_flight == 0:
            del self._endpoints[endpoint.address]
            log.info("endpoint forgotten address=%s", endpoint.address)
