"""The metrics port: Prometheus /metrics and the admin API over the pool.

- GET  /admin/endpoints                  every endpoint (state, in flight, since, drain record) and
                                         the recently closed drain records
- GET  /admin/endpoints/<addr>           one endpoint
- POST /admin/endpoints/<addr>/drain     no new work for it until undrain (a preStop hook, an operator);
                                         refused (409) when the ready capacity left could not carry the
                                         live demand (the capacity guard), unless `?force=true`;
                                         `?wait=S` waits up to S seconds for a replacement first;
                                         `?move_streams=true` (picker proxy) continues its running
                                         streams on other replicas at once (docs, "Streams that ..."),
                                         with peers every picker's (picker/peers/moves.py)
- POST /admin/endpoints/<addr>/undrain   lift an admin drain
- GET  /admin/tenants                    the tenants, bounded (picker/flow/tenant_view.py)
- GET  /admin/rollout                    the canary: phase, weight, steps, gate readings, rollback
- POST /admin/rollout/<verb>             promote | abort | resume | pause (same auth as drains)

A drain records who made it (`?cause=operator`, the default, or `prestop`: `picker drain-wait`), shown
as `drained_by`; an undrain lifts every cause's (or `?cause=`'s only) and says which (`lifted`).

The port binds the configured address (0.0.0.0 in a pod, so Prometheus can scrape it), so the two
POSTs are refused unless the peer is loopback or presents the configured bearer token (compared in
constant time). The GETs follow picker/admin/read_auth.py. Every answer, errors included, is JSON:
bad address 400, unknown endpoint 404, state conflict 409, not allowed 401/403, no review 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from picker.admin import status_page
from picker.admin.browser import refusal as browser_refusal
from picker.admin.capacity_guard import CapacityGuard
from picker.admin.read_auth import ReadGuard, loopback_may_change
from picker.admin.read_auth import error as _error
from picker.admin.status_page import Overview
from picker.config.model import canonical_address
from picker.observability.metrics import Metrics
from picker.pool import Endpoint, EndpointConflict, Pool, UnknownEndpoint
from picker.rollout.runner import COMMANDS, RolloutRunner
from picker.scheduling.load import estimated_load
from picker.sources.access import Reviewer
from picker.sources.drain_causes import Cause, named, shown
from picker.sources.drain_store import DrainRecordUnavailable, DrainRefused, DrainStore, LocalDrains
from picker.streams.ends import DataPlanes

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def describe(pool: Pool, endpoint: Endpoint, drained_by: list[Cause] | None = None) -> dict[str, Any]:
    """One endpoint as the admin API shows it (times: wall clock, seconds since the epoch);
    `drained_by`: who holds its admin drain (the drain store's record)."""
    now = pool.now()
    return {
        "address": endpoint.address,
        "state": endpoint.state.value,
        "in_flight": endpoint.in_flight,
        # prefill / decode pools: its role (None: its role label names none), and the prefill
        # hand-offs whose KV no decode replica has pulled yet, every picker's
        "role": endpoint.role.value if endpoint.role is not None else None,
        "kv_pulls_pending": endpoint.pulls + pool.peer_pulls(endpoint.address),
        # what admission and the pick judge from: the engine's running + waiting at its last scrape,
        # moved by what this picker sent and saw end since (its own count where it has no scrape)
        "occupancy": round(estimated_load(endpoint), 2),
        "picks": endpoint.picks,
        "since": round(pool.wall_time(endpoint.since), 3),
        "for_s": round(now - endpoint.since, 3),
        "admin_drained": pool.admin_drained(endpoint.address),
        "drained_by": [c.as_dict() for c in drained_by or ()],
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
    guard: CapacityGuard | None = None,
    rollout: RolloutRunner | None = None,
    data_planes: DataPlanes | None = None,
    overview: Overview | None = None,
    trust_loopback: bool = False,
    metrics_token: str | None = None,
    metrics_reviewer: Reviewer | None = None,
    read_auth: str = "metrics",
    move_streams: Callable[[str], int] | None = None,
    pool_moves: Callable[[str], Awaitable[dict[str, Any]]] | None = None,
    tenants: Callable[[], dict[str, Any] | None] | None = None,
) -> web.Application:
    """The metrics port's application; `token` allows admin changes from non-loopback peers.

    `drains`: where drain / undrain are recorded (picker/sources/drain_store.py); default: this
    replica's pool only. `propagate`: awaited after a change, before the answer, which carries what
    it returns (`picker serve`: the EDS push and Envoy's ACK, so the answer means Envoy holds it).
    `guard`: the capacity guard a drain must pass (None: drains are not judged).
    `data_planes`: how each data-plane connection reports responses' ends (`/admin/endpoints`).
    `overview`: what the request path adds to the status page (its queue, live requests, peers).
    `trust_loopback`: with a token set, loopback callers need none (admin.trust_loopback).
    `metrics_token`, `metrics_reviewer`: who may read /metrics (admin.metrics_token; a TokenReview
    and a SubjectAccessReview); `read_auth`: `metrics`, the admin reads under the same rule, or `open`.
    `move_streams`: moves an endpoint's running streams elsewhere (picker proxy's resume).
    `pool_moves`: with peers, moves them on every picker sharing the books (picker/peers/moves.py).
    `tenants`: the tenants' table (picker/admin/status_page.py's `tenants`; None: nothing counted).
    """
    admin = _Admin(
        pool, metrics, token, drains if drains is not None else LocalDrains(pool), propagate, pool_drains
    )
    admin.guard, admin.rollout, admin.data_planes = guard, rollout, data_planes
    admin.overview, admin.trust_loopback = overview, trust_loopback
    admin.reads = ReadGuard(metrics_token, metrics_reviewer, admin_token=token, trust_loopback=trust_loopback)
    metrics.register_rejections("drain_record", lambda: admin.store.rejected)
    read = admin.reads.wrap if read_auth == "metrics" else _open
    admin.move_streams, admin.pool_moves, admin.tenants = move_streams, pool_moves, tenants
    app = web.Application(middlewares=[_json_errors])
    app.router.add_get("/metrics", admin.metrics_page)
    app.router.add_get("/admin/endpoints", read(admin.endpoints))
    app.router.add_get("/admin/drains", read(admin.drains))
    app.router.add_get("/admin/endpoints/{address}", read(admin.one_endpoint))
    app.router.add_post("/admin/endpoints/{address}/drain", admin.change("drain"))
    app.router.add_post("/admin/endpoints/{address}/undrain", admin.change("undrain"))
    app.router.add_get("/admin/tenants", read(admin.tenants_table))
    app.router.add_get("/admin/rollout", read(admin.rollout_status))
    app.router.add_get("/admin/status", read(admin.status))
    app.router.add_get("/status", status_page.page)
    app.router.add_get("/status.js", status_page.script)
    app.router.add_post("/admin/rollout/{verb}", admin.rollout_command)
    return app


def _open(handler: Handler) -> Handler:
    return handler


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
        self.guard: CapacityGuard | None = None
        self.rollout: RolloutRunner | None = None
        self.data_planes: DataPlanes | None = None
        self.overview: Overview | None = None
        self.trust_loopback = False
        self.reads = ReadGuard(None, None, admin_token=token, trust_loopback=False)
        self.move_streams: Callable[[str], int] | None = None
        self.pool_moves: Callable[[str], Awaitable[dict[str, Any]]] | None = None
        self.tenants: Callable[[], dict[str, Any] | None] | None = None
        self._drains_turn = asyncio.Lock()

    def refusal(self, request: web.Request) -> web.Response | None:
        """None when the caller may change state: it presents the token, or no token is set (or
        `trust_loopback`) and it calls from loopback with a Host DNS cannot rebind (read_auth.py's
        rule, the reads' too). With a token set, loopback alone is no proof: behind a sidecar (Istio
        forwards from 127.0.0.6) every caller looks local."""
        token = self.token
        browser = browser_refusal(request.headers, token_set=token is not None)
        if browser is not None:  # a web page's request, not the operator's (picker/admin/browser.py)
            self.metrics.count_admin_refused(browser)
            return _error(
                403,
                f"a web page may not change the picker's state ({browser}): use the status page or a client",
            )
        if token is not None:
            scheme, _, presented = request.headers.get("Authorization", "").partition(" ")
            if scheme.lower() == "bearer" and hmac.compare_digest(presented.strip().encode(), token.encode()):
                return None
        if loopback_may_change(request, token_set=token is not None, trust=self.trust_loopback):
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

    async def metrics_page(self, request: web.Request) -> web.Response:
        refused = await self.reads.refusal(request, admin_may=False)
        if refused is not None:
            return refused
        return web.Response(body=self.metrics.exposition(), headers={"content-type": CONTENT_TYPE_LATEST})

    async def endpoints(self, _: web.Request) -> web.Response:
        pool = self.pool
        now = pool.now()
        held = self.store.drained_by()
        return web.json_response(
            {
                "source": pool.source,
                "endpoints": [describe(pool, e, held.get(e.address)) for e in pool.endpoints()],
                "recent_drains": [r.summary(now) for r in pool.recent_drains()],
                # connection -> how its responses' ends reach the picker ("engine": none do)
                "data_planes": {} if self.data_planes is None else self.data_planes.summary(),
            }
        )

    async def drains(self, request: web.Request) -> web.Response:
        """Every drain still open (newest first), then the recently closed ones: the scorecard's input.

        `?scope=pool`, with peers: the records of every picker, merged (`pool_drains`). An open one
        held by the drain store says who holds it (`drained_by`)."""
        own = self.pool.drain_summaries()
        if request.query.get("scope") == "pool" and self.pool_drains is not None:
            merged = await self.pool_drains(own)
            return web.json_response({"drains": shown(merged, self.store.drained_by()), "scope": "pool"})
        return web.json_response({"drains": shown(own, self.store.drained_by())})

    async def one_endpoint(self, request: web.Request) -> web.Response:
        address = self.address_of(request)
        endpoint = self.pool.get(address)
        if endpoint is None:
            return _error(404, f"no endpoint {address}")
        return web.json_response(
            {"endpoint": describe(self.pool, endpoint, self.store.drained_by().get(address))}
        )

    def change(self, verb: str) -> Handler:
        async def handler(request: web.Request) -> web.Response:
            refused = self.refusal(request)
            if refused is not None:
                log.warning("admin %s refused peer=%s status=%d", verb, request.remote, refused.status)
                return refused
            address = self.address_of(request)
            try:
                cause, only = named(verb, request.query.get("cause"))
            except ValueError as exc:
                return _error(400, str(exc))
            move = _flag(request, "move_streams") if verb == "drain" else False
            if move is None or (move and self.move_streams is None):
                why = "only picker proxy can move streams (Envoy cannot re-issue a request mid-response)"
                return _error(400, "move_streams must be true or false" if move is None else why)
            # a drain is judged and applied as one: a second one waits, then is judged on the pool
            # the first left (two at once both passed, and left 4 slots for a demand of 6)
            async with self._drains_turn if verb == "drain" else contextlib.nullcontext():
                check = None
                if verb == "drain" and self.guard is not None:
                    blocked = await self.guarded(request, address, self.guard)
                    if blocked is not None:
                        return blocked
                    check = None if _forced(request) else self.guard.check(address)
                lifted: tuple[Cause, ...] | None = None
                try:
                    if verb == "drain":
                        endpoint = await self.store.drain(address, cause=cause, check=check)
                    else:
                        undone = await self.store.undrain(address, only=only)
                        endpoint, lifted = undone.endpoint, undone.causes
                except DrainRefused as exc:  # another picker's drain reached the record first
                    log.warning("admin drain refused by the capacity guard address=%s %s", address, exc)
                    return _refused(exc.reason, exc.figures)
                except UnknownEndpoint:
                    return _error(404, f"no endpoint {address}")
                except EndpointConflict as exc:
                    return _error(409, str(exc))
                except DrainRecordUnavailable as exc:
                    return _error(503, str(exc), {"Retry-After": "1"})
            reached = await self.propagate() if self.propagate is not None else {}
            log.info(
                "admin %s address=%s cause=%s peer=%s state=%s shared=%s%s",
                verb,
                address,
                cause if lifted is None else ",".join(str(c) for c in lifted) or "-",
                request.remote,
                endpoint.state.value,
                str(self.store.shared).lower(),
                "".join(f" {key}={value}" for key, value in reached.items()),
            )
            if move and self.pool_moves is not None:  # every picker's streams, and their counts
                reached.update(await self.pool_moves(address))
            elif move and self.move_streams is not None:
                reached["moved_streams"] = self.move_streams(address)
            if lifted is not None:
                reached["lifted"] = [c.as_dict() for c in lifted]
            held = self.store.drained_by().get(address)
            return web.json_response({"endpoint": describe(self.pool, endpoint, held), **reached})

        return handler

    async def guarded(self, request: web.Request, address: str, guard: CapacityGuard) -> web.Response | None:
        """The capacity guard for one drain: None when it may go ahead (now, or after `?wait=S` saw
        a replacement become ready), else the 409 that says why. `?force=true` skips it."""
        if _forced(request):
            log.warning("admin drain forced past the capacity guard address=%s", address)
            return None
        try:
            wait_s = min(float(request.query.get("wait", "0")), guard.wait_max_s)
        except ValueError:
            raise web.HTTPBadRequest(text="wait must be a number of seconds") from None
        if not wait_s >= 0:
            raise web.HTTPBadRequest(text="wait must be a number of seconds")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        verdict = guard.verdict(address)
        while not verdict.allowed and (left := deadline - loop.time()) > 0:
            await guard.changed(left)
            verdict = guard.verdict(address)
        if verdict.allowed:
            return None
        log.warning("admin drain refused by the capacity guard address=%s %s", address, verdict.reason)
        return _refused(verdict.reason, verdict.as_dict())

    async def status(self, _: web.Request) -> web.Response:
        """What the status page polls: every lane, the canary, the queue, in one document."""
        shown = status_page.snapshot(self.pool, self.rollout, self.data_planes, self.overview)
        return web.json_response(shown)

    async def tenants_table(self, _: web.Request) -> web.Response:
        """The tenants; `{"tenants": null}`: nothing counted by tenant (no fair share, no budget)."""
        return web.json_response({"tenants": None if self.tenants is None else self.tenants()})

    async def rollout_status(self, _: web.Request) -> web.Response:
        return web.json_response({"rollout": None if self.rollout is None else self.rollout.status()})

    async def rollout_command(self, request: web.Request) -> web.Response:
        """POST /admin/rollout/promote | abort | resume | pause: the same auth as drains."""
        refused = self.refusal(request)
        if refused is not None:
            return refused
        verb = request.match_info["verb"]
        if self.rollout is None:
            return _error(409, "no rollout is configured (rollout.candidate)")
        if verb not in COMMANDS:
            return _error(404, f"no rollout command {verb!r}: {', '.join(COMMANDS)}")
        status = await self.rollout.command(verb)
        log.info(
            "admin rollout %s peer=%s phase=%s weight=%s",
            verb,
            request.remote,
            status["phase"],
            status["weight"],
        )
        return web.json_response({"rollout": status})


def _flag(request: web.Request, name: str) -> bool | None:
    """A true/false query parameter (absent: false; anything else: None)."""
    return {"": False, "false": False, "0": False, "true": True, "1": True}.get(
        request.query.get(name, "").lower()
    )


def _forced(request: web.Request) -> bool:
    return request.query.get("force", "").lower() in ("1", "true", "yes")


def _refused(reason: str, figures: dict[str, object]) -> web.Response:
    """The capacity guard's 409, with the figures it judged by."""
    return web.json_response({"error": {"message": reason, "code": 409, "capacity": figures}}, status=409)
