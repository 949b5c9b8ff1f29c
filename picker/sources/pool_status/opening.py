"""The writer made from the core (picker/wiring.py `Core`): who writes (one picker of several), with
what it reads of the pool, the rollout and the drains."""

from __future__ import annotations

import os
import platform
from collections.abc import Callable
from typing import Protocol

from picker.config.model import PickerConfig
from picker.observability.metrics import Metrics
from picker.pool import Pool
from picker.request.pipeline import RequestPath
from picker.rollout.runner import RolloutRunner
from picker.sources.deletion_cost import writer_gate
from picker.sources.drain_store import DrainStore
from picker.sources.pool_status.writer import Grants, PoolStatusWriter, StatusApi


class Source(Protocol):
    """What the writer reads of the endpoint source (picker/sources/endpoints.py `EndpointSources`)."""

    status_api: StatusApi | None
    status_grants: Grants | None
    problem: str | None

    def on_problem(self, listener: Callable[[str | None], None]) -> None: ...


class Parts(Protocol):
    """What the writer is made from: the core every frontend shares."""

    @property
    def config(self) -> PickerConfig: ...
    @property
    def sources(self) -> Source: ...
    @property
    def path(self) -> RequestPath: ...
    @property
    def pool(self) -> Pool: ...
    @property
    def metrics(self) -> Metrics: ...
    @property
    def leader(self) -> Callable[[], bool] | None: ...
    @property
    def rollout(self) -> RolloutRunner | None: ...
    @property
    def drains(self) -> DrainStore | None: ...


def open_pool_status(core: Parts) -> PoolStatusWriter:
    """The writer of the pool's Ready condition and events, one per pool (the same gate as
    kube.deletion_cost's), named for this picker ($POD_NAME, its peer name, its host), woken by the
    endpoint source's problem as by the pool's changes."""
    kube, sources, peering = core.config.kube, core.sources, core.path.peering
    assert sources.status_api is not None and kube.pool_name is not None
    rollout = core.rollout

    def rollbacks() -> tuple[int, str | None]:
        if rollout is None:
            return 0, None
        canary = rollout.canary
        return canary.rollbacks, (canary.rollback or {}).get("reason")

    def drained_by() -> dict[str, list[object]]:
        drains = core.drains
        return dict(drains.drained_by()) if drains is not None else {}

    def successor() -> bool:
        """Whether another picker serves on once this one stops: a linked peer in another pod
        (then a Stopping condition would say "not ready" while the others serve). Not a standby for
        the Lease: only the holder is ready, so until one takes it no picker serves, and there may
        be none at all; Stopping says so, and the new holder's first look says Ready again. Not a
        worker of this pod either (server.workers): they all stop with it."""
        if core.leader is not None or core.config.server.workers > 1:
            return False
        return peering is not None and bool(set(peering.peers) - set(peering.unlinked()))

    writer = PoolStatusWriter(
        sources.status_api,
        core.pool,
        kube.pool_name,
        identity=os.environ.get("POD_NAME") or (peering.name if peering else "") or platform.node(),
        debounce_s=kube.pool_status_debounce_s,
        resync_s=kube.pool_status_resync_s,
        writing=writer_gate(core.leader, peering),
        successor=successor,
        grants=sources.status_grants,
        problem=lambda: sources.problem,
        drained_by=drained_by,
        rollbacks=rollbacks,
    )
    core.metrics.register_pool_status(writer.figures)
    sources.on_problem(lambda _: writer.wake())  # EndpointSourceUnavailable, and back, without delay
    return writer
