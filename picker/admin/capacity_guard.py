"""The capacity guard a drain must pass: would the ready replicas left carry the live demand?

The rule is picker/scheduling/capacity.py's; this is that rule over the live pool and queue, as the
admin API's drain route (and a rollback, through the drain store) asks it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from picker.pool import Pool
from picker.scheduling.capacity import Verdict, drain_verdict
from picker.scheduling.signals import Completions, PoolFigures, pool_figures
from picker.sources.drain_store import Check, DrainRefused


class CapacityGuard:
    """The capacity guard over the live pool and queue (picker/scheduling/capacity.py's rule), as the
    drain route asks it; its figures, with the replicas a scale-down could take under the same rule,
    feed the picker_pool_* gauges (picker/scheduling/signals.py). `rate_window_s`: the completions'
    window of the predicted wait (autoscaling.rate_window_s)."""

    def __init__(
        self,
        pool: Pool,
        queued: Callable[[], int],
        engine_slots: int | None,
        headroom: float,
        wait_max_s: float,
        rate_window_s: float,
    ) -> None:
        self.pool, self.queued = pool, queued
        self.engine_slots, self.headroom, self.wait_max_s = engine_slots, headroom, wait_max_s
        self.completions = Completions(rate_window_s, pool.now)
        self._changed = asyncio.Event()
        pool.on_change(self._changed.set)

    def verdict(self, address: str, drained_elsewhere: frozenset[str] = frozenset()) -> Verdict:
        return drain_verdict(
            self.pool.endpoints(),
            address,
            queued=self.queued(),
            engine_slots=self.engine_slots,
            headroom=self.headroom,
            drained_elsewhere=drained_elsewhere,
        )

    def check(self, address: str) -> Check:
        """The verdict again, inside the drain store's write, against the record it replaces."""

        def judge(drained_elsewhere: frozenset[str]) -> None:
            verdict = self.verdict(address, drained_elsewhere)
            if not verdict.allowed:
                raise DrainRefused(verdict.reason, verdict.as_dict())

        return judge

    def figures(self) -> PoolFigures:
        """The pool's signals for the metrics page, read when it is scraped."""
        return pool_figures(
            self.pool.endpoints(),
            queued=self.queued(),
            engine_slots=self.engine_slots,
            headroom=self.headroom,
            completions=self.completions,
        )

    async def changed(self, timeout_s: float) -> None:
        """Returns after the pool's next change (a replacement ready, slots learned) or `timeout_s`."""
        self._changed.clear()
        try:
            await asyncio.wait_for(self._changed.wait(), timeout_s)
        except TimeoutError:
            pass
