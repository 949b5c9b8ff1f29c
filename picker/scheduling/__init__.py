"""Scheduling: choose, among READY endpoints, the primary and the ordered fallbacks for one request.

One way through: `rows` (one row per candidate, computed once: load, cached share, LoRA, session,
predicted times), `filters` (which rows stay), `scorers` (row -> number, registered in one table),
`choice` (session, LoRA, sticky prefix, else the best weighted score); `pick` alone when only load
tells the candidates apart. Knows nothing of where endpoints come from. Pure functions, no I/O.
"""

from picker.scheduling.load import (
    LoadPolicy,
    assess,
    estimated_load,
    estimated_waiting,
    saturated,
    without_metrics,
)
from picker.scheduling.pick import Candidate, Stagger, pick

__all__ = [
    "Candidate",
    "LoadPolicy",
    "Stagger",
    "assess",
    "estimated_load",
    "estimated_waiting",
    "pick",
    "saturated",
    "without_metrics",
]
