"""The replicas of one rollout run: one simulator process each (so each can get its own SIGTERM).

Every state change is recorded as a timeline event on the run's clock; the pool setups call `mark`.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from loadtest.procs import Proc, free_port
from loadtest.rollout.timeline import TimelineEvent, mark_event, state_event
from loadtest.stack import health_ok


class Fleet:
    """Addresses for the first generation and its replacements, their processes, their state history."""

    def __init__(self, workdir: Path, replicas: int, sim_args: Sequence[str]) -> None:
        self.workdir = workdir
        self.sim_args = list(sim_args)
        self.first = [f"127.0.0.1:{free_port()}" for _ in range(replicas)]
        self.replacements = [f"127.0.0.1:{free_port()}" for _ in range(replicas)]
        self.procs: dict[str, Proc] = {}
        self.events: list[TimelineEvent] = []
        self.origin = time.monotonic()

    @property
    def every_address(self) -> list[str]:
        return [*self.first, *self.replacements]

    def now(self) -> float:
        return time.monotonic() - self.origin

    def mark(self, address: str, state: str) -> None:
        self.events.append(state_event(max(0.0, self.now()), address, state))

    def moment(self, address: str, label: str) -> None:
        """A tick on the replica's lane: "SIGTERM" or "router told" (timeline.MARK_STYLES)."""
        self.events.append(mark_event(max(0.0, self.now()), address, label))

    def lane_names(self) -> dict[str, str]:
        """ "old 1 (:port)" for the first generation, "new 1 (:port)" for its replacement."""
        names = {}
        for index, (old, new) in enumerate(zip(self.first, self.replacements, strict=True), start=1):
            names[old] = f"old {index}  :{old.rsplit(':', 1)[1]}"
            names[new] = f"new {index}  :{new.rsplit(':', 1)[1]}"
        return names

    def launch(self, address: str) -> Proc:
        port = address.rsplit(":", 1)[1]
        argv = [sys.executable, "-m", "loadtest.sim", "--port", port, *self.sim_args]
        proc = Proc(f"sim-{port}", argv, self.workdir / f"sim-{port}.log")
        self.procs[address] = proc
        self.mark(address, "starting")
        return proc

    async def start(self, address: str, timeout_s: float = 30.0) -> None:
        """Launch a replica and return once its /health answers 200 (not yet in any pool)."""
        proc = self.launch(address)
        port = int(address.rsplit(":", 1)[1])
        await asyncio.to_thread(proc.wait_ready, lambda: health_ok(port), timeout_s)

    async def wait_exit(self, address: str, timeout_s: float) -> int | None:
        """Wait for the replica's process to end (SIGKILL at the deadline, as the kubelet would)."""
        proc = self.procs[address]
        code = await asyncio.to_thread(proc.wait_exit, timeout_s)
        if code is None:
            proc.kill()
        self.mark(address, "gone")
        return code

    def stop_all(self) -> None:
        for proc in self.procs.values():
            proc.stop()
