"""The tenants' table (picker/flow/tenant_view.py): bounded, budgets merged, shares of the pool."""

from __future__ import annotations

from picker.flow.budgets import Budgets, TokenBudget
from picker.flow.tenant_view import grouped, table
from picker.flow.tenants import OTHER, FairShare, Tenants


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _tenants(rules: FairShare, clock: Clock) -> Tenants:
    return Tenants(rules, lambda: (4, 8), clock)


def test_configured_and_busiest_tenants_have_rows_the_rest_is_other() -> None:
    clock = Clock()
    tenants = _tenants(FairShare(weights={"gold": 3.0}), clock)
    for i in range(30):
        name = f"t{i:02d}"
        tenants.arrived(name)
        tenants.dispatched(name, 100 + i)  # t29 the busiest
    tenants.arrived("gold")
    tenants.dispatched("gold", 1)  # configured: its own row, however idle
    rows = grouped(tenants, busiest=5)
    assert set(rows) == {"gold", OTHER} | {f"t{i}" for i in range(25, 30)}
    assert rows[OTHER].requests == 25 and rows[OTHER].in_flight == 25
    assert rows[OTHER].tokens == sum(100 + i for i in range(25))
    view = table(tenants, None, busiest=5)
    assert view["fair_share"] is True and len(view["rows"]) == 7
    assert view["rows"][-1]["tenant"] == OTHER  # the sum comes last, the busiest first
    assert view["rows"][0]["tenant"] == "t29"
    gold = next(r for r in view["rows"] if r["tenant"] == "gold")
    assert gold["weight"] == 3.0 and gold["share"] == round(3.0 / 33.0, 4)  # 30 active at weight 1
    assert abs(sum(r["share"] for r in view["rows"]) - 1.0) < 1e-3
    assert abs(sum(r["token_share"] for r in view["rows"]) - 1.0) < 1e-3


def test_an_idle_tenant_has_no_share_of_the_pool() -> None:
    clock = Clock()
    tenants = _tenants(FairShare(active_s=10.0), clock)
    tenants.arrived("a")
    tenants.dispatched("a", 10)
    tenants.ended("a", 10, 12)
    tenants.arrived("b")
    assert tenants.shares() == {"a": 0.5, "b": 0.5}
    clock.now = 11.0
    tenants.arrived("b")
    view = {r["tenant"]: r for r in table(tenants, None)["rows"]}
    assert view["a"]["share"] == 0.0 and view["b"]["share"] == 1.0
    assert view["a"]["tokens"] == 12  # settled to what the engine reported


def test_budgets_are_merged_and_shown_with_fair_share_off() -> None:
    clock = Clock()
    budgets = Budgets({"acme": TokenBudget(600.0, 100.0)}, clock)
    assert budgets.take("acme", 150) == 0.0
    assert budgets.take("acme", 10) > 0  # refused: the bucket is below zero
    off = table(None, budgets)
    assert off["fair_share"] is False
    (row,) = off["rows"]
    assert row["tenant"] == "acme" and row["tokens"] is None and row["over_budget"] == 1
    assert row["budget"] == {
        "tokens_per_minute": 600.0, "burst": 100.0, "level": -50.0, "spent": 150.0, "refused": 1,
    }  # fmt: skip
    tenants = _tenants(FairShare(), clock)
    tenants.arrived("acme")
    tenants.dispatched("acme", 150)
    on = {r["tenant"]: r for r in table(tenants, budgets)["rows"]}
    assert on["acme"]["tokens"] == 150 and on["acme"]["budget"]["level"] == -50.0
