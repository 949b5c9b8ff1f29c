"""The live status page on the admin port: `GET /status`, one HTML file (picker/admin/static/status.html, no
build step, shipped in the wheel), and the one JSON document it polls, `GET /admin/status`.

What an operator mid-rollout wants at a glance, from one place: a lane per replica (its state, its
streams in flight, the drain in progress with what it still waits for, its cut and failed counts),
the canary (weight, step, each gate's reading and limit, the rollback's reason), the admission
queue, the tenants (picker/flow/tenant_view.py: share, queued, in flight, tokens, budget; bounded),
and what the other pickers hold. Reading is open like the admin API's other GETs; the page's
actions (drain, undrain, promote, abort) go to the admin API's POST routes, with its auth.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import cache
from importlib import resources
from typing import Any

from aiohttp import web

from picker.flow import tenant_view
from picker.pool import Endpoint, EndpointState, Pool
from picker.request.pipeline import RequestPath
from picker.rollout.runner import RolloutRunner
from picker.scheduling.load import estimated_load
from picker.streams.ends import DataPlanes

# What the request path adds (the admission queue, live requests, peers): the wiring's.
Overview = Callable[[], dict[str, Any]]


@cache
def asset(name: str) -> bytes:
    """One of the page's files, read once from the package."""
    return resources.files("picker.admin").joinpath("static", name).read_bytes()


_ORDER = {
    EndpointState.READY: 0,
    EndpointState.DRAINING: 1,
    EndpointState.NOT_READY: 2,
    EndpointState.GONE: 3,
}


def tenants(path: RequestPath) -> dict[str, Any] | None:
    """The tenants' table (picker/flow/tenant_view.py); None when neither fair share nor a budget is
    configured (nothing is counted by tenant)."""
    flow = path.flow
    if flow.tenants is None and flow.budgets is None:
        return None
    return tenant_view.table(flow.tenants, flow.budgets)


def overview(path: RequestPath) -> dict[str, Any]:
    """What the request path adds to the page: its queue, tenants, live requests and peers."""
    peering = path.peering
    return {
        "queue": {"queued": path.flow.queued, "bytes": path.flow.queued_bytes},
        "tenants": tenants(path),
        "live": path.live,
        "accepting": path.accepting,
        "peers": None
        if peering is None
        else {
            "name": peering.name,
            "members": list(peering.peers),
            "unlinked": peering.unlinked(),
            "held": peering.held(),
        },
    }


def lane(pool: Pool, endpoint: Endpoint, now: float, rollout: RolloutRunner | None) -> dict[str, Any]:
    """One replica's lane."""
    drain = endpoint.drain
    group = rollout.canary.group_of(endpoint.labels) if rollout is not None else None
    return {
        "address": endpoint.address,
        "state": endpoint.state.value,
        "for_s": round(now - endpoint.since, 1),
        "in_flight": endpoint.in_flight,
        "peer_in_flight": endpoint.peer_in_flight,
        "role": endpoint.role.value if endpoint.role is not None else "invalid",
        "kv_pulls_pending": endpoint.pulls + pool.peer_pulls(endpoint.address),
        "occupancy": round(estimated_load(endpoint), 1),
        "picks": endpoint.picks,
        "cut": endpoint.cut,
        "failed": endpoint.failed,
        "group": group,
        "admin_drained": pool.admin_drained(endpoint.address),
        # the drain in progress: what it started with, what it still waits for, and its time to zero
        "drain": None if drain is None else drain.summary(now),
    }


def snapshot(
    pool: Pool, rollout: RolloutRunner | None, planes: DataPlanes | None, overview: Overview | None
) -> dict[str, Any]:
    """Everything the page shows, in one document (a poll of it costs one pass over the pool)."""
    now = pool.now()
    order = {
        EndpointState.READY: 0,
        EndpointState.DRAINING: 1,
        EndpointState.NOT_READY: 2,
        EndpointState.GONE: 3,
    }
    endpoints = sorted(pool.endpoints(), key=lambda e: (order[e.state], e.address))
    return {
        "at_wall": round(time.time(), 3),
        "source": pool.source,
        "lanes": [lane(pool, e, now, rollout) for e in endpoints],
        "recent_drains": [r.summary(now) for r in pool.recent_drains()][:8],
        "rollout": None if rollout is None else rollout.status(),
        "data_planes": {} if planes is None else planes.summary(),
        **(overview() if overview is not None else {}),
    }


_HEADERS = {
    "Cache-Control": "no-cache",
    # the page loads nothing from elsewhere, runs only its own script, and is framed by nobody
    "Content-Security-Policy": "default-src 'self'; style-src 'self' 'unsafe-inline'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
}


async def page(_: web.Request) -> web.Response:
    return web.Response(
        body=asset("status.html"), content_type="text/html", charset="utf-8", headers=_HEADERS
    )


async def script(_: web.Request) -> web.Response:
    return web.Response(
        body=asset("status.js"), content_type="text/javascript", charset="utf-8", headers=_HEADERS
    )
