"""One model-server endpoint as the picker sees it."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from picker.pool.drain import DrainRecord
from picker.pool.load import LoadSample


class EndpointState(enum.Enum):
    """Only READY endpoints are ever picked; the others are kept while requests are still in flight."""

    READY = "ready"
    DRAINING = "draining"  # shutting down: finishing its in-flight work, never given new work
    NOT_READY = "not-ready"  # listed but neither ready nor draining (starting up, failing probes)
    GONE = "gone"  # no longer listed by the source; kept only until its last request ends


@dataclass(slots=True)
class Endpoint:
    address: str
    state: EndpointState
    since: float
    in_flight: int = 0
    picks: int = 0
    load: LoadSample | None = None  # last good scrape; None until the first one
    scrape_failures: int = 0  # consecutive; reset by a good scrape
    learned_slots: int = 0  # running count seen while the engine had a queue: its slot count
    arrivals: int = 0  # requests ever attributed here (picked, or moved here by Envoy's choice)
    departures: int = 0  # requests ever ended here or moved away
    drain: DrainRecord | None = None  # the open drain record, while there is one

    @property
    def pickable(self) -> bool:
        return self.state is EndpointState.READY
