"""Fair share between tenants (picker/flow/tenants.py): order by tokens per weight, the reserve, the cap."""

from __future__ import annotations

import asyncio

from picker.contract import Outcome
from picker.flow import FlowController, FlowLimits
from picker.flow.tenants import OTHER, FairShare, Tenants


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Pool:
    """Slots of a pool the controller dispatches into: `free` of `total`, one taken per dispatch."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.busy: list[tuple[str, int]] = []

    def room(self) -> tuple[int, int]:
        return self.total - len(self.busy), self.total

    def try_dispatch(self, payload: tuple[str, int]) -> bool:
        if len(self.busy) >= self.total:
            return False
        self.busy.append(payload)
        return True


def controller(
    total: int, rules: FairShare | None = None
) -> tuple[FlowController[tuple[str, int]], Pool, Tenants, Clock]:
    pool, clock = Pool(total), Clock()
    flow: FlowController[tuple[str, int]] = FlowController(
        pool.try_dispatch, lambda: True, FlowLimits(ttl_s=3600), clock=clock
    )
    tenants = Tenants(rules or FairShare(), pool.room, clock)
    flow.share_by(tenants)
    return flow, pool, tenants, clock


def finish(flow: FlowController[tuple[str, int]], pool: Pool, index: int = 0) -> tuple[str, int]:
    tenant, cost = pool.busy.pop(index)
    flow.settle(tenant, (0, cost), None, None)
    flow.pump()
    return tenant, cost


async def test_saturated_pool_serves_tenants_by_tokens_not_requests() -> None:
    """One slot; a heavy tenant's requests cost 8x a light one's: per 8 light dispatches, one heavy."""
    flow, pool, _tenants, _ = controller(1)
    flow.submit(("heavy", 80), flow="heavy", cost=80)  # takes the slot
    for _ in range(40):
        flow.submit(("heavy", 80), flow="heavy", cost=80)
        flow.submit(("light", 10), flow="light", cost=10)
    order = [finish(flow, pool)[0] for _ in range(36)]
    served = {name: order.count(name) for name in ("light", "heavy")}
    # tokens served per tenant within one heavy request of each other
    assert abs(served["light"] * 10 - served["heavy"] * 80) <= 80 + 10, order


async def test_weights_set_the_share_of_tokens() -> None:
    flow, pool, _tenants, _ = controller(1, FairShare(weights={"gold": 3.0}))
    flow.submit(("gold", 10), flow="gold", cost=10)
    for _ in range(100):
        flow.submit(("gold", 10), flow="gold", cost=10)
        flow.submit(("free", 10), flow="free", cost=10)
    order = [finish(flow, pool)[0] for _ in range(80)]
    assert 58 <= order.count("gold") <= 62, order  # 3 : 1


async def test_a_tenant_alone_is_never_held_back() -> None:
    flow, _pool, tenants, _ = controller(4)
    tickets = [flow.submit(("solo", 100), flow="solo", cost=100) for _ in range(4)]
    assert all(t.outcome is Outcome.DISPATCHED for t in tickets)
    assert tenants.get("solo") is not None and tenants.get("solo").held == 0  # type: ignore[union-attr]


async def test_an_idle_pool_holds_nobody_back() -> None:
    """Two active tenants, free slots beyond the reserve: the one over its share still dispatches."""
    flow, pool, _tenants, _ = controller(16)
    flow.submit(("light", 10), flow="light", cost=10)
    finish(flow, pool)
    for _ in range(10):
        assert flow.submit(("heavy", 80), flow="heavy", cost=80).outcome is Outcome.DISPATCHED


async def test_the_reserve_keeps_slots_for_a_tenant_under_its_share() -> None:
    """The heavy tenant fills the pool but the last slots: the light one's next request goes at once."""
    flow, _pool, tenants, _ = controller(8)
    flow.submit(("light", 10), flow="light", cost=10)  # light is active, one in flight
    heavy = [flow.submit(("heavy", 80), flow="heavy", cost=80) for _ in range(20)]
    dispatched = sum(t.outcome is Outcome.DISPATCHED for t in heavy)
    assert dispatched < 7, dispatched  # held back before the pool's last free slots
    assert tenants.get("heavy").held > 0  # type: ignore[union-attr]
    assert flow.submit(("light", 10), flow="light", cost=10).outcome is Outcome.DISPATCHED


async def test_an_idle_tenant_banks_no_credit() -> None:
    """A tenant that comes back after others were served starts at their virtual time: it takes
    turns with them, it does not get every dispatch until it has caught up."""
    flow, pool, _tenants, _clock = controller(1)
    flow.submit(("a", 10), flow="a", cost=10)
    for _ in range(50):
        flow.submit(("a", 10), flow="a", cost=10)
    for _ in range(30):
        finish(flow, pool)
    for _ in range(20):
        flow.submit(("b", 10), flow="b", cost=10)
    order = [finish(flow, pool)[0] for _ in range(10)]
    assert 4 <= order.count("a") <= 6, order


def test_tenants_past_the_cap_share_the_other_bucket() -> None:
    clock = Clock()
    tenants = Tenants(FairShare(max_tracked=3), lambda: None, clock)
    for name in ("a", "b", "c"):
        assert tenants.key(name) == name
        tenants.arrived(name)
        tenants.dispatched(name, 10)  # in flight: cannot be forgotten
    assert tenants.key("d") == OTHER
    tenants.ended("a", 10, 10)  # idle now: forgotten to make room
    assert tenants.key("d") == "d"
    assert len(tenants) == 2


async def test_no_fairness_id_is_not_counted() -> None:
    flow, pool, tenants, _ = controller(1)
    assert flow.submit(("", 0), flow="").outcome is Outcome.DISPATCHED
    queued = flow.submit(("", 0), flow="")
    assert not queued.done and len(tenants) == 0
    finish(flow, pool)
    await asyncio.sleep(0)
    assert queued.outcome is Outcome.DISPATCHED


async def test_a_held_tenant_leaves_its_slots_to_the_others_whatever_their_priority() -> None:
    """The heavy tenant's critical requests are held back for the reserve: the light tenant's
    sheddable request, in a lower band, takes the slot the reserve kept (the queue does not stop
    at the first band whose flows are all held)."""
    flow, pool, _tenants, _ = controller(8)
    flow.submit(("light", 10), flow="light", cost=10)
    heavy = [flow.submit(("heavy", 80), flow="heavy", cost=80, priority=1) for _ in range(20)]
    assert any(t.outcome is None for t in heavy) and len(pool.busy) < 8  # held, slots free
    light = flow.submit(("light", 10), flow="light", cost=10, priority=-1)
    flow.pump()
    assert light.outcome is Outcome.DISPATCHED
