"""The choice: the primary and the fallbacks, from the rows (sticky until saturated, never into a drain).

Candidates are READY endpoints only (the pool's rule: a draining, not-ready or gone endpoint is never
a candidate, whatever its cache holds); each is a row (picker/scheduling/rows.py). Among the rows
with room (not saturated, not suspect), filtered (picker/scheduling/filters.py):
1. **Session**: the endpoint the session is bound to, while it is in range (within the load gap of
   the least loaded one, and in balance).
2. **LoRA** (for a request naming an adapter some candidate runs or queues): only the best tier in
   range, the reference's scores: running 1, a free adapter slot 0.8, waiting 0.6.
3. **Sticky prefix** (the reference's prefix-cache affinity filter, with its TTFT penalty): of the
   endpoints in range holding at least `sticky_threshold` of the prompt, the one where the request
   waits for the fewest prefill tokens (its backlog of uncached prompt tokens not started, plus what
   this prompt lacks there), unless that wait exceeds the quickest endpoint's by more than
   `prefill_penalty_tokens`. A hot prefix whose endpoint falls behind goes where computing it again
   is quicker, and that endpoint learns it: the prefix spreads as far as its load needs.
4. **Score**: otherwise the best weighted sum of the scorers (picker/scheduling/scorers.py); ties
   go to the lowest tiebreak.
With predictions (the latency model, picker/scheduling/latency.py), the replicas within the latency
gap of the quickest on both figures (or, when none is, on the first token), and meeting the
request's SLO when some can, replace the load range in every step above, and the latency scorer
counts; but a prefix's holder needs only its first token within the gap (the prediction counts
what it holds), for a prefix moved to a quicker decoder is computed again there and evicts another.
When a busy replica (every slot taken) is predicted to finish the request sooner, its wait for a
slot counted, than every one with room by more than the gap, the request waits in the picker for a
slot ("wait"). Fallbacks follow in `pick`'s order. No I/O; weights come from configuration.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from picker.config.model import AffinityConfig
from picker.scheduling import filters, scorers
from picker.scheduling.filters import Slo
from picker.scheduling.rows import Row
from picker.scheduling.scorers import Spans, Weighted


@dataclass(frozen=True, slots=True)
class AffinityPolicy:
    """The weights and bounds of the choice (their defaults and meaning: config.AffinityConfig)."""

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
    scale_down_weight: float = 0.0
    # the scorers with their weights: without predictions, and with them (computed once)
    scored: Weighted = field(default=(), compare=False)
    scored_predicted: Weighted = field(default=(), compare=False)

    def __post_init__(self) -> None:
        weights = {name: getattr(self, registered.weight) for name, registered in scorers.SCORERS.items()}
        object.__setattr__(self, "scored", scorers.weighted(weights, predicted=False))
        object.__setattr__(self, "scored_predicted", scorers.weighted(weights, predicted=True))

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
            latency_weight=config.latency_weight if config.latency != "off" else 0.0,
            latency_gap_ratio=config.latency_gap_ratio,
            latency_gap_s=config.latency_gap_s,
            scale_down_weight=config.scale_down_weight,
        )


@dataclass(frozen=True, slots=True)
class Choice:
    destinations: list[str]
    # "session", "lora", "sticky", "score", "wait" (a busy replica is quicker) or "" (none had room):
    # for metrics and traces
    reason: str
    primary: Row | None = None  # the primary's row (what it was chosen on)


def choose(
    rows: Sequence[Row], count: int, policy: AffinityPolicy, slo: Slo | None = None, ahead: int = 0
) -> Choice:
    """Up to `count` addresses, primary first, from rows in `pick`'s order; no destinations when no
    row has room. `slo`: the request's (TTFT, TPOT) objectives in seconds: the replicas predicted to
    meet them are preferred (when none is, the quickest). `ahead`: the requests waiting in the
    picker ahead of this one."""
    if count <= 0 or not rows:
        return Choice([], "")
    open_rows = filters.with_room(rows)
    if not open_rows:
        if rows[0].full:
            return Choice([], "")  # every candidate is saturated: queue
        return Choice([row.address for row in rows[:count]], "score", rows[0])  # suspects only
    predicted = open_rows[0].latency_s is not None
    if predicted and not ahead and len(open_rows) < len(rows):
        if filters.worth_waiting(rows, open_rows, policy, slo):
            return Choice([], "wait")
    primary, reason = _primary(open_rows, policy, slo, predicted)
    rest = [row.address for row in rows if row is not primary]
    return Choice([primary.address, *rest[: count - 1]], reason, primary)


def _primary(rows: list[Row], policy: AffinityPolicy, slo: Slo | None, predicted: bool) -> tuple[Row, str]:
    """Session, then LoRA, then sticky prefix, each in range (with predictions: the latency gap
    instead of the load range); else the best weighted score."""
    # the predictions count each replica's load in its own speed (a slow replica with fewer
    # requests may still be the slower choice): the latency gap replaces the load range
    within = filters.quick(rows, policy, slo) if predicted else filters.in_range(rows, policy)
    for row in within:  # rows come least loaded first
        if row.session:
            return row, "session"
    within = filters.lora_tier(within)  # an adapter request: where it runs, else a free slot, ...
    tier = within[0].lora
    lora = tier > 0
    near = within
    if predicted:
        # a holder is judged by its first token alone, where the prediction counts what it holds:
        # one slower to decode keeps its prefix while its first token comes within the gap, for
        # moving the prefix to a quicker decoder computes it again there and evicts another one:
        # what all the pool's caches hold, not its quickest replicas' alone, decides the hit rate
        soon = filters.first_token_soon(filters.meeting(rows, slo), policy)
        near = [row for row in soon if row.lora == tier]
    holders = filters.holders(near, policy.sticky_threshold)
    if holders:
        # the endpoint holding the prefix keeps it until the prefill the request would wait for there
        # (its backlog of uncached tokens not started, plus what it lacks) exceeds the quickest
        # endpoint's by more than the penalty: computing a prefix again costs more than its own time
        # (it evicts other prefixes), as the reference's maxTTFTPenalty says
        sticky = _keeper(holders)
        quickest = min(row.prefill for row in within)
        if sticky.prefill <= quickest + policy.prefill_penalty_tokens:
            return sticky, "sticky"
    if lora:
        return within[0], "lora"
    # the load gap of the rows in the running (with predictions, the latency gap's: a slow replica
    # it dropped must not make the quick ones look far above the least load)
    running = within if predicted else rows
    limit = filters.load_limit(running, policy) if policy.scale_down_weight else float("inf")
    spans = Spans.of(rows, within, predicted, limit)
    weighted = policy.scored_predicted if predicted else policy.scored

    def score(row: Row) -> tuple[float, float]:
        return scorers.total(weighted, row, spans), -row.tiebreak  # ties: the lowest, as everywhere

    # with predictions, only the replicas within the latency gap (and meeting the SLO) are scored:
    # a slow one is no choice at all while a quick one has room
    return max(within if predicted else rows, key=score), "score"


def _keeper(holders: list[Row]) -> Row:
    """Which holder keeps a prefix: the one where the request waits for the fewest prefill tokens
    (with predictions: the one predicted to finish it first); of those holding as much of it as
    that one, the one it was routed to last. Of several the index believes hold a prefix, the last
    one still does: a prefix that alternated between two holders by their backlog would be kept by
    neither engine once their caches are full. Only the approximate index knows when (`routed`);
    the engines' own events say what is held, and the backlog decides there as before."""
    best = min(holders, key=lambda row: (row.latency_s or row.prefill, row.cost, row.tiebreak))
    same = [row for row in holders if row.routed and row.cached == best.cached]
    return max(same, key=lambda row: row.routed) if same else best
