"""Wiring: build the planes from the config, start the servers, stop them in order.

The one place that knows which concrete pieces make a picker.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from dataclasses import dataclass

import grpc
from aiohttp import web

from picker.config import PickerConfig, format_address
from picker.extproc.server import HealthState, ext_proc_server, health_server
from picker.extproc.service import ExtProcService
from picker.http_admin import admin_app
from picker.pipeline import RequestPath
from picker.pool import Pool
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
        self.pool.apply(ready=config.pool.endpoints)
        self.metrics = Metrics()
        self.metrics.register_pool(self.pool)
        self.path = RequestPath(self.pool, self.metrics, fallback_count=config.scheduling.fallback_count)
        self.service = ExtProcService(
            self.path,
            max_body_bytes=config.requests.max_body_bytes,
            observer_attach_grace_s=config.streams.observer_attach_grace_s,
        )
        self.health = HealthState()
        self._grpc: grpc.aio.Server | None = None
        self._health: grpc.aio.Server | None = None
        self._http: web.AppRunner | None = None

    async def start(self) -> BoundPorts:
        server = self.config.server
        bind = server.bind_address
        self._grpc, grpc_port = ext_proc_server(self.service, format_address(bind, server.grpc_port))
        self._health, health_port = health_server(self.health, format_address(bind, server.health_port))
        await self._grpc.start()
        await self._health.start()
        self._http = web.AppRunner(admin_app(self.pool, self.metrics), access_log=None)
        await self._http.setup()
        site = web.TCPSite(self._http, bind, server.metrics_port)
        await site.start()
        metrics_port = self._http.addresses[0][1]
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

    async def stop(self) -> None:
        """Stop taking new streams, let in-flight ext_proc streams finish within the drain budget."""
        grace = self.config.shutdown.drain_timeout_s
        await self.health.not_ready()
        self.path.accepting = False
        if self._grpc is not None:
            await self._grpc.stop(grace)
        self.service.cancel_timers()
        if self._health is not None:
            await self._health.stop(0)
        if self._http is not None:
            await self._http.cleanup()
        log.info("picker stopped live_requests=%d in_flight=%d", self.path.live, self.pool.in_flight())


async def serve(config: PickerConfig) -> None:
    """Run until SIGTERM or SIGINT, then stop gracefully; a second signal stops at once."""
    app = PickerApp(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    signals = 0

    def on_signal() -> None:
        nonlocal signals
        signals += 1
        if signals > 1:
            log.warning("second signal: exiting now")
            raise SystemExit(1)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    ports = await app.start()
    print(f"picker ready grpc={ports.grpc} health={ports.health} metrics={ports.metrics}", flush=True)
    await stop.wait()
    await app.stop()
