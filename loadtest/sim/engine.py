"""The capacity model of one replica: running slots, a FCFS waiting queue and a KV cache counted in tokens.

Concurrency model: single event loop, no locks. Each request is an `InFlight` owned by its HTTP handler
task; the engine only moves it between `waiting` and `running` and wakes it. A waiting request is
promoted when a slot is free and its prompt fits the KV cache (head of line blocks, as FCFS does);
tokens held = prompt + generated tokens of running requests. No preemption: usage is capped at 1.0.
"""

from __future__ import annotations

import asyncio
import enum
from collections import deque

from loadtest.sim.config import CapacityConfig
from loadtest.sim.requestlog import RequestRecord


class Interrupt(enum.IntEnum):
    """Why a request's timeline was cut short by the replica (higher value wins)."""

    DRAIN_HANG = 1  # drain timeout in hang mode: send nothing more, keep the connection
    SHUTDOWN_ABORT = 2  # abort-mode shutdown (or drain timeout in abort mode): end per --abort-style
    FORCE_STOP = 3  # Replica.stop() / second SIGTERM: close the connection now


class Admission(enum.Enum):
    RUNNING = "running"
    QUEUED = "queued"
    REJECTED = "rejected"


def _resolve(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


class InFlight:
    """One admitted-or-pending completion request; its handler sleeps on it, the replica wakes it."""

    __slots__ = ("_loop", "_waiter", "generated", "interrupt", "prompt_tokens", "record", "running")

    def __init__(self, loop: asyncio.AbstractEventLoop, record: RequestRecord, prompt_tokens: int) -> None:
        self._loop = loop
        self._waiter: asyncio.Future[None] | None = None
        self.record = record
        self.prompt_tokens = prompt_tokens
        self.generated = 0
        self.running = False
        self.interrupt: Interrupt | None = None

    async def wait(self, deadline: float | None, wake_on: Interrupt = Interrupt.DRAIN_HANG) -> None:
        """Sleep until `deadline` (loop time; None = until woken); returns early on wake() or on an
        interrupt at least as strong as `wake_on`.

        Same cost as asyncio.sleep (one future, one timer) but wakeable, so shutdown never polls.
        """
        if self.interrupt is not None and self.interrupt >= wake_on:
            return
        waiter = self._loop.create_future()
        self._waiter = waiter
        timer = self._loop.call_at(deadline, _resolve, waiter) if deadline is not None else None
        try:
            await waiter
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()

    def wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def cut(self, interrupt: Interrupt) -> None:
        """Interrupt the request's timeline; a stronger interrupt replaces a weaker one."""
        if self.interrupt is None or interrupt > self.interrupt:
            self.interrupt = interrupt
        self.wake()


class Engine:
    def __init__(self, capacity: CapacityConfig) -> None:
        self._capacity = capacity
        self.running: set[InFlight] = set()
        self.waiting: deque[InFlight] = deque()
        self.tokens_held = 0

    @property
    def kv_usage(self) -> float:
        return min(1.0, self.tokens_held / self._capacity.kv_capacity_tokens)

    def admit(self, flight: InFlight) -> Admission:
        if not self.waiting and self._fits(flight):
            self._start(flight)
            return Admission.RUNNING
        limit = self._capacity.max_num_queued_reqs
        if limit is None or len(self.waiting) < limit:
            self.waiting.append(flight)
            return Admission.QUEUED
        return Admission.REJECTED

    def add_tokens(self, flight: InFlight, count: int) -> None:
        flight.generated += count
        self.tokens_held += count

    def release(self, flight: InFlight) -> None:
        """Free the request's slot or queue place (idempotent) and promote waiting requests."""
        if flight.running:
            flight.running = False
            self.running.discard(flight)
            self.tokens_held -= flight.prompt_tokens + flight.generated
        else:
            try:
                self.waiting.remove(flight)
            except ValueError:
                return
        self._promote()

    def _fits(self, flight: InFlight) -> bool:
        if len(self.running) >= self._capacity.max_num_seqs:
            return False
        # A prompt larger than the whole cache still runs alone, as it would in vLLM (max_model_len rules).
        return (
            not self.running or self.tokens_held + flight.prompt_tokens <= self._capacity.kv_capacity_tokens
        )

    def _start(self, flight: InFlight) -> None:
        flight.running = True
        self.running.add(flight)
        self.tokens_held += flight.prompt_tokens
        flight.wake()

    def _promote(self) -> None:
        while self.waiting and self._fits(self.waiting[0]):
            self._start(self.waiting.popleft())
