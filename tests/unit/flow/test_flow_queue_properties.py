"""The admission queue against a plain reference model, over random push/pop/unpop/remove sequences.

The model is lists: the highest priority band first, its flows in rotation order (a flow joins at
the end with its first item, goes to the end after its turn, leaves when empty); within a flow,
items without an objective in arrival order (one put back goes to the front), and an item with one
(`timed`) served before them when it is due no later than the first of them, the earliest due first.
After every step the queue must agree with it and hold nothing but the live entries.
"""

from __future__ import annotations

import gc
import weakref
from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from picker.flow import AdmissionQueue, QueuedItem


@dataclass
class Model:
    bands: dict[int, list[tuple[str, list[QueuedItem]]]] = field(default_factory=dict)

    def push(self, item: QueuedItem, front: bool = False) -> None:
        rotation = self.bands.setdefault(item.priority, [])
        for index, (flow, items) in enumerate(rotation):
            if flow == item.flow:
                if front:
                    items.insert(0, item)
                    rotation.insert(0, rotation.pop(index))
                else:
                    items.append(item)
                return
        rotation.insert(0 if front else len(rotation), (item.flow, [item]))

    def pop(self) -> QueuedItem | None:
        if not self.bands:
            return None
        priority = max(self.bands)
        rotation = self.bands[priority]
        flow, items = rotation.pop(0)
        item = _due_first(items)
        items.remove(item)
        if items:
            rotation.append((flow, items))
        if not rotation:
            del self.bands[priority]
        return item

    def remove(self, item: QueuedItem) -> None:
        rotation = self.bands[item.priority]
        for index, (_, items) in enumerate(rotation):
            if item in items:
                items.remove(item)
                if not items:
                    rotation.pop(index)
                break
        if not rotation:
            del self.bands[item.priority]

    def items(self) -> list[QueuedItem]:
        return [i for rotation in self.bands.values() for _, items in rotation for i in items]


def _due_first(items: list[QueuedItem]) -> QueuedItem:
    untimed = [i for i in items if not i.timed]
    timed = sorted((i for i in items if i.timed), key=lambda i: (i.deadline, i.payload))
    if timed and (not untimed or timed[0].deadline <= untimed[0].deadline):
        return timed[0]
    return untimed[0]


OPS = st.lists(
    st.one_of(
        st.tuples(
            st.just("push"),
            st.sampled_from("abc"),
            st.integers(-40, 3),
            st.integers(0, 50),
            st.one_of(st.none(), st.integers(0, 300)),  # an objective: due at this, else by arrival
        ),
        st.tuples(st.just("pop")),
        st.tuples(st.just("pop_unpop")),
        st.tuples(st.just("remove"), st.integers(0, 10_000)),
        st.tuples(st.just("remove_again"), st.integers(0, 10_000)),
    ),
    max_size=250,
)


@settings(max_examples=300, deadline=None)
@given(OPS)
def test_queue_matches_the_reference_model_and_holds_only_live_entries(ops: list[tuple]) -> None:
    queue = AdmissionQueue(max_items=10**6, max_bytes=10**9)
    model = Model()
    gone: list[QueuedItem] = []
    serial = 0
    for op in ops:
        match op:
            case ("push", flow, priority, size, due):
                serial += 1  # without an objective, due by its time to live: in arrival order
                deadline = float(serial + 100 if due is None else due)
                item = QueuedItem(flow, priority, size, 0.0, serial, deadline=deadline, timed=due is not None)
                queue.push(item)
                model.push(item)
            case ("pop",):
                popped, expected = queue.pop(), model.pop()
                assert popped is expected
                if popped is not None:
                    gone.append(popped)
            case ("pop_unpop",):  # pump finds no room: the item keeps its turn
                popped, expected = queue.pop(), model.pop()
                assert popped is expected
                if popped is not None:
                    queue.unpop(popped)
                    model.push(popped, front=True)
            case ("remove", index):  # TTL expiry or cancellation of a queued entry
                live = model.items()
                if live:
                    target = live[index % len(live)]
                    assert queue.remove(target)
                    model.remove(target)
                    gone.append(target)
            case ("remove_again", index):  # a second expiry/cancel of the same entry is a no-op
                if gone:
                    assert not queue.remove(gone[index % len(gone)])
        live = model.items()
        assert len(queue) == len(live) == queue.held()
        assert queue.bytes == sum(i.size for i in live)
        assert queue.heap_size() <= 3 * len(model.bands) + 17
    assert [i.payload for i in queue.drain()] == [i.payload for i in iter(model.pop, None)]


class Payload:
    """Stands in for a ticket and its request record."""


def test_removed_entries_below_live_traffic_are_freed_at_once() -> None:
    queue = AdmissionQueue(max_items=10**6, max_bytes=10**9)
    live = QueuedItem("live", 0, 1, 0.0, payload=Payload())
    queue.push(live)
    refs = []
    for band in range(20_000):  # expired or cancelled entries, each alone in a lower band
        item = QueuedItem("f", -1 - band, 1, 0.0, payload=Payload())
        queue.push(item)
        refs.append(weakref.ref(item.payload))
        assert queue.remove(item)
    del item
    gc.collect()
    assert not any(ref() is not None for ref in refs)
    assert queue.held() == len(queue) == 1 and queue.heap_size() <= 20
    assert queue.pop() is live and queue.pop() is None
