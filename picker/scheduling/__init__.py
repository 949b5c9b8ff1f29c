"""Scheduling: choose, among READY endpoints, the primary and the ordered fallbacks for one request.

Knows nothing of where endpoints come from; reads only what `Candidate` declares (address,
in-flight, last load sample). Pure functions, no I/O.
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
