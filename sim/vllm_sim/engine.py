"""The capacity model of one replica: running slots, a FCFS waiting queue and a KV cache counted in tokens.

Concurrency model: single event loop, no locks. Each request is an `InFlight` owned by its HTTP handler
task; the engine only moves it between `waiting` and `running` and wakes it. A waiting request is
promoted when a slot is free and its prompt fits the KV cache (head of line blocks, as FCFS does);
tokens held = prompt + generated tokens of running requests. No preemption: usage is capped at 1.0.

LoRA: a request for an adapter runs only while at most `max_loras` adapters are active (adapters of
running requests); one whose adapter cannot be activated waits, and the requests behind it may pass
(vLLM's scheduler skips it). Prefill (`prefill`): the prompt's cached blocks are looked up and its
blocks stored (sim/vllm_sim/prefix.py); with a prefill rate, uncached tokens are computed one request
after another, so prefill is a shared resource and cache hits free it.
"""

from __future__ import annotations

import asyncio
import enum
from collections import deque

from vllm_sim.config import CacheConfig, CapacityConfig
from vllm_sim.kv_events import KvEventPublisher
from vllm_sim.prefix import PrefixCache
from vllm_sim.requestlog import RequestRecord


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

    __slots__ = (
        "_loop",
        "_waiter",
        "cache_salt",
        "cached_tokens",
        "external_tokens",
        "generated",
        "interrupt",
        "lora",
        "lora_loaded",
        "prompt_tokens",
        "record",
        "running",
        "skip_cache_read",
        "token_ids",
    )

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        record: RequestRecord,
        prompt_tokens: int,
        token_ids: tuple[int, ...] = (),
        cache_salt: str | None = None,
        lora: str | None = None,
    ) -> None:
        self._loop = loop
        self._waiter: asyncio.Future[None] | None = None
        self.record = record
        self.prompt_tokens = prompt_tokens
        self.token_ids = token_ids
        self.cache_salt = cache_salt
        self.lora = lora
        self.lora_loaded = False  # its adapter was not active when it started: it paid the load
        self.cached_tokens = 0  # prompt tokens its prefill found cached
        self.external_tokens = 0  # prompt tokens pulled from a prefill replica (disaggregated serving)
        self.skip_cache_read = False  # its prompt is stored but not looked up (vLLM: prompt_logprobs)
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
    def __init__(self, capacity: CapacityConfig, cache: CacheConfig | None = None) -> None:
        self._capacity = capacity
        self._cache = cache or CacheConfig()
        self.running: set[InFlight] = set()
        self.waiting: deque[InFlight] = deque()
        self.tokens_held = 0
        self.prefix = (
            PrefixCache(self._cache.block_size, self.num_blocks) if self._cache.prefix_caching else None
        )
        self.publisher: KvEventPublisher | None = None
        self._prefill_free_at = 0.0  # loop time when the prefill compute is next free
        self.active_loras: dict[str, int] = {}  # adapter -> running requests using it
        # every duration is this many times longer (prefill, first token, each next token): a
        # replica on a slower GPU, or one that turns slow mid-run (POST /sim/speed)
        self.slowdown = 1.0

    def prefill(self, flight: InFlight, now: float) -> float:
        """Look up and store the prompt's blocks; return when its prefill is done (loop time)."""
        self.lookup(flight)
        return self.compute(flight, now)

    def lookup(self, flight: InFlight) -> None:
        """Find the prompt's cached blocks (flight.cached_tokens) and store its blocks."""
        prefix = self.prefix
        if prefix is not None and flight.token_ids:
            if not flight.skip_cache_read:
                flight.cached_tokens = prefix.lookup(flight.token_ids, flight.cache_salt)
            stored = prefix.store(flight.token_ids, flight.cache_salt)
            if self.publisher is not None:
                self.publisher.stored(stored)

    def compute(self, flight: InFlight, now: float) -> float:
        """When the prompt's uncached tokens are computed (loop time), with a shared prefill rate."""
        rate = self._cache.prefill_tokens_per_s
        if rate is None:
            return now
        start = max(now, self._prefill_free_at)
        tokens = max(0, flight.prompt_tokens - flight.cached_tokens)
        self._prefill_free_at = start + tokens * self.slowdown / rate
        return self._prefill_free_at

    def clear_prefix_cache(self) -> None:
        if self.prefix is not None:
            self.prefix.clear()
            if self.publisher is not None:
                self.publisher.cleared()

    @property
    def waiting_loras(self) -> set[str]:
        return {f.lora for f in self.waiting if f.lora is not None}

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
            if self.waiting[0].lora is not None:
                self._promote()  # only adapters wait ahead: it may pass them
            return Admission.RUNNING if flight.running else Admission.QUEUED
        return Admission.REJECTED

    @property
    def num_blocks(self) -> int:
        return self._cache.num_gpu_blocks or max(
            1, self._capacity.kv_capacity_tokens // self._cache.block_size
        )

    def hold_tokens(self, tokens: int) -> None:
        """KV kept after its request ended (a prefill's blocks waiting for their decode)."""
        self.tokens_held += tokens

    def free_tokens(self, tokens: int) -> None:
        self.tokens_held -= tokens
        self._promote()

    def add_tokens(self, flight: InFlight, count: int) -> None:
        flight.generated += count
        self.tokens_held += count

    def release(self, flight: InFlight) -> None:
        """Free the request's slot or queue place (idempotent) and promote waiting requests."""
        if flight.running:
            flight.running = False
            self.running.discard(flight)
            self.tokens_held -= flight.prompt_tokens + flight.generated
            if flight.lora is not None:
                left = self.active_loras[flight.lora] - 1
                if left:
                    self.active_loras[flight.lora] = left
                else:
                    del self.active_loras[flight.lora]
        else:
            try:
                self.waiting.remove(flight)
            except ValueError:
                return
        self._promote()

    def _lora_fits(self, flight: InFlight) -> bool:
        lora = flight.lora
        return lora is None or lora in self.active_loras or len(self.active_loras) < self._cache.max_loras

    def _fits(self, flight: InFlight) -> bool:
        if len(self.running) >= self._capacity.max_num_seqs or not self._lora_fits(flight):
            return False
        # A prompt larger than the whole cache still runs alone, as it would in vLLM (max_model_len rules).
        return (
            not self.running or self.tokens_held + flight.prompt_tokens <= self._capacity.kv_capacity_tokens
        )

    def _start(self, flight: InFlight) -> None:
        flight.running = True
        self.running.add(flight)
        self.tokens_held += flight.prompt_tokens
        if flight.lora is not None:
            flight.lora_loaded = flight.lora not in self.active_loras
            self.active_loras[flight.lora] = self.active_loras.get(flight.lora, 0) + 1
        flight.wake()

    def _promote(self) -> None:
        """FCFS; a request waiting only for an adapter slot is passed by those behind it."""
        passed: list[InFlight] = []
        while self.waiting:
            head = self.waiting[0]
            if self._fits(head):
                self._start(self.waiting.popleft())
            elif not self._lora_fits(head) and len(self.running) < self._capacity.max_num_seqs:
                passed.append(self.waiting.popleft())
            else:
                break
        self.waiting.extendleft(reversed(passed))
