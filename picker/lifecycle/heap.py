"""The garbage collector, set once a frontend has started.

Python's cyclic collector (on 3.11) runs a young collection every 700 net allocations of tracked
objects and, now and then, walks everything the process holds. A picker allocates a few hundred
objects a request and holds tens of thousands for good after start (its config, gRPC and aiohttp
machinery, metrics), so Python's default made the collector about a tenth of the picker's own
Python per request, growing with what it holds (`bench_hot_path` prints its share). Settled here:
start's garbage collected once, what start built frozen out of every later walk (`gc.freeze`), and
young collections every `server.gc_gen0_threshold` net allocations. Cycles that die young are freed
at the next young collection; older ones wait for the rarer older collections, as before; objects
start built are never walked again, so a cycle among them that dies later is not freed (what start
built is the process's for its life).
"""

from __future__ import annotations

import gc
import logging
import time

log = logging.getLogger(__name__)


def settle(gen0_threshold: int) -> None:
    """Collect start's garbage, freeze what start built and space young collections; 0 leaves
    Python's collector as it is."""
    if gen0_threshold <= 0:
        return
    started = time.perf_counter()
    gc.collect()  # start's own garbage goes now, not frozen with the rest
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(gen0_threshold, older, oldest)
    log.info(
        "gc settled in %.0f ms: %d objects frozen, young collections every %d allocations",
        (time.perf_counter() - started) * 1e3,
        gc.get_freeze_count(),
        gen0_threshold,
    )
