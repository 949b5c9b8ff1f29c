"""Pod deletion costs (picker/pool/deletion_cost.py) -> annotation values, with hysteresis.

The ReplicaSet controller only compares the annotation's values, so what is written is an order:
the pods ranked from the cheapest to delete to the dearest. Writes are the scarce thing (each is a
PATCH on the API server and an event for every pod watcher), so:

- **the order is sticky**: a pod moves ahead of another only when clearly cheaper, by more than
  `margin_s` and more than `margin_ratio` of the other's cost; figures that wiggle leave it alone;
- **values change only where the order did**: the pods whose current values already rise along the
  new order keep them (the largest such set; among as large ones, the one keeping the pods that may
  not be written now), the others get values between their neighbours' (values start `SPACING`
  apart, so a pod moved or added rarely renumbers the rest);
- **each pod at most once per `interval_s`**: a change due sooner waits (deferred, counted), and at
  most `max_writes` go out per step, the cheapest end first (the pods a scale-down takes next).

Pure: the step's clock is a parameter. `Ranker` remembers what it wrote and when; the writer
(picker/sources/deletion_cost.py) tells it each write that went through.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field

from picker.pool.deletion_cost import INT32, PodRef

SPACING = 1000  # between neighbours' values when numbered afresh: 0, 1000, 2000, ...


@dataclass(frozen=True, slots=True)
class RankPolicy:
    interval_s: float  # a pod's annotation changes at most once per this
    margin_s: float  # a pod overtakes another only when cheaper by more than this ...
    margin_ratio: float  # ... and by more than this share of the other's cost
    max_writes: int  # writes per step, at most


@dataclass(frozen=True, slots=True)
class Write:
    pod: PodRef
    value: int


@dataclass(slots=True)
class Plan:
    """One step's decision: the order, the writes due now, and the changes held back."""

    order: list[str]  # pod keys, cheapest to delete first
    writes: list[Write] = field(default_factory=list)
    deferred: int = 0  # changes of pods written less than interval_s ago
    over_bound: int = 0  # changes beyond max_writes, left for the next step


def sticky_order(
    keys: Sequence[str], costs: Mapping[str, float], current: Mapping[str, int], margin_s: float, ratio: float
) -> list[str]:
    """The pods from cheapest to dearest, starting from their current order (pods with a value, by
    value), each new pod placed by its cost; then a pod moves ahead only of pods it is clearly
    cheaper than."""

    def clearly_cheaper(a: str, b: str) -> bool:
        return costs[b] - costs[a] > max(margin_s, ratio * costs[b])

    known = sorted((k for k in keys if k in current), key=lambda k: (current[k], k))
    new = sorted((k for k in keys if k not in current), key=lambda k: (costs[k], k))
    order: list[str] = []
    for key in known:
        while new and costs[new[0]] <= costs[key]:
            order.append(new.pop(0))
        order.append(key)
    order += new
    for i in range(1, len(order)):
        j = i
        while j > 0 and clearly_cheaper(order[j], order[j - 1]):
            order[j - 1], order[j] = order[j], order[j - 1]
            j -= 1
    return order


def _kept(order: Sequence[str], current: Mapping[str, int], locked: Collection[str]) -> set[str]:
    """The largest set of pods whose current values strictly rise along `order` (among sets as
    large, the one with the most locked pods): they keep their values."""
    indexed = [k for k in order if k in current]
    unit = len(indexed) + 1  # a locked pod weighs unit + 1: a tie-break, never more pods written
    best: list[int] = []
    back: list[int] = []
    for i, key in enumerate(indexed):
        weight = unit + 1 if key in locked else unit
        prior = [j for j in range(i) if current[indexed[j]] < current[key]]
        j = max(prior, key=lambda p: best[p], default=-1)
        best.append(weight + (best[j] if j >= 0 else 0))
        back.append(j)
    kept: set[str] = set()
    i = max(range(len(indexed)), key=lambda p: best[p], default=-1)
    while i >= 0:
        kept.add(indexed[i])
        i = back[i]
    return kept


