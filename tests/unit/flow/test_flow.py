"""The admission queue and the flow controller, without any server."""

from __future__ import annotations

import asyncio
import gc
import weakref

import pytest

from picker.contract import Outcome
from picker.flow import AdmissionQueue, FlowController, FlowLimits, QueuedItem


def item(flow: str, priority: int = 0, size: int = 1, name: str = "") -> QueuedItem:
    return QueuedItem(flow=flow, priority=priority, size=size, enqueued_at=0.0, payload=name or flow)


def test_priority_first_then_round_robin_between_flows_fifo_within() -> None:
    queue = AdmissionQueue(100, 10_000)
    for name, flow, prio in [
        ("a1", "a", 0),
        ("a2", "a", 0),
        ("a3", "a", 0),
        ("b1", "b", 0),
        ("h1", "h", 5),
        ("c1", "c", 0),
        ("b2", "b", 0),
    ]:
        queue.push(item(flow, prio, name=name))
    order = [queue.pop().payload for _ in range(7)]  # type: ignore[union-attr]
    assert order == ["h1", "a1", "b1", "c1", "a2", "b2", "a3"]
    assert queue.pop() is None and len(queue) == 0 and queue.bytes == 0


def test_bounds_by_count_and_bytes() -> None:
    queue = AdmissionQueue(2, 100)
    assert queue.fits(100) and not queue.fits(101)
    queue.push(item("a", size=60))
    assert not queue.fits(41) and queue.fits(40)
    queue.push(item("a", size=10))
    assert not queue.fits(0)  # count bound


def test_removed_items_are_skipped_and_unpop_keeps_the_turn() -> None:
    queue = AdmissionQueue(10, 1000)
    first, second, third = item("a", name="1"), item("a", name="2"), item("b", name="3")
    for i in (first, second, third):
        queue.push(i)
    assert queue.remove(second) and not queue.remove(second)
    popped = queue.pop()
    assert popped is first
    queue.unpop(popped)
    assert [queue.pop().payload, queue.pop().payload] == ["1", "3"]  # type: ignore[union-attr]
    assert queue.pop() is None and len(queue) == 0


class Room:
    """Capacity as a plain counter, standing in for the pool."""

    def __init__(self, free: int) -> None:
        self.free = free
        self.endpoints = True
        self.dispatched: list[str] = []

    def try_dispatch(self, name: str) -> bool:
        if self.free <= 0:
            return False
        self.free -= 1
        self.dispatched.append(name)
        return True


def controller(room: Room, **limits: float) -> FlowController[str]:
    outcomes: list[Outcome] = []
    flow = FlowController(
        room.try_dispatch,
        lambda: room.endpoints,
        FlowLimits(**limits),  # type: ignore[arg-type]
        on_outcome=lambda outcome, waited: outcomes.append(outcome),
    )
    flow.outcomes = outcomes  # type: ignore[attr-defined]
    return flow


async def test_dispatches_at_once_when_there_is_room() -> None:
    room = Room(1)
    flow = controller(room)
    ticket = flow.submit("r1")
    assert ticket.done and ticket.outcome is Outcome.DISPATCHED and not ticket.queued
    assert await ticket.wait() is Outcome.DISPATCHED


async def test_queued_request_is_released_by_pump_when_room_frees() -> None:
    room = Room(0)
    flow = controller(room)
    ticket = flow.submit("r1")
    assert not ticket.done and flow.queued == 1
    waiter = asyncio.ensure_future(ticket.wait())
    assert flow.pump() == 0
    room.free = 1
    assert flow.pump() == 1
    assert await waiter is Outcome.DISPATCHED
    assert room.dispatched == ["r1"] and flow.queued == 0


