"""Stalls: when a stream's silence is a stall, and the loop that looks for them (and the loop that
applies `drain.kv_pull_timeout_s` to prefill hand-offs, picker/request/pairing.py).

A part that has had no token yet on a replica whose fresh scrape shows requests waiting is queued
there (a cold or busy engine), not stalled: moving it would only queue it elsewhere, and judging it
cut would cut it. `ResponseSide.sweep_stalls` (tracking.py) applies the rest of the rule.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

from picker.pool import EndpointState, Pool
from picker.streams import RequestRecord

log = logging.getLogger(__name__)

QUEUED_AT_MOST = 4  # a part is "queued" for at most this many stall bounds (a cold vLLM: 3.5-14 s)


class Sweeps(Protocol):
    def sweep_stalls(self) -> int: ...


def queued_on_engine(record: RequestRecord, pool: Pool, now: float, stall_after_s: float) -> bool:
    """This part has had no token yet and its replica's last scrape, fresh, showed requests waiting:
    it is queued there, not stalled (a dead replica's last gauges say nothing), for a while."""
    tracker, started = record.tracker, record.part_started_at
    last_chunk_at = tracker.last_chunk_at if tracker is not None else None
    if last_chunk_at is not None and (started is None or last_chunk_at >= started):
        return False
    began = started if started is not None else record.response_started_at
    if began is None or now - began >= QUEUED_AT_MOST * stall_after_s:
        return False  # a hung engine's API server goes on showing its last queue: not for ever
    endpoint = pool.get(record.endpoint or "")
    if endpoint is None or endpoint.state is EndpointState.GONE or endpoint.load is None:
        return False
    return endpoint.load.waiting > 0 and now - endpoint.load.at < stall_after_s


async def sweep_stalls(path: Sweeps, stall_after_s: float) -> None:
    """Forever: mark (and end, when their endpoint is gone) streams silent past the stall bound.

    Supervised: a sweep that raises is logged and the next one runs (one bad record must not stop
    the sweep for good, which would leave every later stall uncounted)."""
    interval = max(0.05, stall_after_s / 4)
    while True:
        await asyncio.sleep(interval)
        try:
            path.sweep_stalls()
        except Exception:
            log.exception("stall sweep failed; the next one runs in %.2f s", interval)


class PullSweeps(Protocol):
    def sweep_pulls(self, timeout_s: float) -> int: ...


async def sweep_pulls(path: PullSweeps, timeout_s: float) -> None:
    """Forever: apply `drain.kv_pull_timeout_s` (checked every second, or ten times per bound when
    shorter: a hand-off is given up within a second of it). Supervised as the stall sweep is: one
    that raises is logged and the next one runs."""
    interval = max(0.05, min(1.0, timeout_s / 10))
    while True:
        await asyncio.sleep(interval)
        try:
            path.sweep_pulls(timeout_s)
        except Exception:
            log.exception("pull sweep failed; the next one runs in %.2f s", interval)
