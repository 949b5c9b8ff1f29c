"""The metrics port: Prometheus /metrics and the admin API over the pool.

- GET  /admin/endpoints                  every endpoint (state, in flight, since, drain record) and
                                         the recently closed drain records
- GET  /admin/endpoints/<addr>           one endpoint
- POST /admin/endpoints/<addr>/drain     no new work for it until undrain (a preStop hook, an operator)
- POST /admin/endpoints/<addr>/undrain   lift an admin drain

The port binds the configured address (0.0.0.0 in a pod, so Prometheus can scrape it), so the two
POSTs are refused unless the peer is loopback or presents the configured bearer token (compared in
constant time). Every answer, errors included, is JSON: bad address 400, unknown endpoint 404,
state conflict 409, not allowed 401/403.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from picker.config import canonical_address
from picker.pool import Endpoint, EndpointConflict, Pool, UnknownEndpoint
from picker.sources.drain_store import DrainRecordUnavailable, DrainStore, LocalDrains
from picker.telemetry import Metrics

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response({"error": {"message": message, "code": status}}, status=status, headers=headers)


def _is_loopback(peer: str | None) -> bool:
    if not peer:
        return False
    try:
        ip = ipaddress.ip_address(peer)
    except ValueError:
        return False
    mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


def describe(pool: Pool, endpoint: Endpoint) -> dict[str, Any]:
    """One endpoint as the admin API shows it (times: wall clock, seconds since the epoch)."""
    now = pool.now()
    return {
        "address": endpoint.address,
        "state": endpoint.state.value,
        "in_flight": endpoint.in_flight,
        "picks": endpoint.picks,
        "since": round(pool.wall_time(endpoint.since), 3),
        "for_s": round(now - endpoint.since, 3),
        "admin_drained": pool.admin_drained(endpoint.address),
        "drain": None if endpoint.drain is None else endpoint.drain.summary(now),
        # scheduling.by_model: what its /v1/models says it serves (None: not read)
        "served": None
        if endpoint.served is None
        else {"models": sorted(endpoint.served.models), "max_model_len": endpoint.served.max_model_len},
    }


Propagate = Callable[[], Awaitable[dict[str, Any]]]


def admin_app(
    pool: Pool,
    metrics: Metrics,
    *,
    token: str | None = None,
    drains: DrainStore | None = None,
    propagate: Propagate | None = None,
    pool_drains: Callable[[list[dict[str, Any]]], Awaitable[list[dict[str, Any]]]] | None = None,
) -> web.Application:
    """The metrics port's application; `token` allows admin changes from non-loopback peers.

    `drains`: where drain / undrain are recorded (picker/sources/drain_store.py); default: this
    replica's pool only. `propagate`: awaited after a change, before the answer, which carries what
    it returns (`picker serve`: the EDS push and Envoy's ACK, so the answer means Envoy holds it).
    """
    admin = _Admin(
        pool, metrics, token, drains if drains is not None else LocalDrains(pool), propagate, pool_drains
    )
    app = web.Application(middlewares=[_json_errors])
    app.router.add_get("/metrics", admin.metrics_page)
    app.router.add_get("/admin/endpoints", admin.endpoints)
    app.router.add_get("/admin/drains", admin.drains)
    app.router.add_get("/admin/endpoints/{address}", admin.one_endpoint)
    app.router.add_post("/admin/endpoints/{address}/drain", admin.change(admin.store.drain, "drain"))
    app.router.add_post("/admin/endpoints/{address}/undrain", admin.change(admin.store.undrain, "undrain"))
    return app


@web.middleware
async def _json_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error is the admin API's JSON error, never aiohttp's HTML page or a traceback."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return _error(exc.status, exc.text if exc.status == 400 else exc.reason)
    except Exception:
        log.exception("admin request failed path=%s", request.path)
        return _error(500, "internal error")


class _Admin:
    """The routes of `admin_app`, over one pool."""

    def __init__(
        self,
        pool: Pool,
        metrics: Metrics,
        token: str | None,
        store: DrainStore,
        propagate: Propagate | None,
        pool_drains: Callable[[list[dict[str, Any]]], Awaitable[list[dict[str, Any]]]] | None,
    ) -> None:
        self.pool, self.metrics, self.token, self.store = pool, metrics, token, store
        self.propagate, self.pool_drains = propagate, pool_drains

    def refusal(self, request: web.Request) -> web.Response | None:
        token = self.token
        if token is not None:
            scheme, _, presented = request.headers.get("Authorization", "").partition(" ")
            if scheme.lower() == "bearer" and hmac.compare_digest(presented.strip().encode(), token.encode()):
                return None
        if _is_loopback(request.remote):
            return None
        if token is None:
            return _error(
                403, "admin changes are accepted from loopback only; set admin.token to allow others"
            )
        return _error(401, "missing or wrong bearer token", {"WWW-Authenticate": "Bearer"})

    @staticmethod
    def address_of(request: web.Request) -> str:
        try:
            return canonical_address(request.match_info["address"])
        except ValueError as exc:
            raise web.HTTPBadRequest(text=str(exc)) from None

    async def metrics_page(self, _: web.Request) -> web.Response:
        return web.Response(body=self.metrics.exposition(), headers={"content-type": CONTENT_TYPE_LATEST})

    async def endpoints(self, _: web.Request) -> web.Response:
        pool = self.pool
        now = pool.now()
        return web.json_response(
            {
                "source": pool.source,
                "endpoints": [describe(pool, e) for e in pool.endpoints()],
                "recent_drains": [r.summary(now) for r in pool.recent_drains()],
            }
        )

    async def drains(self, request: web.Request) -> web.Response:
        """Every drain still open (newest first), then the recently closed ones: the scorecard's input.

        `?scope=pool`, with peers: the records of every picker, merged (`pool_drains`)."""
        pool = self.pool
        now = pool.now()
        open_records = sorted(
            (e.drain for e in pool.endpoints() if e.drain is not None),
            key=lambda r: r.started_at,
            reverse=True,
        )
        own = [r.summary(now) for r in [*open_records, *pool.recent_drains()]]
        if request.query.get("scope") == "pool" and self.pool_drains is not None:
            return web.json_response({"drains": await self.pool_drains(own), "scope": "pool"})
        return web.json_response({"drains": own})

    async def one_endpoint(self, request: web.Request) -> web.Response:
        address = self.address_of(request)
        endpoint = self.pool.get(address)
        if endpoint is None:
            return _error(404, f"no endpoint {address}")
        return web.json_response({"endpoint": describe(self.pool, endpoint)})

    def change(self, action: Callable[[str], Awaitable[Endpoint]], verb: str) -> Handler:
        async def handler(request: web.Request) -> web.Response:
            refused = self.refusal(request)
            if refused is not None:
                log.warning("admin %s refused peer=%s status=%d", verb, request.remote, refused.status)
                return refused
            address = self.address_of(request)
            try:
                endpoint = await action(address)
            except UnknownEndpoint:
                return _error(404, f"no endpoint {address}")
            except EndpointConflict as exc:
                return _error(409, str(exc))
            except DrainRecordUnavailable as exc:
                return _error(503, str(exc), {"Retry-After": "1"})
            reached = await self.propagate() if self.propagate is not None else {}
            log.info(
                "admin %s address=%s peer=%s state=%s shared=%s%s",
                verb,
                address,
                request.remote,
                endpoint.state.value,
                str(self.store.shared).lower(),
                "".join(f" {key}={value}" for key, value in reached.items()),
            )
            return web.json_response({"endpoint": describe(self.pool, endpoint), **reached})

        return handler
