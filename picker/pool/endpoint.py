"""One model-server endpoint as the picker sees it."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class EndpointState(enum.Enum):
    """Only READY endpoints are ever picked; the others are kept while requests are still in flight."""

    READY = "ready"
    DRAINING = "draining"
    GONE = "gone"


@dataclass(slots=True)
class Endpoint:
    address: str
    state: EndpointState
    since: float
    in_flight: int = 0
    picks: int = 0

    @property
    def pickable(self) -> bool:
        return self.state is EndpointState.READY
