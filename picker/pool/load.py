"""Load signals of one endpoint, as last scraped from its own /metrics (`picker/pool/scrapes.py`
records them on the endpoint)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LoadSample:
    """One scrape of an engine's gauges, with the picker's own counters around it.

    They let the picker estimate the engine between scrapes: every request it sent since the scrape
    started may be queued there, every one that ended after the scrape finished freed a slot. The
    engine's snapshot was taken somewhere in between, so both choices err on the busy side.
    """

    running: float
    waiting: float
    kv_usage: float  # 0-1
    at: float  # clock time the scrape finished
    arrivals_before: int  # the endpoint's arrivals counter when the scrape was sent
    departures_after: int  # its departures counter when the answer was read
    peer_arrivals_before: int = 0  # of `arrivals_before`, other pickers' (picker/peers/books.py)
    sent_at: float | None = None  # clock time the scrape was sent (None: not known, take `at`)
