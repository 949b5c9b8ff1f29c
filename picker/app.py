"""Wiring: build the planes from the config, start the servers, stop them in order.

The one place that knows which concrete pieces make a picker.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

import grpc
from aiohttp import web

from picker.config import PickerConfig, format_address
from picker.extproc.access_log import AccessLogService
from picker.extproc.server import HealthState, ext_proc_server, health_server
from picker.extproc.service import ExtProcService
from picker.flow import FlowLimits
from picker.http_admin import admin_app
from picker.pipeline import RequestPath
from picker.pool import Pool
from picker.scheduling import LoadPolicy
from picker.shutdown import Shutdown, ShutdownSummary
from picker.sources.endpoints import EndpointSources
from picker.sources.scraper import Scraper
from picker.telemetry import Metrics

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BoundPorts:
    grpc: int
    health: int
    metrics: int


class PickerApp:
    """A running `picker serve`: ext_proc + health on gRPC, metrics/admin on HTTP."""

    def __init__(self, config: PickerConfig) -> None:
        self.config = config
        self.pool = Pool()
        self.metrics = Metrics()
        self.metrics.register_pool(self.pool)
        self.sources = EndpointSources(config, self.pool, self.metrics)
        load = config.load
        policy = LoadPolicy(
            use_metrics=load.scrape,
            staleness_s=load.staleness_s,
            waiting_threshold=load.waiting_threshold,
            kv_threshold=load.kv_threshold,
            engine_slots=load.engine_slots,
            weight_load=load.weight_load,
            weight_waiting=load.weight_waiting,
            weight_kv=load.weight_kv,
        )
        flow = config.flow
        self.path = RequestPath(
            self.pool,
            self.metrics,
            fallback_count=config.scheduling.fallback_count,
            load_policy=policy,
            flow_limits=FlowLimits(
                max_queued=flow.max_queued, max_queued_bytes=flow.max_queued_bytes, ttl_s=flow.ttl_s
            ),
            reject_without_endpoints=flow.reject_without_endpoints,
            access_log_grace_s=config.streams.access_log_grace_s,
            stall_after_s=config.streams.stall_after_s,
        )
        self.access_log = AccessLogService(self.path)
        self.pool.on_change(self.path.capacity_changed)
        # Envoy is asked to wait a little longer than the TTL, so the picker's 429/503 always wins.
        queue_wait_s = min(flow.envoy_max_message_timeout_s, flow.ttl_s + 1.0)
        self.service = ExtProcService(
            self.path,
            max_body_bytes=config.requests.max_body_bytes,
            observer_attach_grace_s=config.streams.observer_attach_grace_s,
            queue_wait_s=queue_wait_s,
        )
        self.health = HealthState()
        self.scraper = (
            Scraper(
                self.pool,
                load,
                on_round=self.path.capacity_changed,
                on_failure=self.metrics.count_scrape_failure,
            )
            if load.scrape
            else None
        )
        self._tasks: set[asyncio.Task[None]] = set()
        self._grpc: grpc.aio.Server | None = None
        self._health: grpc.aio.Server | None = None
        self._http: web.AppRunner | None = None

    async def start(self) -> BoundPorts:
        server = self.config.server
        bind = server.bind_address
        await self.sources.start()  # the first view, before Envoy can reach the picker
        self._grpc, grpc_port = ext_proc_server(
            self.service, self.access_log, format_address(bind, server.grpc_port)
        )
        self._health, health_port = health_server(self.health, format_address(bind, server.health_port))
        await self._grpc.start()
        await self._health.start()
        token = self.config.admin.token
        admin = admin_app(self.pool, self.metrics, token=token.get_secret_value() if token else None)
        self._http = web.AppRunner(admin, access_log=None)
        await self._http.setup()
        site = web.TCPSite(self._http, bind, server.metrics_port)
        await site.start()
        metrics_port = self._http.addresses[0][1]
        if self.scraper is not None:
            self._spawn(self.scraper.run(), "scraper")
        self._spawn(self._sweep_stalls(), "stall-sweep")
        await self.health.serving()
        ports = BoundPorts(grpc_port, health_port, metrics_port)
        log.info(
            "picker listening grpc=%d health=%d metrics=%d endpoints=%d",
            ports.grpc,
            ports.health,
            ports.metrics,
            len(self.pool),
        )
        return ports

    async def _sweep_stalls(self) -> None:
        interval = max(0.05, self.config.streams.stall_after_s / 4)
        while True:
            await asyncio.sleep(interval)
            self.path.sweep_stalls()

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)

        def done(finished: asyncio.Task[None]) -> None:
            self._tasks.discard(finished)
            if not finished.cancelled() and finished.exception() is not None:
                log.error("background task %s died", name, exc_info=finished.exception())

        task.add_done_callback(done)

    async def shutdown(self, force: asyncio.Event) -> ShutdownSummary:
        """The phased drain (picker/shutdown.py), then the servers stop."""
        summary = await Shutdown(self.path, self.health.not_ready, self.config.shutdown).run(force)
        await self.stop()
        return summary

    async def stop(self) -> None:
        """Stop the servers now; streams still open are cut (the drain already had its budget)."""
        await self.health.not_ready()
        self.path.flow.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.scraper is not None:
            await self.scraper.close()
        await self.sources.aclose()
        if self._grpc is not None:
            await self._grpc.stop(0.5)
        self.service.cancel_timers()
        if self._health is not None:
            await self._health.stop(0)
        if self._http is not None:
            await self._http.cleanup()
        log.info("picker stopped live_requests=%d in_flight=%d", self.path.live, self.pool.in_flight())


async def serve(config: PickerConfig) -> None:
    """Run until SIGTERM or SIGINT, then stop gracefully; a second signal stops at once."""
    app = PickerApp(config)
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
    print(f"picker ready grpc={ports.grpc} health={ports.health} metrics={ports.metrics}", flush=True)
    await stop.wait()
    summary = await app.shutdown(force)
    print(summary.line(), flush=True)
