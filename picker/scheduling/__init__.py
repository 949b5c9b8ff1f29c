"""Scheduling: choose, among READY endpoints, the primary and the ordered fallbacks for one request.

Knows nothing of where endpoints come from; reads only what `Candidate` declares. Pure functions.
"""

from picker.scheduling.pick import Candidate, pick

__all__ = ["Candidate", "pick"]
