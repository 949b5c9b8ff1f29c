"""The pool's autoscaling signals: demand against ready capacity, saturation, predicted wait, and
how many replicas a scale-down could take now (the capacity guard's view, picker/scheduling/capacity.py).

Figures an HPA or KEDA scales on, computed when /metrics is read and never on the request path: the
endpoints' counters are read as they stand. Pure functions over the view, and one small object
(`Completions`) that remembers the last readings; the clock is a parameter. No I/O.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from picker.pool.endpoint import Endpoint, EndpointState
from picker.scheduling.capacity import demand, ready_capacity, removable_replicas


@dataclass(frozen=True, slots=True)
class PoolFigures:
    """One reading of the pool's signals; None where a figure cannot be known (see each)."""

    ready_capacity: int | None  # slots of the READY endpoints; None: a slot count unknown
    demand: float  # requests in flight on every endpoint (every picker's) + this picker's queue
    saturation: float | None  # demand / ready capacity (see `saturation`)
    removable: int | None  # replicas a scale-down could take now, the guard allowing each
    predicted_wait_s: float | None  # a newcomer's wait for a ready slot (see `predicted_wait_s`)


def saturation(load: float, capacity: int | None) -> float | None:
    """Demand over ready capacity: 1.0 is every ready slot busy, above it requests wait.

    With no ready slot at all, the demand itself (as if one slot were ready): above 0 from the
    first request, so an autoscaler scales up, and 0 when nothing is asked. None when a ready
    endpoint's slot count is unknown."""
    if capacity is None:
        return None
    return load / capacity if capacity > 0 else load


def predicted_wait_s(busy: float, capacity: int | None, queued: int, per_s: float | None) -> float | None:
    """A request arriving now waits until a READY slot is free: behind the requests beyond the ready
    slots (this picker's queue where the slot count is unknown), until that many and one more end,
    at the pool's recent rate. `busy`: the queue and the requests in flight on READY endpoints (a
    draining replica's streams hold no slot a newcomer could get, and are not ahead of it).

    0 while a ready slot is free (slots unknown: nothing queued). None before a window has passed,
    and when requests wait and none ended over the window: a wait without bound is no figure (never
    +Inf, which an autoscaler cannot use), as any unknown one."""
    if capacity is None:
        if queued <= 0:
            return 0.0
        ahead = float(queued)
    else:
        if busy < capacity:
            return 0.0
        ahead = busy - capacity
    if per_s is None or per_s <= 0:
        return None
    wait = (ahead + 1) / per_s
    return wait if math.isfinite(wait) else None


class Completions:
    """Requests leaving the pool's endpoints per second over the last `window_s`, from each
    endpoint's departures counter, read at scrape time (nothing counted on the request path).

    An endpoint forgotten between two readings takes its last departures with it: the rate reads a
    little low then (the wait a little long), never high."""

    def __init__(self, window_s: float, clock: Callable[[], float]) -> None:
        self._window_s, self._clock = window_s, clock
        self._seen: dict[str, int] = {}
        self._total = 0
        self._readings: deque[tuple[float, int]] = deque()

    def per_s(self, endpoints: Iterable[Endpoint]) -> float | None:
        """The rate over the window, from the oldest reading in it (None at the first reading)."""
        now = self._clock()
        first = not self._readings
        seen: dict[str, int] = {}
        for endpoint in endpoints:
            count = endpoint.departures
            before = self._seen.get(endpoint.address, count if first else 0)
            self._total += count - before if count >= before else count  # a new endpoint, same address
            seen[endpoint.address] = count
        self._seen = seen
        self._readings.append((now, self._total))
        while len(self._readings) > 2 and now - self._readings[1][0] >= self._window_s:
            self._readings.popleft()  # keep the newest reading at least window_s old
        since, total = self._readings[0]
        return None if now <= since else (self._total - total) / (now - since)


def pool_figures(
    endpoints: Iterable[Endpoint],
    *,
    queued: int,
    engine_slots: int | None,
    headroom: float,
    completions: Completions,
) -> PoolFigures:
    """Every signal from one look at the endpoints and the queue."""
    listed = list(endpoints)
    capacity = ready_capacity(listed, engine_slots)
    load = demand(listed, queued)
    busy = demand((e for e in listed if e.state is EndpointState.READY), queued)
    return PoolFigures(
        ready_capacity=capacity,
        demand=load,
        saturation=saturation(load, capacity),
        removable=removable_replicas(listed, queued=queued, engine_slots=engine_slots, headroom=headroom),
        predicted_wait_s=predicted_wait_s(busy, capacity, queued, completions.per_s(listed)),
    )