def assign(order: Sequence[str], current: Mapping[str, int], locked: Collection[str] = ()) -> dict[str, int]:
    """A value for every pod, rising strictly along `order`, changing as few as it can."""
    kept = _kept(order, current, locked)
    values: dict[str, int] = {k: current[k] for k in kept}
    run: list[str] = []
    lower: int | None = None
    for key in [*order, None]:
        if key is not None and key not in kept:
            run.append(key)
            continue
        upper = current[key] if key is not None else None
        placed = _between(lower, upper, len(run))
        if placed is None:
            return {k: i * SPACING for i, k in enumerate(order)}  # no room: numbered afresh
        values.update(zip(run, placed, strict=True))
        run, lower = [], upper
    return values


def _between(lower: int | None, upper: int | None, count: int) -> list[int] | None:
    """`count` rising values strictly between `lower` and `upper` (None: open), inside int32."""
    if count == 0:
        return []
    if lower is None and upper is None:
        values = [i * SPACING for i in range(count)]
    elif lower is None:
        assert upper is not None
        values = [upper - (count - i) * SPACING for i in range(count)]
    elif upper is None:
        values = [lower + (i + 1) * SPACING for i in range(count)]
    else:
        step = (upper - lower) // (count + 1)
        if step < 1:
            return None
        values = [lower + (i + 1) * step for i in range(count)]
    return values if INT32[0] <= values[0] and values[-1] <= INT32[1] else None


@dataclass(frozen=True, slots=True)
class ScaleDownRanks:
    """What the placement steers by (kube.deletion_cost): where each endpoint's pod stands in the next
    scale-down (`next_to_go`), and how many output tokens make a request long enough to keep off the
    first to go (scale_down.steer_s at the pool's pace)."""

    next_to_go: Mapping[str, float]
    steer_tokens: int


def next_to_go(pods: Sequence[PodRef], value: Callable[[PodRef], int | None]) -> dict[str, float]:
    """Each pod's endpoints by where a scale-down would take it: 0.0 for the pods the ReplicaSet
    controller deletes first (the lowest annotation value; none counts as 0, as the controller
    reads it), 1.0 for the last; equal values share a place (the controller breaks those ties by
    node and age, not by anything the picker knows); pods already being deleted left out; empty when
    no pod has a value (nothing to steer by: a slice source before the first write). The placement
    steers long requests away from the low end (scheduling, `steer`), so the next victims stay light."""
    live = [(pod, value(pod)) for pod in pods if not pod.deleting]
    if not any(found is not None for _, found in live):
        return {}
    values = sorted({found or 0 for _, found in live})
    step = 1.0 / max(1, len(values) - 1)
    place = {found: index * step for index, found in enumerate(values)}
    return {address: place[found or 0] for pod, found in live for address in pod.addresses}


class Ranker:
    """The order and the writes due at each step; remembers its own writes (newer than a watch's word)."""

    def __init__(self, policy: RankPolicy) -> None:
        self.policy = policy
        self.written: dict[str, tuple[int, float]] = {}  # pod key -> (value, when)

    def current(self, pod: PodRef) -> int | None:
        mine = self.written.get(pod.key)
        return mine[0] if mine is not None else pod.value

    def plan(self, pods: Sequence[PodRef], costs: Mapping[str, float], now: float) -> Plan:
        """`costs` by pod key (deletion_cost.pod_work); pods without one (being deleted) are left alone."""
        policy = self.policy
        ranked = [pod for pod in pods if pod.key in costs]
        current = {pod.key: value for pod in ranked if (value := self.current(pod)) is not None}
        keys = [pod.key for pod in ranked]
        order = sticky_order(keys, costs, current, policy.margin_s, policy.margin_ratio)
        locked = {k for k, (_, at) in self.written.items() if now - at < policy.interval_s}
        values = assign(order, current, locked)
        by_key = {pod.key: pod for pod in ranked}
        plan = Plan(order)
        for key in order:
            if values[key] == current.get(key):
                continue
            if key in locked:
                plan.deferred += 1
            elif len(plan.writes) >= policy.max_writes:
                plan.over_bound += 1
            else:
                plan.writes.append(Write(by_key[key], values[key]))
        return plan

    def wrote(self, pod: PodRef, value: int, now: float) -> None:
        self.written[pod.key] = (value, now)

    def keep_only(self, keys: set[str]) -> None:
        """Forget the pods no longer in the pool."""
        for key in [k for k in self.written if k not in keys]:
            del self.written[key]

    def reset(self) -> None:
        """Another writer may write from now on (this picker stands by): trust the pods' own word."""
        self.written.clear()
