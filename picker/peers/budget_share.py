"""The tenants' token budgets across pickers (picker/flow/budgets.py): what each one tells its peers.

Two events, each about the sender's own spending (its id field is `<sender>~`, as a sync's is):
- `["spent", "<sender>~", incarnation, tenant, total]`: its running total for one budgeted tenant,
  after each reservation and settlement; it leaves at once, as the books do;
- `["budgets", "<sender>~", incarnation, [[tenant, level, total], ...]]`: its whole view, first on
  every link it opens and then with every sync of the books (picker/peers/channel.py).
Totals, not increments: a message lost or heard twice changes nothing, the next one puts it right.
Both are checked whole (picker/peers/events.py) before they reach `apply`.
"""

from __future__ import annotations

from picker.flow.budgets import Budgets
from picker.peers.books import Peering
from picker.peers.outbox import Event

SPENT, VIEW = "spent", "budgets"
KINDS = frozenset({SPENT, VIEW})


def share(peering: Peering, budgets: Budgets) -> None:
    """From now on, each change of this picker's spending goes to every peer."""

    def spent(tenant: str, total: float) -> None:
        event: Event = [SPENT, peering.new_id(""), budgets.incarnation, tenant, total]
        for peer in peering.peers:
            peering.outbox.to(peer, event)

    budgets.on_spend = spent


def view(peering: Peering, budgets: Budgets) -> Event:
    """This picker's whole view of the budgets, for a peer."""
    rows = [[tenant, level, total] for tenant, level, total in budgets.view()]
    return [VIEW, peering.new_id(""), budgets.incarnation, rows]


def apply(budgets: Budgets | None, sender: str, event: Event) -> None:
    """A checked `spent` or `budgets` event from `sender` (ignored where no budget is configured)."""
    if budgets is None:
        return
    if event[0] == SPENT:
        budgets.heard(sender, event[2], event[3], float(event[4]))
    else:
        budgets.adopt(sender, event[2], [(t, float(level), float(total)) for t, level, total in event[3]])
