"""The tenants as an operator reads them: one bounded table for the status page, `GET /admin/tenants`,
`picker tenants` and the per-tenant metrics.

A row per configured tenant (a weight or a budget names it) and per busiest other (by tokens) up to
`busiest`; every other tenant is summed into `other`, so the table's size does not grow with the
fairness ids clients send. A row says the tenant's weight and its share of the pool now (its weight
over the active tenants' weights; 0 while it is idle), requests admitted, queued and in flight, its
tokens (reserved at dispatch, settled at the end) and their share of every tenant's, the times it
was held back to keep the reserve, and its token budget where it has one (the bucket's level as this
picker counts every picker's spending, and its refusals). With fair share off only budgets are
counted: the rows are the budgeted tenants, their books empty. Read on the picker's loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from picker.flow.budgets import Budgets
from picker.flow.tenants import OTHER, Tenants

BUSIEST = 20  # tenants with a row of their own besides the configured ones; the rest: `other`


@dataclass(slots=True)
class Totals:
    """One row's books (a tenant's, or the sum of those in `other`)."""

    requests: int = 0
    tokens: int = 0
    held: int = 0
    over_budget: int = 0
    queued: int = 0
    in_flight: int = 0
    weight: float = 0.0
    share: float = 0.0


def grouped(tenants: Tenants, busiest: int = BUSIEST) -> dict[str, Totals]:
    """By label: the configured tenants and the `busiest` others by tokens, the rest summed as `other`."""
    named = set(tenants.rules.weights) | set(tenants.rules.budgets)
    shares = tenants.shares()
    rows: dict[str, Totals] = {}
    ranked = sorted(tenants.all(), key=lambda t: -t.tokens)
    for rank, t in enumerate(ranked):
        label = t.name if t.name in named or rank < busiest else OTHER
        row = rows.setdefault(label, Totals())
        row.requests += t.requests
        row.tokens += t.tokens
        row.held += t.held
        row.over_budget += t.over_budget
        row.queued += t.queued
        row.in_flight += t.in_flight
        row.weight = t.weight if label != OTHER else row.weight + t.weight
        row.share += shares.get(t.name, 0.0)
    return rows


def table(tenants: Tenants | None, budgets: Budgets | None, busiest: int = BUSIEST) -> dict[str, Any]:
    """The whole view: whether fair share is on, and the rows (busiest first, `other` last)."""
    rows: dict[str, dict[str, Any]] = {}
    if tenants is not None:
        books = grouped(tenants, busiest)
        total = sum(row.tokens for row in books.values()) or 0
        for label, row in books.items():
            rows[label] = {
                "tenant": label,
                "weight": round(row.weight, 3),
                "share": round(row.share, 4),
                "requests": row.requests,
                "queued": row.queued,
                "in_flight": row.in_flight,
                "tokens": row.tokens,
                "token_share": round(row.tokens / total, 4) if total > 0 else 0.0,
                "held_back": row.held,
                "over_budget": row.over_budget,
                "budget": None,
            }
    for budget in budgets.rows() if budgets is not None else ():
        name = str(budget["tenant"])
        row = rows.setdefault(name, _unbooked(name))
        row["budget"] = {k: v for k, v in budget.items() if k != "tenant"}
        row["over_budget"] = max(int(row["over_budget"] or 0), int(budget["refused"]))
    ordered = sorted(rows.values(), key=lambda r: (r["tenant"] == OTHER, -(r["tokens"] or 0), r["tenant"]))
    return {"fair_share": tenants is not None, "rows": ordered}


def _unbooked(name: str) -> dict[str, Any]:
    """A budgeted tenant's row with fair share off: only its budget is counted."""
    return {
        "tenant": name,
        "weight": None,
        "share": None,
        "requests": None,
        "queued": None,
        "in_flight": None,
        "tokens": None,
        "token_share": None,
        "held_back": None,
        "over_budget": 0,
        "budget": None,
    }
