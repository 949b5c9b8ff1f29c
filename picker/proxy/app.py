"""Wiring for `picker proxy`: the shared core (picker/app.py), the HTTP frontend, the upstream client.

Same endpoint sources, admin API (with the shared drain store), readiness that follows the sources,
metrics, status contract and shutdown as `picker serve`, all from the shared `Core`; the
difference is who carries the bytes. At the drain deadline the proxy, unlike Envoy, can still say
something to a stream it must cut: a retryable error event and [DONE].
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from picker.config.model import PickerConfig
from picker.contract import Outcome, reply_for
from picker.lifecycle.shutdown import Shutdown, ShutdownSummary
from picker.lifecycle.signals import run_until_signalled
from picker.proxy.h2c import H2Protocol, ProtocolSniffer
from picker.proxy.server import ProxyFrontend
from picker.proxy.upstream import Upstream
from picker.streams.resume import ResumeMode
from picker.wiring import build_core, spawn_owned

log = logging.getLogger(__name__)
logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per upstream request is noise

_CUT_WAIT_S = 2.0  # after the deadline cut: how long the cut exchanges get to write their last bytes
_MOVE_CHECK_S = 0.25  # streams.move_after_s: how often the drains are looked at


@dataclass(frozen=True)
class ProxyPorts:
    proxy: int
    metrics: int


class ProxyApp:
    """A running `picker proxy`: OpenAI HTTP on the proxy port, metrics/admin (+ /ready) on HTTP."""

    def __init__(self, config: PickerConfig) -> None:
        self.config = config
        self.core = core = build_core(config)
        self.pool, self.metrics, self.sources, self.path = core.pool, core.metrics, core.sources, core.path
        self.scraper = core.scraper
        self.upstream = Upstream(config.proxy)
        requests = config.requests
        self.frontend = ProxyFrontend(
            self.path,
            self.pool,
            self.upstream,
            max_body_bytes=requests.max_body_bytes,
            max_hint_bytes=requests.max_hint_header_bytes,
            max_model_bytes=requests.max_model_name_bytes,
            test_hooks=requests.enable_test_hooks,
            session_header=config.affinity.session_header,
            slo_headers=config.affinity.latency != "off",
            resume=ResumeMode(config.streams.resume),
            resume_max=config.streams.resume_max,
            resume_max_tokens=config.streams.resume_max_tokens,
            pd_steps=config.proxy.pd_steps,
            pd_prefill_timeout_s=config.proxy.pd_prefill_timeout_s,
        )
        self.path.on_stall = self.frontend.stalled  # a stalled resumable stream continues elsewhere
        self.ready = False
        self._stopping = False  # once shutdown starts, readiness only goes down
        self._tasks: set[asyncio.Task[None]] = set()
        self._proxy: web.ServerRunner | None = None
        self._listener: asyncio.Server | None = None
        self._h2: set[H2Protocol] = set()
        self._admin: web.AppRunner | None = None

    async def start(self) -> ProxyPorts:
        bind = self.config.server.bind_address
        await self.sources.start()
        await self.core.start_peers()
        server = web.Server(self.frontend.handle_http1, handler_cancellation=True, access_log=None)
        self._proxy = web.ServerRunner(server, shutdown_timeout=_CUT_WAIT_S)
        await self._proxy.setup()
        http1 = self._proxy.server
        assert http1 is not None
        # one port for both: the first bytes of a connection say HTTP/1.1 or h2c (prior knowledge)
        self._listener = await asyncio.get_running_loop().create_server(
            lambda: ProtocolSniffer(http1, self._new_h2),
            bind,
            self.config.proxy.port,
            backlog=1024,
            reuse_address=True,
        )
        proxy_port = self._listener.sockets[0].getsockname()[1]
        admin = self.core.admin(self._spawn, move=self.frontend.move_streams)  # a rollback's moves too
        admin.router.add_get("/ready", self._readiness)
        self._admin = web.AppRunner(admin, access_log=None)
        await self._admin.setup()
        await web.TCPSite(self._admin, bind, self.config.server.metrics_port).start()
        metrics_port = self._admin.addresses[0][1]
        self.core.start_background(self._spawn)
        if self.config.streams.move_after_s is not None:
            self._spawn(self._move_late_streams(self.config.streams.move_after_s), "move-streams")
        self.ready = True
        self.core.follow_sources(self._source_problem)
        log.info(
            "picker proxy listening port=%d metrics=%d endpoints=%d", proxy_port, metrics_port, len(self.pool)
        )
        return ProxyPorts(proxy_port, metrics_port)

    async def _move_late_streams(self, after_s: float) -> None:
        """streams.move_after_s: a drain that has run this long stops waiting for its longest answers;
        its resumable streams continue on other replicas (the pool names the drains due)."""
        while True:
            for address in self.pool.drains_older_than(after_s):
                moved = self.frontend.move_streams(address)
                if moved:
                    log.info("drain of %s past %.1f s: %d stream(s) moving", address, after_s, moved)
            await asyncio.sleep(_MOVE_CHECK_S)  # a period, not a synchronisation

    def _new_h2(self) -> H2Protocol:
        protocol = H2Protocol(self.frontend.serve)
        self._h2 = {p for p in self._h2 if not p.closed}
        self._h2.add(protocol)
        return protocol

    async def _readiness(self, _: web.Request) -> web.Response:
        return web.json_response({"ready": self.ready}, status=200 if self.ready else 503)

    async def _not_ready(self) -> None:
        self._stopping = True
        self.ready = False
        if self.core.pool_status is not None:
            await self.core.pool_status.stopping(self.config.kube.pool_status_stopping_timeout_s)

    def _source_problem(self, problem: str | None) -> None:
        """/ready follows whether the endpoint source can be trusted (never up again once stopping)."""
        self.ready = problem is None and not self._stopping

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        spawn_owned(self._tasks, coro, name)

    async def shutdown(self, force: asyncio.Event) -> ShutdownSummary:
        """The phased drain (picker/lifecycle/shutdown.py); at its deadline every open exchange is cut
        cleanly."""
        summary = await Shutdown(self.path, self._not_ready, self.config.shutdown).run(force)
        cut = self.frontend.cut_all(reply_for(Outcome.REJECTED_SHUTTING_DOWN))
        if cut:
            log.warning("drain deadline: %d open request(s) ended with a retryable error", cut)
            await self.frontend.wait_idle(_CUT_WAIT_S)
        await self.stop()
        return summary

    async def stop(self) -> None:
        self._stopping = True
        self.ready = False
        self.path.flow.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.core.aclose()
        if self._listener is not None:
            self._listener.close()
        for protocol in self._h2:
            protocol.close()
        if self._proxy is not None:
            await self._proxy.cleanup()
        await self.upstream.aclose()
        if self._admin is not None:
            await self._admin.cleanup()
        log.info("picker proxy stopped live_requests=%d in_flight=%d", self.path.live, self.pool.in_flight())


async def serve_proxy(config: PickerConfig) -> None:
    """`picker proxy`: run until SIGTERM or SIGINT, then drain; a second signal skips to the end."""
    await run_until_signalled(
        ProxyApp(config),
        lambda ports: f"picker proxy ready port={ports.proxy} metrics={ports.metrics}",
        gc_gen0_threshold=config.server.gc_gen0_threshold,
    )
