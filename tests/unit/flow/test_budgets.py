"""Token budgets in the flow plane (picker/flow/budgets.py): charged at admission, refunded when the
request is not dispatched after all, settled at its end."""

from __future__ import annotations

from picker.contract import Outcome
from picker.flow import FlowController, FlowLimits
from picker.flow.budgets import Budgets, TokenBudget


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def controller(room: list[int], max_queued: int = 1) -> tuple[FlowController[str], Clock]:
    clock = Clock()

    def dispatch(payload: str) -> bool:
        if room[0] <= 0:
            return False
        room[0] -= 1
        return True

    limits = FlowLimits(max_queued=max_queued, ttl_s=0.01, budgets={"t": TokenBudget(60.0, 500.0)})
    return FlowController(dispatch, lambda: True, limits, clock=clock), clock


def test_the_bucket_refills_at_its_rate_up_to_its_burst() -> None:
    clock = Clock()
    budgets = Budgets({"t": TokenBudget(600.0, 100.0)}, clock)
    assert budgets.take("t", 250) == 0.0  # admitted while above zero: it owes 150 now
    assert budgets.level("t") == -150
    assert budgets.take("t", 1) == 15.0  # 10 tokens a second
    clock.now += 15.5
    assert budgets.take("t", 1) == 0.0
    clock.now += 3600
    assert budgets.level("t") == 100  # never above the burst


async def test_a_request_refused_or_expired_in_the_queue_gets_its_reservation_back() -> None:
    room = [0]
    flow, _clock = controller(room)
    budgets = flow.budgets
    assert budgets is not None
    queued = flow.submit("a", flow="t", cost=100)  # no room: queued, charged
    refused = flow.submit("b", flow="t", cost=100)  # the queue is full: refused, refunded
    assert refused.outcome is Outcome.REJECTED_SATURATED
    assert budgets.level("t") == 400
    assert await queued.wait() is Outcome.REJECTED_TTL_EXPIRED
    assert budgets.level("t") == 500


def test_tenants_without_a_budget_and_requests_without_a_tenant_are_not_counted() -> None:
    flow, _clock = controller([10])
    assert flow.submit("a", flow="other", cost=10_000).outcome is Outcome.DISPATCHED
    assert flow.submit("b", cost=10_000).outcome is Outcome.DISPATCHED
    assert flow.budgets is not None and flow.budgets.level("t") == 500


def test_settled_to_what_the_engine_reported() -> None:
    flow, _clock = controller([10])
    assert flow.submit("a", flow="t", cost=300).outcome is Outcome.DISPATCHED
    flow.settle("t", (100, 200), 100, None)  # no output figure: the reservation stands
    assert flow.budgets is not None and flow.budgets.level("t") == 200
    flow.settle("t", (100, 200), 90, 10)
    assert flow.budgets.level("t") == 400


def test_a_usage_no_request_can_have_is_bounded_not_taken() -> None:
    """An engine's (or a peer's) usage figure is outside input: a negative or absurd count would
    refill a budget shared by every picker, or sink it, past any repair."""
    flow, _clock = controller([10])
    assert flow.submit("a", flow="t", cost=300).outcome is Outcome.DISPATCHED
    flow.settle("t", (100, 200), -(2**62), 10)  # read as 0 prompt tokens: 290 back, no more
    assert flow.budgets is not None and flow.budgets.level("t") == 490
    assert flow.submit("b", flow="t", cost=300).outcome is Outcome.DISPATCHED
    flow.settle("t", (100, 200), 2**62, 0)  # read as the most a request can have
    assert flow.budgets.level("t") < 0 and flow.budgets.level("t") > -(2**40)
