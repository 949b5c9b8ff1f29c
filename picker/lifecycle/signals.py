"""Running a frontend until it is signalled: start, settle the garbage collector, print its ready
line, then a phased shutdown on SIGTERM or SIGINT (a second signal skips to the end). Both `picker
serve` and `picker proxy`."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable
from typing import Any, Protocol

from picker.lifecycle.heap import settle
from picker.lifecycle.shutdown import ShutdownSummary

log = logging.getLogger(__name__)


class Serving(Protocol):
    """What `run_until_signalled` needs of a frontend: start, then a phased shutdown."""

    async def start(self) -> Any: ...

    async def shutdown(self, force: asyncio.Event) -> ShutdownSummary: ...


async def run_until_signalled(
    app: Serving, ready_line: Callable[[Any], str], *, gc_gen0_threshold: int
) -> None:
    """Start `app`, print `ready_line(ports)`, run until SIGTERM or SIGINT, then shut down in phases;
    a second signal skips to the end of the shutdown. Both `picker serve` and `picker proxy` run here.
    Once started, the garbage collector is settled (`heap.settle`: server.gc_gen0_threshold)."""
    stop, force = asyncio.Event(), asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal() -> None:
        if stop.is_set():
            log.warning("second signal: skipping to the end of the shutdown")
            force.set()
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    ports = await app.start()
    settle(gc_gen0_threshold)
    print(ready_line(ports), flush=True)
    await stop.wait()
    summary = await app.shutdown(force)
    print(summary.line(), flush=True)
