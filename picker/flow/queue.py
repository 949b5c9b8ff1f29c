"""The admission queue: priority bands, fair between flows, FIFO within a flow, bounded."""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any


@dataclass(eq=False, slots=True)
class QueuedItem:
    flow: str
    priority: int
    size: int
    enqueued_at: float
    payload: Any = None
    removed: bool = field(default=False, repr=False)


class _Band:
    """One priority level: a round robin over flows, each a FIFO."""

    __slots__ = ("flows",)

    def __init__(self) -> None:
        self.flows: OrderedDict[str, deque[QueuedItem]] = OrderedDict()

    def push(self, item: QueuedItem) -> None:
        self.flows.setdefault(item.flow, deque()).append(item)

    def push_front(self, item: QueuedItem) -> None:
        self.flows.setdefault(item.flow, deque()).appendleft(item)
        self.flows.move_to_end(item.flow, last=False)

    def pop(self) -> QueuedItem | None:
        while self.flows:
            flow, items = next(iter(self.flows.items()))
            item = items.popleft()
            if items:
                self.flows.move_to_end(flow)  # the next pop serves the next flow
            else:
                del self.flows[flow]
            if not item.removed:
                return item
        return None


class AdmissionQueue:
    """Higher priority first; within a priority, flows take turns; bounded by count and bytes.

    Removal of an arbitrary item (TTL, cancellation) is O(1): it is marked and skipped on pop.
    """

    def __init__(self, max_items: int, max_bytes: int) -> None:
        self.max_items = max_items
        self.max_bytes = max_bytes
        self._bands: dict[int, _Band] = {}
        self._count = 0
        self._bytes = 0

    def __len__(self) -> int:
        return self._count

    @property
    def bytes(self) -> int:
        return self._bytes

    def fits(self, size: int) -> bool:
        return self._count < self.max_items and self._bytes + size <= self.max_bytes

    def push(self, item: QueuedItem) -> None:
        band = self._bands.get(item.priority)
        if band is None:
            band = self._bands[item.priority] = _Band()
        band.push(item)
        self._count += 1
        self._bytes += item.size

    def unpop(self, item: QueuedItem) -> None:
        """Put back the item `pop` just returned, at the head of the line it left."""
        item.removed = False
        band = self._bands.get(item.priority)
        if band is None:
            band = self._bands[item.priority] = _Band()
        band.push_front(item)
        self._count += 1
        self._bytes += item.size

    def pop(self) -> QueuedItem | None:
        for priority in sorted(self._bands, reverse=True):
            item = self._bands[priority].pop()
            if not self._bands[priority].flows:
                del self._bands[priority]
            if item is not None:
                self._forget(item)
                return item
        return None

    def remove(self, item: QueuedItem) -> bool:
        if item.removed:
            return False
        self._forget(item)
        return True

    def drain(self) -> list[QueuedItem]:
        items = []
        while (item := self.pop()) is not None:
            items.append(item)
        return items

    def _forget(self, item: QueuedItem) -> None:
        item.removed = True
        self._count -= 1
        self._bytes -= item.size
