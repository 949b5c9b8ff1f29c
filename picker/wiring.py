"""What every frontend shares, wired once: the pool and its sources, metrics, the request path, the scraper,
peers, tracing and the shared admin drains (`Core`, `build_core`). `picker serve` (picker/app.py) and
`picker proxy` (picker/proxy/app.py) each add their servers around it, so the two cannot drift apart.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from picker.admin.capacity_guard import CapacityGuard
from picker.config.model import ConfigError, PickerConfig, canonical_address, format_address
from picker.config.plugins import affinity_settings
from picker.config.sources import read_plugin_config
from picker.flow import FlowLimits
from picker.observability.metrics import Metrics
from picker.observability.tracing import Tracing
from picker.peers.books import Peering
from picker.pool import Pool
from picker.pool.drain import merge_summaries
from picker.pool.health import SuspectPolicy
from picker.request.pipeline import RequestPath
from picker.request.stalls import sweep_pulls, sweep_stalls
from picker.scheduling import LoadPolicy
from picker.sources.drain_store import DrainStore, EndpointsFileDrains, LocalDrains
from picker.sources.endpoints import EndpointSources
from picker.sources.scraper import Scraper

if TYPE_CHECKING:
    from aiohttp import web

    from picker.admin.api import Propagate
    from picker.peers.asks import PoolDrains
    from picker.peers.inbox import PeerInbox
    from picker.rollout.runner import RolloutRunner
    from picker.sources.kube_drains_api import LightkubeDrainRecordApi
    from picker.sources.kv_events import KvEvents
    from picker.sources.pool_status import PoolStatusWriter
    from picker.sources.served_models import ModelCards
    from picker.sources.token_review import TokenReviewer
    from picker.sources.tokenizer import EngineTokenizer

log = logging.getLogger(__name__)


class StartupProblem(Exception):
    """A reason the picker cannot start, already worded as the one line the operator reads."""


Spawn = Callable[[Coroutine[Any, Any, None], str], None]  # a frontend's way to run a background task
Mover = Callable[[str], int]  # picker proxy: moves an endpoint's streams elsewhere (streams.resume)


def spawn_owned(tasks: set[asyncio.Task[None]], coro: Coroutine[Any, Any, None], name: str) -> None:
    """Run `coro` as a task owned by `tasks` (the frontend cancels them at stop); log an unexpected death."""
    task = asyncio.create_task(coro, name=name)
    tasks.add(task)

    def done(finished: asyncio.Task[None]) -> None:
        tasks.discard(finished)
        if not finished.cancelled() and finished.exception() is not None:
            log.error("background task %s died", name, exc_info=finished.exception())

    task.add_done_callback(done)


@dataclass
class Core:
    """What every frontend shares (see the module's docstring)."""

    pool: Pool
    metrics: Metrics
    sources: EndpointSources
    path: RequestPath
    scraper: Scraper | None
    config: PickerConfig
    drain_api: LightkubeDrainRecordApi | None = None  # kube.drains_configmap, once opened
    tracing: Tracing | None = None
    kv_events: KvEvents | None = None  # affinity.prefix precise: the engines' KV events
    model_cards: ModelCards | None = None  # scheduling.by_model: each endpoint's /v1/models
    tokenizer: EngineTokenizer | None = None  # ... and their /tokenize
    peer_inbox: PeerInbox | None = None  # peers.members: the channel between pickers, its receiving side
    peer_drains: PoolDrains | None = None  # ... and the pool's drain records through it
    guard: CapacityGuard | None = None
    rollout: RolloutRunner | None = None  # rollout.candidate set: the canary's clock and drains
    reviewer: TokenReviewer | None = None  # admin.metrics_auth: who may read /metrics
    leader: Callable[[], bool] | None = None  # leader.enabled (picker serve): whether it holds the Lease
    drains: DrainStore | None = None  # where admin drains are recorded (set by `admin`)
    pool_status: PoolStatusWriter | None = None  # kube.pool_status: the InferencePool's condition

    def start_background(self, spawn: Spawn) -> None:
        """The core's own loops (scraper, KV events, stall sweep), run by the frontend's `spawn`."""
        if self.scraper is not None:
            spawn(self.scraper.run(), "scraper")
        if self.kv_events is not None:
            spawn(self.kv_events.run(), "kv-events")
        if self.config.scheduling.by_model:
            from picker.sources.served_models import ModelCards

            self.model_cards = ModelCards(
                self.pool, self.config.scheduling.models_interval_s, on_change=self.path.capacity_changed
            )
            spawn(self.model_cards.run(), "model-cards")
        if self.path.peering is not None:
            from picker.peers.channel import PeerLinks

            peers = self.config.peers
            links = PeerLinks(
                self.path.peering,
                self.path,
                self.config.peers.credential(),
                service=peers.service,
                every_s=peers.resolve_interval_s,
                # counted with the inbox's (picker_peer_connections_rejected_total)
                refused=self.peer_inbox.connections_refused if self.peer_inbox is not None else None,
            )
            spawn(links.run(), "peer-links")
            if self.peer_inbox is not None:
                spawn(self.peer_inbox.run(), "peer-reads")
        if self.rollout is not None:
            spawn(self.rollout.run(), "rollout")
        self.sources.run_deletion_cost(self, spawn)  # kube.deletion_cost, when on
        if self.sources.status_api is not None:
            from picker.sources.pool_status.opening import open_pool_status

            self.pool_status = open_pool_status(self)
            spawn(self.pool_status.run(), "pool-status")
        spawn(sweep_stalls(self.path, self.config.streams.stall_after_s), "stall-sweep")
        spawn(sweep_pulls(self.path, self.config.drain.kv_pull_timeout_s), "pull-sweep")

    def admin(
        self, spawn: Spawn, propagate: Propagate | None = None, move: Mover | None = None
    ) -> web.Application:
        """The metrics port's application (picker/admin/api.py) over this core."""
        from picker.admin.api import admin_app
        from picker.admin.status_page import overview, tenants

        token, metrics_token = self.config.admin.token, self.config.admin.metrics_token
        drains = self.drains = self.open_drains(spawn) or LocalDrains(self.pool)
        if self.rollout is not None:
            self.rollout.store = drains  # a rollback drains through the same store as the admin API
            if self.path.peering is not None and not drains.shared:
                log.warning(
                    "rollout with peers but no shared drain store (kube.drains_configmap, or an endpoints "
                    "file the pickers share): a rollback drains the candidate in this picker's pool only"
                )
        moves = None
        if move is not None and (peering := self.path.peering) is not None:  # moves reach every peer
            from picker.peers.moves import PoolMoves

            moves = PoolMoves(peering, self.config.peers.credential(), move, self.config.peers.move_timeout_s)
            self.metrics.register_rejections("peer_move_answers", lambda: moves.rejected)
            if self.peer_inbox is not None:
                self.peer_inbox.mover = move  # and a peer's ask moves this picker's streams the same way
        if self.rollout is not None and move is not None and self.config.rollout.move_streams:
            from picker.peers.moves import everywhere  # a rollback moves as the admin move does

            self.rollout.move_streams = everywhere(move, moves)
        return admin_app(
            self.pool,
            self.metrics,
            token=token.get_secret_value() if token else None,
            drains=drains,
            propagate=propagate,
            pool_drains=self.pool_drains if self.path.peering is not None else None,
            guard=self.guard if self.config.admin.drain_guard else None,
            rollout=self.rollout,
            data_planes=self.path.data_planes,
            overview=lambda: overview(self.path),
            trust_loopback=self.config.admin.trust_loopback,
            metrics_token=metrics_token.get_secret_value() if metrics_token else None,
            metrics_reviewer=reviewer.review if (reviewer := self.open_reviewer()) is not None else None,
            read_auth=self.config.admin.read_auth,
            move_streams=move,
            pool_moves=None if moves is None else moves.move,
            tenants=lambda: tenants(self.path),
        )

    def open_reviewer(self) -> TokenReviewer | None:
        """admin.metrics_auth: readers' tokens reviewed by the API server (token, access reviews)."""
        if not self.config.admin.metrics_auth:
            return None
        from picker.sources.token_review import TokenReviewer

        self.reviewer = reviewer = TokenReviewer.of(self.config.kube.kubeconfig)
        self.metrics.register_metrics_auth(lambda: reviewer.reviews)
        return reviewer

    def open_drains(self, spawn: Spawn) -> DrainStore | None:
        """Where admin drains are recorded so every picker replica applies them (drain_store.py):
        the ConfigMap named by kube.drains_configmap (its watch run by `spawn`), or the endpoints
        file when it is the source; None: this replica's pool only."""
        kube = self.config.kube
        if kube.drains_configmap is not None:
            from picker.sources.kube_drains_api import open_configmap_drains

            store, self.drain_api = open_configmap_drains(kube, self.pool)
            spawn(store.watch.run(), "drain-record")
            return store
        if self.sources.file is not None:
            return EndpointsFileDrains(self.sources.file, self.pool)
        return None

    def follow_sources(self, listener: Callable[[str | None], None]) -> None:
        """`listener(problem)` now if the endpoint source already has a problem, then on every change
        (a string: the source cannot be trusted, so not ready; None: ready again)."""
        self.sources.on_problem(listener)
        if self.sources.problem is not None:
            listener(self.sources.problem)

    async def start_peers(self) -> int | None:
        """Serve this picker's peers (peers.members set); the port, or None when alone."""
        peering = self.path.peering
        if peering is None:
            return None
        from picker.peers.inbox import PeerInbox

        peers = self.config.peers
        from picker.peers.asks import PoolDrains

        inbox = PeerInbox(
            peering,
            self.path,
            self.config.peers.credential(),
            self.pool.drain_summaries,
            read_every_s=peers.read_every_s,
            max_unauthenticated=peers.max_unauthenticated,
            max_unauthenticated_per_source=peers.max_unauthenticated_per_source,
        )
        self.metrics.register_rejections("peer_events", lambda: inbox.rejected)
        self.metrics.register_rejections("peer_connections", lambda: inbox.connections_refused)
        drains = self.peer_drains = PoolDrains(peering, self.config.peers.credential())
        self.metrics.register_rejections("peer_drain_answers", lambda: drains.rejected)
        port = await inbox.listen(peers.bind_address or self.config.server.bind_address, peers.port)
        self.peer_inbox = inbox
        self.path.catch_up = inbox.catch_up
        log.info("peers name=%s members=%s port=%d", peering.name, ",".join(peering.peers), port)
        return port

    async def pool_drains(self, own: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Every picker's drain records merged: what the pool's drains were (`picker scorecard`); a
        peer's malformed answer is left out and counted (picker/peers/asks.py)."""
        if self.peer_drains is None:
            return merge_summaries([own])
        return await self.peer_drains(own)

    async def aclose(self) -> None:
        """Close what the core opened (after the frontend cancelled its background tasks)."""
        if self.model_cards is not None:
            await self.model_cards.close()
        if self.peer_inbox is not None:
            await self.peer_inbox.close()
        if self.tracing is not None:
            # the batch of spans still buffered goes out now (bounded: the exporter's own timeout)
            await asyncio.to_thread(self.tracing.provider.shutdown)
        if self.scraper is not None:
            await self.scraper.close()
        if self.tokenizer is not None:
            await self.tokenizer.aclose()
        await self.sources.aclose()
        if self.drain_api is not None:
            await self.drain_api.aclose()
        if self.reviewer is not None:
            await self.reviewer.aclose()


def build_core(config: PickerConfig) -> Core:
    """The planes of one picker from its config; `picker serve` and `picker proxy` both start here.

    ConfigError when the reference picker's plugin configuration cannot be used."""
    plugins = read_plugin_config(config.scheduling)
    if plugins is not None:
        for note in plugins.notes:
            log.info("%s", note)
        try:
            affinity = config.affinity.model_validate(
                {**config.affinity.model_dump(), **affinity_settings(plugins)}
            )
        except ValidationError as exc:
            raise ConfigError(f"{config.scheduling.config_file or 'scheduling.config_text'}: {exc}") from exc
        config = config.model_copy(update={"affinity": affinity})
        log.info("plugin configuration: affinity %s", affinity.model_dump(exclude_defaults=True))
    pool = Pool()
    scheduling = config.scheduling
    pool.health.policy = SuspectPolicy(
        scheduling.suspect_after_failures, scheduling.suspect_backoff_s, scheduling.suspect_max_backoff_s
    )
    pool.failed_window_s = scheduling.failed_before_drain_window_s
    metrics = Metrics(pool=config.pool_label())
    metrics.register_pool(pool)
    sources = EndpointSources(config, pool, metrics)
    load = config.load
    policy = LoadPolicy.of(load, config.affinity)
    flow = config.flow
    tracing = start_tracing(config)
    path = RequestPath(
        pool,
        metrics,
        fallback_count=config.scheduling.fallback_count,
        load_policy=policy,
        flow_limits=FlowLimits.of(flow, config.tenants),
        reject_without_endpoints=flow.reject_without_endpoints,
        access_log_grace_s=config.streams.access_log_grace_s,
        stall_after_s=config.streams.stall_after_s,
        cut_after_silence_s=config.streams.cut_after_silence_s,
        engine_gauges=load.scrape,
        engine_transit_s=config.streams.engine_transit_s,
        tracing=tracing,
        affinity=config.affinity,
        peering=peering_of(config, pool),
        by_model=config.scheduling.by_model,
        pd=config.pd,
    )
    path.objectives = sources.objectives
    if path.peering is not None:
        metrics.register_peers(path.peering)
    pool.on_change(path.capacity_changed)
    scraper = None
    if load.scrape:
        scraper = Scraper(pool, load, path.capacity_changed, metrics.count_scrape_failure)
        scraper.on_sample, scraper.blind = metrics.books_checked, path.data_planes.blind
    core = Core(pool, metrics, sources, path, scraper, config, tracing=tracing)
    admin = config.admin
    core.guard = CapacityGuard(
        pool,
        lambda: path.flow.queued,
        load.engine_slots,
        admin.drain_headroom,
        admin.drain_wait_max_s,
        config.autoscaling.rate_window_s,
    )
    metrics.register_capacity(core.guard.figures)
    if config.rollout.candidate is not None:
        from picker.rollout.runner import start_rollout

        core.rollout = start_rollout(config, pool, path)
        metrics.register_rollout(core.rollout.canary)
    if config.affinity.prefix == "precise":
        from picker.sources.kv_events import KvEvents
        from picker.sources.tokenizer import EngineTokenizer

        core.kv_events = kv = KvEvents(pool, config.affinity)
        metrics.register_rejections("kv_events", lambda: kv.rejected)
        core.tokenizer = path.tokenizer = EngineTokenizer(pool, config.affinity.tokenize_timeout_s)
    return core


def peering_of(config: PickerConfig, pool: Pool) -> Peering | None:
    """This picker among `peers.members` (None: it is alone). Its name is its own peer address."""
    peers = config.peers
    if not peers.members and peers.service is None:
        return None
    import os

    name = peers.advertise or format_address(
        os.environ.get("POD_IP") or config.server.bind_address, peers.port
    )
    name = canonical_address(name)
    if peers.service is None and len(peers.members) == 1 and peers.members[0] == name:
        return None
    return Peering(name, peers.members, pool, observer_grace_s=config.streams.observer_attach_grace_s)


def start_tracing(config: PickerConfig) -> Tracing | None:
    """The trace pipeline when `tracing.enabled`: the OpenTelemetry SDK, spans batched to OTLP/gRPC
    (OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_TRACES_SAMPLER, OTEL_SERVICE_NAME: the standard environment)
    or to stdout. The pod's name ($POD_NAME, as the reference chart sets it) names the instance."""
    if not config.tracing.enabled:
        return None
    import os

    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter

    attributes: dict[str, str] = {"service.name": os.environ.get("OTEL_SERVICE_NAME", "inference-picker")}
    if os.environ.get("POD_NAME"):
        attributes["service.instance.id"] = os.environ["POD_NAME"]
    provider = TracerProvider(resource=Resource.create(attributes))
    exporter: SpanExporter
    if config.tracing.exporter == "console":
        exporter = ConsoleSpanExporter()
    else:
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        except ImportError as exc:  # xds-protos' older copy of the OTel protos installed over the newer
            raise StartupProblem(
                f"tracing.exporter: otlp cannot load ({exc}); reinstall opentelemetry-proto "
                "after xds-protos (`pip install --no-deps --force-reinstall opentelemetry-proto==<version>`)"
            ) from exc
        exporter = OTLPSpanExporter()
    provider.add_span_processor(BatchSpanProcessor(exporter))
    log.info("tracing on exporter=%s", config.tracing.exporter)
    return Tracing(provider)
