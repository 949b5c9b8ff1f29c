"""Load policy: how busy an endpoint is now, whether it can take one more request, and its score.

Between two scrapes the picker's own in-flight count is the freshest signal: every request it
dispatched since the scrape is on the engine, every one that ended left it. With the engine's slot
count (configured, or learned from a scrape that showed a queue) that gives the engine queue at
any moment, not only at scrape time.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from picker.config.model import AffinityConfig, LoadConfig
from picker.pool.load import LoadSample


class LoadView(Protocol):
    @property
    def in_flight(self) -> int: ...

    @property
    def peer_in_flight(self) -> int: ...

    @property
    def arrivals(self) -> int: ...

    @property
    def peer_arrivals(self) -> int: ...

    @property
    def departures(self) -> int: ...

    @property
    def superseded(self) -> int: ...

    @property
    def load(self) -> LoadSample | None: ...

    @property
    def learned_slots(self) -> int: ...


@dataclass(frozen=True, slots=True)
class LoadPolicy:
    use_metrics: bool = True
    staleness_s: float = 2.0
    waiting_threshold: float = 1.0  # saturated at this many (estimated) queued requests on the engine
    kv_threshold: float = 0.9  # saturated at this KV-cache usage
    engine_slots: int | None = None  # vLLM --max-num-seqs, if known
    # with the slots known: saturated when one more request would make more than this many wait on
    # the engine (0: a request waits in the picker, not on an engine). None: `waiting_threshold`.
    engine_queue: float | None = None
    weight_load: float = 1.0  # per request the engine holds
    weight_waiting: float = 2.0  # extra per request queued on the engine
    weight_kv: float = 10.0  # per full KV cache
    # affinity.latency auto: `engine_queue` while the predictions are engaged (`engaged`)
    engaged_queue: float | None = None

    @classmethod
    def of(cls, load: LoadConfig, affinity: AffinityConfig) -> LoadPolicy:
        """From the configuration: `load.*`, and with `affinity.latency: on` its engine queue bound (with
        `auto`, the request path applies it while the predictions are engaged: `engaged`)."""
        return cls(
            use_metrics=load.scrape,
            staleness_s=load.staleness_s,
            waiting_threshold=load.waiting_threshold,
            kv_threshold=load.kv_threshold,
            engine_slots=load.engine_slots,
            engine_queue=affinity.latency_engine_queue if affinity.latency == "on" else None,
            weight_load=load.weight_load,
            weight_waiting=load.weight_waiting,
            weight_kv=load.weight_kv,
            engaged_queue=affinity.latency_engine_queue if affinity.latency == "auto" else None,
        )

    def engaged(self) -> LoadPolicy:
        """The policy while `auto`'s predictions are engaged: `on`'s engine queue bound, so that a
        request waits in the picker and goes to the first slot that frees anywhere (one queue for the
        pool), not to one engine's queue: on a mixed pool a request queued on a slow engine waits
        for it, where one held in the picker takes the first slot that frees anywhere
        (loadtest/bench_shapes.py)."""
        if self.engaged_queue is None:
            return self
        return replace(self, engine_queue=self.engaged_queue, engaged_queue=None)


def counted(view: LoadView) -> float:
    """This picker's and its peers' requests on the endpoint, less those a newer request on the same
    client connection shows have ended (their end not heard yet: picker/peers/books.py)."""
    return float(max(0, view.in_flight + view.peer_in_flight - view.superseded))


def estimated_load(view: LoadView) -> float:
    """Requests the engine holds now (running + waiting), from the last scrape and what changed since."""
    sample = view.load
    if sample is None:
        return counted(view)
    # Only this picker's own sends: a peer's pick reaches it after the request reached the engine
    # (so the scrape may count it already), and `counted` holds it anyway. Counted twice, it would
    # make this picker shun that replica until the next scrape.
    own_since = view.arrivals - view.peer_arrivals
    sent_since = own_since - (sample.arrivals_before - sample.peer_arrivals_before)
    ended_since = view.departures - sample.departures_after
    # The pickers' own in-flight counts are exact for their requests: they cover requests still on
    # their way to the engine when the scrape was taken, which the scrape cannot have counted. The
    # scrape's side still holds the superseded (their end not heard: not in `ended_since`).
    scraped = sample.running + sample.waiting + sent_since - ended_since - view.superseded
    return max(counted(view), scraped)


def books_gap(view: LoadView) -> float:
    """The books' error at a scrape, just read: what the pickers count on the endpoint less what its
    engine holds (running + waiting) and less what this picker sent since the scrape was sent (on
    its way there). About 0 where every end is seen; where ends are hidden, the ends since the last
    scrape (the picker's view lags by one scrape interval)."""
    sample = view.load
    if sample is None:
        return 0.0
    own_since = (view.arrivals - view.peer_arrivals) - (sample.arrivals_before - sample.peer_arrivals_before)
    return counted(view) - sample.running - sample.waiting - own_since


def estimated_waiting(view: LoadView, policy: LoadPolicy) -> float:
    """Requests queued on the engine now (0 without a scrape)."""
    sample = view.load
    return 0.0 if sample is None else _queued(estimated_load(view), sample, view, policy)


def _queued(load: float, sample: LoadSample, view: LoadView, policy: LoadPolicy) -> float:
    slots = policy.engine_slots or view.learned_slots
    if slots:
        return max(0.0, load - slots)
    return sample.waiting  # slots unknown: only the scrape can tell


def room(views: Sequence[LoadView], policy: LoadPolicy) -> tuple[int, int] | None:
    """(free batch slots, batch slots) summed over `views`; None while some view's slots are not
    known (configured, or learned from a scrape that showed a queue) or there is none."""
    free = total = 0
    for view in views:
        slots = policy.engine_slots or view.learned_slots
        if not slots:
            return None
        total += slots
        free += max(0, slots - math.ceil(estimated_load(view)))
    return (free, total) if total else None


def saturated(view: LoadView, now: float, policy: LoadPolicy) -> bool:
    """No room for one more request. Stale or missing metrics count as saturated, never as idle."""
    return assess(view, now, policy)[0]


def assess(view: LoadView, now: float, policy: LoadPolicy) -> tuple[bool, float]:
    """(saturated, score; lower is better) in one pass: what `pick` needs of every candidate."""
    if not policy.use_metrics:
        return False, counted(view)  # (a view without load samples: only the counts)
    full, score, _ = measure(view, now, policy)
    return full, score


def measure(view: LoadView, now: float, policy: LoadPolicy) -> tuple[bool, float, float]:
    """(saturated, score, `estimated_load`) in one pass: what a row of the pick holds
    (picker/scheduling/rows.py); the load is computed once for all three."""
    if not policy.use_metrics:
        return False, counted(view), estimated_load(view)
    sample = view.load
    if sample is None:
        load = counted(view)
        return True, load, load
    load = estimated_load(view)
    waiting = _queued(load, sample, view, policy)
    kv = sample.kv_usage
    slots = policy.engine_slots or view.learned_slots
    if policy.engine_queue is not None and slots:
        queue_full = load + 1.0 - slots > policy.engine_queue
    else:
        queue_full = waiting >= policy.waiting_threshold
    full = now - sample.at > policy.staleness_s or queue_full or kv >= policy.kv_threshold
    return full, policy.weight_load * load + policy.weight_waiting * waiting + policy.weight_kv * kv, load


def busy(view: LoadView, now: float, policy: LoadPolicy) -> bool:
    """Saturated only because every batch slot is taken (its figures fresh, its KV cache not full):
    a slot frees when one of its requests ends, so waiting for it is a choice, not a gamble."""
    return busy_when(view, now, policy, assess(view, now, policy)[0])


def busy_when(view: LoadView, now: float, policy: LoadPolicy, full: bool) -> bool:
    """`busy`, given whether the endpoint is saturated (`measure` said so already)."""
    sample = view.load
    return (
        full
        and policy.use_metrics
        and sample is not None
        and now - sample.at <= policy.staleness_s
        and sample.kv_usage < policy.kv_threshold
    )


class ScrapeView(Protocol):
    @property
    def load(self) -> LoadSample | None: ...

    @property
    def scrape_failures(self) -> int: ...


def without_metrics(candidates: Sequence[ScrapeView], policy: LoadPolicy) -> bool:
    """Scraping is on, yet no candidate has load data and every one has failed its scrapes: model
    servers without vLLM's metrics (echo servers, other engines). Counting them all as saturated
    would queue every request until its TTL; the caller picks by its own in-flight counts instead
    (`LoadPolicy(use_metrics=False)`). Before the first scrape (no failure yet) this is False."""
    return (
        policy.use_metrics
        and bool(candidates)
        and all(c.load is None and c.scrape_failures > 0 for c in candidates)
    )
