"""A tenant's token budget is one budget across the pickers that share the books
(picker/flow/budgets.py, picker/peers/budget_share.py): two pickers in process, events carried by
hand through each receiver's inbox, as the channel would."""

from __future__ import annotations

from picker.contract import Outcome, headers
from picker.flow import FlowLimits
from picker.flow.budgets import TokenBudget
from picker.observability.metrics import Metrics
from picker.peers import budget_share
from picker.peers.books import Peering
from picker.peers.inbox import PeerInbox
from picker.pool import Pool
from picker.request.inference import InferenceRequest
from picker.request.pipeline import RequestPath

E1, E2 = "10.0.0.1:8000", "10.0.0.2:8000"
A, B = "10.1.0.1:9004", "10.1.0.2:9004"
COST = 100  # each request: no prompt, max_tokens 100
REQUEST = InferenceRequest(method="POST", path="/v1/completions", model="m", stream=True, max_tokens=COST)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Picker:
    def __init__(self, name: str, clock: Clock, per_minute: float = 600.0, burst: float = 1000.0) -> None:
        self.pool = Pool(clock=clock)
        self.pool.apply(ready=[E1, E2])
        self.peering = Peering(name, (A, B), self.pool, clock=clock)
        limits = FlowLimits(budgets={"t": TokenBudget(per_minute, burst)})
        self.path = RequestPath(
            self.pool,
            Metrics(pool="default"),
            fallback_count=0,
            schedule=lambda d, f: lambda: None,
            peering=self.peering,
            clock=clock,
            flow_limits=limits,
        )
        self.inbox = PeerInbox(self.peering, self.path, None, lambda: [])
        assert self.path.flow.budgets is not None
        self.budgets = self.path.flow.budgets

    def admit(self) -> Outcome | None:
        return self.path.admit(REQUEST, flow="t").outcome

    def opened_link_to(self, peer: str) -> None:
        """The link to `peer` opened: its first message carries this picker's view (channel.py)."""
        self.peering.outbox.to(peer, budget_share.view(self.peering, self.budgets))


def deliver(*pickers: Picker) -> None:
    """Carry every queued event to its peer through the peer's inbox (checked whole there)."""
    by_name = {p.peering.name: p for p in pickers}
    moved = True
    while moved:
        moved = False
        for sender in pickers:
            for name, receiver in by_name.items():
                events = sender.peering.outbox.take(name)
                if events:
                    moved = True
                    receiver.inbox.apply(sender.peering.name, events)


def test_a_tenant_spreading_over_two_pickers_gets_one_budget() -> None:
    """No refill (the clock stands still): a burst of 1,000 tokens is 10 requests of 100 in all,
    whichever picker each reaches, not 10 on each."""
    clock = Clock()
    a, b = Picker(A, clock), Picker(B, clock)
    outcomes = []
    for index in range(40):
        outcomes.append((a if index % 2 else b).admit())
        deliver(a, b)
    assert outcomes.count(Outcome.DISPATCHED) == 10
    assert outcomes.count(Outcome.REJECTED_OVER_BUDGET) == 30
    assert a.budgets.level("t") == b.budgets.level("t") == 0


def test_over_a_minute_two_pickers_admit_at_most_the_budget_and_one_reservation_each() -> None:
    """Requests every 100 ms for a minute, alternating: burst + a minute's refill, plus at most one
    reservation per picker (the request that took its view below zero)."""
    clock = Clock()
    a, b = (
        Picker(A, clock, per_minute=3000.0, burst=1000.0),
        Picker(B, clock, per_minute=3000.0, burst=1000.0),
    )
    admitted = 0
    for index in range(600):
        clock.now += 0.1
        admitted += (a if index % 2 else b).admit() is Outcome.DISPATCHED
        deliver(a, b)
    assert (1000 + 3000) // COST <= admitted <= (1000 + 3000) // COST + 2


def test_without_the_books_shared_each_picker_spends_the_whole_budget() -> None:
    """What sharing prevents: the same traffic with the events never carried."""
    clock = Clock()
    a, b = Picker(A, clock), Picker(B, clock)
    outcomes = [(a if index % 2 else b).admit() for index in range(40)]
    assert outcomes.count(Outcome.DISPATCHED) == 20


