"""Cache-aware picking: sticky to what an endpoint holds until it saturates, never into a drain.

Candidates are READY endpoints only (the pool's rule: a draining, not-ready or gone endpoint is never
a candidate, whatever its cache holds). For each the caller gives what the request would find there
(`Affinity`: the cached share of the prompt, a LoRA score, whether the request's session is bound
there). Then, among the candidates with room (not saturated, not suspect):
1. **Session**: the endpoint the session is bound to, while it has room and its load is within the
   allowed gap of the least loaded one.
2. **LoRA** (for a request naming an adapter some candidate runs or queues): only the best tier
   within the gap, the reference's scores: running 1, a free adapter slot 0.8, waiting 0.6.
3. **Sticky prefix** (the reference's prefix-cache affinity filter, with its TTFT penalty): among
   the endpoints within the gap (`max_load_gap` requests of the least loaded, or `load_gap_ratio`
   of its load when larger) and in balance (their load averaged over the last seconds at most
   `balance_ratio` above the pool's average: a hot prefix's endpoint that stays busier than the
   rest is out of balance, a moment's swing is not) that hold at least `sticky_threshold` of the
   prompt, the one where the
   request waits for the fewest prefill tokens (its backlog of uncached prompt tokens not started,
   plus what this prompt lacks there), unless that wait exceeds the quickest endpoint's by more than
   `prefill_penalty_tokens`. A hot prefix whose endpoint falls behind goes where computing it again
   is quicker, and that endpoint learns it: the prefix spreads as far as its load needs.
4. **Score**: otherwise the best weighted sum of the prefix share (counted only within the load
   gap: past it, what an endpoint holds earns nothing), the load score (1 for the least loaded, 0 for
   the most, min-max as the reference's queue scorer), the LoRA score and the cache's room (a cold
   prompt goes where it evicts least, as the reference's no-hit-LRU scorer spreads cold requests);
   ties random.
With `affinity.latency` (picker/scheduling/latency.py), each candidate comes with its predicted time
to the request's first and last token: the replicas within the latency gap of the quickest on both
(or, when none is, on the first token), and meeting the request's SLO when some can, replace the
load gap in every step above, and the score adds `latency_weight` for the quickest. When a busy
replica (every slot taken) is predicted to finish the request sooner, its wait for a slot counted,
than every one with room by more than the gap, the request waits in the picker for a slot ("wait":
a cold prompt is not sent to a replica that prefills and decodes at half the speed just because it
has room). Fallbacks follow as `pick` orders them. No I/O; the weights come from configuration.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from picker.config.model import AffinityConfig
from picker.scheduling.load import LoadPolicy, assess, busy, estimated_load
from picker.scheduling.pick import Candidate, Stagger


@dataclass(frozen=True, slots=True)
class AffinityPolicy:
    """The weights and bounds of the affinity pick (their defaults and meaning: config.AffinityConfig)."""

    prefix_weight: float
    load_weight: float
    lora_weight: float
    room_weight: float
    sticky_threshold: float
    max_load_gap: float
    load_gap_ratio: float
    balance_ratio: float
    prefill_penalty_tokens: float
    latency_weight: float = 0.0
    latency_gap_ratio: float = 0.3
    latency_gap_s: float = 0.1

    @classmethod
    def of(cls, config: AffinityConfig) -> AffinityPolicy:
        return cls(
            prefix_weight=config.prefix_weight,
            load_weight=config.load_weight,
            lora_weight=config.lora_weight,
            room_weight=config.room_weight,
            sticky_threshold=config.sticky_threshold,
            max_load_gap=config.max_load_gap,
            load_gap_ratio=config.load_gap_ratio,
            balance_ratio=config.balance_ratio,
            prefill_penalty_tokens=config.prefill_penalty_tokens,
            latency_weight=config.latency_weight if config.latency else 0.0,
            latency_gap_ratio=config.latency_gap_ratio,
            latency_gap_s=config.latency_gap_s,
        )


@dataclass(frozen=True, slots=True)
class Affinity:
    """What one request would find on one candidate."""

    cached: float = 0.0  # share of the prompt held there (0-1)
    lora: float = 0.0  # 1 adapter running, 0.8 a free adapter slot, 0.6 adapter waiting, 0 none
    session: bool = False  # the request's session is bound there
    # prefill tokens it would wait for there: the candidate's backlog plus its own uncached tokens
    prefill: float = 0.0
    room: float = 1.0  # the share of the candidate's cache not yet known to be taken (0-1)
    load_avg: float = 0.0  # its load averaged over the last seconds (sustained, not a swing)
    # affinity.latency: its predicted seconds to this request's first token, and per output token
    ttft_s: float | None = None
    tpot_s: float | None = None
    # ... and to its last token (TTFT + TPOT x the tokens it asks for): what the pick minimizes
    latency_s: float | None = None


_BALANCE_SLACK = 0.05  # requests: a pool at rest is never out of balance


@dataclass(frozen=True, slots=True)
class Choice:
    destinations: list[str]
    # "session", "lora", "sticky", "score", "wait" (a busy replica is quicker) or "" (none had room):
    # for metrics and traces
    reason: str


@dataclass(slots=True)
class _Row:
    suspect: bool
    full: bool
    cost: float  # the load score of `assess` (lower is better)
    tiebreak: float
    candidate: Candidate
    affinity: Affinity

    @property
    def order(self) -> tuple[bool, bool, float, float]:
        """`pick`'s order: suspects last, saturated after those with room, then by load."""
        return self.suspect, self.full, self.cost, self.tiebreak


