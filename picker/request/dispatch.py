"""Where a request goes: the pick at dispatch (its candidates, the load policy, the affinity choice,
a prefill / decode pair) and, for a stream cut after its commit point, the replica its rest goes to.

The methods of `RequestPath` (pipeline.py) that choose replicas; admission and the books are
pipeline.py's, the response side tracking.py's. No I/O: the frontends send where this says.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING

from picker.observability.metrics import Metrics
from picker.peers.books import Peering
from picker.pool import DrainEnd, Endpoint, EndpointState, Pool
from picker.request.pairing import Pairing
from picker.request.placement import Placement
from picker.rollout import Canary, canary_side
from picker.scheduling import LoadPolicy, pick, without_metrics
from picker.scheduling.fit import CHARS_PER_TOKEN, fits
from picker.scheduling.load import estimated_load
from picker.streams import RequestRecord
from picker.streams.ends import DataPlanes

if TYPE_CHECKING:
    from picker.flow import FlowController

log = logging.getLogger(__name__)


class Dispatch:
    """The pick and the re-pick: the methods of `RequestPath` after admission (state is RequestPath's)."""

    _pool: Pool
    _metrics: Metrics
    _clock: Callable[[], float]
    _rng: random.Random
    _policy: LoadPolicy
    _engaged_policy: LoadPolicy
    _blind_policy: LoadPolicy
    _warned_without_metrics: bool
    _fallback_count: int
    _live: dict[str, RequestRecord]
    _engine_tracked: int
    placement: Placement
    pairing: Pairing
    peering: Peering | None
    canary: Canary | None
    data_planes: DataPlanes
    flow: FlowController[RequestRecord]

    def _candidates(self, record: RequestRecord) -> list[Endpoint]:
        """The READY endpoints this request may go to (its subset hint, its model, its canary side)."""
        candidates = self._pool.ready()
        if record.allowed is not None:
            candidates = [endpoint for endpoint in candidates if endpoint.address in record.allowed]
        if record.need is not None:
            need = record.need
            candidates = [endpoint for endpoint in candidates if fits(endpoint.served, need)]
        if self.pairing.active:  # a prefill / decode pool: decode replicas of complete pairs
            candidates = self.pairing.destinations(record, candidates, self._serves(record))
        if self.canary is not None:
            bound = self.placement.bound_endpoint(record) if record.group is None else None
            home = self._pool.get(bound) if bound is not None else None
            record.group, candidates = canary_side(self.canary, record.group, home, candidates)
        return candidates

    def _live_policy(self) -> LoadPolicy:
        """The load policy new requests are placed by: under `auto` while its predictions are
        engaged, with a bound on the engines' queues (picker/scheduling/load.py `engaged`), unless
        the books could free slots late and so hold requests back: some data plane hides its
        responses' ends, or some request's end is left to the engines' gauges. Not with peers: each
        picker judges `engaged` from its own model, and one holding requests for a free slot while
        another fills each slot as it frees would wait until its requests' time to live."""
        if (
            self.placement.engaged
            and self.peering is None
            and not self._engine_tracked
            and not self.data_planes.blind()
        ):
            return self._engaged_policy
        return self._policy

    def _try_dispatch(self, record: RequestRecord) -> bool:
        started = self._clock()
        started_ns = time.time_ns() if record.trace is not None else 0
        candidates = self._candidates(record)
        count = 1 + (self._fallback_count if record.fallbacks else 0)
        policy = self._live_policy()
        if without_metrics(candidates, policy):
            policy = self._blind_policy  # no candidate has load data: pick by in-flight counts
            self._metrics.count_pick_without_metrics()
            if not self._warned_without_metrics:
                self._warned_without_metrics = True
                log.warning(
                    "no endpoint has load data and every scrape failed (model servers without vLLM "
                    "metrics?): picking by the picker's own in-flight counts"
                )
        suspects = self._pool.health.suspects()  # failing fast: never the primary, last resort only
        stagger = self.peering.stagger if self.peering is not None else None  # several pickers
        choice = self.placement.choose(
            record, candidates, count, self._rng, started, policy, suspects, stagger, self.flow.ahead
        )
        if choice is not None:
            destinations = choice.destinations
        else:
            destinations = pick(candidates, count, self._rng, started, policy, suspects, stagger)
            if destinations and self.placement.latency is not None:  # auto, not engaged: it learns
                self.placement.learns_from(record, destinations[0], None, None, policy, started)
        if not destinations:
            return False
        if self.pairing.active and len(destinations) > 1:
            destinations = self.pairing.same_revision(destinations)
        record.picked = tuple(destinations)
        record.lease = self._pool.lease(destinations[0])
        if self.pairing.active:
            self._pair(record, destinations[0], started, policy, suspects)
        self.placement.dispatched(record, destinations[0])
        if self.peering is not None:
            self.peering.placed(record, destinations[0])
        self._live[record.request_id] = record
        if record.group is not None and self.canary is not None:
            self.canary.routed_to(record.group)
        self._metrics.count_pick(destinations[0], self._clock() - started, record.model, record.priority)
        if record.trace is not None:
            record.trace.picked(record.picked, started_ns)
        return True

    def _pair(
        self,
        record: RequestRecord,
        destination: str,
        now: float,
        policy: LoadPolicy,
        suspects: frozenset[str],
    ) -> None:
        """Name the prefill replica of a request whose destination is a decode replica: its revision
        and canary group, the replica where its uncached prompt would be ready soonest."""
        canary = self.canary
        group = (lambda e: canary.group_of(e.labels)) if canary is not None else None
        keys = record.keys
        size = keys.estimated_tokens if keys is not None else record.body_bytes // CHARS_PER_TOKEN

        def uncached(endpoint: Endpoint) -> float:
            return size * (1.0 - keys.cached_fraction(endpoint)) if keys is not None else size

        ratio = self.placement.tokens.value  # the engines' tokens per index token
        serves = self._serves(record)
        self.pairing.pair(
            record, destination, uncached, ratio, now, policy, self._rng, suspects, group, serves
        )

    @staticmethod
    def _serves(record: RequestRecord) -> Callable[[Endpoint], bool]:
        """Whether an endpoint may compute `record`'s prompt: its model, with scheduling.by_model
        (the data plane's subset hint names destinations only: a prefill replica is the sidecar's
        or the proxy's to reach, not Envoy's)."""
        need = record.need
        return (lambda e: True) if need is None else (lambda e: fits(e.served, need))

    def recomputed(self, record: RequestRecord, why: str | None, end: DrainEnd) -> None:
        """A frontend that runs a pair's steps itself (picker proxy) gave its hand-off up before any
        byte reached the client: the destination computes the prompt. The prefill replica's lease
        ends with `end` (its books too), and so does its prompt's place in that replica's prefill
        backlog: a fallback that serves it computes the prompt itself; counted by `why` (None: not
        counted)."""
        self.pairing.release_pull(record, end)
        if record.prefill_on is not None and record.prefill_at == record.prefill_on:
            self.placement.prefilled(record)
        record.prefill_on = None
        if why is not None:
            self._metrics.count_pd_recompute(why)

    def sweep_pulls(self, timeout_s: float) -> int:
        """`drain.kv_pull_timeout_s`: abandon hand-offs a draining prefill replica still holds."""
        if not self.pairing.active:  # no prefill-only replica READY: a hand-off may still be held
            if not any(e.pulls for e in self._pool.endpoints()):
                return 0
        return self.pairing.sweep(list(self._live.values()), self._clock(), timeout_s)

    def resume(self, record: RequestRecord, failed: str) -> str | None:
        """A stream cut after its commit point is to be continued (picker/streams/resume.py): the
        READY replica to continue it on (never a draining one, nor one it was cut on or tried; the
        one holding its prefix first), its slot moved there; None when there is none (counted).
        The caller counts the resume once it opened (`resumed`), or why it did not."""
        if failed not in record.cut_on:
            record.cut_on = (*record.cut_on, failed)
        target = self.move_target(record, (failed,))
        if target is not None:
            self.moved(record, target)
        return target

    def move_target(self, record: RequestRecord, tried: Collection[str]) -> str | None:
        """Where the rest of a stream would go (as `resume` chooses, and never to one of `tried`
        nor where it runs now), nothing moved yet: a stream still running moves only once its
        continuation has opened. None when there is nowhere (counted)."""
        candidates = [
            e
            for e in self._resume_candidates(record)
            if e.address not in tried and e.address != record.served
        ]
        if not candidates:
            self._metrics.count_resume("no-replica")
            return None
        suspects = self._pool.health.suspects() | set(tried)
        choice = self.placement.choose(
            record, candidates, 1, self._rng, self._clock(), self._policy, suspects
        )
        found = choice.destinations if choice is not None and choice.destinations else None
        found = found or pick(candidates, 1, self._rng, self._clock(), self._policy, suspects)
        # the stream held a slot already: it moves with it even where every replica looks full
        # (or its sample is stale), queued on an engine rather than cut
        return found[0] if found else min(candidates, key=estimated_load).address

    def moved(self, record: RequestRecord, target: str) -> None:
        """The rest of the stream is asked of `target`: its slot and its place in the books move
        there, and its new part is judged afresh."""
        record.resumed_on = (*record.resumed_on, target)
        record.stalled = record.stall_kept = False  # its new part is judged afresh ...
        record.part_started_at = self._clock()  # ... its silence counted from now
        record.served = target
        if record.lease is not None:
            record.lease.move(target)
        self.placement.dispatched(record, target)
        if self.peering is not None:
            self.peering.placed(record, target, moved=True)

    def _resume_candidates(self, record: RequestRecord) -> list[Endpoint]:
        tried = {*record.cut_on, *record.resumed_on}  # never back to a replica that cut it
        return [e for e in self._candidates(record) if e.address not in tried]

    def movable(self, record: RequestRecord) -> bool:
        """A stalled stream may move: some READY replica it was not on has room for it now (a move
        to a full or absent one would only cut it)."""
        candidates = [e for e in self._resume_candidates(record) if e.address != record.served]
        return bool(candidates) and bool(pick(candidates, 1, self._rng, self._clock(), self._policy))

    def may_stay(self, record: RequestRecord) -> bool:
        """A stream asked to move may run on where it is should no replica take it: its replica is
        not gone (a gone one will never send again: its part is ended first, as after a cut)."""
        endpoint = self._pool.get(record.endpoint or "")
        return endpoint is not None and endpoint.state is not EndpointState.GONE

    def kept(self, record: RequestRecord) -> None:
        """A move found no replica to open the stream's rest: it runs on where it was (a stalled
        one waits there, judged afresh once it sends again; counted `stall-kept`)."""
        if record.stalled and not record.stall_kept:
            record.stall_kept = True
            self._metrics.count_resume("stall-kept")

    def resumed(self, why: str) -> None:
        """A cut stream continued: counted once, with why it was cut."""
        self._metrics.count_resume(why)

    def resume_refused(self, reason: str) -> None:
        """A cut stream was not continued after all (the limit, the continuation failed, what the
        stream showed)."""
        self._metrics.count_resume(reason)
