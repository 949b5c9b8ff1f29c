"""Load signals of one endpoint, as last scraped from its own /metrics."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from picker.pool.endpoint import Endpoint


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
    peer_arrivals_before: int = 0  # of `arrivals_before`, other pickers' (picker/peering.py)
    sent_at: float | None = None  # clock time the scrape was sent (None: not known, take `at`)


def record_sample(
    endpoint: Endpoint,
    running: float,
    waiting: float,
    kv_usage: float,
    now: float,
    arrivals_before: int | None = None,
    peer_arrivals_before: int | None = None,
    sent_at: float | None = None,
) -> None:
    """A good scrape: remember it with the counters that bracket it (see `LoadSample`)."""
    before = endpoint.arrivals if arrivals_before is None else arrivals_before
    peers = endpoint.peer_arrivals if peer_arrivals_before is None else peer_arrivals_before
    endpoint.load = LoadSample(running, waiting, kv_usage, now, before, endpoint.departures, peers, sent_at)
    endpoint.scrape_failures = 0
    if waiting > 0 and running > endpoint.learned_slots:
        endpoint.learned_slots = int(running)


def record_engine_info(
    endpoint: Endpoint,
    block_size: int | None,
    num_blocks: int | None,
    adapters: tuple[frozenset[str], frozenset[str], int] | None,
) -> None:
    """What a scrape said of the engine's cache and adapters (absent: unchanged)."""
    if block_size is not None:
        endpoint.block_size = block_size
    if num_blocks is not None and num_blocks != endpoint.num_blocks:
        endpoint.num_blocks = num_blocks
        if endpoint.prefix is not None:
            endpoint.prefix.resize(num_blocks)
    if adapters is not None:
        endpoint.running_adapters, endpoint.waiting_adapters, endpoint.max_adapters = adapters


def record_failure(endpoint: Endpoint) -> None:
    """A failed scrape (down, slow, garbage): the endpoint's load is unknown, so it counts as saturated."""
    endpoint.load = None
    endpoint.scrape_failures += 1
