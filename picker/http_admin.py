"""The metrics port: Prometheus /metrics and the read-only admin view of the pool."""

from __future__ import annotations

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from picker.pool import Pool
from picker.telemetry import Metrics


def admin_app(pool: Pool, metrics: Metrics) -> web.Application:
    async def metrics_page(_: web.Request) -> web.Response:
        return web.Response(body=metrics.exposition(), headers={"content-type": CONTENT_TYPE_LATEST})

    async def endpoints(_: web.Request) -> web.Response:
        return web.json_response(
            {
                "endpoints": [
                    {"address": e.address, "state": e.state.value, "in_flight": e.in_flight, "picks": e.picks}
                    for e in pool.endpoints()
                ]
            }
        )

    app = web.Application()
    app.router.add_get("/metrics", metrics_page)
    app.router.add_get("/admin/endpoints", endpoints)
    return app
