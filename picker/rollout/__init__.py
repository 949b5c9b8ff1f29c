"""Rollouts: canary groups by an endpoint label, a weighted split, gates that compare the candidate
with stable over a sliding window, and an automatic rollback (`canary.py`, `gates.py`,
`evidence.py`: the core, no I/O); the runner that ticks a canary in a running picker and applies
the drains it asks for (`runner.py`), and `picker rollout`, the operator's command (`command.py`).
The core modules import no runner, command or frontend."""

from picker.rollout.canary import CANDIDATE, STABLE, Actions, Canary, CanaryPlan, canary_side
from picker.rollout.gates import CUT, Limits, Reading, Sample

__all__ = [
    "CANDIDATE",
    "CUT",
    "STABLE",
    "Actions",
    "Canary",
    "CanaryPlan",
    "Limits",
    "Reading",
    "Sample",
    "canary_side",
]
