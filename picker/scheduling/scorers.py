"""The pick's scorers: pure functions (row, the pick's spans) -> a number, higher is better.

A scorer reads one row (picker/scheduling/rows.py) and what the whole pick shares (`Spans`: the
lowest and highest load score, the quickest and slowest prediction, the rows within the load gap);
it calls nothing. The choice (picker/scheduling/choice.py) adds them up with their weights in the
order of `SCORERS`. A new scorer is one function here and one entry in `SCORERS`, naming the
`affinity.*_weight` setting that weighs it (config/model.py; the reference's `EndpointPickerConfig`
plugins map onto these weights in config/plugins.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from picker.scheduling.rows import Row


@dataclass(frozen=True, slots=True)
class Spans:
    """What every row of one pick is scored against: computed once from the rows with room."""

    low: float  # the lowest load score
    span: float  # the highest less the lowest
    quickest: float  # the lowest predicted time to the last token (0: no predictions)
    spread: float  # the slowest less the quickest
    near: frozenset[int]  # id() of the rows within the load gap: only their cache earns a score
    load_limit: float = float("inf")  # the load gap's bound (requests): steering keeps within it

    @classmethod
    def of(
        cls, rows: Sequence[Row], near: Sequence[Row], predicted: bool, load_limit: float = float("inf")
    ) -> Spans:
        low, high = rows[0].cost, max(row.cost for row in rows)
        quickest = min((row.latency_s or 0.0) for row in rows) if predicted else 0.0
        slowest = max((row.latency_s or 0.0) for row in rows) if predicted else 0.0
        near_ids = frozenset(id(row) for row in near)
        return cls(low, high - low, quickest, slowest - quickest, near_ids, load_limit)


Scorer = Callable[[Row, Spans], float]


def prefix(row: Row, spans: Spans) -> float:
    """The share of the prompt cached there; past the load gap it earns nothing (that is where
    stickiness breaks)."""
    return row.cached if id(row) in spans.near else 0.0


def load(row: Row, spans: Spans) -> float:
    """1 for the least loaded, 0 for the most (min-max, as the reference's queue scorer)."""
    return 1.0 if spans.span <= 0 else 1.0 - (row.cost - spans.low) / spans.span


def lora(row: Row, spans: Spans) -> float:
    """The reference's LoRA affinity: running 1, a free adapter slot 0.8, waiting 0.6."""
    return row.lora


def room(row: Row, spans: Spans) -> float:
    """Room left in the cache: a cold prompt goes where it evicts least (the reference's no-hit-LRU
    scorer spreads cold requests alike)."""
    return row.room


def latency(row: Row, spans: Spans) -> float:
    """1 for the replica predicted to finish the request first, 0 for the last (min-max)."""
    if spans.spread > 0:
        return 1.0 - ((row.latency_s or 0.0) - spans.quickest) / spans.spread
    return 1.0


def scale_down(row: Row, spans: Spans) -> float:
    """Keeps a long request off the pods a scale-down takes next (kube.deletion_cost), so their
    drains stay short: the row's `stays`, within the load gap only (past it the load decides: a
    victim with room is not left idle while the others queue)."""
    return row.stays if row.load <= spans.load_limit else 0.0


@dataclass(frozen=True, slots=True)
class Registered:
    scorer: Scorer
    weight: str  # the AffinityConfig field that weighs it
    plugins: tuple[str, ...] = ()  # the reference's plugin types whose weight sets it (config/plugins.py)
    predicted: bool = False  # it reads the latency model's predictions: only scored with them


# every scorer, in the order their weighted scores are summed
SCORERS: Mapping[str, Registered] = MappingProxyType(
    {
        "prefix": Registered(prefix, "prefix_weight", ("prefix-cache-scorer", "precise-prefix-cache-scorer")),
        "load": Registered(load, "load_weight", ("queue-scorer", "kv-cache-utilization-scorer")),
        "lora": Registered(lora, "lora_weight", ("lora-affinity-scorer",)),
        "room": Registered(room, "room_weight"),
        "latency": Registered(latency, "latency_weight", ("latency-scorer",), predicted=True),
        "scale_down": Registered(scale_down, "scale_down_weight"),
    }
)

Weighted = tuple[tuple[Scorer, float], ...]


def weighted(weights: Mapping[str, float], predicted: bool) -> Weighted:
    """The scorers that count (weight above 0; those reading predictions only with them), each with
    its weight; `weights` by registered name."""
    return tuple(
        (registered.scorer, weights[name])
        for name, registered in SCORERS.items()
        if weights.get(name, 0.0) > 0 and (predicted or not registered.predicted)
    )


def total(scorers: Weighted, row: Row, spans: Spans) -> float:
    """The row's weighted sum."""
    value = 0.0
    for scorer, weight in scorers:
        value += weight * scorer(row, spans)
    return value
