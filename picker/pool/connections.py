"""A client connection's next request ends its last: what several pickers learn before the end does.

Envoy dispatches the next request on an HTTP/1.x client connection only once the last one's
response is complete, so a request that arrives on a connection shows that the last request on it
has ended, whichever picker routed it. Its end still has to come round: Envoy tells the picker its
observer stream went to, which tells the others (picker/peers/books.py), a hop that can take longer
than the client's next request takes to reach another picker. Picked meanwhile, that request saw
the replica still busy with the one that had ended: with four pickers in lockstep, most of the
picks that went to a busier replica than another (bench_ha). So each picker notes the connection of
every request in flight (its own, and its peers' from their picks); a request on a connection that
still has one in flight *supersedes* it: its endpoint counts it no longer in the load estimate
(`Endpoint.superseded`) until its end arrives, which settles its books and records exactly as
before. Only HTTP/1.x connections (the routing filter's `request_attributes`,
picker/extproc/translate.py): on HTTP/2 many requests share a connection at once.
"""

from __future__ import annotations

from picker.pool.view import Pool


class ClientConnections:
    """Per client connection, its request in flight; the superseded ones, per endpoint."""

    def __init__(self, pool: Pool) -> None:
        self._pool = pool
        self._latest: dict[str, str] = {}  # connection -> the last request in flight on it
        self._on: dict[str, tuple[str, str]] = {}  # request in flight -> (connection, endpoint)
        self._superseded: dict[str, str] = {}  # request -> the endpoint that counts it no longer
        self.total = 0  # requests ever superseded here (their end had not arrived yet)

    def __len__(self) -> int:
        return len(self._on)

    def arrived(self, connection: str, request_id: str) -> None:
        """`request_id` came on `connection`: the request in flight there before it has ended."""
        previous = self._latest.get(connection)
        if previous is None or previous == request_id or previous in self._superseded:
            return
        where = self._on.get(previous)
        if where is None:
            return
        self._superseded[previous] = where[1]
        self._count(where[1], 1)
        self.total += 1

    def placed(self, request_id: str, connection: str, address: str) -> None:
        """`request_id`, on `connection`, is in flight on `address` (a pick, this picker's or a peer's)."""
        self.arrived(connection, request_id)
        self._latest[connection] = request_id
        self._on[request_id] = (connection, address)

    def moved(self, request_id: str, address: str) -> None:
        """Envoy's fallback took `request_id` to `address`."""
        where = self._on.get(request_id)
        if where is None:
            return
        self._on[request_id] = (where[0], address)
        if request_id in self._superseded:
            self._count(self._superseded[request_id], -1)
            self._superseded[request_id] = address
            self._count(address, 1)

    def ended(self, request_id: str) -> None:
        """Its end arrived (or its books were settled otherwise): nothing of it is left here."""
        where = self._on.pop(request_id, None)
        if where is None:
            return
        if self._latest.get(where[0]) == request_id:
            del self._latest[where[0]]
        address = self._superseded.pop(request_id, None)
        if address is not None:
            self._count(address, -1)

    def _count(self, address: str, delta: int) -> None:
        endpoint = self._pool.get(address)
        if endpoint is not None:
            endpoint.superseded = max(0, endpoint.superseded + delta)