def pick_with_affinity(
    candidates: Sequence[Candidate],
    affinities: Sequence[Affinity],
    count: int,
    rng: random.Random,
    now: float,
    load: LoadPolicy,
    policy: AffinityPolicy,
    last_resort: frozenset[str] = frozenset(),
    stagger: Stagger | None = None,
    slo: tuple[float | None, float | None] | None = None,
    ahead: int = 0,
) -> Choice:
    """Up to `count` addresses, primary first; no destinations when no candidate has room.

    With `stagger` (several pickers), loads compare in whole requests and ties go by the picker's
    own order (`Stagger`), not at random. `slo`: the request's (TTFT, TPOT) objectives in seconds:
    the replicas predicted to meet them are preferred (when none is, the quickest). `ahead`: the
    requests waiting in the picker ahead of this one."""
    if count <= 0 or not candidates:
        return Choice([], "")
    rows = []
    order = stagger.order([candidate.address for candidate in candidates]) if stagger is not None else {}
    for candidate, affinity in zip(candidates, affinities, strict=True):
        full, cost = assess(candidate, now, load)
        if stagger is not None:
            cost, tiebreak = stagger.whole(cost, load), float(order[candidate.address])
        else:
            tiebreak = rng.random()
        rows.append(_Row(candidate.address in last_resort, full, cost, tiebreak, candidate, affinity))
    rows.sort(key=lambda row: row.order)
    open_rows = [row for row in rows if not row.suspect and not row.full]
    if not open_rows:
        if rows[0].full:
            return Choice([], "")  # every candidate is saturated: queue
        return Choice([row.candidate.address for row in rows[:count]], "score")  # suspects only
    some_full = len(open_rows) < len(rows)
    if some_full and not ahead and open_rows[0].affinity.latency_s is not None:
        if _worth_waiting(rows, open_rows, policy, now, load, slo):
            return Choice([], "wait")
    primary, reason = _primary(open_rows, policy, slo)
    rest = [row.candidate.address for row in rows if row is not primary]
    return Choice([primary.candidate.address, *rest[: count - 1]], reason)


def _primary(
    rows: list[_Row], policy: AffinityPolicy, slo: tuple[float | None, float | None] | None = None
) -> tuple[_Row, str]:
    """Session, then sticky prefix, each within the load gap (with latency predictions: the latency
    gap instead); else the best weighted score."""
    loads = [estimated_load(row.candidate) for row in rows]
    least = min(loads)
    limit = least + max(policy.max_load_gap, policy.load_gap_ratio * least)
    averages = [row.affinity.load_avg for row in rows]
    balanced = sum(averages) / len(averages) * (1 + policy.balance_ratio) + _BALANCE_SLACK
    within = [
        row
        for row, load in zip(rows, loads, strict=True)
        if load <= limit and row.affinity.load_avg <= balanced
    ]
    if not within:
        within = rows[:1]  # every one is past a bound: the least loaded
    predicted = rows[0].affinity.latency_s is not None
    if predicted:
        # the predictions count each replica's load in its own speed (a slow replica with fewer
        # requests may still be the slower choice): the latency gap replaces the load gap
        within = _quick(rows, policy, slo)
    for row in within:  # rows come least loaded first
        if row.affinity.session:
            return row, "session"
    tier = max((row.affinity.lora for row in within), default=0.0)
    if tier > 0:  # an adapter request: where it runs, else a free slot, else where it waits
        within = [row for row in within if row.affinity.lora == tier]
    holders = [row for row in within if row.affinity.cached >= policy.sticky_threshold]
    if holders:
        # an endpoint holding the prefix keeps it until the prefill the request would wait for there
        # (its backlog of uncached tokens not started, plus what it lacks) exceeds the quickest
        # endpoint's by more than the penalty: computing a prefix again costs more than its own time
        # (it evicts other prefixes), as the reference's maxTTFTPenalty says
        # (with predictions: the holder predicted to finish it first)
        sticky = min(
            holders, key=lambda row: (row.affinity.latency_s or row.affinity.prefill, row.cost, row.tiebreak)
        )
        quickest = min(row.affinity.prefill for row in within)
        if sticky.affinity.prefill <= quickest + policy.prefill_penalty_tokens:
            return sticky, "sticky"
    if tier > 0:
        return within[0], "lora"
    low, high = rows[0].cost, max(row.cost for row in rows)
    span = high - low

    near = {id(row) for row in within}

    quickest = min((row.affinity.latency_s or 0.0) for row in rows) if predicted else 0.0
    slowest = max((row.affinity.latency_s or 0.0) for row in rows) if predicted else 0.0

    def score(row: _Row) -> tuple[float, float]:
        load_score = 1.0 if span <= 0 else 1.0 - (row.cost - low) / span
        affinity = row.affinity
        if predicted and slowest > quickest:
            latency_score = 1.0 - ((affinity.latency_s or 0.0) - quickest) / (slowest - quickest)
        else:
            latency_score = 1.0
        # past the load gap an endpoint's cache earns nothing: that is where stickiness breaks
        cached = affinity.cached if id(row) in near else 0.0
        total = (
            policy.prefix_weight * cached
            + policy.load_weight * load_score
            + policy.lora_weight * affinity.lora
            + policy.room_weight * affinity.room
            + policy.latency_weight * latency_score
        )
        return total, -row.tiebreak  # ties: the lowest, as everywhere else

    # with predictions, only the replicas within the latency gap (and meeting the SLO) are scored:
    # a slow one is no choice at all while a quick one has room
    return max(within if predicted else rows, key=score), "score"


