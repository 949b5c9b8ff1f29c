"""Runtime state shared by one replica's handlers: engine, counters, request log, faults, drain flag."""

from __future__ import annotations

import asyncio
import itertools
import logging

from prometheus_client.core import CollectorRegistry

from vllm_sim.config import AbortStyle, Role, SimConfig
from vllm_sim.disagg import KvHolds
from vllm_sim.engine import Engine, InFlight, Interrupt
from vllm_sim.faults import FaultBoard
from vllm_sim.kv_events import KvEventPublisher
from vllm_sim.metrics import SimCollector, SimStats, make_registry
from vllm_sim.requestlog import Outcome, RequestLog, RequestRecord

log = logging.getLogger("vllm_sim")


class ReplicaState:
    def __init__(
        self,
        config: SimConfig,
        address: str,
        kv_events_port: int | None = None,
        role: Role | None = None,
        engine_id: str | None = None,
    ) -> None:
        self.config = config
        self.address = address  # "127.0.0.1:PORT", the x-sim-replica header value
        self.engine = Engine(config.capacity, config.cache)
        host, _, port = address.rpartition(":")
        self.kv = KvHolds(
            config.disagg,
            host,
            int(port),
            self.engine,
            config.cache.block_size,
            role,
            engine_id,
        )
        if kv_events_port is not None and self.engine.prefix is not None:
            self.engine.publisher = KvEventPublisher(
                config.host, kv_events_port, config.model, config.cache.block_size
            )
        self.stats = SimStats()
        self.log = RequestLog(config.request_log_size)
        self.faults = FaultBoard(config.faults, config.fault_count)
        self.draining = False
        self.abort_style: AbortStyle = config.shutdown.abort_style
        self.health_status = 200
        self.active: set[InFlight] = set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._sequence = itertools.count()
        self.registry: CollectorRegistry = make_registry(
            SimCollector(
                config.model,
                self.engine,
                self.stats,
                lambda: len(self.active),
                lambda: self.draining,
                config.cache,
            )
        )

    def next_key(self) -> str:
        """The arrival sequence number: the seed key of requests without an x-request-id."""
        return f"#{next(self._sequence)}"

    def enter(self, flight: InFlight) -> None:
        self.active.add(flight)
        self._idle.clear()

    def leave(self, flight: InFlight) -> None:
        self.active.discard(flight)
        if not self.active:
            self._idle.set()

    async def wait_idle(self) -> None:
        await self._idle.wait()

    def cut_all(self, interrupt: Interrupt) -> None:
        for flight in list(self.active):
            flight.cut(interrupt)

    def end(self, record: RequestRecord, outcome: Outcome, finish_reason: str | None = None) -> bool:
        """Close a request's record and count its outcome; False when it had already ended."""
        if not record.finish(outcome, finish_reason):
            return False
        self.stats.ended[outcome.value] += 1
        if self.config.log_requests:
            log.info(
                "request %s %s outcome=%s tokens=%d finish_reason=%s",
                record.request_id,
                record.path,
                outcome.value,
                record.tokens_sent,
                finish_reason,
            )
        return True
