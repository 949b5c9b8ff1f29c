"""The per-endpoint view: which model-server endpoints exist, their state and their in-flight work.

Owns `Endpoint` (address, READY / DRAINING / GONE, in-flight) and `Pool`, the one mutable view every
frontend reads. Sources (static list today; EndpointSlices, file and admin API later) replace the
desired set; the pool keeps counting in-flight requests of endpoints that drain or disappear until
each request ends. Plain synchronous code, driven from one asyncio loop: no locks, no network I/O.
"""

from picker.pool.endpoint import Endpoint, EndpointState
from picker.pool.view import Lease, Pool

__all__ = ["Endpoint", "EndpointState", "Lease", "Pool"]
