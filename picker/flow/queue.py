"""The admission queue: priority bands, fair between flows, the earliest due first within a flow.

Between a band's flows: turns by request, or with fair share (picker/flow/tenants.py) the flow its
`choose` names (the lowest tokens served per weight), which may also name none for now.

Within a flow, a request with a time-to-first-token objective (the SLO headers, read with
`affinity.latency` on) is due at its admission plus that objective, and one without is due when its
time to live ends; the flow serves whichever is due first (earliest deadline first). Requests
without an objective keep their order (their deadlines are in arrival order) and cost as before;
those with one are held apart, sorted by deadline (O(log n) to find, a list insert to place), so in
a burst a request that must see its first token in 500 ms is not served after one that may wait.

Only live entries are held: a removed entry (TTL, cancellation) leaves its flow, its flow leaves its
band when it has nothing left, and an empty band is dropped, so nothing a request left behind keeps
its ticket alive or slows the next pop. Push, pop, unpop and remove of a request without an
objective cost O(1) plus O(log bands) for the priority heap, which holds band priorities lazily and
is rebuilt when stale entries outnumber the live bands.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

# Stale heap entries allowed beyond twice the live bands before the heap is rebuilt.
_HEAP_SLACK = 16

# Which of a band's flows (in turn order) is served next; None: none may be now (flow/tenants.py)
Chooser = Callable[[Iterable[str]], "str | None"]


@dataclass(eq=False, slots=True)
class QueuedItem:
    flow: str
    priority: int
    size: int
    enqueued_at: float
    payload: Any = None
    deadline: float = math.inf  # when it is due (earliest first within its flow)
    timed: bool = False  # due by its own objective (else by its time to live: arrival order)
    cost: int = 0  # tokens its tenant is charged when it dispatches (fair share)
    removed: bool = field(default=False, repr=False)
    order: int = field(default=0, repr=False)  # ties between equal deadlines: the earlier push


_pushes = itertools.count()


class _Line:
    """One flow's queued items: those without an objective in arrival order (an insertion-ordered
    set: O(1) removal from anywhere), those with one sorted by (deadline, order), kept in reverse
    (negated keys) so that the earliest due is taken from the end of the list."""

    __slots__ = ("fifo", "timed")

    def __init__(self) -> None:
        self.fifo: OrderedDict[QueuedItem, None] = OrderedDict()
        self.timed: list[tuple[float, int, QueuedItem]] = []

    def push_timed(self, item: QueuedItem) -> None:
        bisect.insort(self.timed, (-item.deadline, -item.order, item))

    def pop(self) -> QueuedItem:
        timed, fifo = self.timed, self.fifo
        if timed and (not fifo or -timed[-1][0] <= next(iter(fifo)).deadline):
            return timed.pop()[2]
        return fifo.popitem(last=False)[0]

    def remove(self, item: QueuedItem) -> None:
        if not item.timed:
            del self.fifo[item]
            return
        timed = self.timed
        at = bisect.bisect_left(timed, (-item.deadline, -item.order))
        while timed[at][2] is not item:
            at += 1
        del timed[at]

    def __bool__(self) -> bool:
        return bool(self.fifo or self.timed)

    def __len__(self) -> int:
        return len(self.fifo) + len(self.timed)


class _Band:
    """One priority level: a round robin over the flows with queued items, each a `_Line`.

    A flow joins the end of the rotation when it gets its first item, goes to the end after each
    turn, and leaves when its last item is popped or removed.
    """

    __slots__ = ("flows",)

    def __init__(self) -> None:
        self.flows: OrderedDict[str, _Line] = OrderedDict()

    def push(self, item: QueuedItem, front: bool = False) -> None:
        line = self.flows.get(item.flow)
        if line is None:
            line = self.flows[item.flow] = _Line()
        if item.timed:
            line.push_timed(item)  # its place is its deadline's, put back or not
        else:
            line.fifo[item] = None
            if front:
                line.fifo.move_to_end(item, last=False)

    def push_front(self, item: QueuedItem) -> None:
        self.push(item, front=True)
        self.flows.move_to_end(item.flow, last=False)

    def pop(self, choose: Chooser | None = None) -> QueuedItem | None:
        if choose is None:
            flow, line = next(iter(self.flows.items()))
        else:
            chosen = choose(self.flows)
            if chosen is None:
                return None
            flow, line = chosen, self.flows[chosen]
        # a flow without objectives (the usual case) is a FIFO: no method call between
        item = line.pop() if line.timed else line.fifo.popitem(last=False)[0]
        if line.fifo or line.timed:
            self.flows.move_to_end(flow)  # the next pop serves the next flow
        else:
            del self.flows[flow]
        return item

    def remove(self, item: QueuedItem) -> None:
        line = self.flows[item.flow]
        line.remove(item)
        if not line:
            del self.flows[item.flow]

    def __len__(self) -> int:
        return sum(len(line) for line in self.flows.values())


class AdmissionQueue:
    """Higher priority first; within a priority, flows take turns; bounded by count and bytes."""

    def __init__(self, max_items: int, max_bytes: int, choose: Chooser | None = None) -> None:
        self.max_items = max_items
        self.choose = choose  # between a band's flows; None: they take turns
        self.max_bytes = max_bytes
        self._bands: dict[int, _Band] = {}  # only bands with items
        self._heap: list[int] = []  # negated priorities; may hold bands since emptied
        self._count = 0
        self._bytes = 0

    def __len__(self) -> int:
        return self._count

    @property
    def bytes(self) -> int:
        return self._bytes

    def held(self) -> int:
        """Entries the queue holds (O(entries), for tests): always `len(self)`, none left behind."""
        return sum(len(band) for band in self._bands.values())

    def heap_size(self) -> int:
        """Priority heap entries, live or stale (for tests: bounded by the live bands)."""
        return len(self._heap)

    def fits(self, size: int) -> bool:
        return self._count < self.max_items and self._bytes + size <= self.max_bytes

    def push(self, item: QueuedItem) -> None:
        item.removed = False
        if item.timed:
            item.order = next(_pushes)
        self._band(item.priority).push(item)
        self._count += 1
        self._bytes += item.size

    def unpop(self, item: QueuedItem) -> None:
        """Put back the item `pop` just returned, at the head of the line it left."""
        item.removed = False
        self._band(item.priority).push_front(item)
        self._count += 1
        self._bytes += item.size

    def pop(self) -> QueuedItem | None:
        while self._heap:
            priority = -self._heap[0]
            band = self._bands.get(priority)
            if band is None:  # a band emptied since it was pushed on the heap
                heapq.heappop(self._heap)
                continue
            item = band.pop(self.choose)
            if item is None:  # every flow of the first band is held back for now: a lower band may go
                return self._pop_below(priority)
            if not band.flows:
                self._drop_band(priority)
            self._forget(item)
            return item
        return None

    def _pop_below(self, priority: int) -> QueuedItem | None:
        """The first item of a band below `priority` whose flow is not held back: the slots a held
        tenant leaves are kept for the others, whatever their requests' priority."""
        for lower in sorted((p for p in self._bands if p < priority), reverse=True):
            band = self._bands[lower]
            item = band.pop(self.choose)
            if item is not None:
                if not band.flows:
                    self._drop_band(lower)
                self._forget(item)
                return item
        return None

    def remove(self, item: QueuedItem) -> bool:
        if item.removed:
            return False
        band = self._bands[item.priority]
        band.remove(item)
        if not band.flows:
            self._drop_band(item.priority)
        self._forget(item)
        return True

    def drain(self) -> list[QueuedItem]:
        choose, self.choose = self.choose, None  # everything, held back or not
        items = []
        while (item := self.pop()) is not None:
            items.append(item)
        self.choose = choose
        return items

    def _band(self, priority: int) -> _Band:
        band = self._bands.get(priority)
        if band is None:
            band = self._bands[priority] = _Band()
            heapq.heappush(self._heap, -priority)
        return band

    def _drop_band(self, priority: int) -> None:
        del self._bands[priority]
        if len(self._heap) > 2 * len(self._bands) + _HEAP_SLACK:  # amortised O(1) per band dropped
            self._heap = [-p for p in self._bands]
            heapq.heapify(self._heap)

    def _forget(self, item: QueuedItem) -> None:
        item.removed = True
        self._count -= 1
        self._bytes -= item.size
