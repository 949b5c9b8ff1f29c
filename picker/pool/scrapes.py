"""What a scrape of an engine's /metrics records on its endpoint: the load it read (with the
counters that bracket it), the engine's cache and adapters, or a failure."""

from __future__ import annotations

from picker.pool.endpoint import Endpoint
from picker.pool.load import LoadSample


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
    if num_blocks is not None:
        endpoint.num_blocks = num_blocks  # the approximate index follows it (Placement.tune)
    if adapters is not None:
        endpoint.running_adapters, endpoint.waiting_adapters, endpoint.max_adapters = adapters


def record_failure(endpoint: Endpoint) -> None:
    """A failed scrape (down, slow, garbage): the endpoint's load is unknown, so it counts as saturated."""
    endpoint.load = None
    endpoint.scrape_failures += 1
