"""Prefill / decode pairs on the request path: the destinations a disaggregated pool offers, the
prefill replica named beside the destination, and the books of the hand-off.

The rules are picker/scheduling/pairs.py's; this keeps the state they act on:
- `destinations` narrows a request's candidates to decode-capable endpoints of revisions with a
  complete pair (a pool without prefill-only endpoints passes through untouched, at the cost of one
  scan for a prefill-only role);
- `pair` runs once the destination is chosen: the decider, then the prefill replica (same revision,
  same canary group), named in `x-prefiller-host-port`; the prefill replica is leased for the
  hand-off (picker/pool/lease.py `PullLease`), so its load and its drain both count it;
- `pulled` (the destination's first token: its KV is in place) and `ended` release that lease;
- `sweep` applies `drain.kv_pull_timeout_s`: a draining prefill replica's hand-offs still unpulled
  at the bound are abandoned (the decode side recomputes), so a drain never waits without end.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

from picker.config.model import PdConfig
from picker.contract import headers
from picker.observability.metrics import Metrics
from picker.pool import DrainEnd, Endpoint, Pool
from picker.pool.roles import LLM_D_ROLE, role_of
from picker.scheduling import LoadPolicy
from picker.scheduling.pairs import (
    destinations,
    disaggregated,
    pick_prefill,
    prefill_candidates,
    wants_prefill,
)
from picker.streams import RequestRecord
from picker.streams.classify import drain_end
from picker.streams.record import EndReason

Group = Callable[[Endpoint], str]  # an endpoint's canary group, while a canary runs
Serves = Callable[[Endpoint], bool]  # whether an endpoint may compute this request's prompt (its model)


class Books(Protocol):
    """The shared books of several pickers (picker/peers/books.py `Peering`)."""

    def pulling(self, record: RequestRecord, address: str, held: bool = True) -> None: ...


class Pairing:
    def __init__(self, pool: Pool, config: PdConfig, metrics: Metrics) -> None:
        self._pool = pool
        self._config = config
        self._metrics = metrics
        self._revision_label = config.revision_label
        self.peering: Books | None = None  # several pickers: a hand-off is booked on its replica for all
        pool.role_labels = tuple(dict.fromkeys((config.role_label, LLM_D_ROLE)))
        for endpoint in pool.endpoints():  # labels read before the role label was configured
            endpoint.role = role_of(endpoint.labels, pool.role_labels)
        # kept current on every pool change (roles change only with labels, which are one): whether
        # some READY endpoint serves prefill alone (pairs), and whether the request path asks this
        # at all (pairs, or an endpoint whose role label names no role): a pool without roles pays
        # one attribute read per request
        self.disaggregated = self.active = False
        self._changed()
        pool.on_change(self._changed)

    def _changed(self) -> None:
        ready = self._pool.ready()
        self.disaggregated = disaggregated(ready)
        self.active = self.disaggregated or any(e.role is None for e in ready)

    def revision(self, endpoint: Endpoint) -> str | None:
        labels = endpoint.labels
        return labels.get(self._revision_label) if labels is not None else None

    def destinations(
        self, record: RequestRecord, candidates: list[Endpoint], serves: Serves
    ) -> list[Endpoint]:
        """The candidates that may be the destination (all of them in a pool without roles). Pairs
        are judged for this request: `serves` says whether a READY endpoint may compute its prompt
        (its model), so a revision whose prefill replicas serve other models is no pair for it."""
        if not self.disaggregated:  # only an endpoint whose role label names no role to leave out
            return [e for e in candidates if e.role is not None]
        ready = self._pool.ready()
        allowed, paired = destinations(candidates, [e for e in ready if serves(e)], self.revision)
        record.unpaired = not paired
        return allowed

    def pair(
        self,
        record: RequestRecord,
        destination: str,
        uncached_tokens: Callable[[Endpoint], float],
        ratio: float,
        now: float,
        policy: LoadPolicy,
        rng: random.Random,
        suspects: frozenset[str],
        group: Group | None,
        serves: Serves,
    ) -> None:
        """Name a prefill replica for `record`, whose destination is `destination`, when the pool is
        disaggregated and the decider takes the hop; counted either way. `uncached_tokens`: the
        prompt's part an endpoint does not hold, in the index's tokens (the prefill backlogs' unit);
        `ratio`: the engines' tokens per index token (the decider's threshold is in engine tokens)."""
        home = self._pool.get(destination)
        if home is None or not self.disaggregated:
            return
        if record.unpaired:
            self._metrics.count_pd_pick("unpaired")
            return
        if not wants_prefill(uncached_tokens(home) * ratio, self._config.prefill_min_tokens):
            self._metrics.count_pd_pick("short")
            return
        ready = [e for e in self._pool.ready() if serves(e)]
        found: Sequence[Endpoint] = prefill_candidates(ready, home, self.revision)
        if group is not None:
            side = group(home)
            found = [e for e in found if group(e) == side]
        chosen = pick_prefill(found, uncached_tokens, now, policy, rng, suspects)
        if chosen is None:
            self._metrics.count_pd_pick("no-prefill")
            return
        record.prefill_on = chosen.address
        record.prefill = uncached_tokens(chosen)  # the backlog it adds there (placement.dispatched)
        record.pull = self._pool.lease(chosen.address, pull=True)
        if self.peering is not None:
            self.peering.pulling(record, chosen.address)
        self._metrics.count_pd_pick("pair")

    def same_revision(self, destinations: Sequence[str]) -> list[str]:
        """The primary and the fallbacks of its revision: a fallback of another revision would pull
        the named prefill replica's KV across revisions."""
        primary = self._pool.get(destinations[0])
        mine = self.revision(primary) if primary is not None else None
        return [a for a in destinations if (e := self._pool.get(a)) is not None and self.revision(e) == mine]

    def headers(self, record: RequestRecord) -> tuple[tuple[str, str], ...]:
        """The headers naming the pair's prefill replica ((): none)."""
        return ((headers.PREFILLER, record.prefill_on),) if record.prefill_on else ()

    def pulled(self, record: RequestRecord) -> None:
        """The destination sent its first byte: a token, so the prompt's KV is in place and the
        hand-off is done; or an error (a status of 400 or more, an error event), which is how a
        decode whose pull failed answers: the hand-off ended with the request's failure."""
        if record.pull is None:  # no hand-off: every request's first token asks
            return
        self.release_pull(record, DrainEnd.UPSTREAM_ERROR if _failed(record) else DrainEnd.PULLED)

    def ended(self, record: RequestRecord) -> None:
        """The request ended: a hand-off still held ends with it, as the request did."""
        if record.pull is None or not record.pull.held:
            return
        reason, tracker = record.end_reason, record.tracker
        answered = reason is EndReason.COMPLETED
        answered = answered or (tracker is not None and tracker.first_byte_at is not None)
        if answered and not _failed(record):
            self.release_pull(record, DrainEnd.PULLED)
        elif answered:
            self.release_pull(record, DrainEnd.UPSTREAM_ERROR)
        else:
            self.release_pull(record, drain_end(reason) if reason is not None else DrainEnd.UNKNOWN)

    def sweep(self, records: Iterable[RequestRecord], now: float, timeout_s: float) -> int:
        """Abandon the hand-offs of prefill replicas draining for `timeout_s`
        (`drain.kv_pull_timeout_s`)."""
        abandoned = 0
        for record in records:
            if record.pull is None or not record.pull.held:
                continue
            endpoint = self._pool.get(record.prefill_on or "")
            drain = endpoint.drain if endpoint is not None else None
            if drain is not None and now - drain.started_at >= timeout_s:
                self.release_pull(record, DrainEnd.PULL_ABANDONED)
                self._metrics.count_pd_pull_abandoned()
                abandoned += 1
        return abandoned

    def release_pull(self, record: RequestRecord, end: DrainEnd) -> None:
        """End the hand-off's claim on the prefill replica (`end`: how it ended), once, and tell the
        other pickers' books."""
        if record.pull is not None and record.pull.held:
            record.pull.release(end)
            if self.peering is not None and record.prefill_on:
                self.peering.pulling(record, record.prefill_on, held=False)


def _failed(record: RequestRecord) -> bool:
    """The destination answered with an error (a status of 400 or more, or an error event)."""
    tracker = record.tracker
    return (record.status or 0) >= 400 or (tracker is not None and tracker.error_event)