async def test_within_a_flow_the_earliest_due_goes_first() -> None:
    """A request with a TTFT objective is due at its admission plus the objective; one without, when
    its time to live ends. Queued together, the earliest due is served first; a request without an
    objective that has waited long is not passed by one due after it."""
    room, now = Room(0), [100.0]
    flow = FlowController(room.try_dispatch, lambda: True, FlowLimits(ttl_s=30.0), clock=lambda: now[0])
    flow.submit("old")  # due at 130
    now[0] = 125.0
    flow.submit("plain")  # due at 155
    flow.submit("slow-slo", objective_s=10.0)  # due at 135
    flow.submit("tight-slo", objective_s=0.5)  # due at 125.5
    flow.submit("late-slo", objective_s=20.0)  # due at 145
    flow.submit("other-flow", flow="b", objective_s=0.1)  # flows still take turns
    room.free = 6
    assert flow.pump() == 6
    assert room.dispatched == ["tight-slo", "other-flow", "old", "slow-slo", "late-slo", "plain"]


async def test_new_arrival_does_not_overtake_the_queue() -> None:
    room = Room(0)
    flow = controller(room)
    flow.submit("first")
    room.free = 1  # room appears, but nobody pumped yet
    second = flow.submit("second")
    assert room.dispatched == ["first"] and not second.done


async def test_full_queue_is_rejected_saturated() -> None:
    flow = controller(Room(0), max_queued=1)
    flow.submit("r1")
    ticket = flow.submit("r2")
    assert ticket.outcome is Outcome.REJECTED_SATURATED


@pytest.mark.parametrize(
    ("endpoints", "outcome"), [(True, Outcome.REJECTED_TTL_EXPIRED), (False, Outcome.REJECTED_NO_ENDPOINTS)]
)
async def test_ttl_expiry_says_why(endpoints: bool, outcome: Outcome) -> None:
    room = Room(0)
    room.endpoints = endpoints
    flow = controller(room, ttl_s=0.01)
    ticket = flow.submit("r1")
    assert await asyncio.wait_for(ticket.wait(), 2) is outcome
    assert flow.queued == 0


async def test_cancel_frees_the_place_once() -> None:
    flow = controller(Room(0))
    ticket = flow.submit("r1")
    flow.cancel(ticket)
    flow.cancel(ticket)
    assert ticket.outcome is Outcome.REJECTED_CONTEXT_CANCELLED and flow.queued == 0
    assert flow.outcomes == [Outcome.REJECTED_CONTEXT_CANCELLED]  # type: ignore[attr-defined]


async def test_close_evicts_everyone_and_refuses_newcomers() -> None:
    flow = controller(Room(0))
    tickets = [flow.submit(f"r{i}") for i in range(5)]
    assert flow.close() == 5
    assert all(t.outcome is Outcome.REJECTED_SHUTTING_DOWN for t in tickets)
    assert flow.submit("late").outcome is Outcome.REJECTED_SHUTTING_DOWN
    assert flow.queued == 0 and flow.queued_bytes == 0


async def test_every_ticket_gets_exactly_one_outcome() -> None:
    room = Room(2)
    flow = controller(room, max_queued=3, ttl_s=0.02)
    tickets = [flow.submit(f"r{i}") for i in range(8)]
    flow.cancel(tickets[3])
    await asyncio.gather(*(t.wait() for t in tickets if t.queued and not t.done))
    assert all(t.done for t in tickets)
    assert len(flow.outcomes) == 8  # type: ignore[attr-defined]


async def test_expired_and_cancelled_tickets_are_freed_at_once() -> None:
    """Each in its own priority band, as requests of many priorities leave the queue by TTL or cancel."""

    class Payload:
        pass

    flow: FlowController[Payload] = FlowController(lambda _: False, lambda: True, FlowLimits(ttl_s=0.01))
    tickets = [flow.submit(Payload(), priority=-i) for i in range(200)]
    flow.cancel(tickets[0])
    refs = [weakref.ref(t.payload) for t in tickets]
    await asyncio.gather(*(t.wait() for t in tickets[1:]))
    assert {t.outcome for t in tickets[1:]} == {Outcome.REJECTED_TTL_EXPIRED} and flow.queued == 0
    del tickets
    gc.collect()
    assert not any(ref() is not None for ref in refs)