def _worth_waiting(
    rows: list[_Row],
    open_rows: list[_Row],
    policy: AffinityPolicy,
    now: float,
    load: LoadPolicy,
    slo: tuple[float | None, float | None] | None,
) -> bool:
    """Whether a busy replica (its slots all taken, `busy`) is predicted to finish the request sooner,
    its wait for a slot counted, than every replica with room, by more than the latency gap. Asked
    only when no request waits ahead of this one in the picker: then its wait is for the next slot
    to free, which the model predicts; behind others it would wait for theirs too (measured: waiting
    behind the queue cost more time to first token than it saved in decoding). When some replica
    meets the request's SLO, only those that do compare: a replica with room that meets it is not
    passed over for one that is quicker but would not."""
    waiting = [row for row in rows if row.full and not row.suspect and busy(row.candidate, now, load)]
    if slo is not None and any(_meets(row, slo) for row in (*open_rows, *waiting)):
        open_rows = [row for row in open_rows if _meets(row, slo)]
        waiting = [row for row in waiting if _meets(row, slo)]
        if not open_rows:
            return bool(waiting)
    if not waiting:
        return False
    best = min(row.affinity.latency_s or 0.0 for row in waiting)
    bound = max(best * (1.0 + policy.latency_gap_ratio), best + policy.latency_gap_s)
    return min(row.affinity.latency_s or 0.0 for row in open_rows) > bound


def _meets(row: _Row, slo: tuple[float | None, float | None]) -> bool:
    ttft, tpot = slo
    a = row.affinity
    return (ttft is None or (a.ttft_s or 0.0) <= ttft) and (tpot is None or (a.tpot_s or 0.0) <= tpot)


def _quick(
    within: list[_Row], policy: AffinityPolicy, slo: tuple[float | None, float | None] | None
) -> list[_Row]:
    """The replicas predicted to meet the request's SLO (all of them when none is), then those
    within the latency gap of the quickest: a replica twice as slow is not a choice while a quick
    one has room, whatever it holds."""
    if slo is not None:
        within = [row for row in within if _meets(row, slo)] or within
    # within the gap both to the first token and to the last: a replica that would make the
    # request wait for a batch slot is out as much as one that decodes slowly; when no replica is
    # quick on both, the first token decides (a slower decoder then takes the overflow)
    quick = {}
    for figure in ("ttft_s", "latency_s"):
        best = min(getattr(row.affinity, figure) or 0.0 for row in within)
        bound = max(best * (1.0 + policy.latency_gap_ratio), best + policy.latency_gap_s)
        quick[figure] = [row for row in within if (getattr(row.affinity, figure) or 0.0) <= bound]
    both = [row for row in quick["ttft_s"] if row in quick["latency_s"]]
    return both or quick["ttft_s"]


def lora_score(
    model: str, running: frozenset[str], waiting: frozenset[str], max_adapters: int | None
) -> float:
    """The reference's LoRA affinity: running 1, a free slot 0.8, waiting 0.6, else 0."""
    if max_adapters is None:
        return 0.0
    if model in running:
        return 1.0
    if len(running | waiting) < max_adapters:
        return 0.8
    if model in waiting:
        return 0.6
    return 0.0