def test_a_refusal_is_a_429_with_the_reason_and_when_the_budget_has_room() -> None:
    clock = Clock()
    a = Picker(A, clock, per_minute=600.0, burst=100.0)  # 10 tokens a second
    assert a.admit() is Outcome.DISPATCHED  # takes the bucket to 0
    ticket = a.path.admit(REQUEST, flow="t")
    reply = a.path.settle(ticket)
    assert reply.outcome is Outcome.REJECTED_OVER_BUDGET  # type: ignore[union-attr]
    answer = dict(reply.headers())  # type: ignore[union-attr]
    assert reply.status == 429 and answer[headers.DROPPED_REASON] == "rejected-over-budget"  # type: ignore[union-attr]
    assert answer[headers.RETRY_AFTER] == "1"  # 0 tokens: room again in a moment
    assert a.budgets.rows()[0]["refused"] == 1
    clock.now += 0.5
    assert a.admit() is Outcome.DISPATCHED  # 5 tokens back: admitted, the bucket owes 95
    ticket = a.path.admit(REQUEST, flow="t")
    assert ticket.retry_after_s is not None and 9.0 < ticket.retry_after_s <= 9.5
    assert dict(a.path.settle(ticket).headers())[headers.RETRY_AFTER] == "10"  # type: ignore[union-attr]


def test_what_the_engine_did_not_use_comes_back_to_every_picker() -> None:
    clock = Clock()
    a, b = Picker(A, clock), Picker(B, clock)
    record = a.path.admit(REQUEST, flow="t").payload
    deliver(a, b)
    assert b.budgets.level("t") == 900
    a.path.flow.settle("t", record.reserved, 0, 30)  # the engine reported 30 tokens of the 100
    deliver(a, b)
    assert a.budgets.level("t") == b.budgets.level("t") == 970


def test_a_total_heard_twice_or_out_of_a_view_counts_once() -> None:
    clock = Clock()
    a, b = Picker(A, clock), Picker(B, clock)
    a.opened_link_to(B)
    b.opened_link_to(A)
    deliver(a, b)
    a.admit()
    spent = a.peering.outbox.pending[B][-1]
    deliver(a, b)
    b.inbox.apply(A, [spent, spent])  # repeated
    a.opened_link_to(B)  # the next sync's view: the same total
    deliver(a, b)
    assert b.budgets.level("t") == 900


def test_a_restarted_picker_finds_the_budget_where_its_peers_left_it() -> None:
    clock = Clock()
    a, b = Picker(A, clock), Picker(B, clock)
    for _ in range(3):
        a.admit()
        b.admit()
        deliver(a, b)
    assert a.budgets.level("t") == 400
    b = Picker(B, clock)  # restarted: a new incarnation, its own bucket full
    assert b.budgets.level("t") == 1000
    a.opened_link_to(B)  # the links open: each sends its view first
    b.opened_link_to(A)
    deliver(a, b)
    assert a.budgets.level("t") == b.budgets.level("t") == 400
    assert [b.admit() for _ in range(5)].count(Outcome.DISPATCHED) == 4
    deliver(a, b)
    assert a.budgets.level("t") == 0  # the new incarnation's spending counts from zero there


def test_a_malformed_or_foreign_budget_event_is_rejected_whole() -> None:
    clock = Clock()
    b = Picker(B, clock)
    bad = [
        ["spent", f"{A}~", "inc", "t", float("nan")],
        ["spent", f"{A}~", "inc", "t", "100"],
        ["spent", f"{A}~", "inc", "t", 1e30],
        ["budgets", f"{A}~", "inc", [["t", 0.0]]],
        ["budgets", f"{A}~", "inc", "t"],
        ["spent", f"{B}~", "inc", "t", 500.0],  # B's spending, sent by A
    ]
    b.inbox.apply(A, bad)
    assert sum(b.inbox.rejected.values()) == len(bad)
    assert b.budgets.level("t") == 1000
