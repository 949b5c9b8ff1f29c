"""Rollout control: canary groups by an endpoint label, a weighted split, gates that compare the
candidate with stable over a sliding window, and an automatic rollback (picker/rollout/canary.py).
Core plane: no I/O; the wiring runs its tick and applies the drains it asks for."""

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
