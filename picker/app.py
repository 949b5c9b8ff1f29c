"""`picker serve`: the shared core (picker/wiring.py) with the Envoy-facing servers around it:
ext_proc, EDS and the access log on the gRPC port, health, metrics and the admin API; started in
order, stopped in order, readiness held while anything says not to route here.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
from aiohttp import web

from picker.config.model import ConfigError, PickerConfig, format_address
from picker.extproc.access_log import AccessLogService
from picker.extproc.eds import EndpointDiscovery, EndpointPublisher, add_eds_to_server
from picker.extproc.server import HealthState, ext_proc_server, health_server
from picker.extproc.service import ExtProcService, ResponseEnd
from picker.extproc.tls import CertificateError, ServingCertificate
from picker.lifecycle.shutdown import Shutdown, ShutdownSummary
from picker.lifecycle.signals import run_until_signalled
from picker.wiring import build_core, spawn_owned

if TYPE_CHECKING:
    from picker.peers.books import Peering
    from picker.sources.lease import Election

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
        self.core = core = build_core(config)
        self.pool, self.metrics, self.sources, self.path = core.pool, core.metrics, core.sources, core.path
        flow = config.flow
        self.access_log = AccessLogService(self.path, on_failure=self.metrics.count_access_log_failure)
        # Envoy is asked to wait a little longer than the TTL, so the picker's 429/503 always wins.
        queue_wait_s = min(flow.envoy_max_message_timeout_s, flow.ttl_s + 1.0)
        self.service = ExtProcService(
            self.path,
            max_body_bytes=config.requests.max_body_bytes,
            observer_attach_grace_s=config.streams.observer_attach_grace_s,
            queue_wait_s=queue_wait_s,
            max_hint_bytes=config.requests.max_hint_header_bytes,
            test_hooks=config.requests.enable_test_hooks,
            response_end=ResponseEnd(config.streams.response_end),
            fallbacks=config.scheduling.fallbacks,
            max_model_bytes=config.requests.max_model_name_bytes,
            session_header=config.affinity.session_header,
            slo_headers=config.affinity.latency != "off",
        )
        self.health = HealthState()
        self.scraper = core.scraper
        # Envoy's pool cluster over EDS from the same view (config/envoy.yaml); held while the
        # endpoint source cannot be trusted, so Envoy keeps the last view it had.
        eds = config.eds
        self.eds_publisher = EndpointPublisher(
            self.pool,
            debounce_s=eds.debounce_s,
            resync_s=eds.resync_s,
            hold=lambda: self.sources.problem is not None,
        )
        self.eds = EndpointDiscovery(self.eds_publisher)
        self._tasks: set[asyncio.Task[None]] = set()
        self._stopping = False  # once shutdown starts, readiness only goes down
        self._grpc: grpc.aio.Server | None = None
        self.certificate: ServingCertificate | None = None
        self._health: grpc.aio.Server | None = None
        self._http: web.AppRunner | None = None
        self.election: Election | None = None  # leader.enabled: ready only while holding the Lease

    async def start(self) -> BoundPorts:
        server = self.config.server
        bind = server.bind_address
        credentials = None
        if server.secure_serving:  # first: an unusable --cert-path stops the start before anything runs
            try:
                self.certificate = ServingCertificate.from_config(server.cert_path, server.cert_poll_s)
            except CertificateError as exc:
                raise ConfigError(f"server.cert_path {server.cert_path}: {exc}") from exc
            credentials = self.certificate.credentials()
        await self.sources.start()  # the first view, before Envoy can reach the picker
        await self.core.start_peers()
        if self.config.leader.enabled:
            from picker.sources.lease_api import open_election

            self.election = open_election(self.config, self._leader_changed)
            self.core.leader = lambda: self.election is not None and self.election.elector.leading
            self.metrics.register_rejections("lease", lambda: self.election.rejected)  # type: ignore[union-attr]
            self.health.holds.add("standby")  # until the first campaign step says otherwise
            self.metrics.set_leader(False)
        self._grpc, grpc_port = ext_proc_server(
            self.service,
            self.access_log,
            format_address(bind, server.grpc_port),
            credentials,
            reuse_port=server.workers > 1,  # a pod's workers (picker/lifecycle/workers.py)
        )
        self._health, health_port = health_server(self.health, format_address(bind, server.health_port))
        if self.config.eds.enabled:
            add_eds_to_server(self.eds, self._grpc)
            self._spawn(self.eds_publisher.run(), "eds-publisher")
        await self._grpc.start()
        await self._health.start()
        admin = self.core.admin(self._spawn, self._propagate if self.config.eds.enabled else None)
        self._http = web.AppRunner(admin, access_log=None)
        await self._http.setup()
        site = web.TCPSite(self._http, bind, server.metrics_port)
        await site.start()
        metrics_port = self._http.addresses[0][1]
        self.core.start_background(self._spawn)
        if self.certificate is not None:
            self._spawn(self.certificate.watch(), "cert-watch")
        if self.election is not None:
            self._spawn(self.election.run(), "leader-election")  # ready from its first step, if leading
        if self.path.peering is not None and self.config.peers.ready_timeout_s > 0:
            self.health.holds.add("peers")  # until linked to every peer (below)
            self._spawn(self._await_peers(self.path.peering), "peers-readiness")
        await self.health.serving()
        self.core.follow_sources(self._source_problem)
        ports = BoundPorts(grpc_port, health_port, metrics_port)
        log.info(
            "picker listening grpc=%d (%s) health=%d metrics=%d endpoints=%d",
            ports.grpc,
            self._tls_mode(),
            ports.health,
            ports.metrics,
            len(self.pool),
        )
        return ports

    async def _propagate(self) -> dict[str, Any]:
        """After an admin change: Envoy's EDS view carries it (or the answer says it does not yet).

        A picker that dies right after answering would otherwise leave failOpen round robin on a
        view without the drain (pushes are debounced): 3 of 9 requests reached the drained replica.
        """
        acked, streams = await self.eds.propagate(self.config.eds.ack_timeout_s)
        if not acked:
            log.warning("admin change not yet acknowledged by every EDS stream streams=%d", streams)
        return {"eds": {"acked": acked, "streams": streams}}

    def _tls_mode(self) -> str:
        if self.certificate is None:
            return "plaintext"
        return f"tls from {self.config.server.cert_path}" if self.certificate.directory else "tls self-signed"

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        spawn_owned(self._tasks, coro, name)

    async def _await_peers(self, peering: Peering) -> None:
        """Ready once linked to every peer, or after peers.ready_timeout_s (a peer that is down must
        not keep this one out). Routing before its peers' books arrive, a picker places its first
        requests blind: started one after another, four pickers' links took up to 1.5 s (backoff),
        and the misplacements of that first wave lasted as long as its streams (bench_ha)."""
        from picker.peers.channel import wait_linked

        timeout_s = self.config.peers.ready_timeout_s
        if not await wait_linked(peering, timeout_s):
            missing = sorted(peering.unlinked())
            log.warning("peers not linked after %.1f s: %s; ready with the books it has", timeout_s, missing)
        if not self._stopping:
            await self.health.hold("peers", False)

    def _leader_changed(self, leading: bool) -> None:
        """Only the Lease's holder is ready (active-passive, as the reference picker's HA mode)."""
        self.metrics.set_leader(leading)
        if self.core.pool_status is not None:
            self.core.pool_status.wake()  # a new writer of the pool's status writes at once
        if not self._stopping:
            self._spawn(self.health.hold("standby", not leading), "leader-readiness")

    async def _stand_down(self) -> None:
        """Shutdown's first step: not ready, and the Lease handed back so a standby leads at once."""
        await self.health.not_ready()
        if self.core.pool_status is not None:  # while still the writer: the Lease goes next
            await self.core.pool_status.stopping(self.config.kube.pool_status_stopping_timeout_s)
        if self.election is not None:
            await self.election.release()

    def _source_problem(self, problem: str | None) -> None:
        """Readiness follows whether the endpoint source can be trusted (never up again once stopping)."""
        if problem is None and self._stopping:
            return
        self._spawn(self.health.hold("source", problem is not None), "source-readiness")

    async def shutdown(self, force: asyncio.Event) -> ShutdownSummary:
        """The phased drain (picker/lifecycle/shutdown.py), then the servers stop."""
        self._stopping = True
        summary = await Shutdown(self.path, self._stand_down, self.config.shutdown).run(force)
        await self.stop()
        return summary

    async def stop(self) -> None:
        """Stop the servers now; streams still open are cut (the drain already had its budget)."""
        self._stopping = True
        await self.health.not_ready()
        self.path.flow.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.core.aclose()
        if self.election is not None:
            await self.election.api.aclose()  # type: ignore[attr-defined]
        if self._grpc is not None:
            await self._grpc.stop(0.5)
        self.service.cancel_timers()
        if self._health is not None:
            await self._health.stop(0)
        if self._http is not None:
            await self._http.cleanup()
        log.info("picker stopped live_requests=%d in_flight=%d", self.path.live, self.pool.in_flight())


async def serve(config: PickerConfig) -> None:
    """`picker serve`: the ext_proc endpoint picker."""
    await run_until_signalled(
        PickerApp(config),
        lambda ports: f"picker ready grpc={ports.grpc} health={ports.health} metrics={ports.metrics}",
        gc_gen0_threshold=config.server.gc_gen0_threshold,
    )
