"""The picker's own graceful shutdown: one budget, spent in named phases, driven by events.

1. propagate: readiness goes NOT_SERVING (liveness stays SERVING) and requests are still admitted
   and dispatched, because the load balancer in front may not have noticed yet. The phase ends
   when no request has arrived for two quiet intervals, or when the propagation window ends.
2. evict: every queued request gets a retryable 503 `rejected-shutting-down`; so does every newcomer.
3. drain: dispatched requests keep their ext_proc streams until each ends, or the deadline.
4. done: one summary line; the caller stops the servers and exits 0 before the deadline.
A second signal (`force`) skips straight to the end.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from picker.config.model import ShutdownConfig
from picker.request.pipeline import RequestPath

log = logging.getLogger(__name__)


@dataclass
class ShutdownSummary:
    queued_at_start: int = 0
    live_at_start: int = 0
    arrivals_during: int = 0
    evicted: int = 0
    live_by_phase: dict[str, int] = field(default_factory=dict)
    cut_at_deadline: int = 0
    forced: bool = False
    seconds: float = 0.0

    def line(self) -> str:
        phases = " ".join(f"live_after_{k}={v}" for k, v in self.live_by_phase.items())
        return (
            f"picker shutdown done seconds={self.seconds:.2f} queued_at_start={self.queued_at_start} "
            f"live_at_start={self.live_at_start} arrivals_during={self.arrivals_during} "
            f"evicted={self.evicted} {phases} cut_at_deadline={self.cut_at_deadline} forced={self.forced}"
        )


class Shutdown:
    def __init__(
        self,
        path: RequestPath,
        not_ready: Callable[[], Awaitable[None]],
        config: ShutdownConfig,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._path = path
        self._not_ready = not_ready
        self._config = config
        self._clock = clock
        self._idle = asyncio.Event()
        path.on_idle(self._idle.set)

    async def run(self, force: asyncio.Event) -> ShutdownSummary:
        started = self._clock()
        deadline = started + self._config.drain_timeout_s
        arrivals_before = self._path.arrivals
        summary = ShutdownSummary(queued_at_start=self._path.flow.queued, live_at_start=self._path.live)
        log.info(
            "picker shutdown started budget_s=%.1f queued=%d live=%d",
            self._config.drain_timeout_s,
            summary.queued_at_start,
            summary.live_at_start,
        )

        await self._not_ready()
        await self._propagate(started, min(deadline, started + self._config.propagation_s), force)
        summary.live_by_phase["propagate"] = self._path.live

        summary.evicted = self._path.flow.close()
        summary.live_by_phase["evict"] = self._path.live

        await self._drain(deadline, force)
        summary.live_by_phase["drain"] = self._path.live
        summary.cut_at_deadline = self._path.live
        summary.forced = force.is_set()
        summary.arrivals_during = self._path.arrivals - arrivals_before
        summary.seconds = self._clock() - started
        log.info(summary.line())
        return summary

    async def _propagate(self, started: float, window_end: float, force: asyncio.Event) -> None:
        quiet_needed = 2 * self._config.quiet_interval_s
        while not force.is_set():
            now = self._clock()
            last = max(started, self._path.last_arrival_at or started)
            quiet_left = quiet_needed - (now - last)
            if quiet_left <= 0 or now >= window_end:
                return
            await _wait(force, min(quiet_left, window_end - now))

    async def _drain(self, deadline: float, force: asyncio.Event) -> None:
        if self._path.live == 0:
            return
        self._idle.clear()
        if self._path.live == 0:
            return
        idle = asyncio.ensure_future(self._idle.wait())
        forced = asyncio.ensure_future(force.wait())
        try:
            await asyncio.wait(
                {idle, forced},
                timeout=max(0.0, deadline - self._clock()),
                return_when=asyncio.FIRST_COMPLETED,
            )
        finally:
            idle.cancel()
            forced.cancel()


async def _wait(event: asyncio.Event, seconds: float) -> None:
    """Until `event` is set or `seconds` pass, whichever is first."""
    try:
        await asyncio.wait_for(event.wait(), seconds)
    except TimeoutError:
        pass
