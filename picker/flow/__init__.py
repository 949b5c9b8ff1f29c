"""Flow control: admit now, queue, or refuse; release queued requests the moment capacity frees.

Owns the admission queue (priority bands, round robin between fairness flows, FIFO within a flow,
bounded by count and bytes), time-to-live expiry, client cancellation and shutdown eviction. Every
queued request ends with exactly one `Outcome`. Runs on one asyncio loop (futures and timers),
without locks and without network I/O; what "capacity" means is a callback from the pipeline.
"""

from picker.flow.controller import FlowController, FlowLimits, Ticket
from picker.flow.queue import AdmissionQueue, QueuedItem

__all__ = ["AdmissionQueue", "FlowController", "FlowLimits", "QueuedItem", "Ticket"]
