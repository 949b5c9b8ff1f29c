"""Who tells the picker that a response ended, per data-plane connection.

Gateways differ in what they show the picker of a response (docs, "Gateways"). Where something
reports each end (an observer filter, the routing stream's own body, Envoy's access log, a routing
stream that closes with its response) the picker's in-flight counts are exact. Where nothing does
(response headers only, NGINX Gateway Fabric's shim) a request counts on its replica only until the
engine's scraped gauges can show it, and its end is inferred when they drop (`RequestPath`'s
engine-tracked requests). Each connection's mode is learned from what arrives on it; this module
keeps them, bounded, for the log, the metric and `/admin/endpoints`.
"""

from __future__ import annotations

import enum
from collections import Counter, OrderedDict


class Ends(enum.Enum):
    """How the ends of a connection's requests reach the picker."""

    OBSERVER = "observer"  # an observer filter's stream reports the body and its end
    BODY = "body"  # the routing stream carries the response body (STREAMED, FULL_DUPLEX_STREAMED)
    STREAM_CLOSE = "stream-close"  # response headers SKIP: the routing stream closes with the response
    ACCESS_LOG = "access-log"  # Envoy's gRPC access log reports each request's end
    ENGINE = "engine"  # nothing does: the engines' gauges, one scrape behind (blind)

    @property
    def blind(self) -> bool:
        return self is Ends.ENGINE


_KEPT = 256  # connections remembered; the oldest is forgotten first (reconnects must not grow it)


class DataPlanes:
    """Each data-plane connection's `Ends`, as last learned (no I/O: the frontends note them)."""

    def __init__(self, kept: int = _KEPT) -> None:
        self._modes: OrderedDict[str, Ends] = OrderedDict()
        self._kept = kept
        self._blind = 0  # connections whose mode is ENGINE (`blind` is asked at every pick)

    def note(self, connection: str | None, mode: Ends) -> bool:
        """Record what a connection showed; True when that is news (a first sight or a change)."""
        if connection is None:
            return False
        before = self._modes.get(connection)
        if before is mode:
            return False
        self._blind += (mode is Ends.ENGINE) - (before is Ends.ENGINE)
        self._modes[connection] = mode
        self._modes.move_to_end(connection)
        while len(self._modes) > self._kept:
            _, dropped = self._modes.popitem(last=False)
            self._blind -= dropped is Ends.ENGINE
        return True

    def mode(self, connection: str | None) -> Ends | None:
        return None if connection is None else self._modes.get(connection)

    def blind(self) -> bool:
        """Whether some connection hides its responses' ends."""
        return self._blind > 0

    def counts(self) -> Counter[Ends]:
        return Counter(self._modes.values())

    def summary(self) -> dict[str, str]:
        """connection -> mode, newest last (the admin API's `data_planes`)."""
        return {connection: mode.value for connection, mode in self._modes.items()}
