"""The garbage collector, set once a frontend has started.

Python's cyclic collector runs a young collection every 700 allocations by default and, now and then,
walks everything the process holds. A picker allocates a few hundred objects a request and holds
tens of thousands for good after start (its config, gRPC and aiohttp machinery, metrics), so the
default made the collector a tenth of the picker's own Python per request, growing with what it
holds (`bench_hot_path`: 19-61 us of about 300). Settled here: what start built is frozen out of
every later walk (`gc.freeze`) and young collections run every `server.gc_gen0_threshold`
allocations (cycles still collected, a little later: the memory of a few thousand allocations).
"""

from __future__ import annotations

import gc
import logging

log = logging.getLogger(__name__)


def settle(gen0_threshold: int) -> None:
    """Freeze what start built and space young collections; 0 leaves Python's collector as it is."""
    if gen0_threshold <= 0:
        return
    gc.collect()  # what start left as garbage goes now, not frozen with the rest
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(gen0_threshold, older, oldest)
    log.debug(
        "gc: %d objects frozen, young collections every %d allocations", gc.get_freeze_count(), gen0_threshold
    )
