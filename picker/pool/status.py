"""The pool's health as the picker reports it on the InferencePool (picker/sources/pool_status/
writes it): a pure reading of the view and of where the process is in its life, no I/O.

READY while at least one endpoint takes new work; DEGRADED when none does (none listed, none ready,
or every one draining: the reason says which, since "a rollout drained them all" and "the pods never
became ready" call for different fixes); STOPPING once the picker shuts down. No "starting" reading:
the writer starts after the endpoint source's first load or first attempt (an empty view reads
NoReadyEndpoints). A source that cannot be trusted (a missing or invalid InferencePool) is DEGRADED
too, whatever the last view says.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass
from typing import assert_never

from picker.contract.pool_status import CONDITION_STATUS, PoolReason, PoolState
from picker.pool.endpoint import Endpoint, EndpointState


class Phase(enum.Enum):
    """Where the picker process is in its life (closed set)."""

    SERVING = "serving"
    STOPPING = "stopping"


@dataclass(frozen=True, slots=True)
class PoolHealth:
    """One reading: the state, the condition's reason and message, and the counts behind them."""

    state: PoolState
    reason: PoolReason
    message: str
    ready: int = 0
    draining: int = 0
    listed: int = 0  # endpoints the source lists (not GONE)

    @property
    def status(self) -> str:
        """The condition's status: True, False or Unknown."""
        return CONDITION_STATUS[self.state]


def pool_health(endpoints: Iterable[Endpoint], phase: Phase, problem: str | None = None) -> PoolHealth:
    """The pool's health now (see the module's docstring)."""
    ready = draining = listed = 0
    for endpoint in endpoints:
        match endpoint.state:
            case EndpointState.READY:
                ready += 1
            case EndpointState.DRAINING:
                draining += 1
            case EndpointState.NOT_READY:
                pass
            case EndpointState.GONE:
                continue
            case other:
                assert_never(other)
        listed += 1
    counts = {"ready": ready, "draining": draining, "listed": listed}
    tally = f"{ready} of {listed} endpoints ready, {draining} draining"
    match phase:
        case Phase.STOPPING:
            return PoolHealth(
                PoolState.STOPPING, PoolReason.STOPPING, f"the picker is shutting down ({tally})", **counts
            )
        case Phase.SERVING:
            pass
        case other:
            assert_never(other)
    if problem is not None:
        message = f"the endpoint source cannot be used: {problem[:300]} ({tally}, last good view)"
        return PoolHealth(PoolState.DEGRADED, PoolReason.SOURCE_UNAVAILABLE, message, **counts)
    if ready:
        return PoolHealth(PoolState.READY, PoolReason.READY, tally, **counts)
    if listed and draining == listed:
        message = f"every endpoint is draining ({tally}): new requests wait or get 503"
        return PoolHealth(PoolState.DEGRADED, PoolReason.ALL_DRAINING, message, **counts)
    why = "no endpoint listed" if not listed else "no endpoint ready"
    return PoolHealth(
        PoolState.DEGRADED,
        PoolReason.NO_READY_ENDPOINTS,
        f"{why} ({tally}): new requests wait or get 503",
        **counts,
    )
