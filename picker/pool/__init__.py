"""The per-endpoint view: which model-server endpoints exist, their state and their in-flight work.

Owns `Endpoint` (address, READY / DRAINING / NOT_READY / GONE, in-flight), `Pool`, the one mutable
view every frontend reads, drain records (`drain.py`) and the pure reading of what sources say
(`slices.py`: EndpointSlices -> desired states). Sources (static list, endpoints file, EndpointSlice
watch, admin API; adapters in picker/sources/ and picker/admin/api.py) replace the desired set; the
pool keeps counting in-flight requests of endpoints that drain or disappear until each request ends.
Plain synchronous code, driven from one asyncio loop: no locks, no network or file I/O.
"""

from picker.pool.connections import ClientConnections
from picker.pool.drain import DrainCause, DrainEnd, DrainExit, DrainRecord, DrainTotals
from picker.pool.endpoint import Endpoint, EndpointState
from picker.pool.lease import Lease, PullLease
from picker.pool.roles import Role
from picker.pool.view import EndpointConflict, Pool, UnknownEndpoint

__all__ = [
    "ClientConnections",
    "DrainCause",
    "DrainEnd",
    "DrainExit",
    "DrainRecord",
    "DrainTotals",
    "Endpoint",
    "EndpointConflict",
    "EndpointState",
    "Lease",
    "Pool",
    "PullLease",
    "Role",
    "UnknownEndpoint",
]
