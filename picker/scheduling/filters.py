"""The pick's filters: which rows stay in the running. Each takes rows and returns a subset, in order.

Pure functions over the rows (picker/scheduling/rows.py); none reads the view or a model.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from picker.scheduling.rows import Row

_BALANCE_SLACK = 1.0  # requests: less than one request above the mean is never out of balance

Slo = tuple[float | None, float | None]  # a request's (TTFT, TPOT) objectives in seconds


class Gaps(Protocol):
    """The bounds the filters read (picker/scheduling/choice.py `AffinityPolicy`)."""

    @property
    def max_load_gap(self) -> float: ...

    @property
    def load_gap_ratio(self) -> float: ...

    @property
    def balance_ratio(self) -> float: ...

    @property
    def latency_gap_ratio(self) -> float: ...

    @property
    def latency_gap_s(self) -> float: ...


def with_room(rows: Sequence[Row]) -> list[Row]:
    """Neither suspect nor saturated."""
    return [row for row in rows if not row.suspect and not row.full]


def load_limit(rows: Sequence[Row], gaps: Gaps) -> float:
    """The load gap's bound: `max_load_gap` requests above the least loaded, or `load_gap_ratio` of
    its load when larger."""
    least = min(row.load for row in rows)
    return least + max(gaps.max_load_gap, gaps.load_gap_ratio * least)


def in_range(rows: Sequence[Row], gaps: Gaps) -> list[Row]:
    """Within the load gap (`max_load_gap` requests of the least loaded, or `load_gap_ratio` of its
    load when larger) and in balance (load averaged over the last seconds at most `balance_ratio`
    and one request above the pool's average: a hot prefix's endpoint that stays busier than the
    rest is out of balance; a moment's swing is not, nor, on a lightly loaded pool, a request more
    than the mean, which moving a prefix would not repay); the least loaded when every one is past
    a bound."""
    limit = load_limit(rows, gaps)
    balanced = sum(row.load_avg for row in rows) / len(rows) * (1 + gaps.balance_ratio) + _BALANCE_SLACK
    return [row for row in rows if row.load <= limit and row.load_avg <= balanced] or list(rows[:1])


def meets(row: Row, slo: Slo) -> bool:
    """Predicted to meet the objectives."""
    ttft, tpot = slo
    return (ttft is None or (row.ttft_s or 0.0) <= ttft) and (tpot is None or (row.tpot_s or 0.0) <= tpot)


def quick(rows: Sequence[Row], gaps: Gaps, slo: Slo | None) -> list[Row]:
    """The replicas predicted to meet the request's SLO (all of them when none is), then those
    within the latency gap of the quickest: a replica twice as slow is not a choice while a quick
    one has room (unless it holds the prompt: picker/scheduling/choice.py). Within the gap both to
    the first token and to the last: a replica that would make the request wait for a batch slot
    is out as much as one that decodes slowly; when no replica is quick on both, the first token
    decides (a slower decoder then takes the overflow)."""
    within = meeting(rows, slo)
    soon = first_token_soon(within, gaps)
    best = min(row.latency_s or 0.0 for row in within)
    bound = max(best * (1.0 + gaps.latency_gap_ratio), best + gaps.latency_gap_s)
    return [row for row in soon if (row.latency_s or 0.0) <= bound] or soon


def meeting(rows: Sequence[Row], slo: Slo | None) -> list[Row]:
    """The replicas predicted to meet the request's SLO; all of them when none is (or it sets none)."""
    if slo is None:
        return list(rows)
    return [row for row in rows if meets(row, slo)] or list(rows)


def first_token_soon(rows: Sequence[Row], gaps: Gaps) -> list[Row]:
    """The replicas within the latency gap of the quickest predicted first token."""
    best = min(row.ttft_s or 0.0 for row in rows)
    bound = max(best * (1.0 + gaps.latency_gap_ratio), best + gaps.latency_gap_s)
    return [row for row in rows if (row.ttft_s or 0.0) <= bound]


def lora_tier(rows: Sequence[Row]) -> list[Row]:
    """For a request naming an adapter: only the best tier (running, a free slot, waiting)."""
    tier = max((row.lora for row in rows), default=0.0)
    return [row for row in rows if row.lora == tier] if tier > 0 else list(rows)


def holders(rows: Sequence[Row], threshold: float) -> list[Row]:
    """Holding at least `threshold` of the prompt."""
    return [row for row in rows if row.cached >= threshold]


def worth_waiting(rows: Sequence[Row], open_rows: Sequence[Row], gaps: Gaps, slo: Slo | None) -> bool:
    """Whether a busy replica (its slots all taken) is predicted to finish the request sooner, its
    wait for a slot counted, than every replica with room, by more than the latency gap. Asked only
    when no request waits ahead of this one in the picker: then its wait is for the next slot to
    free, which the model predicts; behind others it would wait for theirs too (measured: waiting
    behind the queue cost more time to first token than it saved in decoding). When some replica
    meets the request's SLO, only those that do compare: a replica with room that meets it is not
    passed over for one that is quicker but would not."""
    waiting = [row for row in rows if row.busy and not row.suspect]
    if slo is not None and any(meets(row, slo) for row in (*open_rows, *waiting)):
        open_rows = [row for row in open_rows if meets(row, slo)]
        waiting = [row for row in waiting if meets(row, slo)]
        if not open_rows:
            return bool(waiting)
    if not waiting:
        return False
    best = min(row.latency_s or 0.0 for row in waiting)
    bound = max(best * (1.0 + gaps.latency_gap_ratio), best + gaps.latency_gap_s)
    return min(row.latency_s or 0.0 for row in open_rows) > bound
